"""Pieces shared by the Triton kernels: activations, autotune configs, availability."""

from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl

from .ops import COUNT_BLOCK, norm_numel, workspace_numel

try:  # programmatic dependent launch (Hopper and later)
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    _GDC = True
except ImportError:  # an older Triton: launches stay plain
    _GDC = False

ACT_CODES = {"relu": 0, "silu": 1, "gelu": 2, "gelu_tanh": 3}
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
# One config per kernel instead of an autotuning sweep: for correctness runs of the compiled
# kernels (tests/conftest.py sets it), where tuning every parametrised shape costs minutes of
# GPU time and measures nothing. Benchmarks leave it unset.
QUICK_TUNE = os.environ.get("DEJAVU_QUICK_TUNE") == "1"

# The one config of each kind of kernel for quick tuning and for deterministic mode: tiles
# (selected rows x columns) per program and, for the reducing kernels, neuron tiles per program.
TILE_FIXED = ({"BLOCK_N": 8, "BLOCK_D": 16, "num_warps": 1} if INTERPRET
              else {"BLOCK_N": 32, "BLOCK_D": 128, "num_warps": 4})
# the per-row tile kernels (up and query projections) loop over TILES slices of d
TILE_LOOP_FIXED = {**TILE_FIXED, "TILES": 1}
REDUCE_FIXED = {**TILE_FIXED, "TILES": 2}
# The kernels of a batch's union selection multiply each weight tile with a block of
# ``UNION_ROWS`` rows at once (``tl.dot``: every tile dimension at least 16).
UNION_ROWS = 16
UNION_TILE_FIXED = {**TILE_FIXED, "BLOCK_N": max(16, TILE_FIXED["BLOCK_N"])}
UNION_REDUCE_FIXED = {**UNION_TILE_FIXED, "TILES": 2}


def fixed_config(fixed: dict) -> triton.Config:
    """The autotuner's config of a ``*_FIXED`` dict (its ``num_warps`` and, when given,
    ``num_stages`` launch options)."""
    meta = {k: v for k, v in fixed.items() if k not in ("num_warps", "num_stages")}
    return triton.Config(meta, num_warps=fixed["num_warps"],
                         num_stages=fixed.get("num_stages", 3))


def deterministic() -> bool:
    """Whether results must be bitwise reproducible (PyTorch's switch,
    ``torch.use_deterministic_algorithms``). The projection kernels then give each program its
    own slot of partial sums, added afterwards by one ordered sum, instead of atomics that meet
    in no fixed order; they run with the fixed configs above (the slot count is known before
    the launch). Slower: for tests and debugging."""
    return torch.are_deterministic_algorithms_enabled()


def partials(det: bool, splits: int, *shape: int, device, zero: bool = False) -> torch.Tensor:
    """``[S, *shape]`` fp32 targets of a kernel's partial sums: with atomics one zeroed slot
    (S = 1) they all add into; in deterministic mode ``splits`` slots, one per program along the
    kernel's split, zeroed when ``zero`` (programs that leave part of their slot unwritten)."""
    if not det:
        return torch.zeros(1, *shape, device=device, dtype=torch.float32)
    return (torch.zeros if zero else torch.empty)(splits, *shape, device=device,
                                                   dtype=torch.float32)


def tile_slots(d: int, fixed: dict) -> int:
    """Programs along ``d`` of a tile kernel run with ``fixed`` (its slots of partials): a
    program covers ``TILES`` slices of ``BLOCK_D`` (one slice for the union kernels)."""
    return triton.cdiv(d, fixed["BLOCK_D"] * fixed.get("TILES", 1))


def reduce_slots(k: int, fixed: dict = REDUCE_FIXED) -> int:
    """Programs along ``k`` selected rows of a reducing kernel run with ``fixed``."""
    return triton.cdiv(k, fixed["BLOCK_N"] * fixed["TILES"])


def total(parts: torch.Tensor, det: bool) -> torch.Tensor:
    """The sum of ``partials``: the ordered sum of the slots, or the one slot of the atomics."""
    return parts.sum(0) if det else parts[0]


def selection(idx: torch.Tensor, n_rows: int, units: int, union: bool) -> torch.Tensor:
    """The ids the kernels read: each row's ``[R, k]``, or with ``union`` and more than one row
    the batch's union ``[1, S]`` (``reference.union_ids``, -1 padded) that every row reads."""
    from .reference import union_ids

    if union and n_rows > 1:
        return union_ids(idx, units)
    return idx.reshape(n_rows, -1).contiguous()


def shared(sel: torch.Tensor, n_rows: int) -> bool:
    """Whether the batch reads one shared id row (a union selection): the union kernels."""
    return sel.shape[0] == 1 and n_rows > 1


def ieee(*tensors) -> bool:
    """Whether a union kernel's products run in fp32: an fp32 operand, or mixed dtypes; and
    bf16 under the interpreter, whose ``tl.dot`` multiplies bf16 as raw integers (the GPU runs
    of tests/test_kernels.py cover the bf16 tensor-core path)."""
    dtypes = {t.dtype for t in tensors}
    return torch.float32 in dtypes or len(dtypes) > 1 or (INTERPRET and torch.bfloat16 in dtypes)


def idx_stride(sel: torch.Tensor) -> int:
    """Row stride of the ids passed to a kernel: 0 for one row shared by all (union)."""
    return 0 if sel.shape[0] == 1 else sel.stride(0)


# Programmatic dependent launch: a kernel launched with it may start while the kernel before
# it in the stream finishes; it loads what older kernels wrote (ids, activations, weights),
# then waits for its predecessor (``wait_inputs``) before reading what that one wrote or
# adding into its buffers, and lets its own successor start. A sparse op launches its
# zero-fill right before its first kernel, so that kernel's predecessor is the fill, except on
# a workspace (no fill): there the first kernel's predecessor is another op's and may have
# written its ids or input, so it waits before it loads anything (the sparse MLP's up kernel,
# the output projection's kernels).
# On by default where it can be (Hopper or later, compiled Triton, not deterministic mode):
# OPT-13B's captured lazy K/V step took 4.19 and 4.20 ms with it against 4.56 and 4.29 without,
# side by side on an H200 (BENCHMARKS.md, twentieth session). ``DEJAVU_PDL=0`` turns it off;
# ``dejavu bench`` runs its modes named ``*_pdl`` with it and every other mode without.
PDL_ENV = "DEJAVU_PDL"


@functools.cache
def _hopper() -> bool:
    return torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9


def programmatic() -> bool:
    """Whether the kernels launch with programmatic dependent launch: on a Hopper or later
    GPU, with compiled Triton, not in deterministic mode (whose kernels write unzeroed slots
    with no fill before them), unless ``DEJAVU_PDL=0``. Any value of ``DEJAVU_PDL`` but unset,
    ``0`` or ``1`` is an error."""
    asked = os.environ.get(PDL_ENV, "1")
    if asked not in ("0", "1"):
        raise ValueError(f"{PDL_ENV}={asked!r}: set it to 1 (programmatic launch, the default "
                         f"on Hopper and later) or 0 (plain launches)")
    return asked == "1" and _GDC and not INTERPRET and not deterministic() and _hopper()


def env_choice(name: str, choices: tuple[str, ...]) -> str:
    """The value of the environment variable ``name``, one of ``choices`` (unset is the
    first). Any other value is an error naming the variable and the choices."""
    asked = os.environ.get(name, choices[0])
    if asked not in choices:
        raise ValueError(f"{name}={asked!r}: set it to one of {choices}")
    return asked


# Where a kernel launched programmatically lets the kernel after it start. "wait", the
# default: right after its own wait (``wait_inputs``; the sparse MLP's up kernel after the
# op's zero-fill, before it; the add-norm and finish kernels under ``DEJAVU_NORM_LAUNCH=late``
# after their last store), so that the successor's programs are resident and load what they
# may before their wait while this kernel still runs. "exit": no kernel starts its successor
# itself, so the successor starts as this kernel's last programs exit (the implicit start),
# each kernel still launched programmatically and waiting as before: what remains is the
# launch's latency hidden, not the overlap. A TensorRT-LLM bug fix (nvbug 6168859,
# pull request 14537, "move tinygemm PDL release after reduction") moved a kernel's start of
# its successor after that kernel's output stores, as ``late`` did for the add-norm
# kernel here, whose start right after its wait gave wrong steps that no read before a wait
# explains (BENCHMARKS.md, forty-fifth to forty-ninth sessions). "exit" is the same rule for
# every kernel. On an H200 (fifty-first session) ``race_study``'s ``norm programmatic`` launches
# were right in 5 of 5 runs under it and wrong in 5 of 5 without it. On an H100 (fifty-second
# session) OPT-13B's step ran 4.22 ms under it against 4.08 for the default, one round side by
# side (each process tuning its own tiles: no H100 configs were shipped then): slower, so off.
# ``dejavu bench`` modes ``*_exit_pdl`` set it.
PDL_START_ENV = "DEJAVU_PDL_START"
PDL_STARTS = ("wait", "exit")
# the ``PDL`` meta-parameter under "exit" (``wait_inputs`` and ``start_dependents`` start
# nothing); True under "wait"
PDL_EXIT = 2


def pdl_start() -> str:
    """Where a kernel launched programmatically starts its successor: one of ``PDL_STARTS``
    (``PDL_START_ENV``; unset is "wait"). Any other value is an error."""
    return env_choice(PDL_START_ENV, PDL_STARTS)


def pdl_meta() -> dict:
    """The ``PDL`` meta-parameter of a launch, and Triton's launch option when it is on:
    ``PDL`` True, or ``PDL_EXIT`` under ``DEJAVU_PDL_START=exit`` (``pdl_start``)."""
    if not programmatic():
        return {"PDL": False}
    return {"PDL": True if pdl_start() == "wait" else PDL_EXIT, "launch_pdl": True}


# The add-norm and finish kernels launch plainly, whatever ``programmatic`` says. On an H200
# (forty-fifth session, BENCHMARKS.md, ``examples/race_study.py``) a small OPT's step (the
# fixed selector, no CUDA graphs) called step by step with every kernel launched
# programmatically gave wrong logits in 6 of 8 runs with lazy K/V and 4 of 8 with dense K/V,
# and a captured one in 1 of 8; with these two kernels launched plainly and every other
# programmatically, none of 16 runs was wrong; launching any other group plainly left runs
# wrong. What goes wrong in them is not known. ``race_study`` turns each back on.
ADD_NORM_PDL = False
FINISH_PDL = False
# ``DEJAVU_NORM_LAUNCH=late`` launches those two programmatically again, each letting its
# successor start only after its last store (``LATE``) rather than right after its wait: the
# kernel still starts early, loads its weights and waits while the kernel before it drains,
# but nothing after it starts before it has read its inputs and written its outputs. On an
# H200 (forty-seventh session) its GPU tests passed and ``race_study`` found 0 of 4 runs
# wrong, against 4 of 4 with the early start; one OPT-13B round each, 3.61 ms against 3.56
# for plain, so plain stays the default; bench modes ``*_normlate_pdl`` set it.
NORM_LAUNCH_ENV = "DEJAVU_NORM_LAUNCH"
NORM_LAUNCHES = ("plain", "late")


def norm_launch() -> str:
    """How the add-norm and finish kernels launch: one of ``NORM_LAUNCHES``
    (``NORM_LAUNCH_ENV``; unset is "plain"). Any other value is an error."""
    return env_choice(NORM_LAUNCH_ENV, NORM_LAUNCHES)


def norm_launch_meta(early: bool) -> dict:
    """The ``PDL`` and ``LATE`` meta-parameters (and Triton's launch option) of an add-norm or
    finish launch: ``early`` (``ADD_NORM_PDL`` or ``FINISH_PDL``), programmatic with the
    successor started right after the wait, as before the forty-fifth session's fix; else as
    ``norm_launch`` says: plain, or programmatic with the successor started last."""
    if early:
        return {**pdl_meta(), "LATE": False}
    if norm_launch() == "late":
        return {**pdl_meta(), "LATE": True}
    return {"PDL": False, "LATE": False}


@triton.jit
def wait_inputs(PDL: tl.constexpr, STARTED: tl.constexpr = False):
    """Under programmatic launch: wait until the kernel before this one has finished and its
    writes are visible, then let the kernel after this one start (unless ``STARTED``: this
    kernel lets it start itself, ``start_dependents``, before or after; or ``PDL`` is
    ``PDL_EXIT``: it starts as this kernel's programs exit)."""
    if PDL:
        gdc_wait()
        if not STARTED:
            start_dependents(PDL)


@triton.jit
def start_dependents(PDL: tl.constexpr):
    """Under programmatic launch: let the kernel after this one start now, before this one's
    loads (then ``wait_inputs(PDL, True)``). Only a kernel whose predecessor is finished may
    (the op's zero-fill, a plain launch): what its successor loads before its own wait is then
    older than both. The sparse MLP's up kernel does, so that the down kernel's programs load
    their first weights as the up kernel's last ones drain. Called last instead, after the
    wait and every store, it starts the successor only once this kernel has read and written
    everything (the add-norm and finish kernels' ``LATE``). Under ``PDL_EXIT`` nothing: the
    successor starts as this kernel's programs exit."""
    if PDL:
        if PDL != 2:  # PDL_EXIT
            gdc_launch_dependents()


# The sparse MLP's up kernel and the query projection's kernel may store whole rows (each
# program all of d, no atomics): the up kernel then also clears the down kernel's sums and
# counters, so the MLP launches no zero-fill, and the query projection adds its bias and casts
# as it stores, so it launches no finish (two launches instead of three each). Off unless
# ``DEJAVU_STORE_ROWS=1``: on the H200 (ninth session, ``dejavu bench`` mode ``dejavu_store``)
# the two store kernels took 90 us a step more on OPT-13B than the kernels they replace, about
# what the launches they remove took, and the MLP's zero-fill has since gone another way (a
# workspace kept zero).
STORE_ROWS_ENV = "DEJAVU_STORE_ROWS"


def stores_rows() -> bool:
    """Whether the up and query projections run their row-storing kernels (``STORE_ROWS_ENV``)."""
    return os.environ.get(STORE_ROWS_ENV) == "1"


# A sparse op's first kernel waits for the kernel before it before it loads anything when
# that kernel may have written its ids: on a workspace the sparse MLP's up kernel may follow
# the selector. Two cases are known from the graph to have older ids:
# - the up kernel of an MLP whose predictor ran ahead (the lookahead pass: its ids were
#   written a layer earlier, on a side stream whose event the op waited on before this
#   launch; ``kernels.lookahead.waiting`` tells the launcher);
# - the output projection of an attention whose heads a predictor or fixed ids chose (the
#   query projection and the attention read the same ids first; the sparsify pass marks it).
# With ``DEJAVU_EARLY_IDS=1`` such a kernel loads its ids and its first slice of weight rows
# before the wait, as the down kernel does with its first tile, and its input, the kernel
# before's output, after it. Off unless set: on the H200 (thirty-fourth session) it was under
# 1% faster on OPT-13B's step and 0.3-6% slower on Llama-3-8B's (BENCHMARKS.md).
EARLY_IDS_ENV = "DEJAVU_EARLY_IDS"


def early_ids() -> bool:
    """Whether kernels whose ids are older than the kernel before them load their ids and
    first weights before their wait (``EARLY_IDS_ENV``: 1 on, 0 or unset off; any other value
    is an error)."""
    asked = os.environ.get(EARLY_IDS_ENV, "0")
    if asked not in ("0", "1"):
        raise ValueError(f"{EARLY_IDS_ENV}={asked!r}: set it to 1 (kernels whose ids are older "
                         f"than the kernel before them load them and their first weights "
                         f"before their wait) or 0 (off, the default)")
    return asked == "1"


def launch(kernel, grid, *args, fixed: dict | None = None, **meta) -> None:
    """Launch the autotuned ``kernel`` over ``grid`` (a function of the meta-parameters), or,
    with ``fixed``, the kernel under it with that config (no autotuning); ``PDL`` as
    ``pdl_meta`` says."""
    if fixed is None:
        kernel[grid](*args, **meta, **pdl_meta())
    else:
        kernel.fn[grid](*args, **meta, **fixed, **pdl_meta())


@triton.jit
def add_partial(ptrs, vals, mask, ATOMIC: tl.constexpr):
    """Add ``vals`` into ``ptrs`` with atomics, or store them (each program its own slot).
    The atomics are relaxed: what reads the sums is a later kernel, or ``finish_last`` after
    its barrier and counter."""
    if ATOMIC:
        tl.atomic_add(ptrs, vals, mask=mask, sem="relaxed")
    else:
        tl.store(ptrs, vals, mask=mask)


@triton.jit
def load_rows(w_ptr, rows, valid, stride_w, offs_d, mask_d):
    """The rows ``rows`` of ``W`` (those ``valid``; zeros elsewhere) at columns ``offs_d``
    (those ``mask_d``): [R, BLOCK_D] in W's dtype."""
    return tl.load(w_ptr + rows[:, None] * stride_w + offs_d[None, :],
                   mask=valid[:, None] & mask_d[None, :], other=0.0)


@triton.jit
def add_rows(acc, w_ptr, rows, valid, stride_w, offs_d, mask_d, x):
    """One loop step of the GEMVs that read whole weight rows: ``acc`` [R, BLOCK_D] plus the
    rows ``rows`` of ``W`` (those ``valid``) at columns ``offs_d`` (those ``mask_d``) times
    ``x`` (fp32 [BLOCK_D]). The 2-d accumulator is reduced once, after the loop."""
    w = load_rows(w_ptr, rows, valid, stride_w, offs_d, mask_d)
    return acc + w.to(tl.float32) * x[None, :]


@triton.jit
def add_row_slices(acc, x_row, w_ptr, rows, valid, stride_w, start, D,
                   BLOCK_D: tl.constexpr):
    """The loop of the GEMVs that read whole weight rows: ``acc`` [R, BLOCK_D] plus the rows
    ``rows`` of ``W`` (those ``valid``) times the row of d values at ``x_row``, over the
    slices of ``BLOCK_D`` columns from ``start`` (a slice boundary) to ``D`` (``add_rows``
    each step)."""
    for d0 in range(start, D, BLOCK_D):
        offs_d = d0 + tl.arange(0, BLOCK_D)
        mask_d = offs_d < D
        x = tl.load(x_row + offs_d, mask=mask_d, other=0.0).to(tl.float32)
        acc = add_rows(acc, w_ptr, rows, valid, stride_w, offs_d, mask_d, x)
    return acc


@triton.jit
def _biased_sums(acc_ptrs, b_ptrs, mask, HAS_B: tl.constexpr):
    """The fp32 sums at ``acc_ptrs`` (read atomically, from L2 where the atomics ran) plus the
    bias at ``b_ptrs``: a reducing kernel's finished outputs."""
    v = tl.atomic_add(acc_ptrs, tl.zeros(acc_ptrs.shape, dtype=tl.float32), mask=mask,
                      sem="acquire")
    if HAS_B:
        v += tl.load(b_ptrs, mask=mask, other=0.0).to(tl.float32)
    return v


@triton.jit
def finish_last(acc_ptrs, out_ptrs, b_ptrs, mask, cnt_ptr, n_split, HAS_B: tl.constexpr,
                CLEAN: tl.constexpr = False):
    """The finish launch folded into a reducing kernel: after this program has added its
    partial sums into ``acc_ptrs`` (fp32), it counts itself in ``cnt_ptr``; the last of the
    ``n_split`` programs adding into these outputs reads the sums (atomically, from L2 where
    the atomics ran), adds the bias and stores them at ``out_ptrs`` in the output's dtype.
    The barrier puts every thread's atomics before the count (its release); the count's
    acquire puts the other programs' before the read. With ``CLEAN`` it then zeroes the sums
    and the count, which every program of this launch is done with: a workspace kept zero
    between calls (``workspace_targets``)."""
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == n_split - 1:
        v = _biased_sums(acc_ptrs, b_ptrs, mask, HAS_B)
        tl.store(out_ptrs, v.to(out_ptrs.dtype.element_ty), mask=mask)
        if CLEAN:
            tl.store(acc_ptrs, tl.zeros(acc_ptrs.shape, dtype=tl.float32), mask=mask)
            tl.atomic_xchg(cnt_ptr, 0)


@triton.jit
def finish_norm_last(acc_ptrs, b_ptrs, offs, mask, cnt_ptr, n_split, res, h_row, n_row,
                     nw_ptr, nb_ptr, stats_row, rcnt_ptr, DOUT, eps, HAS_B: tl.constexpr,
                     HAS_NB: tl.constexpr, CLEAN: tl.constexpr, BLOCK_D: tl.constexpr,
                     BLOCK_T: tl.constexpr, BLOCK_ROW: tl.constexpr):
    """``finish_last`` followed by the residual add and the layer norm that read its output
    (``ops.sparse_mlp_norm``): the last program of an output tile (columns ``offs`` of the
    row) stores ``h = res + round(sums + b)`` at ``h_row`` (``res``: the residual's values
    at ``offs``, which the kernel loads right after its wait, so that no load of them waits
    here), and the tile's sum and sum of squared deviations from its own mean at
    ``stats_row``; the last of the row's tiles (``rcnt_ptr`` counts them, and is left zero)
    merges the tiles' statistics (Chan's formula: the row's mean and variance, no cancellation
    of a one-pass E[h^2] - E[h]^2) and stores ``(h - mean) / sqrt(var + eps) * w (+ b)`` for
    the whole row at ``n_row``. That program loads the statistics, the row (``BLOCK_ROW``
    columns at once) and the norm's weights all before it uses any: one wait on memory, not
    one a chunk, which a loop of loads and stores to memory the compiler cannot tell apart
    would cost. The row's values are read from L2 (``.cg``), where the other programs stored
    them before their count (release) and after this one's (acquire). The statistics and the
    row's counter are left zero. One kernel fewer in the step than a layer norm after."""
    tl.debug_barrier()
    if tl.atomic_add(cnt_ptr, 1, sem="acq_rel") == n_split - 1:
        v = _biased_sums(acc_ptrs, b_ptrs, mask, HAS_B)
        # the op's output rounded to its dtype, then the residual add rounded again: what the
        # graph computed before the rewrite
        y = v.to(h_row.dtype.element_ty).to(tl.float32)
        h = (res.to(tl.float32) + y).to(h_row.dtype.element_ty)
        tl.store(h_row + offs, h, mask=mask)
        hf = tl.where(mask, h.to(tl.float32), 0.0)
        total = tl.sum(hf, 0)
        dev = tl.where(mask, hf - total / tl.sum(mask.to(tl.float32), 0), 0.0)
        tile = tl.program_id(2)
        tl.store(stats_row + 2 * tile, total)
        tl.store(stats_row + 2 * tile + 1, tl.sum(dev * dev, 0))
        if CLEAN:
            tl.store(acc_ptrs, tl.zeros(acc_ptrs.shape, dtype=tl.float32), mask=mask)
            tl.atomic_xchg(cnt_ptr, 0)
        tl.debug_barrier()
        tiles = tl.num_programs(2)
        if tl.atomic_add(rcnt_ptr, 1, sem="acq_rel") == tiles - 1:
            t = tl.arange(0, BLOCK_T)
            mt = t < tiles
            cols = tl.arange(0, BLOCK_ROW)
            mc = cols < DOUT
            sums = tl.load(stats_row + 2 * t, mask=mt, other=0.0, cache_modifier=".cg")
            m2 = tl.load(stats_row + 2 * t + 1, mask=mt, other=0.0, cache_modifier=".cg")
            x = tl.load(h_row + cols, mask=mc, other=0.0, cache_modifier=".cg")
            w = tl.load(nw_ptr + cols, mask=mc, other=0.0)
            if HAS_NB:
                nb = tl.load(nb_ptr + cols, mask=mc, other=0.0)
            # read: left zero, like the rest of a workspace
            tl.store(stats_row + 2 * t, tl.zeros([BLOCK_T], dtype=tl.float32), mask=mt)
            tl.store(stats_row + 2 * t + 1, tl.zeros([BLOCK_T], dtype=tl.float32), mask=mt)
            width = tl.maximum(tl.minimum(DOUT - t * BLOCK_D, BLOCK_D), 1).to(tl.float32)
            mean = tl.sum(sums, 0) / DOUT
            gap = tl.where(mt, sums / width - mean, 0.0)
            var = (tl.sum(m2, 0) + tl.sum(width * gap * gap, 0)) / DOUT
            out = (x.to(tl.float32) - mean) * (1.0 / tl.sqrt(var + eps)) * w.to(tl.float32)
            if HAS_NB:
                out += nb.to(tl.float32)
            tl.store(n_row + cols, out.to(n_row.dtype.element_ty), mask=mc)
            tl.atomic_xchg(rcnt_ptr, 0)


@triton.jit
def finish_tile(out_row, fin_row, b_ptr, offs, mask, cnt_ptr, n_split, res, nrm_row, nw_ptr,
                nb_ptr, stats_row, rcnt_ptr, DOUT, eps, FUSED: tl.constexpr, NORM: tl.constexpr,
                HAS_B: tl.constexpr, HAS_NB: tl.constexpr, CLEAN: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_ROW: tl.constexpr):
    """The end of a reducing kernel's program over columns ``offs`` of one row (the down and
    output-projection kernels): with ``FUSED`` the last program of the tile finishes the
    row's sums at ``out_row`` (``finish_last`` into ``fin_row``), with ``NORM`` also adding
    the residual ``res`` and normalising (``finish_norm_last``: ``fin_row`` the sum,
    ``nrm_row`` its norm); without ``FUSED`` nothing (a finish launch follows, or the
    add-norm launch finishes the sums). ``res`` is unread without ``NORM``."""
    if FUSED and NORM:
        finish_norm_last(out_row + offs, b_ptr + offs, offs, mask, cnt_ptr, n_split, res, fin_row,
                         nrm_row, nw_ptr, nb_ptr, stats_row, rcnt_ptr, DOUT, eps, HAS_B, HAS_NB,
                         CLEAN, BLOCK_D, BLOCK_T, BLOCK_ROW)
    elif FUSED:
        finish_last(out_row + offs, fin_row + offs, b_ptr + offs, mask, cnt_ptr, n_split, HAS_B,
                    CLEAN)


# How ``sparse_mlp_norm`` and ``sparse_head_out_norm`` (option ``fuse_norm``) finish their
# residual add and layer norm on CUDA where the reducing kernel could (per-row ids and
# atomics): "sums", the default, the reducing kernel leaves its fp32 sums unfinished (no
# count, no last program) and one ``add_norm`` launch after the op adds the op's bias to
# them, rounds, adds the residual, normalises and zeroes the sums (``add_norm_sums``): in
# OPT-13B's step on an H200 the down kernel 1.9 us a call faster and the output projection
# 1.6, the add-norm launches 0.3 us a norm slower, and the step 3.63, 3.48 and 3.49 ms
# against 3.68, 3.69 and 3.71 for "kernel" side by side (BENCHMARKS.md, thirty-eighth
# session); "kernel", the op ends as it does without the norm and an ``add_norm`` launch
# follows, a row in registers per program in place of Inductor's fused kernel, which loops
# over the row twice (a row of 5120 is longer than the 1024 it holds in registers): 1.8 us
# a norm against 2.6, and the step 0.10-0.28 ms faster in four rounds (thirty-seventh
# session); "last", in that kernel's last programs (``finish_norm_last``), one launch fewer
# but a chain of memory round trips at the end of the kernel, slower (thirty-sixth
# session); "mixed", the MLP's in the down kernel's last programs and the output
# projection's in an ``add_norm`` launch (its kernel already spills at the shipped tile, and
# the finish made it 5.8 us a call slower, the down kernel 1.9 us), 3.67 against 3.54 ms for
# "kernel" in one round. ``dejavu bench`` modes ``dejavu_captured_qkv_normk_pdl``,
# ``dejavu_captured_qkv_norm_pdl`` and ``dejavu_captured_qkv_normm_pdl`` set the last three,
# ``dejavu_captured_qkv_norms_pdl`` the first (the default step said explicitly).
NORM_FINISH_ENV = "DEJAVU_NORM_FINISH"
NORM_FINISHES = ("sums", "kernel", "last", "mixed")


def norm_finish() -> str:
    """Where a fused norm is computed on CUDA: one of ``NORM_FINISHES`` (``NORM_FINISH_ENV``;
    unset is "sums"). Any other value of the variable is an error."""
    return env_choice(NORM_FINISH_ENV, NORM_FINISHES)


def norm_in_finish(op: str, norm=None) -> bool:
    """Whether the reducing kernel of ``op`` ("mlp" or "head_out") finishes a fused norm
    itself (``norm_finish``), rather than an ``add_norm`` launch after the op. An RMS norm
    (``norm`` = (residual, weight, bias, eps, True)) never is: ``finish_norm_last`` computes
    layer norms only, so with "last" or "mixed" its op finishes and an add-norm launch
    follows."""
    asked = norm_finish()
    return (asked == "last" or (asked == "mixed" and op == "mlp")) and not is_rms(norm)


def is_rms(norm) -> bool:
    """Whether a fused op's ``norm`` tuple (residual, weight, bias or None, eps[, rms]) asks
    for Llama's RMS norm rather than a layer norm."""
    return norm is not None and len(norm) > 4 and bool(norm[4])


@triton.jit
def _add_norm_kernel(y_ptr, yb_ptr, r_ptr, w_ptr, b_ptr, h_ptr, n_ptr,
                     N, eps,
                     stride_y, stride_r, stride_h, stride_n,
                     HAS_B: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                     SUMS: tl.constexpr = False, HAS_YB: tl.constexpr = False,
                     CLEAN: tl.constexpr = False, RMS: tl.constexpr = False,
                     LATE: tl.constexpr = False):
    # one program a row, the whole row in registers: the weight and biases load before the
    # wait (they are no kernel's output), the row after it, then no memory until the stores.
    # SUMS: y is a reducing kernel's fp32 sums, finished here as ``finish_last`` would (the
    # op's bias ``yb`` added, rounded to the rows' dtype); CLEAN: and left zero (a workspace);
    # RMS: Llama's RMS norm (``reference.add_norm``) in place of the layer norm; LATE: the
    # successor started after the last store (``norm_launch``), not right after the wait
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < N
    w = tl.load(w_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_B:
        nb = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    if HAS_YB:
        yb = tl.load(yb_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wait_inputs(PDL, LATE)
    y = tl.load(y_ptr + row * stride_y + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(r_ptr + row * stride_r + offs, mask=mask, other=0.0)
    if SUMS:
        if HAS_YB:
            y += yb
        y = y.to(h_ptr.dtype.element_ty).to(tl.float32)  # the op's output, as it was rounded
        if CLEAN:
            tl.store(y_ptr + row * stride_y + offs, tl.zeros([BLOCK], dtype=tl.float32),
                     mask=mask)
    # the sum rounded to the rows' dtype, then normalised: what the graph computed
    h = (r.to(tl.float32) + y).to(h_ptr.dtype.element_ty)
    tl.store(h_ptr + row * stride_h + offs, h, mask=mask)
    hf = h.to(tl.float32)
    if RMS:
        # h times the reciprocal root of its mean square, rounded to the rows' dtype, then
        # times the weight, rounded again: Llama's module, op for op
        scaled = hf * (1.0 / tl.sqrt(tl.sum(hf * hf, 0) / N + eps))
        out = scaled.to(n_ptr.dtype.element_ty).to(tl.float32) * w
    else:
        dev = tl.where(mask, hf - tl.sum(hf, 0) / N, 0.0)
        out = dev * (1.0 / tl.sqrt(tl.sum(dev * dev, 0) / N + eps)) * w
        if HAS_B:
            out += nb
    tl.store(n_ptr + row * stride_n + offs, out.to(n_ptr.dtype.element_ty), mask=mask)
    if LATE:
        start_dependents(PDL)


def add_norm(y: torch.Tensor, residual: torch.Tensor, norm_w: torch.Tensor,
             norm_b: torch.Tensor | None, eps: float,
             rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``reference.add_norm`` in one launch: y (any shape with residual's rows of d) and
    residual [..., d] -> (h = residual + y, layer_norm(h) over d with ``norm_w`` and
    ``norm_b``, or with ``rms`` Llama's RMS norm with ``norm_w``), both shaped and typed as
    residual. One program a row holds the row in registers (two-pass statistics from
    registers, no cancellation)."""
    check_dtype("add_norm", y, residual, norm_w, norm_b)
    d = residual.shape[-1]
    if y.numel() != residual.numel() or y.dtype != residual.dtype:
        raise ValueError(f"add_norm: y must be {residual.dtype} with {residual.numel()} values "
                         f"(the residual's), got {y.dtype} {tuple(y.shape)}")
    rows, res = y.reshape(-1, d).contiguous(), residual.reshape(-1, d).contiguous()
    return _launch_add_norm(rows, None, res, norm_w.contiguous(), norm_b, eps, residual.shape,
                            rms=rms)


def _launch_add_norm(rows, y_bias, res, w, norm_b, eps, shape, sums: bool = False,
                     clean: bool = False, rms: bool = False):
    if rms and norm_b is not None:
        raise ValueError("add_norm: an RMS norm takes no bias")
    h, normed = torch.empty_like(res), torch.empty_like(res)
    block = triton.next_power_of_2(res.shape[1])
    _add_norm_kernel[(res.shape[0],)](
        rows, w if y_bias is None else y_bias, res, w,
        w if norm_b is None else norm_b.contiguous(), h,
        normed, res.shape[1], float(eps),
        rows.stride(0), res.stride(0), h.stride(0), normed.stride(0),
        HAS_B=norm_b is not None, BLOCK=block, SUMS=sums, HAS_YB=y_bias is not None,
        CLEAN=clean, RMS=rms, num_warps=min(16, max(1, block // 256)),
        **norm_launch_meta(ADD_NORM_PDL))
    return h.reshape(shape), normed.reshape(shape)


def add_norm_sums(sums: torch.Tensor, bias: torch.Tensor | None, residual: torch.Tensor,
                  norm_w: torch.Tensor, norm_b: torch.Tensor | None, eps: float,
                  rms: bool = False, *, clean: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``add_norm`` of a reducing kernel's unfinished output (``DEJAVU_NORM_FINISH=sums``):
    sums [R, d] fp32 (row stride free, columns contiguous), the op's ``bias`` [d] or None ->
    (h = residual + round(sums + bias), layer_norm(h), or with ``rms`` Llama's RMS norm),
    shaped and typed as residual [..., d]. ``clean``: the sums are left zero (a workspace kept
    zero between calls)."""
    check_dtype("add_norm", bias, residual, norm_w, norm_b)
    d = residual.shape[-1]
    if sums.dtype != torch.float32 or sums.dim() != 2 or sums.shape[1] != d \
            or sums.shape[0] * d != residual.numel() or sums.stride(1) != 1:
        raise ValueError(f"add_norm_sums: the sums must be fp32 [{residual.numel() // d}, {d}] "
                         f"with contiguous columns, got {sums.dtype} {tuple(sums.shape)}")
    res = residual.reshape(-1, d).contiguous()
    y_bias = None if bias is None else bias.contiguous()
    return _launch_add_norm(sums, y_bias, res, norm_w.contiguous(), norm_b, eps,
                            residual.shape, sums=True, clean=clean, rms=rms)


def norm_meta(d_out: int) -> dict:
    """``finish_norm_last``'s sizes for rows of ``d_out``: the tiles' statistics (at most one
    tile per ``COUNT_BLOCK`` columns) and the row, each in one load."""
    return {"BLOCK_T": triton.next_power_of_2(triton.cdiv(d_out, COUNT_BLOCK)),
            "BLOCK_ROW": triton.next_power_of_2(d_out)}


def norm_buffers(n_rows: int, d_out: int, device, workspace: torch.Tensor | None = None,
                 at: int = 0):
    """The [R, 2 * tiles] fp32 statistics and [R] int32 row counters of ``finish_norm_last``:
    ``norm_numel`` values of ``workspace`` from ``at`` (zero between calls: the kernel leaves
    the counters zero), or of a new zeroed buffer."""
    width = 2 * triton.cdiv(d_out, COUNT_BLOCK)
    need = norm_numel(n_rows, d_out)
    if workspace is None:
        buf, at = torch.zeros(need, device=device, dtype=torch.float32), 0
    elif workspace.numel() < at + need:
        raise ValueError(f"sparse op workspace must hold {at + need} fp32 values with the layer "
                         f"norm's (ops.norm_numel), got {workspace.numel()}")
    else:
        buf = workspace
    stats = buf[at: at + n_rows * width].view(n_rows, width)
    return stats, buf[at + n_rows * width: at + need].view(torch.int32)


def norm_args(norm, fin: torch.Tensor, parts: torch.Tensor, cnt: torch.Tensor,
              workspace: torch.Tensor | None = None, at: int = 0) -> tuple:
    """The norm arguments of a reducing kernel that finishes into ``fin`` [R, d_out] with
    ``finish_norm_last``: (residual [R, d_out], the normalised output [R, d_out], the norm's
    weight, its bias or None, statistics, row counters, eps) for ``norm`` = (residual, weight,
    bias or None, eps), the statistics and counters from ``norm_buffers`` (``workspace`` from
    ``at``, else a new buffer). Without a norm, the kernel's own ``fin``, sums (``parts``) and
    counters (``cnt``) stand in for tensors of the same dtypes: one tuning key for both."""
    if norm is None:
        return fin, fin, fin, None, parts, cnt, 0.0
    if is_rms(norm):  # (``norm_in_finish`` sends RMS norms to an add-norm launch)
        raise ValueError("finish_norm_last computes layer norms only, not an RMS norm")
    residual, norm_w, norm_b, eps = norm[:4]
    n_rows, d_out = fin.shape
    stats, rcnt = norm_buffers(n_rows, d_out, fin.device, workspace, at)
    return (residual.reshape(n_rows, d_out).contiguous(), torch.empty_like(fin), norm_w, norm_b,
            stats, rcnt, float(eps))


@triton.jit
def apply_act(h, ACT: tl.constexpr):
    """The MLP activation ``ACT`` (see ``ACT_CODES``) on fp32 ``h``."""
    if ACT == 0:
        return tl.maximum(h, 0.0)
    elif ACT == 1:
        return h / (1.0 + tl.exp(-h))
    elif ACT == 2:
        return 0.5 * h * (1.0 + tl.math.erf(h * 0.7071067811865476))
    else:
        z = 0.7978845608028654 * (h + 0.044715 * h * h * h)
        return h * (1.0 - 1.0 / (1.0 + tl.exp(2.0 * z)))  # 0.5 * h * (1 + tanh(z))


def tile_configs() -> list[triton.Config]:
    """Tile shapes swept by autotuning: (selected rows x columns) per program, warps, and
    ``TILES`` column slices summed in a loop per program.

    With one slice, each program handles one tile, no serial loop, so small selections still
    fill the GPU. Longer loops keep a 2-d accumulator and reduce it once, the design that took
    the down projection from 29 to 18 us (``reduce_configs``); they also add fewer atomics.
    Under the interpreter (CPU tests) one small config keeps runs short.
    """
    if INTERPRET or QUICK_TUNE:
        return [fixed_config(TILE_LOOP_FIXED)]
    one = [(16, 128, 4), (32, 128, 4), (64, 128, 4), (128, 128, 8), (16, 256, 4),
           (32, 256, 4), (64, 256, 8), (32, 64, 2), (64, 64, 4), (16, 512, 4), (32, 512, 8)]
    loops = [(16, 256, 4), (32, 256, 4), (16, 512, 4), (32, 512, 8)]
    return ([triton.Config({"BLOCK_N": n, "BLOCK_D": d, "TILES": 1}, num_warps=w)
             for n, d, w in one]
            + [triton.Config({"BLOCK_N": n, "BLOCK_D": d, "TILES": t}, num_warps=w)
               for n, d, w in loops for t in (2, 4, 8)])


def union_tile_configs() -> list[triton.Config]:
    """Tile shapes of the union kernels' ``tl.dot`` (both dimensions at least 16)."""
    if INTERPRET or QUICK_TUNE:
        return [fixed_config(UNION_TILE_FIXED)]
    shapes = [(16, 256, 4), (32, 128, 4), (32, 256, 4), (64, 128, 4), (64, 256, 8),
              (128, 128, 8), (64, 64, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_D": d}, num_warps=w) for n, d, w in shapes]


def union_reduce_configs() -> list[triton.Config]:
    """``union_tile_configs`` with ``TILES`` neuron tiles summed per program (see
    ``reduce_configs``)."""
    if INTERPRET or QUICK_TUNE:
        return [fixed_config(UNION_REDUCE_FIXED)]
    shapes = [(16, 128, 4), (32, 128, 4), (64, 128, 4), (32, 256, 4), (64, 64, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_D": d, "TILES": t}, num_warps=w)
            for n, d, w in shapes for t in (1, 2, 4, 8)]


@triton.jit
def dot_rows(a, b, acc, IEEE: tl.constexpr):
    """``acc + a @ b`` in fp32: half types on the tensor cores (their products are exact in
    fp32), fp32 operands in full fp32 (not TF32)."""
    if IEEE:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    return tl.dot(a, b, acc)


@triton.jit
def dot_split(h, b, acc, IEEE: tl.constexpr):
    """``acc + h @ b`` for fp32 ``h`` and ``b`` in a half type: ``h`` split into a high and a
    low part in ``b``'s dtype, two tensor-core products (the pair carries about twice the
    half type's mantissa, so ``h`` is not rounded to it; an fp16 ``h`` beyond fp16's range,
    65504, overflows here as it would in the dense model's fp16 MLP)."""
    if IEEE:
        return dot_rows(h, b, acc, True)
    high = h.to(b.dtype)
    low = (h - high.to(tl.float32)).to(b.dtype)
    return tl.dot(low, b, tl.dot(high, b, acc))


# at most this many fp32 accumulator values per thread in a row-storing kernel's configs (more
# spill registers)
VALUES_PER_THREAD = 128


def store_configs(rows: tuple[int, ...] = (4, 8, 16)) -> list[triton.Config]:
    """Configs of the kernels whose programs cover all of d for their ``rows`` (choices of
    ``BLOCK_N``) and store them (``stores_rows``, and the dense GEMV of ``kernels/dense.py``):
    rows per program, the slice of d per loop step, warps and pipeline depth, at most
    ``VALUES_PER_THREAD`` accumulator values a thread."""
    if INTERPRET or QUICK_TUNE:
        return [triton.Config({"BLOCK_N": 4, "BLOCK_D": 16 if INTERPRET else 512},
                              num_warps=1 if INTERPRET else 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_D": d}, num_warps=w, num_stages=st)
            for n in rows for d in (256, 512, 1024) for w in (4, 8)
            for st in ((3, 4) if w == 4 else (3,)) if n * d // (32 * w) <= VALUES_PER_THREAD]


def reduce_configs() -> list[triton.Config]:
    """Configs of the kernels whose tiles all add into the same outputs (the down and output
    projections): ``TILES`` neuron tiles per program are summed in a loop before one atomic
    add, so fewer atomics meet on each output than with one tile per program."""
    if INTERPRET or QUICK_TUNE:
        return [fixed_config(REDUCE_FIXED)]
    # BLOCK_D 512 (1 KB of each selected row) and loops of 8 tiles ran fastest in
    # examples/down_kernel_study.py on an H200. Loops of 16 are left out: at the Llama-3-8B
    # down projection at density 0.5 they ran 15-65% slower than loops of 8 for every tile
    # shape, in the decode step's form and the plain one (``--flags``, twelfth session), yet
    # the autotuner picked one in a bench run (26 against 22 us a layer). 128 x 64 (4 warps)
    # joined in the seventy-fourth session: on an H100 it was the fastest of four tiles of
    # OPT-13B's down projection at 0.1 leaving its sums unfinished (as the step does, which
    # also zeroes the pre-activations), 9.7 us in loops of 4 against 10.5 for 64 x 128 and
    # 11.3 for the shipped 16 x 512, and second only to the autotuned tile on Llama-3-8B's at
    # 0.5 with the finish (seventy-third session). Inside OPT-13B's step on an H100 it ran
    # level with 64 x 128 in three pairs (4.04 against 4.03 ms, seventy-fifth session)
    shapes = [(16, 128, 4), (32, 128, 4), (64, 128, 4), (128, 64, 4), (32, 256, 4),
              (64, 256, 8), (16, 512, 4), (32, 512, 4)]
    return [triton.Config({"BLOCK_N": n, "BLOCK_D": d, "TILES": t}, num_warps=w)
            for n, d, w in shapes for t in (1, 2, 4, 8)]


def column_configs() -> list[triton.Config]:
    """Configs of the output projection over the original ``[d_out, H * head_dim]`` layout
    (``heads._head_out_cols_kernel``): output rows per program, heads read per loop step
    (``UNROLL``, each a ``[BLOCK_M, head_dim]`` tile) and warps."""
    if INTERPRET or QUICK_TUNE:
        return [triton.Config({"BLOCK_M": 8 if INTERPRET else 16, "UNROLL": 2},
                              num_warps=1 if INTERPRET else 4)]
    # (8, 4, 8): the fastest of 84 tiles (4-32 rows, 1-8 heads a step, 4 or 8 warps, 2-4
    # stages; the stages changed nothing) on OPT-13B's output projection at head densities 0.1,
    # 0.5 and 0.8 on an H100, and (16, 4, 8) the second at 0.5 and 0.8 (BENCHMARKS.md,
    # sixty-first session)
    shapes = [(8, 1, 2), (8, 2, 2), (8, 4, 4), (16, 1, 4), (16, 2, 4), (16, 4, 4), (16, 2, 2),
              (32, 1, 4), (32, 2, 4), (32, 2, 8), (32, 4, 8), (64, 1, 8), (64, 2, 8),
              (8, 4, 8), (16, 4, 8)]
    return [triton.Config({"BLOCK_M": m, "UNROLL": u}, num_warps=w) for m, u, w in shapes]


def check_norm(name: str, x: torch.Tensor, d_out: int, residual, norm_w, norm_b, eps,
               rms: bool = False) -> None:
    """Raise a clear error for a residual or layer norm the fused finish cannot take: the
    residual in x's dtype with d_out values a row, the weight and bias [d_out], no bias for
    an RMS norm."""
    check_dtype(name, residual, norm_w, norm_b)
    if rms and norm_b is not None:
        raise ValueError(f"{name}: an RMS norm takes no bias")
    if residual.dtype != x.dtype or residual.shape[-1] != d_out \
            or residual.numel() != x.numel() // x.shape[-1] * d_out:
        raise ValueError(f"{name}: the residual must be {x.dtype} [..., {d_out}] with the input's "
                         f"rows, got {residual.dtype} {tuple(residual.shape)}")
    for t in (norm_w, norm_b):
        if t is not None and tuple(t.shape) != (d_out,):
            raise ValueError(f"{name}: the norm's weight and bias must be [{d_out}], got "
                             f"{tuple(t.shape)}")
    if not eps >= 0:
        raise ValueError(f"{name}: eps must be a non-negative number, got {eps}")


def check_dtype(name: str, *tensors) -> None:
    """Raise a clear error for a dtype the kernels do not handle (they accumulate in fp32)."""
    for t in tensors:
        if t is not None and t.dtype not in KERNEL_DTYPES:
            raise TypeError(f"{name}: the Triton kernel handles {KERNEL_DTYPES}, got {t.dtype}")


@triton.jit
def _finish_kernel(acc_ptr, b_ptr, out_ptr, N, stride_acc, stride_out,
                   HAS_B: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr,
                   LATE: tl.constexpr = False):
    # LATE: the successor started after the store (``norm_launch``), not right after the wait
    pid, row = tl.program_id(0), tl.program_id(1)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    if HAS_B:
        b = tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    wait_inputs(PDL, LATE)  # the accumulator is the previous kernel's
    v = tl.load(acc_ptr + row * stride_acc + offs, mask=mask, other=0.0)
    if HAS_B:
        v += b
    tl.store(out_ptr + row * stride_out + offs, v.to(out_ptr.dtype.element_ty), mask=mask)
    if LATE:
        start_dependents(PDL)


def _carve(buf: torch.Tensor, n_rows: int, d_out: int, before: int, dtype):
    """(earlier, sums, counters, output) of ``fused_targets`` laid out at the start of the fp32
    ``buf``: ``before`` values, the [R, d_out] sums, the [R, d_out / COUNT_BLOCK] counters
    (int32); the output is a new [R, d_out] tensor in ``dtype``."""
    start = before + n_rows * d_out
    counters = n_rows * triton.cdiv(d_out, COUNT_BLOCK)
    return (buf[:before], buf[before:start].view(n_rows, d_out),
            buf[start: start + counters].view(torch.int32),
            torch.empty(n_rows, d_out, device=buf.device, dtype=dtype))


def workspace_targets(workspace: torch.Tensor, n_rows: int, d_out: int, before: int, k: int,
                      dtype):
    """``fused_targets`` carved from ``workspace``, a buffer that is zero between calls (the
    lower pass attaches one to each sparse MLP and head-gathered output projection on CUDA;
    ``ops.workspace_numel`` sizes it), so no zero-fill launch runs: the reducing kernel leaves
    it zero again (its ``CLEAN``). Returns (earlier, sums, counters, output, the down kernel's
    [R, k] counters of the programs done reading each neuron tile; ``k`` 0 for none)."""
    need = before + n_rows * k + workspace_numel(n_rows, d_out)
    if workspace.dtype != torch.float32 or workspace.dim() != 1 or workspace.numel() < need \
            or workspace.stride(0) != 1:
        raise ValueError(f"sparse op workspace must be contiguous fp32 [>= {need}], got "
                         f"{workspace.dtype} {tuple(workspace.shape)}")
    clean = workspace[need - n_rows * k: need].view(torch.int32)
    return (*_carve(workspace, n_rows, d_out, before, dtype), clean)


def fused_targets(n_rows: int, d_out: int, before: int, dtype, device, zeroed: bool = True):
    """Targets of a reducing kernel that finishes its outputs itself (``finish_last``): one
    zeroed fp32 buffer (one launch) holding ``before`` values the op's earlier kernel adds
    into, the [R, d_out] sums, and the [R, d_out / COUNT_BLOCK] counters (int32, zero bits);
    and the op's output [R, d_out] in ``dtype``. Returns (earlier, sums, counters, output).
    With ``zeroed`` false the buffer is left as allocated (no launch): the earlier kernel
    stores its values and zeroes the sums and counters itself (``zero_share``)."""
    size = before + workspace_numel(n_rows, d_out)
    buf = (torch.zeros if zeroed else torch.empty)(size, device=device, dtype=torch.float32)
    return _carve(buf, n_rows, d_out, before, dtype)


@triton.jit
def zero_share(ptr, count, BLOCK: tl.constexpr):
    """Zero this program's share of ``count`` fp32 values at ``ptr``, the programs of the
    launch taking consecutive equal shares: a kernel clearing the buffers the op's next kernel
    adds into, in place of a fill launch before it."""
    pid = (tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)) * tl.num_programs(2) \
        + tl.program_id(2)
    programs = tl.num_programs(0) * tl.num_programs(1) * tl.num_programs(2)
    share = tl.cdiv(count, programs)
    end = tl.minimum(pid * share + share, count)
    for start in range(pid * share, end, BLOCK):
        offs = start + tl.arange(0, BLOCK)
        tl.store(ptr + offs, tl.zeros([BLOCK], dtype=tl.float32), mask=offs < end)


def fuses_finish(det: bool, shared_ids: bool) -> bool:
    """Whether a reducing kernel finishes its outputs itself: with atomics and per-row ids (the
    union kernels and deterministic mode launch ``finish`` after)."""
    return not det and not shared_ids


def finish(acc: torch.Tensor, bias: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """``(acc + bias).to(dtype)`` in one launch: acc [R, N] fp32 (the atomics' target), bias [N]
    or None. Each launch in a decode step costs a few microseconds of GPU time however little
    it does, so the bias and the cast share one."""
    if bias is None and dtype == acc.dtype:
        return acc
    rows, n = acc.shape
    out = torch.empty(rows, n, dtype=dtype, device=acc.device)
    block = min(1024, triton.next_power_of_2(n))
    _finish_kernel[(triton.cdiv(n, block), rows)](
        acc, bias if bias is not None else acc, out, n, acc.stride(0), out.stride(0),
        HAS_B=bias is not None, BLOCK=block, num_warps=4, **norm_launch_meta(FINISH_PDL))
    return out
