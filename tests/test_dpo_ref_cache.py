"""--ref-cache (issue 30 item 3): DPO's reference log-probs stored per row on disk and reused;
the same loss and gradient bits as computing them; the first hit of a process checked against
the model; a cache of another base model refused."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
from safetensors import safe_open

from mesp.cli import main
from mesp.engines import make_engine
from mesp.engines.objective import PreferenceEngine, check_pairs, pair_terms, sequence_logps
from mesp.engines.ref_cache import FILE, RefCache, row_keys
from mesp.errors import MespError
from tests.engine_cases import model_with_adapter
from tests.test_dpo import DPO, engine_grads, pair_batch
from tests.test_dpo_cli import model_dir, write_pairs  # noqa: F401,F811 - a fixture
from tests.tiny_dir import train_argv


def _engine(cache_dir: Path | None) -> PreferenceEngine:
    e = PreferenceEngine(make_engine("mesp"), DPO)
    e.ref_cache = RefCache(cache_dir) if cache_dir is not None else None
    return e


def test_ref_cache_is_written_reused_and_checked(tmp_path: Path) -> None:
    model, batch = model_with_adapter("qwen2"), pair_batch()
    loss0, g0 = engine_grads(_engine(None), model, batch)
    first = _engine(tmp_path)
    loss1, g1 = engine_grads(first, model, batch)  # a miss: computed and stored
    lines = (tmp_path / FILE).read_text().splitlines()
    assert len(lines) == 4 and first.ref_cache and first.ref_cache.misses == 1
    assert {json.loads(x)["k"] for x in lines} == set(row_keys(batch))
    assert loss1 == loss0 and all(torch.equal(g0[n], g1[n]) for n in g0)

    with (tmp_path / FILE).open("a") as f:
        f.write('{"k": "torn')  # a crash mid-line: ignored on reading
    again = _engine(tmp_path)  # a new process (a resume, a later epoch)
    loss2, g2 = engine_grads(again, model, batch)  # the first hit: recomputed and checked
    cache = again.ref_cache
    assert cache is not None and cache.verified and cache.hits == 1
    assert loss2 == loss0 and all(torch.equal(g0[n], g2[n]) for n in g0)

    # once checked, the values come from the cache: shift one row's and the loss follows it
    keys = row_keys(batch)
    cache.values[keys[0]] += 0.5
    loss3, _ = engine_grads(again, model, batch)
    ref = torch.tensor([cache.values[k] for k in keys], dtype=torch.float64)
    lp = sequence_logps(model, batch)
    want, _ = pair_terms(DPO, lp, ref, check_pairs(batch))
    assert loss3 == pytest.approx(float(want), rel=1e-12) and loss3 != loss0


def test_ref_cache_of_another_base_model_is_refused(tmp_path: Path) -> None:
    model, batch = model_with_adapter("qwen2"), pair_batch()
    engine_grads(_engine(tmp_path), model, batch)
    other = copy.deepcopy(model)
    with torch.no_grad():  # another base: the LM head's weights (shared with the embedding)
        other.head_weight().dense(torch.float32).mul_(1.05)
    with pytest.raises(MespError, match="another base model"):
        engine_grads(_engine(tmp_path), other, batch)


def test_ref_cache_must_be_a_directory(tmp_path: Path) -> None:
    f = tmp_path / "x"
    f.write_text("")
    with pytest.raises(MespError, match="not a directory"):
        RefCache(f)


def test_train_with_ref_cache_gives_the_same_adapter(
    model_dir: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """mesp train --ref-cache: 8 steps over 6 batches a epoch (the last 2 steps read the
    cache; the first 4 are split by a resume) give the adapter of the run without it."""
    data = write_pairs(tmp_path / "pairs.jsonl", 16)
    flags = dict(batch_size=2, lr="1e-2", rank=2, eval_every=0, warmup=0, seq_len=48, save_every=1)
    flags |= dict(valid_fraction=0.25, eval_batches=1, schedule="constant")
    plain, cached, cache = tmp_path / "plain", tmp_path / "cached", tmp_path / "refs"
    assert main(train_argv(model_dir, data, plain, "--objective", "dpo", steps=8, **flags)) == 0
    argv = train_argv(model_dir, data, cached, "--objective", "dpo", steps=3, **flags)
    assert main([*argv, "--ref-cache", str(cache)]) == 0
    resume = ["train", "--resume", str(cached), "--steps", "8", "--no-progress"]
    assert main([*resume, "--ref-cache", str(cache)]) == 0
    keys = [json.loads(x)["k"] for x in (cache / FILE).read_text().splitlines()]
    # 12 training pairs' rows and the scored validation batch's 2 pairs (validation reads the
    # cache too), a row repeated kept once
    assert 16 <= len(keys) == len(set(keys)) <= 28
    a = (plain / "adapter_model.safetensors").read_bytes()
    assert a == (cached / "adapter_model.safetensors").read_bytes()
    summaries = [json.loads((d / "summary.json").read_text()) for d in (plain, cached)]
    valid = [{k: v for k, v in s.items() if k.startswith("valid_")} for s in summaries]
    assert valid[0] == valid[1] and "valid_accuracy_after" in valid[0]
    capsys.readouterr()
    orpo = train_argv(model_dir, data, tmp_path / "o", "--objective", "orpo", steps=1, **flags)
    assert main([*orpo, "--ref-cache", str(cache)]) == 2
    assert "needs --objective dpo" in capsys.readouterr().err


def test_grad_with_ref_cache(
    model_dir: Path,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    """mesp grad --ref-cache writes the batch's reference rows, then reads them (checked
    against the model): the same gradient bits as without the cache, both times."""
    data, cache = write_pairs(tmp_path / "pairs.jsonl", 4), tmp_path / "refs"
    base = ["grad", "--model", str(model_dir), "--data", str(data), "--objective", "dpo"]
    base += ["--batch-size", "2", "--init-b", "0.01", "--quantize", "none", "--seq-len", "64"]
    outs = [tmp_path / f"{i}.safetensors" for i in range(3)]
    assert main([*base, "--out", str(outs[0])]) == 0
    for o in outs[1:]:
        assert main([*base, "--ref-cache", str(cache), "--out", str(o)]) == 0
        assert len((cache / FILE).read_text().splitlines()) == 4
    first, *rest = [_grads(o) for o in outs]  # (safetensors orders metadata as it likes)
    for meta, grads in rest:
        assert meta == first[0] and grads.keys() == first[1].keys()
        assert all(torch.equal(grads[k], first[1][k]) for k in grads)


def _grads(path: Path) -> tuple[dict[str, str], dict[str, torch.Tensor]]:
    with safe_open(str(path), "pt") as f:
        return f.metadata(), {k: f.get_tensor(k) for k in f.keys()}
