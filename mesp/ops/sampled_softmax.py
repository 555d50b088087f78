"""Softmax over a vocabulary subset (approximate loss, off by default): `--loss sampled-softmax`.

The cross-entropy of each trained position runs over one shared set S of vocabulary rows, so
W_S (|S|, D) is gathered once, logits cost |S|/V of the exact head, and no (rows × V) block
exists, even in slices. Per row, loss = logsumexp_{v∈S}(z_v + b_v) − z_target and
∂loss/∂z_v = softmax_S(z + b)_v − onehot for v ∈ S only. S holds:
  * every target token of the batch (b = 0);
  * K/2 "hard" tokens, the top of a cheap proxy: the head's own logits at up to 32 probe
    positions of the batch (max over probes), b = 0;
  * K/2 tokens drawn uniformly from the rest of the vocabulary (R tokens), each standing for
    R/(K/2) of them: b = log(R/(K/2)), so Σ_S e^(z+b) is an unbiased estimate of the partition
    sum over everything outside the targets and hard tokens.
Why a proxy rather than nearest neighbours of the target in the tied embedding space:
  * the error is the softmax mass S misses; it is smallest when S holds the tokens with the
    largest logits in context, which the proxy measures with the current model (it follows
    training), where embedding neighbours only say which tokens look alike;
  * cost: P probes × V × D (P ≤ 32) against U unique targets × V × D for a neighbour search
    (U ~ the number of tokens: as much as the exact head);
  * it works for untied heads too (Llama-3.2-3B and larger untie the embedding).
Why the drawn half: with hard tokens alone, a token outside every S is never pushed down and
drifts up as training moves the hidden states. Measured on SmolLM2-135M (30 steps, K=1000):
valid perplexity 70.1 -> 95.3 with hard tokens only, -> 45.1 with this S, -> 43.5 exact
(`mesp bench softmax` reports the current figures).
Probes and draws come from a generator seeded by `seed` and the batch, so the same batch and
seed always give the same S. When S covers the vocabulary, the loss is the exact CE.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from mesp.errors import MespError
from mesp.models.linear import FrozenWeight
from mesp.ops.matmul import linear

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
) -> tuple[Tensor, Tensor]:
    """hs (n, D) trained final-normed states, tgt (n,) -> (S, bias): sorted vocabulary ids
    (int64) and a per-column logit offset (fp32). S = the unique targets, the K//2 highest
    proxy scores among the other tokens (bias 0), and K − K//2 tokens drawn uniformly without
    replacement from the rest, each standing for the R/k_r tokens of that rest (R tokens, k_r
    drawn): bias log(R/k_r), the importance weight of the partition-sum estimate
    Z ≈ Σ_fixed e^z + (R/k_r)·Σ_drawn e^z. Without the drawn part, tokens outside every S
    never get pushed down and drift up (measured: SmolLM2 valid perplexity rose in training).
    Fewer tokens when the vocabulary runs out (then bias 0: the sum is exact).
    The head is read one vocabulary slice at a time."""
    vocab = head.out_features
    check_subset(k, vocab)
    n = hs.shape[0]
    host_targets = torch.unique(tgt)  # tgt may sit on the host (meta-device runs)
    targets = host_targets
    n_hard = min(k // 2, vocab - targets.numel())
    n_rand = min(k - n_hard, vocab - targets.numel() - n_hard)
    g = torch.Generator().manual_seed(seed * 1_000_003 + int(tgt.sum()) * 7 + n)  # per batch
    probes = torch.randperm(n, generator=g)[: min(n, PROBES)].to(hs.device)
    hp = hs.index_select(0, probes)  # (P, D)
    score = torch.empty(vocab, dtype=torch.float32, device=hs.device)
    for v0 in range(0, vocab, vocab_chunk):
        v1 = min(v0 + vocab_chunk, vocab)
        w = head.rows(v0, v1, hs.dtype).to(hs.dtype)
        score[v0:v1] = linear(hp, w).amax(0).float()  # a softcap is monotone: same ranking
        del w
    targets = targets.to(hs.device)
    score[targets] = -torch.inf
    hard = torch.topk(score, n_hard, sorted=False).indices
    taken = torch.zeros(vocab, dtype=torch.bool)
    taken[host_targets.cpu()] = True
    if not hard.is_meta:  # (a meta run, for memory accounting, has no values to exclude)
        taken[hard.cpu()] = True
    rest = (~taken).nonzero().squeeze(1)
    drawn = rest[torch.randperm(rest.numel(), generator=g)[:n_rand]].to(hs.device)
    ids = torch.cat([targets, hard, drawn])
    bias = torch.zeros(ids.numel(), dtype=torch.float32, device=hs.device)
    if n_rand:
        bias[-n_rand:] = math.log(rest.numel() / n_rand)
    order = torch.argsort(ids)
    return ids[order], bias[order]


def subset_head(
    head: FrozenWeight, subset: Tensor, tgt: Tensor, dtype: torch.dtype
) -> tuple[Tensor, Tensor]:
    """(W_S (|S|, D) in dtype, each target's column in S). Every target must be in S."""
    local = torch.searchsorted(subset, tgt.to(subset.device))
    return head.gather(subset).to(dtype), local
