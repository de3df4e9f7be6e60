"""The learned selector on the GPU: two cuBLAS GEMVs, the activation in place, and the one-launch
top-k of ``kernels/topk.py`` (ids ascending, as the reference returns them; without Triton,
``torch.topk``). Reference: ``kernels/reference.py::select_predictor``.
"""

from __future__ import annotations

import torch

from .reference import activate, expand_groups

try:
    from .topk import MAX_UNITS
    from .topk import topk_indices as _topk
except ImportError:  # no Triton: PyTorch's top-k
    MAX_UNITS, _topk = 0, None


def _top(logits: torch.Tensor, k: int) -> torch.Tensor:
    if _topk is not None and logits.shape[-1] <= MAX_UNITS:
        return _topk(logits, k)
    return torch.topk(logits, k, dim=-1, sorted=False).indices


def select_predictor(x, w1, b1, w2, b2, act: str, k: int, group: int) -> torch.Tensor:
    """x: [..., d]; w1: [r, d]; w2: [U, r]; returns unit ids [..., k * group]."""
    z = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), w1, b1)
    if act == "relu":
        z = z.relu_()
    elif act != "none":
        z = activate(z, act)
    logits = torch.nn.functional.linear(z, w2, b2)
    units = expand_groups(_top(logits, k), group)
    return units.reshape(*x.shape[:-1], k * group)
