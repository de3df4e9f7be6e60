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
