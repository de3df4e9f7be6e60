"""Dense GEMV for a decode step's remaining dense projections (``torch.ops.dejavu.gemv``).

A decode step of one token multiplies each weight matrix with one row. cuBLAS picks split-K
GEMMs for these shapes, with a second reduction launch: on an H200 the fused Q, K and V
projection of Llama-3-8B ran at 76% of copy bandwidth and its output projection at 71% plus
1.8 us for the reduction (BENCHMARKS.md, profile of ``dejavu_sparse``), where the sparse up
kernel, which reads whole weight rows the same way, reached 93-95%. So the lower pass
(``DejavuOptions.dense_gemv``) can hand the one-row dense projections of the model's blocks
to this kernel: each program reads ``BLOCK_N`` whole rows of the weight in a pipelined loop over
``d`` with a 2-d accumulator reduced once, adds the bias and stores its outputs in the input's
dtype: one launch, no atomics, no zero-fill. In deterministic mode it runs one fixed config.
Under programmatic launch (``triton_common.programmatic``) it loads its first slice of weight
rows, which no kernel writes, before it waits for the kernel before it, and x after: the
weights start streaming while that kernel finishes, as the down kernel's first tile does.

More rows than ``MAX_ROWS`` (a prefill) go to ``torch.nn.functional.linear``: the kernel reads
the weight once per row.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from .triton_common import (
    INTERPRET,
    QUICK_TUNE,
    add_row_slices,
    check_dtype,
    deterministic,
    fixed_config,
    launch,
    load_rows,
    store_configs,
    wait_inputs,
)

# rows up to which the kernel runs (it reads the weight once per row); more go to cuBLAS
MAX_ROWS = 1
GEMV_FIXED = ({"BLOCK_N": 4, "BLOCK_D": 16, "num_warps": 1} if INTERPRET
              else {"BLOCK_N": 8, "BLOCK_D": 512, "num_warps": 4})


def gemv_configs() -> list[triton.Config]:
    """The row-storing kernels' sweep (``triton_common.store_configs``) with up to 32 rows a
    program; ``GEMV_FIXED`` alone under the interpreter and with quick tuning."""
    if INTERPRET or QUICK_TUNE:
        return [fixed_config(GEMV_FIXED)]
    return store_configs(rows=(4, 8, 16, 32))


@triton.autotune(configs=gemv_configs(), key=["N", "D"])
@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    N, D,
    stride_x, stride_w, stride_out,
    HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    row, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < N
    rows = offs_n.to(tl.int64)
    # the first slice of the weight rows (a parameter, older than any kernel) before the wait;
    # x, which the kernel before may have written, after it
    offs_d = tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    w = load_rows(w_ptr, rows, mask_n, stride_w, offs_d, mask_d)
    wait_inputs(PDL)
    x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
    acc = add_row_slices(w.to(tl.float32) * x[None, :], x_ptr + row * stride_x, w_ptr, rows,
                         mask_n, stride_w, BLOCK_D, D, BLOCK_D)
    y = tl.sum(acc, 1)
    if HAS_B:
        y += tl.load(b_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs_n, y.to(out_ptr.dtype.element_ty), mask=mask_n)


def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Triton launcher of ``torch.ops.dejavu.gemv``: ``F.linear(x, w, b)``.

    x: [..., d]; w: [N, d]; b: [N] or None; returns [..., N] in x's dtype. Rows beyond
    ``MAX_ROWS``, a weight whose rows are not contiguous, or mixed dtypes run ``F.linear``.
    """
    check_dtype("gemv", x, w, b)
    d, n = x.shape[-1], w.shape[0]
    if w.shape[1] != d or (b is not None and b.shape != (n,)):
        raise ValueError(f"gemv: weight {tuple(w.shape)} / bias "
                         f"{None if b is None else tuple(b.shape)} do not fit x [..., {d}]")
    rows = x.reshape(-1, d)
    if (rows.shape[0] > MAX_ROWS or w.stride(1) != 1 or w.dtype != x.dtype
            or (b is not None and b.dtype != x.dtype)):
        return F.linear(x, w, b)
    rows = rows.contiguous()
    out = torch.empty(rows.shape[0], n, device=x.device, dtype=x.dtype)
    args = (rows, w, b if b is not None else w, out, n, d, rows.stride(0), w.stride(0),
            out.stride(0))
    grid = lambda m: (rows.shape[0], triton.cdiv(n, m["BLOCK_N"]))  # noqa: E731
    # deterministic mode: the same config, so the same sums, in every process
    launch(_gemv_kernel, grid, *args, HAS_B=b is not None,
           fixed=GEMV_FIXED if deterministic() else None)
    return out.reshape(*x.shape[:-1], n)
