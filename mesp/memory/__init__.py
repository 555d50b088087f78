"""`mesp.memory`: the three ways mesp measures memory, in one place.

(a) Exact live-tensor bytes: `LiveTensorTracker` / `measure_peak` (a TorchDispatchMode that
    counts each new output storage and sees its free through a weakref), split into weights,
    adapter + grads + optimizer state, and working memory.
(b) Process peak RSS: `run_child` starts a fresh interpreter with glibc told to unmap freed
    blocks (`FAITHFUL_MALLOC_ENV`), resets the high-water mark through /proc/self/clear_refs
    and reads VmHWM (`reset_peak_rss`, `peak_rss_bytes`); `rss_parts` splits the current RSS
    into anonymous and file-backed pages.
(c) CUDA: `cuda_peak_bytes` / `reset_cuda_peak` (torch.cuda.max_memory_allocated).
"""

from mesp.memory.rss import (
    FAITHFUL_MALLOC_ENV,
    cuda_peak_bytes,
    current_rss_bytes,
    peak_rss_bytes,
    reset_cuda_peak,
    reset_peak_rss,
    rss_parts,
    run_child,
)
from mesp.memory.tracker import LiveTensorTracker, adapter_tensors, measure_peak

__all__ = [
    "FAITHFUL_MALLOC_ENV",
    "LiveTensorTracker",
    "adapter_tensors",
    "cuda_peak_bytes",
    "current_rss_bytes",
    "measure_peak",
    "peak_rss_bytes",
    "reset_cuda_peak",
    "reset_peak_rss",
    "rss_parts",
    "run_child",
]
