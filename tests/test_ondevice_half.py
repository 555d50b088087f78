"""Block inputs kept in half precision on the device (--checkpoint-dtype float16 / bfloat16:
runtime/src/checkpoints.h, half.h; mesp/ondevice/et_driver.py's Checkpoints).

- The runner's casts equal torch's, bit for bit, on every kind of float (normals, ties,
  subnormals, overflow, infinities, NaN) and back.
- The native runner (in memory and on disk) equals the Python driver with the same storage; the
  forward and the loss do not change (step 1's loss is the float32 run's), the adapter moves by
  what the rounding of the block inputs makes of the gradient: small, and not zero.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from mesp.ondevice import et_driver, runner
from tests import export_cases as T

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def probe(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("half") / "half_probe"
    cmd = ["g++", "-O2", "-std=c++17", f"-I{ROOT / 'runtime' / 'src'}", "-o", str(out)]
    r = subprocess.run(
        [*cmd, str(ROOT / "tests" / "half_probe.cpp")], capture_output=True, text=True
    )
    if r.returncode != 0 and "not found" in r.stderr:
        pytest.skip("no C++ compiler")
    assert r.returncode == 0, r.stderr
    return out


def test_casts_equal_torchs_bit_for_bit(probe: Path) -> None:
    g = torch.Generator().manual_seed(0)
    rnd = torch.randint(-(2**31), 2**31, (200_000,), generator=g, dtype=torch.int64)
    special = [0.0, -0.0, 1.0, 65504.0, 65519.99, 65520.0, 1e-8, 6e-8, 3e-5, 1e38, 3.4e38]
    special += [float("inf"), float("-inf"), float("nan"), 1 + 2**-11, 1 + 3 * 2**-11]
    special += [1 + 2**-8, 1 + 3 * 2**-8, -(2**-24), 2**-25, 2**-14 - 2**-24]
    x = torch.cat([rnd.to(torch.int32).view(torch.float32), torch.tensor(special)])
    x = torch.cat([x, torch.randn(50_000, generator=g) * 1e3, torch.randn(50_000, generator=g)])
    text = "".join(f"{v:08x}\n" for v in x.view(torch.int32).tolist() for v in [v & 0xFFFFFFFF])
    r = subprocess.run([str(probe)], input=text, capture_output=True, text=True, check=True)
    got = torch.tensor([[int(w, 16) for w in line.split()] for line in r.stdout.splitlines()])
    h, b = x.to(torch.float16), x.to(torch.bfloat16)
    u16 = lambda t: t.view(torch.int16).to(torch.int64) & 0xFFFF  # noqa: E731
    u32 = lambda t: t.view(torch.int32).to(torch.int64) & 0xFFFFFFFF  # noqa: E731
    nan = x.isnan()
    assert torch.equal(got[~nan, 0], u16(h)[~nan]) and torch.equal(got[~nan, 1], u16(b)[~nan])
    assert torch.equal(got[~nan, 2], u32(h.float())[~nan])
    assert torch.equal(got[~nan, 3], u32(b.float())[~nan])
    # NaN stays NaN (torch keeps the payload's top bits; the runner writes the quiet NaN)
    back = got[nan, 2:].to(torch.int32).view(torch.float32)
    assert back.isnan().all()


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_runner_equals_driver_and_stays_near_float32(  # type: ignore[no-untyped-def]
    et_cases, runner_bin, tmp_path: Path, dtype: str
) -> None:
    case, rows, steps, lr = et_cases("qwen2", "q4"), T._rows(), 4, 0.05
    full, full_losses = et_driver.train(case.art, rows, runner.RunConfig(steps, lr, "sgd"))
    cfg = runner.RunConfig(steps, lr, "sgd", checkpoint_dtype=dtype)
    half, losses = et_driver.train(case.art, rows, cfg)
    assert losses[0] == full_losses[0]  # the forward and the loss are the float32 ones
    data = T._write_jsonl(tmp_path / "rows.jsonl", rows)
    for where in ([], ["--checkpoints-dir", str(tmp_path)]):
        out = tmp_path / f"a{len(where)}"
        argv = [str(runner_bin), str(case.dir), "--data", str(data), "--steps", str(steps)]
        argv += ["--lr", repr(lr), "--out", str(out), "--checkpoint-dtype", dtype, *where]
        r = subprocess.run(argv, capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr
        got = load_file(out / "adapter_model.safetensors")
        for i, lora in enumerate(half.lora):
            for k, p in lora.items():
                native = got[f"{runner.PEFT_PREFIX}model.layers.{i}.{k}.weight"]
                torch.testing.assert_close(native, p, rtol=0, atol=1e-6)
    moved = max(
        float((p - full.lora[i][k]).abs().max() / full.lora[i][k].abs().max())
        for i, lora in enumerate(half.lora)
        for k, p in lora.items()
    )
    assert 0 < moved < (1e-3 if dtype == "float16" else 1e-2), moved


def test_bad_checkpoint_dtype_one_line(et_cases, runner_bin, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    case = et_cases("qwen2", "q4")
    data = T._write_jsonl(tmp_path / "rows.jsonl", T._rows())
    argv = [str(runner_bin), str(case.dir), "--data", str(data), "--steps", "1", "--out",
            str(tmp_path / "a"), "--checkpoint-dtype", "int8"]  # fmt: skip
    r = subprocess.run(argv, capture_output=True, text=True)
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1
    assert "--checkpoint-dtype must be float32, float16 or bfloat16" in r.stderr


def test_a_block_input_past_float16s_range_stops_both_drivers_in_one_line(  # type: ignore[no-untyped-def]
    et_cases, runner_bin, tmp_path: Path
) -> None:
    """Embeddings scaled to ~1e6: block 0's input would round to infinity in float16, and the
    backward would turn the adapter into NaN. Both drivers stop before the backward, in the
    same one line, with no adapter written."""
    import shutil

    from safetensors import safe_open
    from safetensors.torch import save_file

    case = et_cases("qwen2", "q4")
    big = tmp_path / "big"
    shutil.copytree(case.dir, big)
    with safe_open(big / "embedding.safetensors", "pt") as f:  # keep its export id
        meta, emb = f.metadata(), {k: f.get_tensor(k) for k in f.keys()}  # noqa: SIM118
    emb = {k: v * 1e7 if v.dtype == torch.float32 else v for k, v in emb.items()}
    save_file(emb, big / "embedding.safetensors", metadata=meta)
    cfg = runner.RunConfig(2, 0.05, "sgd", checkpoint_dtype="float16")
    with pytest.raises(runner.RunnerError) as e:
        et_driver.train(runner.Artifacts(big), T._rows(), cfg)
    expected = str(e.value)
    assert expected.startswith("--checkpoint-dtype float16: block 0's input reaches ")
    assert expected.endswith(
        "past float16's largest (65504); use bfloat16 or float32; no adapter written"
    )
    data = T._write_jsonl(tmp_path / "rows.jsonl", T._rows())
    out = tmp_path / "a"
    argv = [str(runner_bin), str(big), "--data", str(data), "--steps", "2", "--out", str(out)]
    r = subprocess.run([*argv, "--checkpoint-dtype", "float16"], capture_output=True, text=True)
    assert r.returncode != 0 and r.stderr.strip().splitlines() == [r.stderr.strip()]
    assert expected in r.stderr and not out.exists()
