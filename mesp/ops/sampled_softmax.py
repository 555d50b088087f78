"""Softmax over a vocabulary subset (approximate loss, off by default): `--loss sampled-softmax`.

The cross-entropy of each trained position runs over one shared set S of vocabulary rows:
every target token of the batch plus K tokens chosen as the most relevant. Per row,
loss = logsumexp_{v∈S} z_v − z_target, and ∂loss/∂z_v = softmax_S(z)_v − onehot, for v ∈ S only.
With W_S (|S|, D) gathered once, logits cost |S|/V of the exact head and no (rows × V) block
exists, even in slices.

How the K tokens are chosen: the top K of a cheap proxy, the head's own logits at a few probe
positions of the same batch (max over probes). Why this and not nearest neighbours of the
target in the tied embedding space:
  * what the approximation drops is the softmax mass outside S; it is smallest when S holds the
    tokens with the largest logits, which is exactly what the proxy ranks by, measured with the
    current model (it follows training), where embedding neighbours only say which tokens look
    alike and ignore the context;
  * cost: P probes × V × D (P ≤ 32) against U unique targets × V × D for neighbour search
    (U ~ the number of tokens, i.e. as much as the exact head);
  * it works for untied heads too (Llama-3.2-3B and larger unties the embedding).
The probes are drawn from the trained rows with a generator seeded by `seed`, so the same
batch and seed always give the same S. Targets are always in S, so the loss is a lower bound
of the exact loss (fewer terms in the partition sum) and equals it when S covers the
vocabulary.
"""

from __future__ import annotations

import torch
from torch import Tensor

from mesp.errors import MespError
from mesp.models.linear import FrozenWeight

PROBES = 32  # proxy positions per batch


def check_subset(k: int, vocab: int) -> None:
    """K must be a positive count below the vocabulary size (a clear error otherwise)."""
    if type(k) is not int or k < 1:
        raise MespError(f"--vocab-subset must be a positive integer, got {k!r}")
    if k >= vocab:
        raise MespError(
            f"--vocab-subset {k} is not smaller than the vocabulary ({vocab} tokens): "
            "use --loss ce for the exact softmax"
        )


@torch.no_grad()
def choose_subset(
    hs: Tensor,
    tgt: Tensor,
    head: FrozenWeight,
    k: int,
    seed: int = 0,
    vocab_chunk: int = 8192,
) -> Tensor:
    """hs (n, D) trained final-normed states, tgt (n,) -> sorted vocabulary ids S (int64):
    the unique targets plus the K highest proxy scores among the other tokens (fewer when the
    vocabulary runs out). The head is read one vocabulary slice at a time."""
    vocab = head.out_features
    check_subset(k, vocab)
    n = hs.shape[0]
    g = torch.Generator().manual_seed(seed)
    probes = torch.randperm(n, generator=g)[: min(n, PROBES)].to(hs.device)
    hp = hs.index_select(0, probes)  # (P, D)
    score = torch.empty(vocab, dtype=torch.float32, device=hs.device)
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(v0 + vocab_chunk, vocab)
        w = head.rows(v0, v1, hs.dtype).to(hs.dtype)
        score[v0:v1] = (hp @ w.t()).amax(0).float()  # a softcap is monotone: same ranking
        del w
    targets = torch.unique(tgt).to(hs.device)  # tgt may sit on the host (meta-device runs)
    score[targets] = -torch.inf
    extra = min(k, vocab - targets.numel())
    top = torch.topk(score, extra, sorted=False).indices
    return torch.sort(torch.cat([targets, top])).values


def subset_head(
    head: FrozenWeight, subset: Tensor, tgt: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(W_S (|S|, D) in dtype, each target's column in S). Every target must be in S."""
    local = torch.searchsorted(subset, tgt.to(subset.device))
    return head.gather(subset).to(dtype), local
