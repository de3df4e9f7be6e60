"""Head-gathered projections: the query projection and the output projection of attention,
computed for the selected heads only.

A selection names heads; head ``h`` owns weight rows ``h * head_dim .. (h + 1) * head_dim - 1``
of ``W_q`` ([H * head_dim, d]) and of the transposed output projection ``W_o_t``
([H * head_dim, d_out]), each row contiguous. Both kernels split over the selected rows.
References: ``kernels/reference.py::sparse_head_proj`` and ``sparse_head_out``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import check_dtype, gather_configs


@triton.jit
def _weight_rows(idx_ptr, row, stride_idx, offs, HEAD_DIM, mask):
    """Weight-row ids of the selected-row positions ``offs`` (head id * head_dim + offset)."""
    head = tl.load(idx_ptr + row * stride_idx + offs // HEAD_DIM, mask=mask, other=0).to(tl.int64)
    return head * HEAD_DIM + offs % HEAD_DIM


@triton.autotune(configs=gather_configs(), key=["D", "J"])
@triton.jit
def _head_proj_kernel(
    x_ptr, idx_ptr, w_ptr, b_ptr, out_ptr,
    D, J, HEAD_DIM,
    stride_x, stride_idx, stride_w, stride_out,
    HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < J
    wrows = _weight_rows(idx_ptr, row, stride_idx, offs, HEAD_DIM, mask)
    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        w = tl.load(w_ptr + wrows[:, None] * stride_w + offs_d[None, :],
                    mask=mask[:, None] & mask_d[None, :], other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
    if HAS_B:
        acc += tl.load(b_ptr + wrows, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + wrows, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.autotune(configs=gather_configs(), key=["DOUT", "J"], reset_to_zero=["out_ptr"])
@triton.jit
def _head_out_kernel(
    a_ptr, idx_ptr, w_ptr, out_ptr,
    DOUT, J, HEAD_DIM,
    stride_a, stride_idx, stride_w, stride_out,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < J
    wrows = _weight_rows(idx_ptr, row, stride_idx, offs, HEAD_DIM, mask)
    vals = tl.load(a_ptr + row * stride_a + wrows, mask=mask, other=0.0).to(tl.float32)
    for o0 in range(0, DOUT, BLOCK_D):
        offs_o = o0 + tl.arange(0, BLOCK_D)
        mask_o = offs_o < DOUT
        w = tl.load(w_ptr + wrows[:, None] * stride_w + offs_o[None, :],
                    mask=mask[:, None] & mask_o[None, :], other=0.0)
        part = tl.sum(w.to(tl.float32) * vals[:, None], axis=0)
        tl.atomic_add(out_ptr + row * stride_out + offs_o, part, mask=mask_o)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def sparse_head_proj(x, idx, w, b, head_dim: int) -> torch.Tensor:
    """Triton launcher of ``torch.ops.dejavu.sparse_head_proj``: [..., d] -> [..., H * head_dim]."""
    check_dtype("sparse_head_proj", x, w, b)
    rows, sel = _rows(x), _rows(idx)
    j = sel.shape[1] * head_dim
    out = torch.zeros(rows.shape[0], w.shape[0], device=x.device, dtype=x.dtype)

    def grid(meta):
        return (triton.cdiv(j, meta["BLOCK_N"]), rows.shape[0])

    _head_proj_kernel[grid](
        rows, sel, w, b if b is not None else w, out,
        rows.shape[1], j, head_dim,
        rows.stride(0), sel.stride(0), w.stride(0), out.stride(0),
        HAS_B=b is not None,
    )
    return out.reshape(*x.shape[:-1], w.shape[0])


def sparse_head_out(attn, idx, wo_t, b, head_dim: int) -> torch.Tensor:
    """Triton launcher of ``torch.ops.dejavu.sparse_head_out``: [..., H * head_dim] -> [..., d]."""
    check_dtype("sparse_head_out", attn, wo_t, b)
    rows, sel = _rows(attn), _rows(idx)
    j = sel.shape[1] * head_dim
    d_out = wo_t.shape[1]
    out = torch.zeros(rows.shape[0], d_out, device=attn.device, dtype=torch.float32)

    def grid(meta):
        return (triton.cdiv(j, meta["BLOCK_N"]), rows.shape[0])

    _head_out_kernel[grid](
        rows, sel, wo_t, out,
        d_out, j, head_dim,
        rows.stride(0), sel.stride(0), wo_t.stride(0), out.stride(0),
    )
    if b is not None:
        out += b
    return out.to(attn.dtype).reshape(*attn.shape[:-1], d_out)
