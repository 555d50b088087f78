"""Exact byte counts for the live-tensor tracker, and RSS measured in a faithful-malloc child."""

from __future__ import annotations

import threading

import pytest
import torch

from mesp.errors import MespError
from mesp.memory.rss import (
    FAITHFUL_MALLOC_ENV,
    cuda_peak_bytes,
    current_rss_bytes,
    peak_rss_bytes,
    reset_cuda_peak,
    run_child,
)
from mesp.memory.tracker import LiveTensorTracker, adapter_tensors, measure_peak

MiB = 2**20


def test_alloc_free_sequence_exact() -> None:
    with LiveTensorTracker() as t:
        a = torch.empty(100)  # 400 B
        b = torch.zeros(200, dtype=torch.float64)  # 1600 B
        c = torch.randn(50)  # 200 B
        assert (t.current_bytes, t.peak_bytes) == (2200, 2200)
        del b
        assert (t.current_bytes, t.peak_bytes) == (600, 2200)
        d = torch.ones(1000)  # 4000 B
        assert (t.current_bytes, t.peak_bytes) == (4600, 4600)
        e = torch.empty(0)
        assert t.current_bytes == 4600
        del a, c, d, e
        assert (t.current_bytes, t.peak_bytes) == (0, 4600)
        t.reset_peak()
        f = torch.arange(10, dtype=torch.int64)
        assert (t.current_bytes, t.peak_bytes) == (80, 80)
        del f


def test_views_and_inplace_not_counted() -> None:
    with LiveTensorTracker() as t:
        a = torch.ones(1000)
        views = [a[10:], a.view(10, 100), a.reshape(10, 100).t(), a.detach(), a.unsqueeze(0)]
        views += list(a.chunk(4)) + list(a.split(3))  # ops returning lists of views
        a.add_(1)
        a.mul_(2).clamp_(max=3)
        torch.add(a, 1, out=a)
        assert t.current_bytes == 4000
        copy = views[2].reshape(1000)  # non-contiguous -> reshape must copy: new storage
        assert t.current_bytes == 8000
        del a, copy
        assert t.current_bytes == 4000  # the views keep the storage alive
        del views
        assert (t.current_bytes, t.peak_bytes) == (0, 8000)


def test_tuple_outputs_resize_and_set() -> None:
    with LiveTensorTracker() as t:
        x = torch.randn(100)  # 400
        values, indices = torch.sort(x)  # 400 + 800 (int64)
        assert t.current_bytes == 1600
        del values, indices
        buf = torch.empty(0)
        buf.resize_(50)  # grows a tracked storage in place
        assert t.current_bytes == 600
        buf.resize_(0)  # shape only: the 200 B storage stays
        assert t.current_bytes == 600
        torch.cat([x, x], out=buf)  # out= grows buf's storage to 800 B
        assert t.current_bytes == 1200
        other = torch.ones(10)
        other.set_(x)  # other now shares x's storage: its own 40 B are freed
        assert t.current_bytes == 1200
        del x
        assert t.current_bytes == 1200  # still held through `other`
        del other, buf
        assert t.current_bytes == 0
        lifted = torch.tensor([1.0, 2.0])  # built outside dispatch, then aten.lift_fresh
        assert t.current_bytes == 8
        del lifted


def test_freed_inside_loop() -> None:
    with LiveTensorTracker() as t:
        x = torch.ones(256)  # 1 KiB
        for _ in range(5):
            y = x * 2
            x = y + 1  # old x, y and the new x are live together: 3 KiB
            del y
        assert (t.current_bytes, t.peak_bytes) == (1024, 3072)


def test_untracked_preexisting_and_register() -> None:
    w = torch.ones(100)  # 400 B, allocated before the mode
    b = torch.ones(25)  # 100 B
    t = LiveTensorTracker()
    with t:
        w.add_(1)
        v = w[:10]
        assert t.current_bytes == 0  # views/in-place of unknown storage are not allocations
    assert t.register([w, v, w.view(10, 10)], "weights") == 400  # one storage, counted once
    assert t.register([b], "adapter") == 100
    with t:
        tmp = w * 2
        assert (t.current_bytes, t.peak_bytes) == (900, 900)
        del tmp, b
        assert t.current_bytes == 400  # freeing a registered tensor is seen too
    assert t.breakdown() == {"weights": 400, "adapter": 100, "working": 400, "total": 900}


# float32 sizes: B*H*4 = 32768, B*O*4 = 4096, H*O*4 = 8192, D*H*4 = 16384
B, D, H, O = 64, 32, 128, 16  # noqa: E741


def _mlp() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    x = torch.randn(B, D, generator=g)
    w1 = torch.randn(D, H, generator=g, requires_grad=True)
    w2 = torch.randn(H, O, generator=g, requires_grad=True)
    return x, w1, w2


def test_mlp_forward_backward_exact() -> None:
    """y = relu(x @ W1) @ W2; loss = y.sum(). Only x is saved by mm1 (W1 needs no input grad),
    relu saves its result r (not h), mm2 saves r and W2, sum saves nothing.
    fwd: h (32768) + r (32768) live at relu -> 65536; then h dies; y dies after sum; left r + loss.
    bwd peak inside ReluBackward: r + loss(4) + seed(4, held by the expand view)
        + grad_r (32768) + W2.grad (8192) + grad_h (32768) = 106504.
    end: loss + W1.grad (16384) + W2.grad = 24580."""
    x, w1, w2 = _mlp()
    t = LiveTensorTracker()
    base = t.register([x], "input") + t.register([w1, w2], "weights")
    assert base == 8192 + 16384 + 8192
    with t:
        loss = ((x @ w1).relu() @ w2).sum()
        assert (t.current_bytes - base, t.peak_bytes - base) == (32772, 65536)
        loss.backward()
        assert (t.current_bytes - base, t.peak_bytes - base) == (24580, 106504)
        del loss
        assert t.current_bytes - base == 24576
    parts = t.breakdown(weights=[w1, w2], adapter=[w1.grad, w2.grad])
    # W2.grad is live at the peak (AccumulateGrad runs before ReluBackward), W1.grad is not yet.
    assert parts == {
        "weights": 24576,
        "adapter": 8192,
        "input": 8192,
        "working": 106504 - 8192,
        "total": base + 106504,
    }


def test_mlp_no_grad_inplace_relu() -> None:
    x, w1, w2 = _mlp()
    with torch.no_grad(), LiveTensorTracker() as t:
        y = (x @ w1).relu() @ w2  # h + r at relu
        assert (t.current_bytes, t.peak_bytes) == (4096, 65536)
        t.reset_peak()
        del y
        y = (x @ w1).relu_() @ w2  # in-place relu: h + y only
        assert (t.current_bytes, t.peak_bytes) == (y.nbytes, 32768 + 4096)


def test_measure_peak_with_late_adapter_state() -> None:
    w = torch.ones(1000)  # 4000 B weights
    p = torch.ones(10)  # 40 B LoRA param
    state: list[torch.Tensor] = []

    def step() -> None:
        p.grad = torch.ones(10)  # 40 B, created during the run
        state.append(torch.zeros(10))  # 40 B "optimizer state"
        tmp = w * 2  # 4000 B working, the peak
        del tmp

    parts = measure_peak(step, weights=[w], adapter=lambda: [p, p.grad, *state])
    assert parts == {"weights": 4000, "adapter": 120, "working": 4000, "total": 8120}


def test_adapter_tensors_collects_grads_and_optimizer_state() -> None:
    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    p.sum().backward()
    opt.step()
    got = adapter_tensors([p], opt)
    assert [x is y for x, y in zip(got, [p, p.grad], strict=False)] == [True, True]
    assert len(got) == 3 and got[2] is opt.state[p]["momentum_buffer"]


class _LoggingTracker(LiveTensorTracker):
    """Records every +/- byte change, in order, for comparison with the allocator's events."""

    def __init__(self) -> None:
        super().__init__()
        self.log: list[int] = []

    def _grow(self, n: int) -> None:
        self.log.append(n)
        super()._grow(n)

    def _shrink(self, n: int) -> None:
        self.log.append(-n)
        super()._shrink(n)


def test_matches_cpu_allocator_profiler() -> None:
    """Independent ground truth: the CPU allocator's own alloc/free events, in order. They
    agree exactly except for 4-8 byte wrapped scalars that kernels create and free internally
    (invisible to a dispatch mode), so compare the sequences without those."""
    from torch.profiler import ProfilerActivity, profile

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(64, 256), torch.nn.GELU(), torch.nn.Linear(256, 64))
    x = torch.randn(16, 64)
    opt = torch.optim.AdamW(model.parameters(), foreach=True)

    def step() -> None:
        model(x).square().mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    step()  # create optimizer state first
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        step()
    events = [e for e in prof.profiler.kineto_results.events() if e.name() == "[memory]"]
    allocator = [e.nbytes() for e in sorted(events, key=lambda e: e.start_ns())]
    with _LoggingTracker() as t:
        step()
    assert [n for n in t.log if abs(n) > 8] == [n for n in allocator if abs(n) > 8]
    assert len([n for n in t.log if abs(n) > 8]) > 30 and sum(allocator) == t.current_bytes == 0
    running = [sum(allocator[: i + 1]) for i in range(len(allocator))]
    assert 0 <= max(running) - t.peak_bytes <= 16
    assert t.peak_bytes > 200_000


def test_free_from_another_thread() -> None:
    with LiveTensorTracker() as t:
        box = [torch.ones(100)]
    th = threading.Thread(target=box.clear)
    th.start()
    th.join()
    assert (t.current_bytes, t.peak_bytes) == (0, 400)


# -- RSS --------------------------------------------------------------------------------------

_CHILD = """
import torch
from mesp.memory.rss import current_rss_bytes, peak_rss_bytes, report, reset_peak_rss
MiB = 2**20
warm = torch.ones(MiB); del warm  # start the thread pool before measuring
base0 = current_rss_bytes()
big = torch.ones(200 * MiB // 4); del big
freed = current_rss_bytes() - base0
no_reset = peak_rss_bytes() - base0
ok = reset_peak_rss()
base = current_rss_bytes()
small = torch.ones(50 * MiB // 4)
report(reset_ok=ok, no_reset=no_reset, freed=freed, delta=peak_rss_bytes() - base)
"""


def test_child_peak_rss_after_reset() -> None:
    r = run_child(["-c", _CHILD], timeout=120)
    assert r["no_reset"] >= 200e6  # the 200 MiB tensor is in the high-water mark
    assert r["freed"] < 5 * MiB  # faithful malloc returned it to the kernel
    if not r["reset_ok"]:
        pytest.skip("/proc/self/clear_refs not writable here: VmHWM cannot be reset")
    assert abs(r["delta"] - 50 * MiB) <= 0.1 * 50 * MiB


def test_run_child_protocol_and_env() -> None:
    code = (
        "import os; from mesp.memory.rss import report; print('noise');"
        "report(env={k: os.environ[k] for k in ['MALLOC_MMAP_THRESHOLD_', 'EXTRA']}, n=1)"
    )
    r = run_child(["-c", code], env_extra={"EXTRA": "x"}, timeout=60)
    mmap = FAITHFUL_MALLOC_ENV["MALLOC_MMAP_THRESHOLD_"]
    assert r == {"env": {"MALLOC_MMAP_THRESHOLD_": mmap, "EXTRA": "x"}, "n": 1}


def test_run_child_failures() -> None:
    with pytest.raises(MespError, match="exited with 3: boom happened"):
        run_child(["-c", "import sys; sys.stderr.write('x\\nboom happened\\n'); sys.exit(3)"])
    with pytest.raises(MespError, match="no result"):
        run_child(["-c", "print('hello')"])


def test_in_process_rss_and_cuda_wrappers() -> None:
    assert peak_rss_bytes() >= current_rss_bytes() > 0
    if not torch.cuda.is_available():
        assert cuda_peak_bytes() is None
        assert reset_cuda_peak() is None
