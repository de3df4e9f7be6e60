"""Fused sparse MLP: gather the selected neurons' rows, activate, and apply the down projection,
in one kernel.

Each program owns ``BLOCK_N`` selected neurons of one token row. It reads their rows of W1 (and
of W_up for gated MLPs; ``[N, d]``, a neuron's row contiguous), computes
``h = act(x . W1[j] + b1[j]) [* x . W_up[j]]`` in fp32, then reads the same neurons' rows of the
transposed down projection ``W2_t`` (``[N, d_out]``, contiguous too: paper section 4.4) and adds
``h @ W2_t[rows]`` into an fp32 output with atomics. Splitting over the selected neurons keeps
the GPU full at small densities, and one launch for the whole MLP keeps the fixed launch cost
(about 15 us for a plain gather-GEMV pair on an H200, see BENCHMARKS.md) from dominating.

Weights are never copied: the gather is fused into the matrix-vector product (paper section 4.4).
Reference: ``kernels/reference.py::sparse_mlp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import ACT_CODES, apply_act, check_dtype, gather_configs


@triton.autotune(configs=gather_configs(), key=["D", "DOUT", "K"], reset_to_zero=["out_ptr"])
@triton.jit
def _sparse_mlp_kernel(
    # pointers
    x_ptr, idx_ptr, w1_ptr, b1_ptr, wup_ptr, w2t_ptr, out_ptr,
    # sizes
    D, DOUT, K,
    # strides (rows; columns are contiguous)
    stride_x, stride_idx, stride_w1, stride_wup, stride_w2t, stride_out,
    # meta-parameters
    ACT: tl.constexpr, HAS_B1: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
):
    pid = tl.program_id(0)
    row = tl.program_id(1)
    offs_n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K
    neurons = tl.load(idx_ptr + row * stride_idx + offs_n, mask=mask_n, other=0).to(tl.int64)

    acc = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        tile = mask_n[:, None] & mask_d[None, :]
        w = tl.load(w1_ptr + neurons[:, None] * stride_w1 + offs_d[None, :], mask=tile, other=0.0)
        acc += tl.sum(w.to(tl.float32) * x[None, :], axis=1)
        if GATED:
            u = tl.load(wup_ptr + neurons[:, None] * stride_wup + offs_d[None, :], mask=tile,
                        other=0.0)
            acc_up += tl.sum(u.to(tl.float32) * x[None, :], axis=1)
    if HAS_B1:
        acc += tl.load(b1_ptr + neurons, mask=mask_n, other=0.0).to(tl.float32)
    h = apply_act(acc, ACT)
    if GATED:
        h = h * acc_up
    h = tl.where(mask_n, h, 0.0)

    for o0 in range(0, DOUT, BLOCK_D):
        offs_o = o0 + tl.arange(0, BLOCK_D)
        mask_o = offs_o < DOUT
        w2 = tl.load(w2t_ptr + neurons[:, None] * stride_w2t + offs_o[None, :],
                     mask=mask_n[:, None] & mask_o[None, :], other=0.0)
        part = tl.sum(w2.to(tl.float32) * h[:, None], axis=0)
        tl.atomic_add(out_ptr + row * stride_out + offs_o, part, mask=mask_o)


def sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act: str) -> torch.Tensor:
    """Triton launcher with the signature of ``torch.ops.dejavu.sparse_mlp``.

    x: [..., d] (fp16/bf16/fp32); idx: [..., k] int64; w1, w_up: [N, d]; w2_t: [N, d_out];
    returns [..., d_out] in x's dtype.
    """
    check_dtype("sparse_mlp", x, w1, b1, w_up, w2_t, b2)
    d, d_out, k = x.shape[-1], w2_t.shape[1], idx.shape[-1]
    rows = x.reshape(-1, d)
    sel = idx.reshape(-1, k)
    if w1.stride(1) != 1 or w2_t.stride(1) != 1 or (w_up is not None and w_up.stride(1) != 1):
        raise ValueError("sparse_mlp kernel needs row-contiguous weights (lower pass re-lays out)")
    rows = rows.contiguous()
    sel = sel.contiguous()
    out = torch.zeros(rows.shape[0], d_out, device=x.device, dtype=torch.float32)
    up = w_up if w_up is not None else w1

    def grid(meta):
        return (triton.cdiv(k, meta["BLOCK_N"]), rows.shape[0])

    _sparse_mlp_kernel[grid](
        rows, sel, w1, b1 if b1 is not None else w1, up, w2_t, out,
        d, d_out, k,
        rows.stride(0), sel.stride(0), w1.stride(0), up.stride(0), w2_t.stride(0), out.stride(0),
        ACT=ACT_CODES[act], HAS_B1=b1 is not None, GATED=w_up is not None,
    )
    if b2 is not None:
        out += b2
    return out.to(x.dtype).reshape(*x.shape[:-1], d_out)
