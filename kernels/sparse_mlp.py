"""Sparse MLP: gather the selected neurons' rows, activate, apply the transposed down projection.

Two kernels, each over a 2-d grid of tiles with at most a short loop, so that even a
small selection puts hundreds of tiles in flight (a first version looping over d inside each
program ran at a constant ~88 us on an H200 whatever the density: latency-bound, see
BENCHMARKS.md):

1. ``_up_kernel``: tile (selected neurons x a slice of d) of ``x . W1[rows]`` (and of
   ``x . W_up[rows]`` for gated MLPs), added into fp32 pre-activations with atomics; each
   program may sum ``TILES`` (autotuned) slices of d in a loop first.
2. ``_down_kernel``: tile (selected neurons x a slice of d_out): ``h = act(pre + b1) [* up]``
   for its neurons, times their rows of ``W2_t`` ([N, d_out], a neuron's row contiguous: paper
   section 4.4), added into the fp32 output with atomics; each program first sums ``TILES``
   (autotuned) neuron tiles in a loop, so fewer atomics meet on each output. The products
   stay in a 2-d accumulator until the loop ends: one reduction over neurons per program
   instead of one per tile took the Llama-3-8B down projection at density 0.5 from 29 to 18 us
   on an H200 (examples/down_kernel_study.py, BENCHMARKS.md). With atomics and per-row ids the
   last program adding into an output tile adds ``b2`` and casts it
   (``triton_common.finish_last``): no separate finish launch.

With ``DEJAVU_STORE_ROWS=1`` (``triton_common.stores_rows``; bench mode ``dejavu_store``) a
per-row selection runs ``_up_store_kernel`` instead of step 1: each program covers all of d
for its rows in a pipelined loop (the dense GEMV's design, ``kernels/dense.py``) and stores its
pre-activations, and the programs zero the down kernel's sums and counters, so the op launches
no zero-fill: two launches instead of three. Off by default: on an H200 it ran slower than
``_up_kernel`` (README, "Kernels"), whose op launches no zero-fill either on a workspace.

A batch's union selection (one id row that every row reads) runs the same two steps in
``_up_union_kernel`` and ``_down_union_kernel``: each program loads its weight tile once and
multiplies it with a block of ``UNION_ROWS`` rows on the tensor cores, where the per-row kernels
would read the tile once per row.

Weights are never copied: the gather is fused into the matrix-vector products (section 4.4).
Under ``torch.use_deterministic_algorithms(True)`` each program stores its partial sums in its
own slot and one ordered sum adds them (``triton_common.deterministic``): bitwise reproducible.
Reference: ``kernels/reference.py::sparse_mlp``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .ops import workspace_numel
from .triton_common import (
    ACT_CODES,
    REDUCE_FIXED,
    TILE_LOOP_FIXED,
    UNION_REDUCE_FIXED,
    UNION_ROWS,
    UNION_TILE_FIXED,
    add_norm,
    add_norm_sums,
    add_partial,
    add_rows,
    apply_act,
    check_dtype,
    check_norm,
    deterministic,
    dot_rows,
    dot_split,
    early_ids,
    finish,
    finish_tile,
    fused_targets,
    fuses_finish,
    idx_stride,
    ieee,
    launch,
    load_rows,
    norm_args,
    norm_finish,
    norm_in_finish,
    norm_meta,
    partials,
    reduce_configs,
    reduce_slots,
    selection,
    shared,
    start_dependents,
    store_configs,
    stores_rows,
    tile_configs,
    tile_slots,
    total,
    union_reduce_configs,
    union_tile_configs,
    wait_inputs,
    workspace_targets,
    zero_share,
)


@triton.autotune(configs=tile_configs(), key=["D", "K"], reset_to_zero=["pre_ptr", "up_out_ptr"])
@triton.jit
def _up_kernel(
    # pointers
    x_ptr, idx_ptr, w1_ptr, wup_ptr, pre_ptr, up_out_ptr,
    # sizes
    D, K,
    # strides (rows; columns are contiguous)
    stride_x, stride_idx, stride_w1, stride_wup, stride_pre,
    # between the slots of partial sums (deterministic mode, ATOMIC false; a slot per pid_d)
    stride_part,
    # meta-parameters
    GATED: tl.constexpr, ATOMIC: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr,
    # AFTER: the kernel before is the op's zero-fill, so the ids and x are older than it: they
    # load before the wait, and the down kernel may start now. Otherwise (a workspace, no fill)
    # they may be that kernel's own outputs (the selector's ids): wait first, unless EARLY:
    # the ids are older than the kernel before (a lookahead block's, ``triton_common.early_ids``)
    # and load before the wait with the first slice's weights; x, that kernel's output, after
    TILES: tl.constexpr, PDL: tl.constexpr, AFTER: tl.constexpr, EARLY: tl.constexpr,
):
    if AFTER:
        start_dependents(PDL)  # the down kernel loads its first weights while these run
    elif not EARLY:
        wait_inputs(PDL)
    row, pid_n, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K
    neurons = tl.load(idx_ptr + row * stride_idx + offs_n, mask=mask_n, other=-1).to(tl.int64)
    valid = neurons >= 0  # -1: union padding, no neuron
    # TILES slices of d in a loop, products kept in 2-d accumulators, reduced once
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    if EARLY:
        offs_d = pid_d * TILES * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        w = load_rows(w1_ptr, neurons, valid, stride_w1, offs_d, mask_d)
        if GATED:
            w_up = load_rows(wup_ptr, neurons, valid, stride_wup, offs_d, mask_d)
        wait_inputs(PDL)
        x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        acc += w.to(tl.float32) * x[None, :]
        if GATED:
            acc_up += w_up.to(tl.float32) * x[None, :]
    for t in range(1 if EARLY else 0, TILES):
        offs_d = (pid_d * TILES + t) * BLOCK_D + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        acc = add_rows(acc, w1_ptr, neurons, valid, stride_w1, offs_d, mask_d, x)
        if GATED:
            acc_up = add_rows(acc_up, wup_ptr, neurons, valid, stride_wup, offs_d, mask_d, x)
    if AFTER:
        wait_inputs(PDL, True)  # the targets are the zero-fill's, the kernel before
    out = pid_d * stride_part + row * stride_pre + offs_n
    add_partial(pre_ptr + out, tl.sum(acc, 1), mask_n, ATOMIC)
    if GATED:
        add_partial(up_out_ptr + out, tl.sum(acc_up, 1), mask_n, ATOMIC)


@triton.autotune(configs=store_configs(), key=["D", "K"])
@triton.jit
def _up_store_kernel(
    x_ptr, idx_ptr, w1_ptr, wup_ptr, pre_ptr, up_out_ptr, zero_ptr,
    D, K, ZERO,
    stride_x, stride_idx, stride_w1, stride_wup, stride_pre,
    GATED: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """``_up_kernel`` with each program covering all of d for its selected rows, in a
    pipelined loop, so it stores its pre-activations instead of adding them with atomics; the
    programs also zero the ``ZERO`` fp32 values at ``zero_ptr`` (the down kernel's sums and
    counters): the op needs no zero-fill launch."""
    wait_inputs(PDL)  # the ids are the previous kernel's (no fill runs in between)
    row, pid_n = tl.program_id(0), tl.program_id(1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K
    neurons = tl.load(idx_ptr + row * stride_idx + offs_n, mask=mask_n, other=-1).to(tl.int64)
    valid = neurons >= 0
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    acc_up = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for d0 in range(0, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_ptr + row * stride_x + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        acc = add_rows(acc, w1_ptr, neurons, valid, stride_w1, offs_d, mask_d, x)
        if GATED:
            acc_up = add_rows(acc_up, wup_ptr, neurons, valid, stride_wup, offs_d, mask_d, x)
    out = row * stride_pre + offs_n
    tl.store(pre_ptr + out, tl.sum(acc, 1), mask=mask_n)
    if GATED:
        tl.store(up_out_ptr + out, tl.sum(acc_up, 1), mask=mask_n)
    zero_share(zero_ptr, ZERO, 256)


@triton.jit
def _down_tile(ids, w2t_ptr, offs_n, K, offs_o, mask_o, stride_w2n, stride_w2o):
    """The ids at ``offs_n`` (-1 past ``K``) and their rows of ``W2_t`` at ``offs_o``."""
    neurons = tl.load(ids + offs_n, mask=offs_n < K, other=-1).to(tl.int64)
    valid = neurons >= 0  # -1: past K or union padding
    w2 = tl.load(w2t_ptr + neurons[:, None] * stride_w2n + offs_o[None, :] * stride_w2o,
                 mask=valid[:, None] & mask_o[None, :], other=0.0)
    return neurons, w2


@triton.jit
def _down_add(acc, w2, neurons, pre_row, up_row, b1_ptr, offs_n, K, ACT: tl.constexpr,
              HAS_B1: tl.constexpr, GATED: tl.constexpr):
    """``acc`` plus the tile's products: ``w2`` times ``h = act(pre + b1) [* up]``."""
    mask_n = offs_n < K
    valid = neurons >= 0
    h = tl.load(pre_row + offs_n, mask=mask_n, other=0.0)
    if HAS_B1:
        h += tl.load(b1_ptr + neurons, mask=valid, other=0.0).to(tl.float32)
    h = apply_act(h, ACT)
    if GATED:
        h = h * tl.load(up_row + offs_n, mask=mask_n, other=0.0)
    h = tl.where(valid, h, 0.0)
    return acc + w2.to(tl.float32) * h[:, None]


# the weight's column stride is in the key: a transposed view (the one call before the in-place
# re-layout) must not pick the tiles that every later call, on the re-laid-out rows, runs with
# CLEAN zeroes the pre-activations once read: the autotuner restores them between its trials
@triton.autotune(configs=reduce_configs(), key=["DOUT", "K", "stride_w2o"],
                 reset_to_zero=["out_ptr", "cnt_ptr", "clean_ptr"],
                 restore_value=["pre_ptr", "up_ptr"])
@triton.jit
def _down_kernel(
    # pointers (FUSED: ``fin_ptr`` the output in its dtype, ``b2_ptr`` its bias, ``cnt_ptr``
    # the counters of ``triton_common.finish_last``; CLEAN: ``clean_ptr`` [R, K] counters of
    # the programs done reading each neuron tile; NORM: the residual, the normalised output,
    # the norm's weight and bias, the tiles' statistics and the rows' counters of
    # ``triton_common.finish_norm_last``, ``fin_ptr`` then the residual sum)
    pre_ptr, up_ptr, idx_ptr, b1_ptr, w2t_ptr, out_ptr, fin_ptr, b2_ptr, cnt_ptr, clean_ptr,
    res_ptr, nrm_ptr, nw_ptr, nb_ptr, stats_ptr, rcnt_ptr,
    # sizes
    DOUT, K, eps,
    # strides (``W2_t`` may be any view: a row per neuron is fastest, see the lower pass)
    stride_pre, stride_idx, stride_w2n, stride_w2o, stride_out, stride_stats,
    # between the slots of partial sums (deterministic mode, ATOMIC false; a slot per pid_n)
    stride_part,
    # meta-parameters
    ACT: tl.constexpr, HAS_B1: tl.constexpr, GATED: tl.constexpr, ATOMIC: tl.constexpr,
    FUSED: tl.constexpr, HAS_B2: tl.constexpr,
    # leave the op's workspace zero: the output sums (``finish_last``) and, by the last program
    # to read each neuron tile, its pre-activations
    CLEAN: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
    NORM: tl.constexpr = False, HAS_NB: tl.constexpr = False, BLOCK_T: tl.constexpr = 1,
    BLOCK_ROW: tl.constexpr = 1,
):
    row, pid_n, pid_o = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    offs_o = pid_o * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_o = offs_o < DOUT
    ids = idx_ptr + row * stride_idx
    pre_row, up_row = pre_ptr + row * stride_pre, up_ptr + row * stride_pre
    # the first tile's ids and weights are older than the up kernel: loaded before the wait,
    # while the up kernel may still run (``start_dependents``)
    offs_n = pid_n * TILES * BLOCK_N + tl.arange(0, BLOCK_N)
    neurons, w2 = _down_tile(ids, w2t_ptr, offs_n, K, offs_o, mask_o, stride_w2n, stride_w2o)
    wait_inputs(PDL)  # the pre-activations are the up kernel's, the kernel before
    if NORM:  # the residual (an earlier kernel's): loaded now, so the finish waits on no load
        res = tl.load(res_ptr + row * stride_out + offs_o, mask=mask_o, other=0.0)
    else:
        res = 0.0  # (unread)
    # products summed over the tiles in a 2-d accumulator and reduced over neurons once at the
    # end, in a loop after the first tile (not unrolled). Compiled for sm_90 (Triton 3.6) the
    # loop stages nothing through shared memory: a step loads its tile's ids, then the rows
    # they name, then adds their products, one tile's loads in flight at a time. (Loading the
    # next tile's rows before this tile's products, in registers, was slower at the best tiles
    # on an H100: BENCHMARKS.md, seventy-first session; loading only the next tile's ids with
    # this tile's rows, one round trip a step instead of two, was no faster there either:
    # seventy-third session, ``IDS_AHEAD`` in 2be971f)
    acc = _down_add(tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32), w2, neurons, pre_row,
                    up_row, b1_ptr, offs_n, K, ACT, HAS_B1, GATED)
    for t in range(1, TILES):
        offs_n = (pid_n * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        neurons, w2 = _down_tile(ids, w2t_ptr, offs_n, K, offs_o, mask_o, stride_w2n,
                                 stride_w2o)
        acc = _down_add(acc, w2, neurons, pre_row, up_row, b1_ptr, offs_n, K, ACT, HAS_B1,
                        GATED)
    add_partial(out_ptr + pid_n * stride_part + row * stride_out + offs_o, tl.sum(acc, 0), mask_o,
                ATOMIC)
    finish_tile(out_ptr + row * stride_out, fin_ptr + row * stride_out, b2_ptr, offs_o, mask_o,
                cnt_ptr + row * tl.num_programs(2) + pid_o, tl.num_programs(1), res,
                nrm_ptr + row * stride_out, nw_ptr, nb_ptr, stats_ptr + row * stride_stats,
                rcnt_ptr + row, DOUT, eps, FUSED, NORM, HAS_B2, HAS_NB, CLEAN, BLOCK_D, BLOCK_T,
                BLOCK_ROW)
    if CLEAN:
        # every thread's loads of the tile's pre-activations before the count (its release);
        # the last of the tile's readers zeroes them for the next call
        tl.debug_barrier()
        done = clean_ptr + row * K + pid_n
        if tl.atomic_add(done, 1, sem="acq_rel") == tl.num_programs(2) - 1:
            for t in range(TILES):
                offs_n = (pid_n * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
                zeros = tl.zeros([BLOCK_N], dtype=tl.float32)
                tl.store(pre_ptr + row * stride_pre + offs_n, zeros, mask=offs_n < K)
                if GATED:
                    tl.store(up_ptr + row * stride_pre + offs_n, zeros, mask=offs_n < K)
            tl.atomic_xchg(done, 0)


@triton.autotune(configs=union_tile_configs(), key=["D", "K"],
                 reset_to_zero=["pre_ptr", "up_out_ptr"])
@triton.jit
def _up_union_kernel(
    x_ptr, idx_ptr, w1_ptr, wup_ptr, pre_ptr, up_out_ptr,
    R, D, K,
    stride_x, stride_w1, stride_wup, stride_pre, stride_part,
    GATED: tl.constexpr, ATOMIC: tl.constexpr, IEEE: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, PDL: tl.constexpr,
):
    """``_up_kernel`` for one id row shared by the batch: the tile (selected neurons x a slice
    of d) is loaded once for a block of ``ROWS`` rows."""
    pid_r, pid_n, pid_d = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    mask_r = rows < R
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_n = offs_n < K
    neurons = tl.load(idx_ptr + offs_n, mask=mask_n, other=-1).to(tl.int64)
    offs_d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_d = offs_d < D
    tile = (neurons >= 0)[:, None] & mask_d[None, :]  # -1: union padding, no neuron
    x = tl.load(x_ptr + rows[:, None] * stride_x + offs_d[None, :],
                mask=mask_r[:, None] & mask_d[None, :], other=0.0)
    w = tl.load(w1_ptr + neurons[:, None] * stride_w1 + offs_d[None, :], mask=tile, other=0.0)
    if GATED:
        u = tl.load(wup_ptr + neurons[:, None] * stride_wup + offs_d[None, :], mask=tile,
                    other=0.0)
    wait_inputs(PDL)  # the targets are the zero-fill's, the kernel before
    zero = tl.zeros([ROWS, BLOCK_N], dtype=tl.float32)
    out = pid_d * stride_part + rows[:, None] * stride_pre + offs_n[None, :]
    mask = mask_r[:, None] & mask_n[None, :]
    add_partial(pre_ptr + out, dot_rows(x.to(w.dtype), tl.trans(w), zero, IEEE), mask, ATOMIC)
    if GATED:
        add_partial(up_out_ptr + out, dot_rows(x.to(u.dtype), tl.trans(u), zero, IEEE), mask,
                    ATOMIC)


@triton.autotune(configs=union_reduce_configs(), key=["DOUT", "K", "stride_w2o"],
                 reset_to_zero=["out_ptr"])
@triton.jit
def _down_union_kernel(
    pre_ptr, up_ptr, idx_ptr, b1_ptr, w2t_ptr, out_ptr,
    R, DOUT, K,
    stride_pre, stride_w2n, stride_w2o, stride_out, stride_part,
    ACT: tl.constexpr, HAS_B1: tl.constexpr, GATED: tl.constexpr, ATOMIC: tl.constexpr,
    IEEE: tl.constexpr, ROWS: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr, PDL: tl.constexpr,
):
    """``_down_kernel`` for one id row shared by the batch: each tile of ``W2_t`` is loaded
    once and multiplied with the activations of a block of ``ROWS`` rows."""
    pid_r, pid_n, pid_o = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    rows = pid_r * ROWS + tl.arange(0, ROWS)
    mask_r = rows < R
    offs_o = pid_o * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_o = offs_o < DOUT
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for t in tl.static_range(TILES):
        offs_n = (pid_n * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < K
        neurons = tl.load(idx_ptr + offs_n, mask=mask_n, other=-1).to(tl.int64)
        valid = neurons >= 0  # -1: past K or union padding
        w2 = tl.load(w2t_ptr + neurons[:, None] * stride_w2n + offs_o[None, :] * stride_w2o,
                     mask=valid[:, None] & mask_o[None, :], other=0.0)
        if HAS_B1:
            b1 = tl.load(b1_ptr + neurons, mask=valid, other=0.0).to(tl.float32)
        if t == 0:
            wait_inputs(PDL)  # the pre-activations are the up kernel's, the kernel before
        here = mask_r[:, None] & mask_n[None, :]
        at = rows[:, None] * stride_pre + offs_n[None, :]
        h = tl.load(pre_ptr + at, mask=here, other=0.0)
        if HAS_B1:
            h += b1[None, :]
        h = apply_act(h, ACT)
        if GATED:
            h = h * tl.load(up_ptr + at, mask=here, other=0.0)
        h = tl.where(here & valid[None, :], h, 0.0)
        acc = dot_split(h, w2, acc, IEEE)
    add_partial(out_ptr + pid_n * stride_part + rows[:, None] * stride_out + offs_o[None, :],
                acc, mask_r[:, None] & mask_o[None, :], ATOMIC)


def _targets(det: bool, n_pre: int, n_rows: int, k: int, d: int, d_out: int, device, dtype,
             zero_pre: bool = False, union: bool = False, workspace: torch.Tensor | None = None):
    """fp32 targets of the partial sums (``triton_common.partials``), pre-activations
    [S, n_pre, R, k] and output [S', R, d_out]; with atomics both share one zeroed buffer (one
    launch), and with per-row ids the down kernel's counters too, and the op's output
    [R, d_out] in ``dtype`` that it finishes itself (``triton_common.finish_last``; otherwise
    None). With per-row ids and atomics, a ``workspace`` kept zero between calls holds them
    instead (no launch), with the down kernel's counters of its readers of each neuron tile
    (``triton_common.workspace_targets``). Returns (pre, out, counters or None, output or None,
    those readers' counters or None)."""
    if not det:
        if fuses_finish(det, union):
            before, clean = n_pre * n_rows * k, None
            if workspace is None:
                pre, out, cnt, fin = fused_targets(n_rows, d_out, before, dtype, device)
            else:
                pre, out, cnt, fin, clean = workspace_targets(workspace, n_rows, d_out, before,
                                                              k, dtype)
            return pre.view(1, n_pre, n_rows, k), out[None], cnt, fin, clean
        buf = torch.zeros(n_pre * n_rows * k + n_rows * d_out, device=device, dtype=torch.float32)
        return (buf[: n_pre * n_rows * k].view(1, n_pre, n_rows, k),
                buf[n_pre * n_rows * k:].view(1, n_rows, d_out), None, None, None)
    reduce = UNION_REDUCE_FIXED if union else REDUCE_FIXED
    tile = UNION_TILE_FIXED if union else TILE_LOOP_FIXED
    return (partials(True, tile_slots(d, tile), n_pre, n_rows, k, device=device, zero=zero_pre),
            partials(True, reduce_slots(k, reduce), n_rows, d_out, device=device), None, None,
            None)


def _launch_up(rows, sel, w, w_up, pre_target, up_target, parts, gated: bool, det: bool,
               after: bool = True, early: bool = False):
    """``after``: the kernel launched last is the op's own (its zero-fill or gather), so the
    up kernel may load the ids and x before it waits (``_up_kernel``'s ``AFTER``). ``early``
    (otherwise): the ids are older than that kernel, so they and the first weights may load
    before the wait (``EARLY``)."""
    d, k, n_rows = rows.shape[1], sel.shape[1], rows.shape[0]
    if shared(sel, n_rows):
        launch(_up_union_kernel, lambda m: (triton.cdiv(n_rows, UNION_ROWS),
                                            triton.cdiv(k, m["BLOCK_N"]),
                                            triton.cdiv(d, m["BLOCK_D"])),
               rows, sel, w, w_up, pre_target, up_target,
               n_rows, d, k,
               rows.stride(0), w.stride(0), w_up.stride(0), parts.stride(2),
               parts.stride(0) if det else 0,
               GATED=gated, ATOMIC=not det, IEEE=ieee(rows, w, w_up), ROWS=UNION_ROWS,
               fixed=UNION_TILE_FIXED if det else None)
    else:
        launch(_up_kernel, lambda m: (n_rows, triton.cdiv(k, m["BLOCK_N"]),
                                      triton.cdiv(d, m["BLOCK_D"] * m["TILES"])),
               rows, sel, w, w_up, pre_target, up_target,
               d, k,
               rows.stride(0), idx_stride(sel), w.stride(0), w_up.stride(0), parts.stride(2),
               parts.stride(0) if det else 0,
               GATED=gated, ATOMIC=not det, AFTER=after, EARLY=early and not after,
               fixed=TILE_LOOP_FIXED if det else None)


def _launch_down(pre, sel, b1, w2_t, parts, act: str, gated: bool, det: bool,
                 fin=None, b2=None, cnt=None, clean=None, norm=None, finish: bool = True):
    """``pre`` [2 or 1, R, k]: pre-activations (and up values of a gated MLP). With ``fin``
    (per-row ids, atomics) the kernel finishes its outputs into it, adding ``b2``, counting in
    ``cnt`` (``triton_common.finish_last``); with ``clean`` ([R, k] int32 zeros) it leaves the
    pre-activations, sums and counters zero (a workspace, ``workspace_targets``). ``norm``
    (with ``fin``): ``triton_common.norm_args`` of a norm, for ``finish_norm_last``, ``fin``
    then receiving the residual sum. ``finish`` false: the sums are left unfinished (and not
    zeroed) for ``triton_common.add_norm_sums``; ``fin`` and ``cnt`` only stand in for
    themselves, so that the call has the tuning key of one that finishes."""
    k, d_out, n_rows = sel.shape[1], w2_t.shape[1], pre.shape[1]
    if shared(sel, n_rows):
        launch(_down_union_kernel, lambda m: (triton.cdiv(n_rows, UNION_ROWS),
                                              triton.cdiv(k, m["BLOCK_N"] * m["TILES"]),
                                              triton.cdiv(d_out, m["BLOCK_D"])),
               pre[0], pre[-1], sel, b1 if b1 is not None else w2_t, w2_t, parts[0],
               n_rows, d_out, k,
               pre.stride(1), w2_t.stride(0), w2_t.stride(1), parts.stride(1),
               parts.stride(0) if det else 0,
               ACT=ACT_CODES[act], HAS_B1=b1 is not None, GATED=gated, ATOMIC=not det,
               IEEE=ieee(w2_t), ROWS=UNION_ROWS, fixed=UNION_REDUCE_FIXED if det else None)
    else:
        fin_arg = fin if fin is not None else parts
        cnt_arg = cnt if cnt is not None else parts
        res, nrm, nw, nb, stats, rcnt, eps = norm or norm_args(None, fin_arg, parts, cnt_arg)
        launch(_down_kernel, lambda m: (n_rows, triton.cdiv(k, m["BLOCK_N"] * m["TILES"]),
                                        triton.cdiv(d_out, m["BLOCK_D"])),
               pre[0], pre[-1], sel, b1 if b1 is not None else w2_t, w2_t, parts[0],
               fin_arg, b2 if b2 is not None else w2_t, cnt_arg,
               clean if clean is not None else cnt_arg,
               res, nrm, nw, nb if nb is not None else nw, stats, rcnt,
               d_out, k, eps,
               pre.stride(1), idx_stride(sel), w2_t.stride(0), w2_t.stride(1), parts.stride(1),
               stats.stride(0) if norm else 0, parts.stride(0) if det else 0,
               ACT=ACT_CODES[act], HAS_B1=b1 is not None, GATED=gated, ATOMIC=not det,
               FUSED=fin is not None and finish, HAS_B2=b2 is not None,
               CLEAN=clean is not None,
               NORM=norm is not None, HAS_NB=nb is not None, **norm_meta(d_out),
               fixed=REDUCE_FIXED if det else None)


def sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act: str, union: bool = False,
               workspace: torch.Tensor | None = None, ahead: bool = False, norm=None):
    """Triton launcher with the signature of ``torch.ops.dejavu.sparse_mlp``.

    x: [..., d] (fp16/bf16/fp32); idx: [..., k] int64; w1, w_up: [N, d]; w2_t: [N, d_out];
    workspace: None or fp32 zeros (``ops.workspace_numel``), given back zero: with per-row
    ids and atomics the op then launches no zero-fill (two launches, not three); ahead: the
    ids come from a predictor run a layer ahead (``kernels.lookahead.waiting``), so with
    ``DEJAVU_EARLY_IDS=1`` the up kernel loads them before its wait (``triton_common.early_ids``);
    returns [..., d_out] in x's dtype. With ``norm`` = (residual [..., d_out], weight, bias or
    None, eps[, rms]): ``torch.ops.dejavu.sparse_mlp_norm``, returning (residual + output, its
    layer norm, or with ``rms`` Llama's RMS norm, always in an add-norm launch), which the
    down kernel finishes itself with per-row ids and atomics
    (``triton_common.finish_norm_last``; ``workspace`` then has ``ops.norm_numel`` values
    more); otherwise, or where ``triton_common.norm_in_finish`` says not, one
    ``triton_common.add_norm`` launch computes them after the op, or with
    ``DEJAVU_NORM_FINISH=sums`` (the default) ``triton_common.add_norm_sums`` from the down
    kernel's unfinished sums.
    """
    check_dtype("sparse_mlp", x, w1, b1, w_up, w2_t, b2)
    d, d_out = x.shape[-1], w2_t.shape[1]
    if norm is not None:
        check_norm("sparse_mlp_norm", x, d_out, *norm)
    if w1.stride(1) != 1 or (w_up is not None and w_up.stride(1) != 1):
        raise ValueError("sparse_mlp kernel needs row-contiguous w1 and w_up")
    rows = x.reshape(-1, d).contiguous()
    sel = selection(idx, rows.shape[0], w1.shape[0], union)
    k = sel.shape[1]
    det, gated = deterministic(), w_up is not None
    n_rows, union_ids = rows.shape[0], shared(sel, rows.shape[0])
    n_pre = 2 if gated else 1
    # the add-norm launch finishes the down kernel's unfinished sums and zeroes them
    from_sums = norm is not None and norm_finish() == "sums"
    if norm is not None and (not (from_sums or norm_in_finish("mlp", norm)) or stores_rows()
                             or not fuses_finish(det, union_ids)):
        return add_norm(sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, union, workspace, ahead),
                        *norm)
    if stores_rows() and fuses_finish(det, union_ids):
        # no fill: the up kernel stores the pre-activations and zeroes the sums and counters
        pre, out, cnt, fin = fused_targets(n_rows, d_out, n_pre * n_rows * k, x.dtype, x.device,
                                           zeroed=False)
        pre, zero = pre.view(n_pre, n_rows, k), out.numel() + cnt.numel()
        launch(_up_store_kernel, lambda m: (n_rows, triton.cdiv(k, m["BLOCK_N"])),
               rows, sel, w1, w_up if gated else w1, pre[0], pre[-1], out, d, k, zero,
               rows.stride(0), idx_stride(sel), w1.stride(0),
               (w_up if gated else w1).stride(0), pre.stride(1), GATED=gated)
        _launch_down(pre, sel, b1, w2_t, out[None], act, gated, det, fin, b2, cnt)
        return fin.reshape(*x.shape[:-1], d_out)
    pre, out, cnt, fin, clean = _targets(det, n_pre, n_rows, k, d, d_out, x.device,
                                         x.dtype, union=union_ids, workspace=workspace)
    # (fin: the fused finish, which a norm needs, is checked above)
    fused = None if norm is None or from_sums else norm_args(norm, fin, out[0], cnt, workspace,
                                                        workspace_numel(n_rows, d_out, k, gated))
    # on a workspace no fill runs: the kernel before the up kernel is another op's
    _launch_up(rows, sel, w1, w_up if gated else w1, pre[0, 0], pre[0, -1], pre, gated, det,
               after=clean is None, early=ahead and early_ids())
    _launch_down(total(pre, det), sel, b1, w2_t, out, act, gated, det, fin, b2, cnt, clean,
                 fused, finish=not from_sums)
    if from_sums:
        return add_norm_sums(out[0], b2, *norm, clean=clean is not None)
    if fused is not None:
        shape = norm[0].shape
        return fin.reshape(shape), fused[1].reshape(shape)
    if fin is None:
        fin = finish(total(out, det), b2, x.dtype)
    return fin.reshape(*x.shape[:-1], d_out)


def sparse_mlp_gated(x, idx, g, w_up, w2_t, b2, act: str, union: bool = False) -> torch.Tensor:
    """Triton launcher with the signature of ``torch.ops.dejavu.sparse_mlp_gated``: the gate
    pre-activations of the selected neurons are gathered from ``g`` (computed densely by the
    selector's projection), the up kernel computes only the selected rows of ``w_up``, and the
    down kernel applies act(gate) * up as for ``sparse_mlp``.

    x: [..., d]; idx: [..., k] int64; g: [..., N]; w_up: [N, d]; w2_t: [N, d_out].
    """
    check_dtype("sparse_mlp_gated", x, g, w_up, w2_t, b2)
    d, d_out = x.shape[-1], w2_t.shape[1]
    if w_up.stride(1) != 1:
        raise ValueError("sparse_mlp_gated kernel needs a row-contiguous w_up")
    rows = x.reshape(-1, d).contiguous()
    n_rows, det = rows.shape[0], deterministic()
    sel = selection(idx, n_rows, w_up.shape[0], union)
    k = sel.shape[1]
    # the gate's slots after the first stay zero, so the ordered sum keeps the gathered values
    pre, out, cnt, fin, _ = _targets(det, 2, n_rows, k, d, d_out, x.device, x.dtype, zero_pre=det,
                                  union=shared(sel, n_rows))
    # the gate of each row at the ids (padding reads unit 0; the kernels skip it)
    torch.gather(g.reshape(n_rows, -1).float(), 1, sel.clamp_min(0).expand(n_rows, -1),
                 out=pre[0, 0])
    _launch_up(rows, sel, w_up, w_up, pre[0, 1], pre[0, 1], pre, False, det)
    _launch_down(total(pre, det), sel, None, w2_t, out, act, True, det, fin, b2, cnt)
    if fin is None:
        fin = finish(total(out, det), b2, x.dtype)
    return fin.reshape(*x.shape[:-1], d_out)
