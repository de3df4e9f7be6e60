"""Head-gathered projections: the query projection and the output projection of attention,
computed for the selected heads only.

A selection names heads; head ``h`` owns weight rows ``h * head_dim .. (h + 1) * head_dim - 1``
of ``W_q`` ([H * head_dim, d]) and of the transposed output projection ``W_o_t``
([H * head_dim, d_out]), each row contiguous. Both kernels run a 2-d grid of tiles (selected
rows x a slice of the other dimension) and add partial sums into fp32 with atomics (in
deterministic mode, each program into its own slot, summed afterwards in order). With atomics
and per-row ids, the output projection's kernel also adds the bias and casts its outputs
(``triton_common.finish_last``); the query projection launches ``finish`` after it, unless
``DEJAVU_STORE_ROWS=1`` (``triton_common.stores_rows``) runs ``_head_proj_store_kernel``, whose
programs cover all of d and store biased rows in the output's dtype. A batch's
union selection (one id row for every row) runs ``_head_proj_union_kernel`` and
``_head_out_union_kernel``: a weight tile loaded once for a block of ``UNION_ROWS`` rows and
multiplied with them by ``tl.dot``, as in ``sparse_mlp.py``.
References: ``kernels/reference.py::sparse_head_proj`` and ``sparse_head_out``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from . import ops
from . import triton_common as tc
from .triton_common import (
    add_partial,
    dot_rows,
    reduce_configs,
    tile_configs,
    union_reduce_configs,
    union_tile_configs,
    wait_inputs,
)


@triton.jit
def _weight_rows(idx_ptr, row, stride_idx, offs, HEAD_DIM, mask):
    """Weight-row ids of the selected-row positions ``offs`` (head id * head_dim + offset), and
    which positions are rows of a head (not past the selection nor -1, union padding)."""
    head = tl.load(idx_ptr + row * stride_idx + offs // HEAD_DIM, mask=mask, other=-1).to(tl.int64)
    return head * HEAD_DIM + offs % HEAD_DIM, head >= 0


@triton.autotune(configs=tile_configs(), key=["D", "J"], reset_to_zero=["out_ptr"])
@triton.jit
def _head_proj_kernel(
    x_ptr, idx_ptr, w_ptr, b_ptr, out_ptr,
    D, J, HEAD_DIM,
    stride_x, stride_idx, stride_w, stride_out, stride_part,
    HAS_B: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    TILES: tl.constexpr, PDL: tl.constexpr,
):
    row, pid, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = offs < J
    wrows, mask = _weight_rows(idx_ptr, row, stride_idx, offs, HEAD_DIM, mask)
    acc2 = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)  # as sparse_mlp._up_kernel's
    for t in range(TILES):
        offs_d = (pid_d * TILES + t) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        acc2 = tc.add_rows(acc2, w_ptr, wrows, mask, stride_w, offs_d, mask_d, x)
    acc = tl.sum(acc2, axis=1)
    if HAS_B:
        bias = tl.load(b_ptr + wrows, mask=mask & (pid_d == 0), other=0.0).to(tl.float32)
        acc += bias
    wait_inputs(PDL)  # the target is the zero-fill's, the kernel before
    add_partial(out_ptr + pid_d * stride_part + row * stride_out + wrows, acc, mask, ATOMIC)


@triton.autotune(configs=tc.store_configs(), key=["D", "J"])
@triton.jit
def _head_proj_store_kernel(
    x_ptr, idx_ptr, w_ptr, b_ptr, out_ptr,
    D, J, HEAD_DIM,
    stride_x, stride_idx, stride_w, stride_out,
    HAS_B: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """``_head_proj_kernel`` with each program covering all of d for its selected rows (a
    pipelined loop): it adds the bias and stores the rows in the output's dtype, so no finish
    launch follows (``triton_common.stores_rows``)."""
    wait_inputs(PDL)  # the target is the zero-fill's, the kernel before
    row, pid = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows, mask = _weight_rows(idx_ptr, row, stride_idx, offs, HEAD_DIM, offs < J)
    acc2 = tc.add_row_slices(tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32),
                             x_ptr + row * stride_x, w_ptr, wrows, mask, stride_w, 0, D, BLOCK_D)
    acc = tl.sum(acc2, axis=1)
    if HAS_B:
        acc += tl.load(b_ptr + wrows, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + wrows, acc.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _out_tile(idx_ptr, w_ptr, row, tile, J, HEAD_DIM, offs_o, mask_o, stride_idx, stride_wn,
              stride_wo, BLOCK_N: tl.constexpr):
    """Tile ``tile`` of ``BLOCK_N`` selected rows of the output projection: their weight-row
    ids and which are rows of a head (``_weight_rows``), and their weights at ``offs_o``."""
    offs = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows, mask = _weight_rows(idx_ptr, row, stride_idx, offs, HEAD_DIM, offs < J)
    w = tl.load(w_ptr + wrows[:, None] * stride_wn + offs_o[None, :] * stride_wo,
                mask=mask[:, None] & mask_o[None, :], other=0.0)
    return wrows, mask, w


@triton.jit
def _out_add(acc, a_row, wrows, mask, w):
    """``acc`` plus a tile's weights (``_out_tile``) times its activations from ``a_row``."""
    vals = tl.load(a_row + wrows, mask=mask, other=0.0).to(tl.float32)
    return acc + w.to(tl.float32) * vals[:, None]


# column stride in the key: see sparse_mlp._down_kernel
@triton.autotune(configs=reduce_configs(), key=["DOUT", "J", "stride_wo"],
                 reset_to_zero=["out_ptr", "cnt_ptr"])
@triton.jit
def _head_out_kernel(
    # FUSED: the kernel finishes into ``fin_ptr`` (as sparse_mlp._down_kernel); CLEAN: and
    # leaves its sums and counters zero (a workspace, ``triton_common.workspace_targets``);
    # NORM: and adds the residual and normalises the rows (as sparse_mlp._down_kernel)
    a_ptr, idx_ptr, w_ptr, out_ptr, fin_ptr, b_ptr, cnt_ptr,
    res_ptr, nrm_ptr, nw_ptr, nb_ptr, stats_ptr, rcnt_ptr,
    DOUT, J, HEAD_DIM, eps,
    stride_a, stride_idx, stride_wn, stride_wo, stride_out, stride_stats, stride_part,
    ATOMIC: tl.constexpr, FUSED: tl.constexpr, HAS_B: tl.constexpr, CLEAN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
    # EARLY: the ids are older than the kernel before (``triton_common.early_ids``): they and
    # the first tile's weights load before the wait; the activations, its output, after
    EARLY: tl.constexpr,
    NORM: tl.constexpr = False, HAS_NB: tl.constexpr = False, BLOCK_T: tl.constexpr = 1,
    BLOCK_ROW: tl.constexpr = 1,
):
    row, pid, pid_o = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_o = pid_o * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_o = offs_o < DOUT
    if not EARLY:
        wait_inputs(PDL)  # the activations (or the zero-fill's target) are the kernel before's
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)  # as sparse_mlp._down_kernel's
    if EARLY:
        wrows, mask, w = _out_tile(idx_ptr, w_ptr, row, pid * TILES, J, HEAD_DIM, offs_o, mask_o,
                                   stride_idx, stride_wn, stride_wo, BLOCK_N)
        wait_inputs(PDL)
        acc = _out_add(acc, a_ptr + row * stride_a, wrows, mask, w)
    if NORM:  # the residual (an earlier kernel's): loaded now, so the finish waits on no load
        res = tl.load(res_ptr + row * stride_out + offs_o, mask=mask_o, other=0.0)
    else:
        res = 0.0  # (unread)
    for t in range(1 if EARLY else 0, TILES):
        wrows, mask, w = _out_tile(idx_ptr, w_ptr, row, pid * TILES + t, J, HEAD_DIM, offs_o,
                                   mask_o, stride_idx, stride_wn, stride_wo, BLOCK_N)
        acc = _out_add(acc, a_ptr + row * stride_a, wrows, mask, w)
    add_partial(out_ptr + pid * stride_part + row * stride_out + offs_o, tl.sum(acc, 0), mask_o,
                ATOMIC)
    tc.finish_tile(out_ptr + row * stride_out, fin_ptr + row * stride_out, b_ptr, offs_o, mask_o,
                   cnt_ptr + row * tl.num_programs(2) + pid_o, tl.num_programs(1), res,
                   nrm_ptr + row * stride_out, nw_ptr, nb_ptr, stats_ptr + row * stride_stats,
                   rcnt_ptr + row, DOUT, eps, FUSED, NORM, HAS_B, HAS_NB, CLEAN, BLOCK_D,
                   BLOCK_T, BLOCK_ROW)


@triton.autotune(configs=tc.column_configs(), key=["DOUT", "HEADS"])
@triton.jit
def _head_out_cols_kernel(
    a_ptr, idx_ptr, w_ptr, b_ptr, out_ptr,
    DOUT, HEADS, HEAD_DIM,
    stride_a, stride_idx, stride_w, stride_out,
    HAS_B: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_H: tl.constexpr, UNROLL: tl.constexpr,
    EXACT: tl.constexpr, PDL: tl.constexpr,
):
    """The output projection on the original ``W_o`` ([d_out, H * head_dim], rows of stride
    ``stride_w``, a selected head's ``head_dim`` columns contiguous in each): each program
    owns ``BLOCK_M`` output rows and loops over every selected head, ``UNROLL`` heads a step
    (a ``[BLOCK_M, UNROLL * BLOCK_H]`` tile), so it stores finished, biased outputs in their
    dtype, with no atomics, partial sums or counters. The next step's head ids load while
    this step's weights do, so a step waits on one memory latency, not two (ids, then the
    weights they address). ``EXACT``: ``head_dim`` is ``BLOCK_H`` (a power of two), so each
    head's columns are one contiguous, aligned run the loads can vectorise."""
    row, pid = tl.program_id(0), tl.program_id(1)
    offs_m = pid * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < DOUT
    offs_k = tl.arange(0, UNROLL * BLOCK_H)
    slot_k, in_k = offs_k // BLOCK_H, offs_k % BLOCK_H
    w_rows = w_ptr + offs_m.to(tl.int64)[:, None] * stride_w
    ids_ptr = idx_ptr + row * stride_idx
    wait_inputs(PDL)  # the activations and ids are the kernels' before
    heads = tl.load(ids_ptr + slot_k, mask=slot_k < HEADS, other=-1)
    acc = tl.zeros([BLOCK_M, UNROLL * BLOCK_H], dtype=tl.float32)
    for s in range(0, HEADS, UNROLL):
        cur = heads
        nxt = s + UNROLL + slot_k
        heads = tl.load(ids_ptr + nxt, mask=nxt < HEADS, other=-1)
        cols = cur.to(tl.int64) * HEAD_DIM + in_k
        if EXACT:
            cols = tl.max_contiguous(tl.multiple_of(cols, BLOCK_H), BLOCK_H)
        ok = (cur >= 0) & (in_k < HEAD_DIM)  # -1: past the selection, or union padding
        a = tl.load(a_ptr + row * stride_a + cols, mask=ok, other=0.0).to(tl.float32)
        w = tl.load(w_rows + cols[None, :], mask=mask_m[:, None] & ok[None, :], other=0.0)
        acc += w.to(tl.float32) * a[None, :]
    out = tl.sum(acc, 1)
    if HAS_B:
        out += tl.load(b_ptr + offs_m, mask=mask_m, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_out + offs_m, out.to(out_ptr.dtype.element_ty), mask=mask_m)


@triton.autotune(configs=union_tile_configs(), key=["D", "J"], reset_to_zero=["out_ptr"])
@triton.jit
def _head_proj_union_kernel(
    x_ptr, idx_ptr, w_ptr, b_ptr, out_ptr,
    R, D, J, HEAD_DIM,
    stride_x, stride_w, stride_out, stride_part,
    HAS_B: tl.constexpr, ATOMIC: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """``_head_proj_kernel`` for one id row shared by the batch (``ROWS`` rows a program)."""
    pid_r, pid, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    mask_r = rows < R
    offs = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    wrows, mask = _weight_rows(idx_ptr, 0, 0, offs, HEAD_DIM, offs < J)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(w_ptr + wrows[:, None] * stride_w + offs_d[None, :],
                mask=mask[:, None] & mask_d[None, :], other=0.0)
    acc = dot_rows(x.to(w.dtype), tl.trans(w), tl.zeros([ROWS, BLOCK_N], dtype=tl.float32), IEEE)
    if HAS_B:
        acc += tl.load(b_ptr + wrows, mask=mask & (pid_d == 0), other=0.0).to(tl.float32)[None, :]
    wait_inputs(PDL)  # the target is the zero-fill's, the kernel before
    add_partial(out_ptr + pid_d * stride_part + rows[:, None] * stride_out + wrows[None, :], acc,
                mask_r[:, None] & mask[None, :], ATOMIC)


@triton.autotune(configs=union_reduce_configs(), key=["DOUT", "J", "stride_wo"],
                 reset_to_zero=["out_ptr"])
@triton.jit
def _head_out_union_kernel(
    a_ptr, idx_ptr, w_ptr, out_ptr,
    R, DOUT, J, HEAD_DIM,
    stride_a, stride_wn, stride_wo, stride_out, stride_part,
    ATOMIC: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
):
    """``_head_out_kernel`` for one id row shared by the batch (``ROWS`` rows a program)."""
    pid_r, pid, pid_o = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    mask_r = rows < R
    offs_o = pid_o * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_o = offs_o < DOUT
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for t in tl.static_range(TILES):
        offs = (pid * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        wrows, mask = _weight_rows(idx_ptr, 0, 0, offs, HEAD_DIM, offs < J)
        vals = tl.load(a_ptr + rows[:, None] * stride_a + wrows[None, :],
                       mask=mask_r[:, None] & mask[None, :], other=0.0)
        w = tl.load(w_ptr + wrows[:, None] * stride_wn + offs_o[None, :] * stride_wo,
                    mask=mask[:, None] & mask_o[None, :], other=0.0)
        acc = dot_rows(vals.to(w.dtype), w, acc, IEEE)
    wait_inputs(PDL)  # the target is the zero-fill's, the kernel before
    add_partial(out_ptr + pid * stride_part + rows[:, None] * stride_out + offs_o[None, :], acc,
                mask_r[:, None] & mask_o[None, :], ATOMIC)


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1, t.shape[-1]).contiguous()


def sparse_head_proj(x, idx, w, b, head_dim: int, union: bool = False) -> torch.Tensor:
    """Triton launcher of ``torch.ops.dejavu.sparse_head_proj``: [..., d] -> [..., H * head_dim]."""
    tc.check_dtype("sparse_head_proj", x, w, b)
    rows = _rows(x)
    sel = tc.selection(idx, rows.shape[0], w.shape[0] // head_dim, union)
    j, d = sel.shape[1] * head_dim, rows.shape[1]
    det, shared = tc.deterministic(), tc.shared(sel, rows.shape[0])
    if tc.stores_rows() and tc.fuses_finish(det, shared):
        # the rows of unselected heads stay zero; the kernel stores the others, biased and cast
        out = torch.zeros(rows.shape[0], w.shape[0], device=x.device, dtype=x.dtype)
        tc.launch(_head_proj_store_kernel,
                  lambda m: (rows.shape[0], triton.cdiv(j, m["BLOCK_N"])),
                  rows, sel, w, b if b is not None else w, out, d, j, head_dim,
                  rows.stride(0), tc.idx_stride(sel), w.stride(0), out.stride(0),
                  HAS_B=b is not None)
        return out.reshape(*x.shape[:-1], w.shape[0])
    fixed = tc.UNION_TILE_FIXED if shared else tc.TILE_LOOP_FIXED
    # the rows of unselected heads stay zero
    parts = tc.partials(det, tc.tile_slots(d, fixed), rows.shape[0], w.shape[0], device=x.device,
                        zero=True)
    if shared:
        tc.launch(_head_proj_union_kernel,
                  lambda m: (triton.cdiv(rows.shape[0], tc.UNION_ROWS),
                             triton.cdiv(j, m["BLOCK_N"]), triton.cdiv(d, m["BLOCK_D"])),
                  rows, sel, w, b if b is not None else w, parts[0],
                  rows.shape[0], d, j, head_dim,
                  rows.stride(0), w.stride(0), parts.stride(1), parts.stride(0) if det else 0,
                  HAS_B=b is not None, ATOMIC=not det, IEEE=tc.ieee(rows, w),
                  ROWS=tc.UNION_ROWS, fixed=fixed if det else None)
    else:
        tc.launch(_head_proj_kernel,
                  lambda m: (rows.shape[0], triton.cdiv(j, m["BLOCK_N"]),
                             triton.cdiv(d, m["BLOCK_D"] * m["TILES"])),
                  rows, sel, w, b if b is not None else w, parts[0],
                  d, j, head_dim,
                  rows.stride(0), tc.idx_stride(sel), w.stride(0), parts.stride(1),
                  parts.stride(0) if det else 0,
                  HAS_B=b is not None, ATOMIC=not det, fixed=fixed if det else None)
    return tc.finish(tc.total(parts, det), None, x.dtype).reshape(*x.shape[:-1], w.shape[0])


def reads_columns(wo_t: torch.Tensor, head_dim: int) -> bool:
    """Whether the output projection's weight is the transposed view of the original
    ``[d_out, H * head_dim]`` W_o (column stride 1: the lower pass left it in place, option
    ``out_layout``), read by ``_head_out_cols_kernel``: each output row's selected heads
    are ``head_dim`` contiguous values. One-wide units (the TEAL rewrite's) stay with the
    row-gathered kernels, whatever the layout."""
    return wo_t.stride(0) == 1 and wo_t.shape[1] > 1 and head_dim >= ops.COLUMN_HEAD_DIM


def sparse_head_out(attn, idx, wo_t, b, head_dim: int, union: bool = False,
                    workspace: torch.Tensor | None = None, early: bool = False, norm=None):
    """Triton launcher of ``torch.ops.dejavu.sparse_head_out``: [..., H * head_dim] -> [..., d].
    On the original layout (``reads_columns``), one launch that stores finished outputs (no
    workspace used). Otherwise, with per-row ids and atomics, a ``workspace`` (fp32 zeros,
    ``ops.workspace_numel``) holds the sums and counters, and is given back zero: no zero-fill
    launch. ``early``: the ids are older than the kernel before (the op's), so with
    ``DEJAVU_EARLY_IDS=1`` the per-row kernel loads them and its first weights before its
    wait (``triton_common.early_ids``). With ``norm`` = (residual, weight, bias or None, eps[, rms]):
    ``torch.ops.dejavu.sparse_head_out_norm``, returning (residual + output, its layer norm),
    finished by the per-row kernel itself as ``sparse_mlp.sparse_mlp``'s (``workspace`` then
    has ``ops.norm_numel`` values more), otherwise (or where ``tc.norm_in_finish`` says not)
    by one ``tc.add_norm`` launch after the op, or with ``DEJAVU_NORM_FINISH=sums`` (the
    default) by ``tc.add_norm_sums`` from the kernel's unfinished sums."""
    tc.check_dtype("sparse_head_out", attn, wo_t, b)
    rows = _rows(attn)
    sel = tc.selection(idx, rows.shape[0], wo_t.shape[0] // head_dim, union)
    j, d_out = sel.shape[1] * head_dim, wo_t.shape[1]
    det, shared = tc.deterministic(), tc.shared(sel, rows.shape[0])
    # the add-norm launch finishes the kernel's unfinished sums (no count) and zeroes them
    from_sums = norm is not None and tc.norm_finish() == "sums"
    if norm is not None:
        tc.check_norm("sparse_head_out_norm", attn, d_out, *norm)
        if reads_columns(wo_t, head_dim) or not tc.fuses_finish(det, shared) \
                or not (from_sums or tc.norm_in_finish("head_out", norm)):
            return tc.add_norm(sparse_head_out(attn, idx, wo_t, b, head_dim, union, workspace,
                                               early), *norm)
    if reads_columns(wo_t, head_dim):
        out = torch.empty(rows.shape[0], d_out, device=attn.device, dtype=attn.dtype)
        block_h = triton.next_power_of_2(head_dim)
        tc.launch(_head_out_cols_kernel,
                  lambda m: (rows.shape[0], triton.cdiv(d_out, m["BLOCK_M"])),
                  rows, sel, wo_t, b if b is not None else wo_t, out,
                  d_out, sel.shape[1], head_dim,
                  rows.stride(0), tc.idx_stride(sel), wo_t.stride(1), out.stride(0),
                  HAS_B=b is not None, BLOCK_H=block_h, EXACT=block_h == head_dim)
        return out.reshape(*attn.shape[:-1], d_out)
    fixed = tc.UNION_REDUCE_FIXED if shared else tc.REDUCE_FIXED
    fin = cnt = None
    clean = workspace is not None and tc.fuses_finish(det, shared)
    if tc.fuses_finish(det, shared):
        if clean:
            _, sums, cnt, fin, _ = tc.workspace_targets(workspace, rows.shape[0], d_out, 0, 0,
                                                        attn.dtype)
        else:
            _, sums, cnt, fin = tc.fused_targets(rows.shape[0], d_out, 0, attn.dtype,
                                                 attn.device)
        parts = sums[None]
    else:
        parts = tc.partials(det, tc.reduce_slots(j, fixed), rows.shape[0], d_out,
                            device=attn.device)
    if shared:
        tc.launch(_head_out_union_kernel,
                  lambda m: (triton.cdiv(rows.shape[0], tc.UNION_ROWS),
                             triton.cdiv(j, m["BLOCK_N"] * m["TILES"]),
                             triton.cdiv(d_out, m["BLOCK_D"])),
                  rows, sel, wo_t, parts[0],
                  rows.shape[0], d_out, j, head_dim,
                  rows.stride(0), wo_t.stride(0), wo_t.stride(1), parts.stride(1),
                  parts.stride(0) if det else 0,
                  ATOMIC=not det, IEEE=tc.ieee(rows, wo_t), ROWS=tc.UNION_ROWS,
                  fixed=fixed if det else None)
    else:
        fin_arg = fin if fin is not None else parts
        cnt_arg = cnt if cnt is not None else parts
        res, nrm, nw, nb, stats, rcnt, eps = tc.norm_args(
            None if from_sums else norm, fin_arg, parts, cnt_arg, workspace if clean else None,
            ops.workspace_numel(rows.shape[0], d_out))
        tc.launch(_head_out_kernel,
                  lambda m: (rows.shape[0], triton.cdiv(j, m["BLOCK_N"] * m["TILES"]),
                             triton.cdiv(d_out, m["BLOCK_D"])),
                  rows, sel, wo_t, parts[0], fin_arg, b if b is not None else wo_t, cnt_arg,
                  res, nrm, nw, nb if nb is not None else nw, stats, rcnt,
                  d_out, j, head_dim, eps,
                  rows.stride(0), tc.idx_stride(sel), wo_t.stride(0), wo_t.stride(1),
                  parts.stride(1), stats.stride(0) if norm is not None else 0,
                  parts.stride(0) if det else 0,
                  ATOMIC=not det, FUSED=fin is not None and not from_sums, HAS_B=b is not None,
                  CLEAN=clean, EARLY=early and tc.early_ids(),
                  NORM=norm is not None and not from_sums, HAS_NB=nb is not None,
                  **tc.norm_meta(d_out), fixed=fixed if det else None)
        if from_sums:
            return tc.add_norm_sums(parts[0], b, *norm, clean=clean)
        if norm is not None:
            shape = norm[0].shape
            return fin.reshape(shape), nrm.reshape(shape)
    if fin is None:
        fin = tc.finish(tc.total(parts, det), b, attn.dtype)
    return fin.reshape(*attn.shape[:-1], d_out)
