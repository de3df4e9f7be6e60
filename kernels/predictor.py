"""The learned selector on the GPU.

With buckets (the profile's ``buckets`` > 1, or a block small enough to be one bucket, such as
the heads of a layer) the selector is two Triton launches:

1. ``_hidden_kernel``: ``z = act(x w1^T + b1)``, one program per few rows of ``w1`` looping
   over ``d`` (``w1`` is ``rank x d``, about a megabyte).
2. ``_bucket_kernel``: one program per bucket of units computes the bucket's logits
   ``z w2[bucket]^T + b2`` and keeps its top ``k / buckets`` in registers (a bitonic top-k on
   keys that pack the score's bits above the unit's id), then writes their ids (expanded to
   heads for KV-group granularity).

Without buckets over more units than one program can rank, the selector stays two cuBLAS GEMVs,
the activation in place and ``torch.topk`` (several launches: about 30 us per block on an H200,
BENCHMARKS.md). A one-program radix select over all 20K units was tried in its place and was
slower (13.5 ms per token against 8.4 ms for OPT-13B at MLP 0.1): one program cannot scan 20K
scores 32 times as fast as PyTorch's multi-block select; buckets split that scan over programs.

Both paths return the ids in ascending order, as the reference does: on the H200 the down
projection's kernel read the rows of unsorted ids at about a third of the speed of sorted ones
(1167 against 421 us per OPT-13B step, BENCHMARKS.md).
Reference: ``kernels/reference.py::select_predictor`` and ``bucket_topk``.
"""

from __future__ import annotations

import torch

from .reference import activate, bucket_topk, expand_groups

try:
    from .bucket_select import bucketed, select_hidden_triton, select_predictor_triton
    from .triton_common import INTERPRET
except ImportError:  # no Triton: the PyTorch path below
    INTERPRET = False

    def bucketed(units: int, buckets: int) -> bool:
        return False


def select_predictor(x, w1, b1, w2, b2, act: str, k: int, group: int, buckets: int = 1,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """x: [..., d]; w1: [r, d]; w2: [U, r]; returns unit ids [..., k * group], ascending: in
    ``out`` when given (int64, contiguous; the bucket kernel writes it directly)."""
    if (x.is_cuda or INTERPRET) and bucketed(w2.shape[0], buckets):
        return select_predictor_triton(x, w1, b1, w2, b2, act, k, group, buckets, out)
    h = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), w1, b1)
    ids = _rank(h, None, w2, b2, act, k, group, buckets).reshape(*x.shape[:-1], k * group)
    return ids if out is None else out.copy_(ids)


def select_hidden(h, b1, w2, b2, act: str, k: int, group: int, buckets: int = 1) -> torch.Tensor:
    """A folded predictor's selection from its hidden pre-activations h [..., r] (see
    ``select_predictor``); the bucket launch alone when bucketed, else PyTorch."""
    if (h.is_cuda or INTERPRET) and bucketed(w2.shape[0], buckets):
        return select_hidden_triton(h, b1, w2, b2, act, k, group, buckets)
    return _rank(h.reshape(-1, h.shape[-1]), b1, w2, b2, act, k, group, buckets
                 ).reshape(*h.shape[:-1], k * group)


def _rank(h, b1, w2, b2, act: str, k: int, group: int, buckets: int) -> torch.Tensor:
    """The PyTorch path after the first GEMV: act(h + b1) w2^T + b2 over rows h [n, r], top-k
    per bucket (sorted), expanded to groups: ids [n, k * group]."""
    z = h + b1 if b1 is not None else h
    if act != "none":  # out of place: ``h`` may be the op's input
        z = activate(z, act)
    logits = torch.nn.functional.linear(z, w2, b2)
    return expand_groups(bucket_topk(logits, k, buckets), group)
