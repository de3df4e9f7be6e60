"""KV-cache selection ops (second paper, appendix A): score cached positions by the attention
of the last prompt tokens, then choose the positions to keep per KV head. Both run once per
request, after prefill; decoding then reads the gathered cache. The default implementations
are the references in ``kernels/reference.py`` (plain PyTorch, so they run on CPU and GPU)."""

from __future__ import annotations

import torch

from . import reference as ref


@torch.library.custom_op("dejavu::kv_scores", mutates_args=())
def kv_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [B, H, W, hd] observation queries; k: [B, KVH, T, hd]; returns [B, KVH, T] fp32."""
    return ref.kv_scores(q, k, scale)


@kv_scores.register_fake
def _(q, k, scale):
    return k.new_empty(k.shape[0], k.shape[1], k.shape[2], dtype=torch.float32)


@torch.library.custom_op("dejavu::kv_select", mutates_args=())
def kv_select(scores: torch.Tensor, budget: int, sinks: int, window: int,
              smooth: int) -> torch.Tensor:
    """scores: [B, KVH, T]; returns kept positions [B, KVH, min(budget, T)] int64, ascending."""
    return ref.kv_select(scores, budget, sinks, window, smooth)


@kv_select.register_fake
def _(scores, budget, sinks, window, smooth):
    return scores.new_empty(*scores.shape[:2], min(budget, scores.shape[2]), dtype=torch.int64)


# ``counters`` is working memory of the CUDA kernel, zero before and after every call, so the
# op declares no mutation: its value is the same after the call as before.
@torch.library.custom_op("dejavu::decode_attention", mutates_args=())
def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None,
                     counters: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None) -> torch.Tensor:
    """One decode token's attention over its KV cache, grouped-query heads read once per KV
    head: q [B, H, 1, D], k / v [B, KVH, L, D], mask None or bool [B, L] (True: attend) ->
    [B, H, 1, D]. On CUDA the split-K Triton kernel of ``kernels/decode_attention.py``; every
    mode of ``dejavu bench --kv`` reads its cache through it. ``counters`` (int32 zeros, at
    least B * KVH, or B * S with ``heads``; the lower pass attaches them) let that kernel merge
    its chunks in the same launch; the result is the same without them. ``heads`` (int ids
    [..., S], a row per sequence or one for the batch, -1 for none; option
    ``decode_selected_heads``): only the KV groups of the query heads named are computed, each
    KV head read once, and the other groups' output rows are zeros."""
    check_decode(q, k, v, mask, counters, heads)
    return ref.decode_attention(q, k, v, scale, mask, heads)


def check_decode(q, k, v, mask, counters=None, heads=None) -> None:
    if q.dim() != 4 or q.shape[2] != 1 or k.shape[:3] != v.shape[:3] \
            or q.shape[1] % k.shape[1] or q.shape[-1] != k.shape[-1] or q.shape[0] != k.shape[0]:
        raise ValueError(f"decode_attention: q {tuple(q.shape)} must be [B, H, 1, D] with H a "
                         f"multiple of the KV heads of k {tuple(k.shape)} / v {tuple(v.shape)}")
    if mask is not None and (mask.dtype != torch.bool or tuple(mask.shape) != (k.shape[0], k.shape[2])):
        raise ValueError(f"decode_attention: mask must be bool [B, L] = {(k.shape[0], k.shape[2])}, "
                         f"got {mask.dtype} {tuple(mask.shape)}")
    slots = k.shape[1]
    if heads is not None:
        rows = heads.numel() // heads.shape[-1] if heads.dim() and heads.shape[-1] else 0
        if heads.dtype not in (torch.int64, torch.int32) or heads.dim() < 1 \
                or heads.shape[-1] < 1 or rows not in (1, q.shape[0]) or heads.device != q.device:
            raise ValueError(f"decode_attention: heads must be int64 or int32 ids [..., S] with "
                             f"S >= 1 and B = {q.shape[0]} rows or one, on {q.device}, got "
                             f"{heads.dtype} {tuple(heads.shape)} on {heads.device}")
        slots = heads.shape[-1]
    if counters is not None and (counters.dtype != torch.int32 or counters.dim() != 1
                                 or counters.numel() < k.shape[0] * slots
                                 or counters.device != q.device):
        what = "S (the heads' ids)" if heads is not None else "KVH"
        raise ValueError(f"decode_attention: counters must be int32 [>= B * {what} = "
                         f"{k.shape[0] * slots}] on {q.device}, got {counters.dtype} "
                         f"{tuple(counters.shape)} on {counters.device}")


@decode_attention.register_fake
def _(q, k, v, scale, mask=None, counters=None, heads=None):
    check_decode(q, k, v, mask, counters, heads)
    return torch.empty_like(q)
