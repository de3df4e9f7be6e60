"""The learned selector on the GPU: two cuBLAS GEMVs, the activation in place, and an unsorted
top-k.

The reference sorts the chosen ids (so reads walk memory forwards and results are deterministic
on CPU); on the GPU the sort is one more launch per layer for nothing: the Triton kernels read
the selected rows in any order and add their contributions with atomics, whose order is not
fixed anyway. A one-program Triton top-k (radix select on the score bits) was tried in place of
``torch.topk`` and was slower end to end (OPT-13B at MLP 0.1: 13.5 ms per token against 8.4 ms):
one program cannot read and reduce 20K scores 32 times as fast as PyTorch's multi-block select.
Reference: ``kernels/reference.py::select_predictor``.
"""

from __future__ import annotations

import torch

from .reference import activate, expand_groups


def select_predictor(x, w1, b1, w2, b2, act: str, k: int, group: int) -> torch.Tensor:
    """x: [..., d]; w1: [r, d]; w2: [U, r]; returns unit ids [..., k * group] (unsorted)."""
    z = torch.nn.functional.linear(x.reshape(-1, x.shape[-1]), w1, b1)
    if act == "relu":
        z = z.relu_()
    elif act != "none":
        z = activate(z, act)
    logits = torch.nn.functional.linear(z, w2, b2)
    units = expand_groups(torch.topk(logits, k, dim=-1, sorted=False).indices, group)
    return units.reshape(*x.shape[:-1], k * group)
