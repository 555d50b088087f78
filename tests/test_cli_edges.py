"""CLI edges a user hits: config files, no validation set, a rerun into an old directory, the
grad/generate flags that have no meaning, and a real disk-full write (not a patched writer)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from mesp.cli import main
from tests.tiny_dir import make_jsonl, make_model_dir, train_argv

FAST = ["--quantize", "none", "--seq-len", "48", "--no-progress", "--eval-batches", "1"]


@pytest.fixture(scope="module")
def env(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("edges")
    return {
        "root": root,
        "model": make_model_dir(root / "model", "qwen2"),
        "data": make_jsonl(root / "d.jsonl", 16),
    }


def _argv(env: dict[str, Path], out: Path, *extra: str) -> list[str]:
    return train_argv(env["model"], env["data"], out, *FAST, *extra)


def _train(env: dict[str, Path], out: Path, *extra: str) -> int:
    return main(_argv(env, out, *extra))


def test_config_file_takes_every_flag_by_its_name(
    env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """`data` (whose field is `path`), tuples as lists, numbers as numbers; flags still win."""
    cfg = tmp_path / "run.toml"
    cfg.write_text(
        f'data = "{env["data"]}"\nrank = 2\ntargets = ["q_proj", "v_proj"]\nsteps = 2\n'
        'quantize = "none"\nseq-len = 48\nprogress = false\neval_batches = 1\n'
    )
    out = tmp_path / "out"
    assert main(["train", "--model", str(env["model"]), "--config", str(cfg), "--steps", "1",
                 "--adapter-out", str(out)]) == 0  # fmt: skip
    args = json.loads((out / "run_args.json").read_text())
    assert args["path"] == str(env["data"]) and args["rank"] == 2
    assert args["targets"] == ["q_proj", "v_proj"] and args["steps"] == 1
    keys = load_file(str(out / "adapter_model.safetensors"))
    assert {k.split(".")[-3] for k in keys} == {"q_proj", "v_proj"}


@pytest.mark.parametrize(
    "text,expect",
    [
        ("rank: [2]\n", "rank: invalid value [2]"),
        ("rank: two\n", "rank: invalid value 'two'"),
        ("engine: fast\n", "engine: 'fast' is not one of"),
        ("pack: 3\n", "pack: expected true or false"),
        ("lr: {a: 1}\n", "lr: invalid value"),
    ],
)
def test_config_file_values_are_checked_like_flags(
    env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture, text: str, expect: str
) -> None:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    out = tmp_path / "out"
    assert _train(env, out, "--config", str(cfg)) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expect in err, err
    assert not out.exists() or not (out / "adapter_model.safetensors").exists()


def test_no_validation_set_trains_and_says_so(
    env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    out = tmp_path / "out"
    assert _train(env, out, "--valid-fraction", "0", "--steps", "2") == 0
    assert "no validation set" in capsys.readouterr().out
    summary = json.loads((out / "summary.json").read_text())
    assert summary["valid_ppl_before"] is None and summary["valid_ppl_after"] is None
    assert (out / "adapter_model.safetensors").exists()


def test_a_fresh_run_starts_a_new_log_and_a_resume_continues_it(
    env: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"

    def steps() -> list[int]:
        rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
        return [r["step"] for r in rows if "loss" in r]

    assert _train(env, out, "--steps", "2", "--save-every", "1") == 0
    assert steps() == [1, 2]
    assert _train(env, out, "--steps", "2", "--seed", "3") == 0  # a new run, same directory
    assert steps() == [1, 2]
    assert main(["train", "--resume", str(out), "--steps", "3"]) == 0
    assert steps() == [1, 2, 3]
    row = json.loads((out / "log.jsonl").read_text().splitlines()[0])
    assert 0 < row["trained_tokens_per_s"] <= row["tokens_per_s"]


def test_grad_refuses_mezo_and_fills_both_factors_with_init_b(
    env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    base = ["grad", "--model", str(env["model"]), "--data", str(env["data"]), *FAST[:4]]
    out = tmp_path / "sub" / "g.safetensors"  # the parent is created
    assert main([*base, "--engine", "mezo", "--out", str(out)]) == 2
    assert "mezo computes no gradient" in capsys.readouterr().err
    assert main([*base, "--out", str(out)]) == 0
    assert "every lora_A gradient is 0" in capsys.readouterr().err
    g = load_file(str(out))
    assert all(float(v.abs().max()) == 0 for k, v in g.items() if "lora_A" in k)
    assert main([*base, "--init-b", "0.02", "--rank", "2", "--out", str(out)]) == 0
    g = load_file(str(out))
    assert all(float(v.abs().max()) > 0 for v in g.values())
    assert all(v.shape[0] == 2 for k, v in g.items() if "lora_A" in k)


@pytest.mark.parametrize(
    "extra,expect",
    [
        (["--prompt", ""], "--prompt is empty"),
        (["--prompt", "To be", "--temperature", "0.8", "--top-p", "0"], "--top-p"),
        (["--prompt", "To be", "--max-tokens", "0"], "--max-tokens"),
        (["--prompt", "To be", "--temperature", "-1"], "--temperature"),
    ],
)
def test_generate_rejects_flags_without_meaning(
    env: dict[str, Path], capsys: pytest.CaptureFixture, extra: list[str], expect: str
) -> None:
    assert main(["generate", "--model", str(env["model"]), "--quantize", "none", *extra]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and expect in err, err


def test_generate_stops_at_the_models_positions(
    env: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    argv = ["generate", "--model", str(env["model"]), "--quantize", "none", "--prompt", "To be"]
    assert main([*argv, "--max-tokens", "100000", "--temperature", "0.7", "--top-p", "1e-9"]) == 0
    assert "stopping after" in capsys.readouterr().err


def test_disk_full_during_a_real_save_is_one_line_and_keeps_the_old_adapter(
    env: dict[str, Path], tmp_path: Path
) -> None:
    """The real writer (safetensors raises SafetensorError, not OSError) hitting a file-size
    limit: RLIMIT_FSIZE in a child makes every write past N bytes fail with EFBIG."""
    out = tmp_path / "out"
    assert _train(env, out, "--steps", "1") == 0
    before = (out / "adapter_model.safetensors").read_bytes()
    limit = len(before) // 2
    code = (
        "import resource, signal, sys\n"
        "from mesp.cli import main\n"
        "signal.signal(signal.SIGXFSZ, signal.SIG_IGN)\n"
        f"resource.setrlimit(resource.RLIMIT_FSIZE, ({limit}, {limit}))\n"
        "sys.exit(main(sys.argv[1:]))\n"
    )
    argv = _argv(env, out, "--steps", "1", "--seed", "1")
    r = subprocess.run(
        [sys.executable, "-c", code, *argv], capture_output=True, text=True, timeout=300
    )
    assert r.returncode == 2, r.stderr
    *warnings, last = r.stderr.strip().splitlines()  # warnings: e.g. rows truncated
    assert "Traceback" not in r.stderr and all("warning" in w for w in warnings), r.stderr
    assert last.startswith("mesp: error:") and "adapter_model.safetensors: could not save" in last
    assert (out / "adapter_model.safetensors").read_bytes() == before
    assert not [p for p in out.iterdir() if p.name.startswith(".")]  # no temp file left


def test_info_counts_match_transformers_and_peft(
    env: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    """`mesp info MODEL`: the parameter count is transformers' own, the LoRA count PEFT's."""
    import peft
    import transformers

    assert main(["info", str(env["model"]), "--rank", "4", "--targets", "q_proj,v_proj"]) == 0
    out = capsys.readouterr().out
    fields = {line.split()[0]: line.split()[1] for line in out.splitlines()}
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(env["model"]))
    assert int(fields["parameters"].replace(",", "")) == hf.num_parameters()
    lora = peft.get_peft_model(
        hf, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], lora_alpha=8)
    )
    trainable = sum(p.numel() for p in lora.parameters() if p.requires_grad)
    assert int(fields["LoRA"].replace(",", "")) == trainable
    assert "(with --quantize)" in out and "4-bit group 64" in out


def test_max_memory_stops_mid_run_saves_and_resumes(
    env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """The smallest budget the planner accepts (its own predicted peak, to the byte) is crossed
    by the measured one (weights + what training adds to RSS: the planner counts tensors, not
    the allocator's slack, the first step's code and imports): stop at step 1, save, resume.
    The shape is large enough (seq 256 x 4 rows, packed full) that the tensors the step really
    allocates, not only that overhead, carry the crossing: at 48 x 4 the measured peak was
    4.9 MB here against a 3 MB budget, and under 3 MB on another machine."""
    flags = ["--quantize", "none", "--seq-len", "256", "--batch-size", "4"]
    assert main(["plan", "--model", str(env["model"]), *flags, "--json"]) == 0
    need = json.loads(capsys.readouterr().out)["engines"]["mesp"]["total"]
    out, data = tmp_path / "out", make_jsonl(tmp_path / "d.jsonl", 100)
    argv = train_argv(env["model"], data, out, *flags, "--pack", "--eval-batches", "1")
    # a fresh process: in pytest's, earlier tests' freed heap would absorb the step's growth
    r = subprocess.run(
        [sys.executable, "-m", "mesp", *argv, "--steps", "3", "--max-memory", str(need)],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 2, r.stderr
    err = r.stderr.strip().splitlines()[-1]
    assert "crossed --max-memory" in err and "at step 1" in err, err
    assert (out / "adapter_model.safetensors").exists()
    assert main(["train", "--resume", str(out), "--max-memory", "2GB"]) == 0
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows if "loss" in r] == [1, 2, 3]


def test_mezo_takes_the_mezo_papers_lr_and_a_constant_schedule(
    env: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "out"
    assert _train(env, out, "--engine", "mezo", "--steps", "3", "--warmup", "0") == 0
    args = json.loads((out / "run_args.json").read_text())
    assert (args["lr"], args["schedule"]) == (1e-4, "constant")
    rows = [json.loads(x) for x in (out / "log.jsonl").read_text().splitlines()]
    lrs = [r["lr"] for r in rows if "lr" in r]
    assert lrs[:3] == [1e-4] * 3
    assert _train(env, tmp_path / "o2", "--steps", "1") == 0  # the other engines: 2e-4, cosine
    args = json.loads((tmp_path / "o2" / "run_args.json").read_text())
    assert (args["lr"], args["schedule"]) == (2e-4, "cosine")


def test_device_flag_is_checked_and_every_weight_moves_with_the_model(
    env: dict[str, Path], capsys: pytest.CaptureFixture
) -> None:
    import torch

    from mesp.loading import load_model
    from mesp.quant import QuantSpec

    if not torch.cuda.is_available():
        argv = ["eval", "--model", str(env["model"]), "--device", "cuda"]
        assert main(argv) == 2
        assert "sees no CUDA device" in capsys.readouterr().err
    assert main(["eval", "--model", str(env["model"]), "--device", "tpu"]) == 2
    # `--device cuda` moves the model with .to(): every frozen tensor must be a buffer it sees
    model = load_model(env["model"], QuantSpec(4, 64)).model.to("meta")
    assert all(t.is_meta for t in model.state_dict().values())
    assert all(t.is_meta for t in model.buffers())


def test_analyze_grads_convergence_runs_both_engines_from_one_start(
    env: dict[str, Path], tmp_path: Path
) -> None:
    out = tmp_path / "conv"
    argv = ["analyze-grads", "--model", str(env["model"]), "--data", str(env["data"])]
    argv += [*FAST[:4], "--convergence", "4", "--eval-batches", "1", "--out", str(out)]
    assert main(argv) == 0
    res = json.loads((out / "convergence.json").read_text())
    runs = res["runs"]
    assert set(runs) == {"mesp", "mezo"} and (out / "convergence.png").exists()
    for r in runs.values():
        assert r["steps"][0] == 0 and r["steps"][-1] == 4
        assert len(r["seconds"]) == len(r["valid_loss"]) == len(r["steps"])
    assert runs["mesp"]["valid_loss"][0] == runs["mezo"]["valid_loss"][0]  # one start
    lrs = [json.loads(x).get("lr") for x in (out / "mezo" / "log.jsonl").read_text().splitlines()]
    assert 1e-4 in lrs  # mezo trained at its own lr, not mesp's


def test_mezo_zo_full_trains_every_weight_and_resumes_bit_for_bit(
    env: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    """--zo-full: SPSA over every weight of an unquantized base; the trained base is a model
    directory beside the adapter, and a resume reads it back (2 + 2 steps == 4 steps)."""
    import torch

    from mesp.loading import load_model

    assert _train(env, tmp_path / "q", "--engine", "mezo", "--zo-full", "--quantize", "4") == 2
    assert "--zo-full needs" in capsys.readouterr().err
    full = ["--engine", "mezo", "--zo-full", "--lr", "1e-2", "--warmup", "0"]
    one, two = tmp_path / "one", tmp_path / "two"
    assert _train(env, one, *full, "--steps", "4") == 0
    assert _train(env, two, *full, "--steps", "2") == 0
    assert main(["train", "--resume", str(two), "--steps", "4"]) == 0
    base = load_model(env["model"]).model.state_dict()
    a, b = (
        load_model(one / "model").model.state_dict(),
        load_model(two / "model").model.state_dict(),
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert any(not torch.equal(a[k], base[k]) for k in a)  # the base itself was trained
    ad1 = load_file(str(one / "adapter_model.safetensors"))
    ad2 = load_file(str(two / "adapter_model.safetensors"))
    assert all(torch.equal(ad1[k], ad2[k]) for k in ad1)
