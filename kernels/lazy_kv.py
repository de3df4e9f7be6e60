"""``dejavu::lazy_kv`` on CUDA: the keys and values of the selected heads, their missing
positions filled in from the kept inputs, in one launch (paper section 4.2; the op and its state
are described in ``kernels/ops.py`` and ``kernels/kv_state.py``, the reference is
``kernels/reference.py::lazy_kv``).

Grid: (sequence x K/V head, column tile of the head, keys or values), or in a decode step with
``grid="selection"``, the default (sequence x slot of the selection's ids, plus one slot for the
heads not named, ...; ``GRIDS``). A program of a selected
head walks the positions from the head's valid prefix to the last new one in tiles of
``BLOCK_P``: a position before the new ones is missing when its key (or value) columns of the
program's tile are all zero, and the new ones are always computed; a tile with any such position
is multiplied out, ``inputs[rows] @ W[head's columns]^T`` (the new rows read from ``x``), on the
tensor cores, and stored where needed. Each program checks and writes only its own columns, so
no program reads what another writes. A program of an unselected head writes zeros at the new
positions. The last program of a head (a counter per head, zero between calls) records the
head's new valid prefix; the programs share out the storing of the new rows' inputs. In a
decode step each selected head reads its weight rows once: at head density 0.5, half the bytes
of the dense K/V projections.

Split form (``SPLIT`` > 1): each (head, column tile, keys or values) has ``SPLIT`` programs,
each over a slice of d, so several times as many programs share the GPU and each loop is
shorter. They add their fp32 sums into a workspace row per position
(``kv_state.split_workspace``); the last of a position tile's programs
(``triton_common.finish_last``) adds the bias, stores the cache rows and zeroes the sums and its
counter. All programs of a tile see the same missing positions: the rows are stored only after
every one of them has counted itself. Under ``torch.use_deterministic_algorithms`` a decode step
runs unsplit (``step_config``): the atomics' order would change the bits from run to run.

With the query (``lazy_qkv``, option ``fuse_qkv``; ``MATS`` 3): a third matrix in the grid,
whose programs compute the selected heads' query columns at the new positions only (never a
missing one) into the returned rows [B, n, H * hd], and store zeros in the other heads'
columns; it shares the input, the selection and the split form's workspace (a third slice).
One launch instead of the query projection's zero-fill, kernel and finish: on an H200 in the
twenty-first session, 27.7 us a layer for OPT-13B's shape at head density 0.5 against 35.9
for the two launches (``examples/qkv_study.py``), and the decode step 0.13-0.27 ms faster.

Measured (H200, BENCHMARKS.md). In the fifteenth session the kernel had only the unsplit forms
and was latency-bound: 34 us at best on OPT-13B's shape at head density 0.5, against 30.6 us for
cuBLAS's dense K/V reading twice the bytes. In the sixteenth, the tensor-core form split over 8
programs took 22.8 us (cuBLAS 31.3) and 74 us with 100 positions missing for half the selected
heads, and in the OPT-13B decode step (at ``10bf031``) 1143 us a step for 39 layers against 1225
for cuBLAS's K/V and its reductions: the captured lookahead step was 10-16% faster than with
dense K/V in three runs of three.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .kv_state import lazy_state, split_workspace
from .reference import id_rows
from .triton_common import (
    INTERPRET,
    QUICK_TUNE,
    check_dtype,
    deterministic,
    dot_rows,
    finish_last,
    fixed_config,
    ieee,
    pdl_meta,
    wait_inputs,
)

# a decode step's configs (one new token): positions in tiles of BLOCK_P, multiplied on the tensor
# cores (DOT, BLOCK_P at least 16) or as a broadcast product summed over d (a GEMV per position:
# the common step has one needed position, the new one).
# The tiles the autotuner sweeps on a GPU: the tensor-core form. In examples/lazy_kv_study.py
# on an H200 (sixteenth session, BENCHMARKS.md) the first two (d split over 8 programs) were
# the fastest in every scenario, 22.8-24.2 us with only the new position to compute and 74-80
# us with 100 missing positions, against cuBLAS's dense K/V at 31.3 us. The GEMV form (BLOCK_P
# 1) is slower with nothing missing (29.6 us) and many times slower with missing positions
# (86.6 us with 3, 411 with 20). The autotuner times a call with few missing positions, and
# how many a later call finds depends on the selections in between, which it cannot see:
# given the GEMV form among its configs, it picked it for the OPT-13B decode step, where it
# took 125 us a layer.
# In examples/qkv_study.py (twenty-first session, BENCHMARKS.md), d split over 4 programs ran
# faster than over 8 in one sweep of 30 tiles: keys and values 21.2-22.9 us a layer against
# 23.4-25.0, and with the query (MATS 3) 27.7 us against 30.3-31.4; those three tiles join.
# Column tiles of 16 or 32 with d split over one or two programs (fewer atomics or none, no
# finish in a last program) were all slower with the query: 29.9-68.9 us a layer against
# 27.3 at the shipped C64 K64 S4 (thirty-ninth session, ``qkv_study.py --unsplit``).
DECODE_TILES = [{"BLOCK_P": 16, "DOT": True, "BLOCK_C": c, "BLOCK_K": k, "SPLIT": split,
                 "num_warps": 4, "num_stages": 3}
                for c, k, split in ((64, 128, 8), (64, 64, 8), (64, 128, 4), (64, 64, 4),
                                    (128, 64, 4))]
# the one config of quick tuning: on a GPU the first of those; under the interpreter a small
# GEMV form, so that the CPU tests run that form too (each form also has its own kernel test)
DECODE_FIXED = ({"BLOCK_P": 4, "DOT": False, "BLOCK_C": 16, "BLOCK_K": 32, "SPLIT": 2,
                 "num_warps": 4} if INTERPRET else DECODE_TILES[0])
# under torch.use_deterministic_algorithms: quick tuning's config over the whole of d (on a GPU
# the tensor-core form), no atomics (the split form's sums meet in no fixed order), so a step
# gives the same bits every run
DETERMINISTIC_FIXED = {**DECODE_FIXED, "SPLIT": 1}
# a prefill through the op (several new tokens): every head, tiles of 64 positions
PREFILL_FIXED = {"BLOCK_P": 64 if not INTERPRET else 16, "DOT": True, "BLOCK_C": 32,
                 "BLOCK_K": 32 if INTERPRET else 64, "SPLIT": 1, "num_warps": 4}


# the programs of a decode step with a selection: one set per head, an unselected head's only
# writing its zeros ("heads"; at head density 0.5 half the programs have nothing to compute),
# or one set per slot of the selection's ids (the first slot of each head named computes it)
# and one more that writes the zeros of every other head ("selection", built in the
# thirty-first session). A prefill, or a call without a selection, runs over heads. The default
# is "selection" since the forty-third session, "heads" where ``DEJAVU_LAZY_GRID=heads``
# (``dejavu bench`` mode ``dejavu_captured_qkv_heads_pdl``). It had been "heads": on an H200
# the selection grid was slower. In
# ``examples/qkv_study.py``, at the shipped OPT-13B tile with the query (C64 K64 S4), 36.5
# against 28.1 us a layer in its first form (its extra slot looped over the heads); in the
# OPT-13B step, side by side, 4.17 against 3.88 ms in this vectorised form (thirty-first
# session, BENCHMARKS.md). Both steps then ran the one tile shipped for the key, the grid not
# being in it: C64 K64 S4, among the heads grid's fastest and the selection grid's slowest. In the
# forty-third session's study, with half the selected heads filling a missing position at
# every call (``--missing 0.5``), the selection grid at C128 K64 S4 took 26.0 us a layer, the
# fastest of both grids' tiles, against 27.2 for the heads grid at C64 K64 S4; the grid is
# now in the tuning key, and the shipped file names a tile for each. With those tiles, in two
# runs side by side, the OPT-13B step took 3.38 ms over the selection against 3.43 and 3.41
# over heads (BENCHMARKS.md, forty-third session).
GRIDS = ("selection", "heads")  # the first the default
GRID_ENV = "DEJAVU_LAZY_GRID"


def default_grid() -> str:
    """The grid of a launch that names none: ``DEJAVU_LAZY_GRID`` if set (one of ``GRIDS``,
    else an error), else "selection"."""
    grid = os.environ.get(GRID_ENV, GRIDS[0])
    if grid not in GRIDS:
        raise ValueError(f"{GRID_ENV}={grid!r}: set it to one of {GRIDS}")
    return grid


def decode_configs() -> list[triton.Config]:
    """Tiles the autotuner sweeps for a decode step. The kernel may run twice on the same call
    with the same result (a second run finds the filled positions present and records the same
    prefixes), so the autotuner may time it on the real cache."""
    if INTERPRET or QUICK_TUNE:
        return [fixed_config(DECODE_FIXED)]
    return [fixed_config(tile) for tile in DECODE_TILES]


@triton.jit
def _record_prefix(cnt_ptr, valid_ptr, programs, prefix):
    """Counts this program among its head's ``programs``; the last records the head's new
    valid ``prefix`` and leaves the counter zero. Every program of the head read the old prefix
    before counting (release)."""
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == programs - 1:
        tl.store(valid_ptr, prefix)
        tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def _zero_the_rest(ids, k_ptr, v_ptr, q_ptr, valid_ptr, b, s, offs_c, mask_c, kv, pid_c, H, HD,
                   stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_qb,
                   BLOCK_H: tl.constexpr, BLOCK_C: tl.constexpr):
    """The grid over a selection's slots (a decode step: one new position, ``s``): zeros at
    position ``s`` (columns ``offs_c`` of matrix ``kv``) of every head of sequence ``b`` that
    ``ids`` does not name, and (once, from the keys' first column tile) its valid prefix cut
    at ``s``, as a program of that head would in the grid over heads; no other program of the
    launch reads those heads. All heads in one store, not a loop over them: a loop of 40 heads
    in one program ran after the others had finished."""
    offs_g = tl.arange(0, BLOCK_H)
    named = tl.sum((ids[None, :] == offs_g[:, None]).to(tl.int32), 1)
    rest = (offs_g < H) & (named == 0)
    if kv == 0:
        rows = k_ptr + b * stride_kb + offs_g[:, None] * stride_kh + s * stride_kl
    elif kv == 1:
        rows = v_ptr + b * stride_vb + offs_g[:, None] * stride_vh + s * stride_vl
    else:  # the query's rows: the new position is row 0
        rows = q_ptr + b * stride_qb + offs_g[:, None] * HD
    tl.store(rows + offs_c[None, :], tl.zeros([BLOCK_H, BLOCK_C], dtype=rows.dtype.element_ty),
             mask=rest[:, None] & mask_c[None, :])
    if (pid_c == 0) & (kv == 0):
        prefix = valid_ptr + b * H + offs_g
        tl.store(prefix, tl.minimum(tl.load(prefix, mask=rest, other=0), s), mask=rest)


@triton.jit
def _lazy_kv_kernel(
    x_ptr, in_ptr, idx_ptr, wk_ptr, bk_ptr, wv_ptr, bv_ptr, k_ptr, v_ptr, pos_ptr, valid_ptr,
    cnt_ptr, ws_ptr, tile_cnt_ptr, wq_ptr, bq_ptr, q_ptr,
    D, N, NIDS, H, HD, L, CMAX,
    stride_xb, stride_xn, stride_ib, stride_il, stride_idx, stride_wk, stride_wv,
    stride_kb, stride_kh, stride_kl, stride_vb, stride_vh, stride_vl, stride_wq, stride_qb,
    stride_qn,
    ALL: tl.constexpr, HAS_B: tl.constexpr, IEEE: tl.constexpr, BLOCK_C: tl.constexpr,
    BLOCK_P: tl.constexpr, DOT: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_IDS: tl.constexpr,
    SPLIT: tl.constexpr, MATS: tl.constexpr, SEL: tl.constexpr, BLOCK_H: tl.constexpr,
    PDL: tl.constexpr,
):
    # the position, ids, input and the state of the cache may all be the kernels' before
    wait_inputs(PDL)
    pid, pid_c, pid_z = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    kv = pid_z // SPLIT  # 0 keys, 1 values, 2 the query (MATS 3)
    part = pid_z % SPLIT  # this program's slice of d
    slice_d = tl.cdiv(tl.cdiv(D, SPLIT), BLOCK_K) * BLOCK_K
    d_lo = part * slice_d
    d_hi = tl.minimum(D, d_lo + slice_d)
    s = tl.load(pos_ptr).to(tl.int32)
    e = s + N
    # slot j of the sequence's ids, the slot after the last one the other heads (a decode
    # step: N is 1); or head h of the sequence
    slots = NIDS + 1 if SEL else H
    b = pid // slots
    j = pid % slots
    if not ALL:
        offs_i = tl.arange(0, BLOCK_IDS)
        ids = tl.load(idx_ptr + b * stride_idx + offs_i, mask=offs_i < NIDS, other=-1)
    if SEL:
        h = tl.load(idx_ptr + b * stride_idx + tl.minimum(j, NIDS - 1)).to(tl.int32)
        # a head's first slot computes it; a repeated id or a pad (-1) computes nothing
        repeated = tl.sum(((ids == h) & (offs_i < j)).to(tl.int32), 0)
        chosen = ((j < NIDS) & (h >= 0) & (h < H) & (repeated == 0)).to(tl.int32)
    else:
        h = j
        if ALL:
            chosen = tl.full([], 1, dtype=tl.int32)
        else:
            chosen = tl.sum((ids == h).to(tl.int32), 0)
    bh = b * H + h
    if SEL:  # a slot that computes nothing may hold no head
        lo = tl.minimum(tl.load(valid_ptr + bh, mask=chosen > 0, other=0), s)
    else:
        lo = tl.minimum(tl.load(valid_ptr + bh), s)
    start = lo
    if kv == 0:
        cache = k_ptr + b * stride_kb + h * stride_kh
        w_ptr, b_ptr, stride_w, stride_l = wk_ptr, bk_ptr, stride_wk, stride_kl
    elif kv == 1:
        cache = v_ptr + b * stride_vb + h * stride_vh
        w_ptr, b_ptr, stride_w, stride_l = wv_ptr, bv_ptr, stride_wv, stride_vl
    else:  # the query's rows [B, N, H * HD], row p - s of position p; new positions only
        cache = q_ptr + b * stride_qb + h * HD - s * stride_qn
        w_ptr, b_ptr, stride_w, stride_l = wq_ptr, bq_ptr, stride_wq, stride_qn
        start = s
    offs_c = pid_c * BLOCK_C + tl.arange(0, BLOCK_C)
    mask_c = offs_c < HD
    rows_w = h * HD + offs_c
    if chosen > 0:
        tile = 0
        for p0 in range(start, e, BLOCK_P):
            offs_p = p0 + tl.arange(0, BLOCK_P)
            old = offs_p < s
            new = (offs_p >= s) & (offs_p < e)
            kept = tl.load(cache + offs_p[:, None] * stride_l + offs_c[None, :],
                           mask=old[:, None] & mask_c[None, :], other=0.0)
            missing = old & (tl.max(tl.abs(kept.to(tl.float32)), 1) == 0.0)
            need = missing | new
            if tl.max(need.to(tl.int32), 0) > 0:
                acc = tl.zeros([BLOCK_P, BLOCK_C], dtype=tl.float32)
                for d0 in range(d_lo, d_hi, BLOCK_K):
                    offs_k = d0 + tl.arange(0, BLOCK_K)
                    mask_k = offs_k < d_hi
                    y = tl.load(in_ptr + b * stride_ib + offs_p[:, None] * stride_il
                                + offs_k[None, :], mask=missing[:, None] & mask_k[None, :],
                                other=0.0)
                    y += tl.load(x_ptr + b * stride_xb + (offs_p - s)[:, None] * stride_xn
                                 + offs_k[None, :], mask=new[:, None] & mask_k[None, :],
                                 other=0.0)
                    w = tl.load(w_ptr + rows_w[:, None] * stride_w + offs_k[None, :],
                                mask=mask_c[:, None] & mask_k[None, :], other=0.0)
                    if DOT:
                        acc = dot_rows(y, tl.trans(w), acc, IEEE)
                    else:
                        acc += tl.sum(y.to(tl.float32)[:, None, :] * w.to(tl.float32)[None, :, :],
                                      2)
                out = cache + offs_p[:, None] * stride_l + offs_c[None, :]
                needed = need[:, None] & mask_c[None, :]
                if SPLIT == 1:
                    if HAS_B:
                        acc += tl.load(b_ptr + rows_w, mask=mask_c,
                                       other=0.0).to(tl.float32)[None, :]
                    tl.store(out, acc.to(cache.dtype.element_ty), mask=needed)
                else:  # fp32 sums per position; the tile's last program stores the rows
                    sums = ws_ptr + ((b * MATS + kv) * L + offs_p)[:, None] * (H * HD) \
                        + rows_w[None, :]
                    tl.atomic_add(sums, acc, mask=needed, sem="relaxed")
                    count = tile_cnt_ptr + ((bh * MATS + kv) * CMAX + pid_c) * (L + 1) + tile
                    finish_last(sums, out, b_ptr + rows_w[None, :] + 0 * offs_p[:, None],
                                needed, count, SPLIT, HAS_B, True)
            tile += 1
    elif part == 0:
        if SEL:
            if j == NIDS:  # the heads no slot computes: zeros, prefix cut at s
                _zero_the_rest(ids, k_ptr, v_ptr, q_ptr, valid_ptr, b, s, offs_c, mask_c, kv,
                               pid_c, H, HD, stride_kb, stride_kh, stride_kl, stride_vb,
                               stride_vh, stride_vl, stride_qb, BLOCK_H, BLOCK_C)
        else:
            for p0 in range(s, e, BLOCK_P):
                offs_p = p0 + tl.arange(0, BLOCK_P)
                zeros = tl.zeros([BLOCK_P, BLOCK_C], dtype=cache.dtype.element_ty)
                tl.store(cache + offs_p[:, None] * stride_l + offs_c[None, :], zeros,
                         mask=(offs_p < e)[:, None] & mask_c[None, :])
    # the new rows' inputs, kept for later fills, in chunks of BLOCK_K shared out over the
    # sequence's programs: one program copying them all runs its chunks one after another, a
    # load's latency each (40 chunks of OPT-13B's row)
    programs = tl.num_programs(1) * tl.num_programs(2)  # a head's (a slot's)
    chunks = tl.cdiv(D, BLOCK_K)
    first = j * programs + pid_c * tl.num_programs(2) + pid_z
    for item in range(first, N * chunks, slots * programs):
        r = item // chunks
        offs_k = (item % chunks) * BLOCK_K + tl.arange(0, BLOCK_K)
        row = tl.load(x_ptr + b * stride_xb + r * stride_xn + offs_k, mask=offs_k < D)
        tl.store(in_ptr + b * stride_ib + (s + r) * stride_il + offs_k, row, mask=offs_k < D)
    # every program of the head read its valid prefix before counting (release); the last
    # one records the new prefix and leaves the counter zero
    if SEL:
        if chosen > 0:
            _record_prefix(cnt_ptr + bh, valid_ptr + bh, programs, e)
    else:
        _record_prefix(cnt_ptr + bh, valid_ptr + bh, programs, tl.where(chosen > 0, e, lo))


# the grid is in the key: the two grids' fastest tiles differ (``GRIDS``), and each ships its own
_decode_kernel = triton.autotune(configs=decode_configs(),
                                 key=["D", "HD", "MATS", "SEL"])(_lazy_kv_kernel)


def step_config(n: int, config: dict | None = None) -> dict | None:
    """The fixed config a call with ``n`` new tokens runs, None for the autotuned decode
    kernel: a prefill ``PREFILL_FIXED``; a decode step ``config`` when given, else in
    deterministic mode ``DETERMINISTIC_FIXED`` (``config`` too must then not split d)."""
    if n > 1:
        return PREFILL_FIXED
    if deterministic():
        if config is not None and config["SPLIT"] > 1:
            raise ValueError("lazy_kv: a config that splits d (SPLIT > 1) adds its sums with "
                             "atomics, which deterministic mode does not allow")
        return config or DETERMINISTIC_FIXED
    return config


def lazy_kv(x, idx, wk, bk, wv, bv, keys, values, pos, config: dict | None = None,
            grid: str | None = None) -> None:
    """CUDA implementation of ``dejavu::lazy_kv`` (see the module docstring). A decode step (one
    new token) runs the autotuned kernel, or ``config`` (a ``DECODE_FIXED``-like dict) when
    given; a prefill runs ``PREFILL_FIXED``; deterministic mode a form without atomics
    (``step_config``). ``grid``: one of ``GRIDS``, ``default_grid()`` when None."""
    _launch(x, idx, None, None, wk, bk, wv, bv, keys, values, pos, None, config, grid)


def lazy_qkv(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos, config: dict | None = None,
             out: torch.Tensor | None = None, grid: str | None = None) -> torch.Tensor:
    """CUDA implementation of ``dejavu::lazy_qkv``: ``lazy_kv`` and the query projection of
    the selected heads in the same launch (a third matrix in the grid), which share its input
    and selection. Returns the query [B, n, H * hd], zeros in the columns of the heads not
    selected: every element is written, into ``out`` when given (contiguous, x's dtype)."""
    batch, n, _ = x.shape
    shape = (batch, n, wq.shape[0])
    if out is not None and (tuple(out.shape) != shape or out.dtype != x.dtype
                            or not out.is_contiguous()):
        raise ValueError(f"lazy_qkv: out must be a contiguous {x.dtype} tensor of shape {shape}, "
                         f"got {out.dtype} {tuple(out.shape)}")
    q = torch.empty(shape, device=x.device, dtype=x.dtype) if out is None else out
    _launch(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos, q, config, grid)
    return q


def _launch(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos, q, config, grid) -> None:
    name = "lazy_kv" if q is None else "lazy_qkv"
    grid = default_grid() if grid is None else grid
    if grid not in GRIDS:
        raise ValueError(f"{name}: grid must be one of {GRIDS}, got {grid!r}")
    check_dtype(name, x, wk, wv, keys, values, wq)  # (None, without the query, is skipped)
    batch, n, d = x.shape
    heads, hd = keys.shape[1], keys.shape[3]
    if x.stride(2) != 1 or wk.stride(1) != 1 or wv.stride(1) != 1 \
            or keys.stride(3) != 1 or values.stride(3) != 1 \
            or (wq is not None and wq.stride(1) != 1):
        raise ValueError(f"{name}: the inputs, weights and cache need contiguous last dims")
    if wq is not None and (wq.shape != wk.shape or (bq is None) != (bk is None)):
        raise ValueError(f"{name}: the query's weight {tuple(wq.shape)} and bias must match the "
                         f"keys' {tuple(wk.shape)} (one K/V head per query head)")
    mats = 2 if q is None else 3
    state = lazy_state(keys, d, x.dtype)
    every = idx is None or n > 1
    ids = x if every else id_rows(idx, batch)

    sums, tile_counts, cmax = split_workspace(keys, heads * hd, mats)

    # a selection's decode step over its slots (and one for the other heads), else every head
    sel = grid == "selection" and not every and ids.shape[1] > 0
    rows = batch * (ids.shape[1] + 1) if sel else batch * heads

    def launch_grid(meta):
        return (rows, triton.cdiv(hd, meta["BLOCK_C"]), mats * meta["SPLIT"])

    args = (x, state.inputs, ids, wk, bk if bk is not None else wk, wv,
            bv if bv is not None else wv, keys, values, pos, state.valid, state.counts, sums,
            tile_counts, wk if wq is None else wq,
            (bk if bk is not None else wk) if bq is None else bq, keys if q is None else q,
            d, n, 0 if every else ids.shape[1], heads, hd, keys.shape[2], cmax,
            x.stride(0), x.stride(1), state.inputs.stride(0), state.inputs.stride(1),
            0 if every or ids.shape[0] == 1 else ids.stride(0), wk.stride(0), wv.stride(0),
            keys.stride(0), keys.stride(1), keys.stride(2),
            values.stride(0), values.stride(1), values.stride(2),
            wk.stride(0) if wq is None else wq.stride(0), 0 if q is None else q.stride(0),
            0 if q is None else q.stride(1))
    meta = dict(ALL=every, HAS_B=bk is not None, IEEE=ieee(x, wk, wv), MATS=mats, SEL=sel,
                BLOCK_H=triton.next_power_of_2(heads),
                BLOCK_IDS=max(16, triton.next_power_of_2(0 if every else ids.shape[1])))
    fixed = step_config(n, config)
    meta.update(pdl_meta())
    if fixed is None:
        _decode_kernel[launch_grid](*args, **meta)
    else:
        _lazy_kv_kernel[launch_grid](*args, **meta, **fixed)
