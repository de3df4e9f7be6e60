"""The sparse MLP in one launch instead of two, timed on a GPU against the package's op.

In OPT-13B's decode step (MLP density 0.1) the up and down kernels took 9.5 and 12.9 us a
layer on an H200 (BENCHMARKS.md, forty-ninth session's breakdown) for 42 MB, about 44% of the
copy bandwidth, where a copy of that size reaches 80-84%. One launch instead of two would pay
one ramp and one tail. A selected neuron's down-projection row (``W2_t``, section 4.4's
layout) needs only that neuron's activation, so one program can finish a neuron tile's
pre-activations over all of d and at once add its products into every output:
``_onepass_kernel``, a program per tile of ``BLOCK_N`` selected neurons, the up loop over d
then the down loop over d_out, its products added into the fp32 sums with atomics. It leaves
the sums unfinished, as the step's down kernel does for the add-norm launch that follows it
(``DEJAVU_NORM_FINISH=sums``), so both forms are timed with that launch:

- ``op``: ``sparse_mlp.sparse_mlp`` on a workspace with the layer norm (the step's form: up
  kernel, down kernel, ``add_norm_sums``), autotuned;
- ``onepass``: ``_onepass_kernel`` then ``add_norm_sums``, over a grid of tiles;
- ``persistent``: ``_persistent_kernel`` then ``add_norm_sums``. The op's two kernels in one
  launch of a grid that the GPU holds at once (1-6 programs a multiprocessor): the
  programs share out the up kernel's tiles, meet at a barrier (a counter each adds itself
  into and waits on), and share out the down kernel's tiles. Each program loads its first
  down tile (weights and ids, which the first phase does not write) before it waits, so the
  barrier's wait overlaps a load, as the op's down kernel loads its first tile before its
  programmatic wait. One ramp and one tail for the tiles of both kernels.

All forms read 8 layers' weights in turn (more than the L2 holds) in one CUDA graph. Prints
each form's time with GB/s on the weight bytes read, and its largest error against the op's
output. About a minute per shape and form (compiling each config):

    python examples/onepass_mlp_study.py                     # needs a CUDA GPU
    python examples/onepass_mlp_study.py --shape opt --form persistent

Measured on an H100 (fifty-sixth session, BENCHMARKS.md): the one launch is slower on both
shapes, at its best tile 29.7 against the op's 24.6 us on OPT-13B's (42.6 MB) and 72.5
against 67.1 on Llama-3-8B's (176 MB), so the package keeps its two kernels. Why was not
measured. Unlike the op's, each program here reads its rows over all of d in one loop, the
grid has fewer programs than either of the op's, and every program adds into every output
with atomics. The persistent form is slower too, on an H100 (sixty-ninth session; OPT-13B's
shape only): 28.8 us at its best config (up tiles 16 x 256; down 8 x 512 in loops of 8, 4
warps, 4 programs a multiprocessor) against the op's 23.7 and 24.6 us timed before and after
it, and 29.6 us with the op's down tile (2 programs a multiprocessor). Fewer programs were
slower (1 a multiprocessor: 37.7 us and more); 3 or more of the op's 32 x 512 down tile do
not fit at once (registers), which ``resident_programs`` reports instead of launching a
barrier that would never open. Not run on Llama-3-8B's shape or on an H200.
"""
import argparse
import itertools

import torch
import triton
import triton.language as tl
from dejavu_compile.kernels import ops
from dejavu_compile.kernels import sparse_mlp as sm
from dejavu_compile.kernels import triton_common as tc

from dejavu_compile.bench import _time_layers, bucket_ids


@triton.jit
def _onepass_kernel(
    x_ptr, idx_ptr, w1_ptr, wup_ptr, b1_ptr, w2t_ptr, sums_ptr,
    D, DOUT, K,
    stride_w1, stride_wup, stride_w2,
    ACT: tl.constexpr, HAS_B1: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_O: tl.constexpr,
):
    """x [D]; idx [K] selected neurons; w1, w_up [N, D]; w2t [N, DOUT]; sums fp32 [DOUT]
    (zero before the call) += act(w1[idx] x + b1[idx]) [* w_up[idx] x] @ w2t[idx]."""
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    neurons = tl.load(idx_ptr + offs_n, mask=offs_n < K, other=-1).to(tl.int64)
    valid = neurons >= 0
    acc = tc.add_row_slices(tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32), x_ptr, w1_ptr,
                            neurons, valid, stride_w1, 0, D, BLOCK_D)
    h = tl.sum(acc, 1)
    if HAS_B1:
        h += tl.load(b1_ptr + neurons, mask=valid, other=0.0).to(tl.float32)
    h = tc.apply_act(h, ACT)
    if GATED:  # the up rows in a second pass over x (in L1 by now)
        acc_up = tc.add_row_slices(tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32), x_ptr,
                                   wup_ptr, neurons, valid, stride_wup, 0, D, BLOCK_D)
        h = h * tl.sum(acc_up, 1)
    h = tl.where(valid, h, 0.0)
    for o0 in range(0, DOUT, BLOCK_O):
        offs_o = o0 + tl.arange(0, BLOCK_O)
        mask_o = offs_o < DOUT
        w2 = tl.load(w2t_ptr + neurons[:, None] * stride_w2 + offs_o[None, :],
                     mask=valid[:, None] & mask_o[None, :], other=0.0)
        tl.atomic_add(sums_ptr + offs_o, tl.sum(w2.to(tl.float32) * h[:, None], 0), mask=mask_o,
                      sem="relaxed")


def onepass_sums(x, ids, w1, b1, w_up, w2_t, act: str, sums, block_n: int = 16,
                 block_d: int = 512, block_o: int = 512, num_warps: int = 4,
                 num_stages: int = 3) -> torch.Tensor:
    """``sums`` (fp32 [1, d_out], zero) plus the sparse MLP of one row ``x`` [1, d] over the
    neurons ``ids`` [1, k], without its output bias: ``_onepass_kernel``. Returns ``sums``."""
    if x.shape[0] != 1 or ids.shape[0] != 1:
        raise ValueError("onepass_sums takes one row and one id row")
    d, k, d_out = x.shape[1], ids.shape[1], w2_t.shape[1]
    gated = w_up is not None
    _onepass_kernel[(triton.cdiv(k, block_n),)](
        x, ids, w1, w_up if gated else w1, b1 if b1 is not None else w1, w2_t, sums,
        d, d_out, k,
        w1.stride(0), (w_up if gated else w1).stride(0), w2_t.stride(0),
        ACT=tc.ACT_CODES[act], HAS_B1=b1 is not None, GATED=gated,
        BLOCK_N=block_n, BLOCK_D=block_d, BLOCK_O=block_o, num_warps=num_warps,
        num_stages=num_stages)
    return sums


@triton.jit
def _down_block(acc, block, first, idx_ptr, w2t_ptr, pre_ptr, up_ptr, b1_ptr, offs_o, mask_o, K,
                stride_w2, ACT: tl.constexpr, HAS_B1: tl.constexpr, GATED: tl.constexpr,
                BLOCK_M: tl.constexpr, TILES: tl.constexpr):
    """``acc`` plus the down products of neuron block ``block`` (``TILES`` tiles of
    ``BLOCK_M``) from its tile ``first`` on, at the outputs ``offs_o``."""
    for t in range(first, TILES):
        offs_m = (block * TILES + t) * BLOCK_M + tl.arange(0, BLOCK_M)
        neurons, w2 = sm._down_tile(idx_ptr, w2t_ptr, offs_m, K, offs_o, mask_o, stride_w2, 1)
        acc = sm._down_add(acc, w2, neurons, pre_ptr, up_ptr, b1_ptr, offs_m, K, ACT, HAS_B1,
                           GATED)
    return acc


@triton.jit
def _persistent_kernel(
    x_ptr, idx_ptr, w1_ptr, wup_ptr, b1_ptr, w2t_ptr, pre_ptr, up_ptr, sums_ptr, bar_ptr,
    D, DOUT, K,
    stride_w1, stride_wup, stride_w2,
    ACT: tl.constexpr, HAS_B1: tl.constexpr, GATED: tl.constexpr,
    BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_O: tl.constexpr, TILES: tl.constexpr, PHASE: tl.constexpr,
):
    """x [D]; idx [K]; w1, w_up [N, D]; w2t [N, DOUT]; pre, up fp32 [K] and bar int32 [2]
    zero before the call and left zero; sums fp32 [DOUT] (zero before the call) += the sparse
    MLP less its output bias. The grid's programs all stay resident and share out the work of
    both kernels of the op: first the up kernel's items (``BLOCK_N`` neurons x ``BLOCK_D`` of
    d, added into ``pre`` and ``up``), then, after a barrier over the grid (a counter every
    program adds itself into and waits on), the down kernel's (``TILES`` x ``BLOCK_M`` neurons x
    ``BLOCK_O`` outputs, added into ``sums``). Each program loads its first down tile before it
    waits: only weights and ids, which the first phase does not write. ``PHASE`` 0: both
    phases and the barrier (the grid must fit on the GPU at once); 1 or 2: that phase alone,
    one launch after the other (the interpreter, which runs the programs in turn)."""
    pid, programs = tl.program_id(0), tl.num_programs(0)
    if PHASE != 2:
        slices = tl.cdiv(D, BLOCK_D)
        for item in range(pid, tl.cdiv(K, BLOCK_N) * slices, programs):
            offs_n = (item // slices) * BLOCK_N + tl.arange(0, BLOCK_N)
            offs_d = (item % slices) * BLOCK_D + tl.arange(0, BLOCK_D)
            mask_n, mask_d = offs_n < K, offs_d < D
            neurons = tl.load(idx_ptr + offs_n, mask=mask_n, other=-1).to(tl.int64)
            valid = neurons >= 0
            x = tl.load(x_ptr + offs_d, mask=mask_d, other=0.0).to(tl.float32)
            zero = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
            acc = tc.add_rows(zero, w1_ptr, neurons, valid, stride_w1, offs_d, mask_d, x)
            tl.atomic_add(pre_ptr + offs_n, tl.sum(acc, 1), mask=mask_n, sem="relaxed")
            if GATED:
                acc = tc.add_rows(zero, wup_ptr, neurons, valid, stride_wup, offs_d, mask_d, x)
                tl.atomic_add(up_ptr + offs_n, tl.sum(acc, 1), mask=mask_n, sem="relaxed")
    if PHASE != 1:
        outs = tl.cdiv(DOUT, BLOCK_O)
        items = tl.cdiv(K, BLOCK_M * TILES) * outs
        # this program's first down item, its first tile loaded before the barrier
        offs_o = (pid % outs) * BLOCK_O + tl.arange(0, BLOCK_O)
        mask_o = offs_o < DOUT
        offs_m = (pid // outs) * TILES * BLOCK_M + tl.arange(0, BLOCK_M)
        neurons, w2 = sm._down_tile(idx_ptr, w2t_ptr, offs_m, K, offs_o, mask_o, stride_w2, 1)
        if PHASE == 0:
            # every thread's atomics before the count (its release); the count's acquire puts
            # every program's before the loads of pre and up below
            tl.debug_barrier()
            arrived = tl.atomic_add(bar_ptr, 1, sem="acq_rel") + 1
            while arrived < programs:
                arrived = tl.atomic_add(bar_ptr, 0, sem="acquire")
            tl.debug_barrier()
        if pid < items:
            acc = sm._down_add(tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32), w2, neurons,
                               pre_ptr, up_ptr, b1_ptr, offs_m, K, ACT, HAS_B1, GATED)
            acc = _down_block(acc, pid // outs, 1, idx_ptr, w2t_ptr, pre_ptr, up_ptr, b1_ptr,
                              offs_o, mask_o, K, stride_w2, ACT, HAS_B1, GATED, BLOCK_M, TILES)
            tl.atomic_add(sums_ptr + offs_o, tl.sum(acc, 0), mask=mask_o, sem="relaxed")
        for item in range(pid + programs, items, programs):
            offs_o = (item % outs) * BLOCK_O + tl.arange(0, BLOCK_O)
            mask_o = offs_o < DOUT
            acc = _down_block(tl.zeros([BLOCK_M, BLOCK_O], dtype=tl.float32), item // outs, 0,
                              idx_ptr, w2t_ptr, pre_ptr, up_ptr, b1_ptr, offs_o, mask_o, K,
                              stride_w2, ACT, HAS_B1, GATED, BLOCK_M, TILES)
            tl.atomic_add(sums_ptr + offs_o, tl.sum(acc, 0), mask=mask_o, sem="relaxed")
        # the last program done reading pre and up zeroes them and the two counters
        tl.debug_barrier()
        if tl.atomic_add(bar_ptr + 1, 1, sem="acq_rel") == programs - 1:
            for k0 in range(0, K, 1024):
                offs_k = k0 + tl.arange(0, 1024)
                tl.store(pre_ptr + offs_k, tl.zeros([1024], dtype=tl.float32), mask=offs_k < K)
                if GATED:
                    tl.store(up_ptr + offs_k, tl.zeros([1024], dtype=tl.float32),
                             mask=offs_k < K)
            tl.atomic_xchg(bar_ptr, 0)
            tl.atomic_xchg(bar_ptr + 1, 0)


def resident_programs(kernel, device) -> int:
    """How many programs of the compiled ``kernel`` the GPU ``device`` holds at once: its
    multiprocessors times the fewest that one holds by warps, registers and shared memory."""
    kernel._init_handles()  # loads the binary: its register count
    props = torch.cuda.get_device_properties(device)
    warps = kernel.metadata.num_warps
    per_sm = min(props.max_threads_per_multi_processor // (32 * warps), 32)
    regs = max(kernel.n_regs, 1)
    # registers are allocated to a warp in units of 256
    per_sm = min(per_sm, props.regs_per_multiprocessor // (triton.cdiv(regs * 32, 256) * 256
                                                           * warps))
    shared = kernel.metadata.shared
    if shared:
        per_sm = min(per_sm, props.shared_memory_per_multiprocessor // (shared + 1024))
    return per_sm * props.multi_processor_count


def persistent_sums(x, ids, w1, b1, w_up, w2_t, act: str, sums, pre, bar, programs: int,
                    block_n: int = 16, block_d: int = 256, block_m: int = 32,
                    block_o: int = 512, tiles: int = 4, num_warps: int = 4,
                    num_stages: int = 3) -> torch.Tensor:
    """``sums`` (fp32 [1, d_out], zero) plus the sparse MLP of one row ``x`` [1, d] over the
    neurons ``ids`` [1, k], without its output bias, in one launch of ``programs`` resident
    programs (``_persistent_kernel``); ``pre`` fp32 [2, k] and ``bar`` int32 [2], zero, are
    left zero. Under the interpreter the two phases run as two launches. Raises ValueError
    where the GPU cannot hold ``programs`` at once (the barrier would never open)."""
    if x.shape[0] != 1 or ids.shape[0] != 1:
        raise ValueError("persistent_sums takes one row and one id row")
    d, k, d_out = x.shape[1], ids.shape[1], w2_t.shape[1]
    if w2_t.stride(1) != 1 or pre.shape != (2, k) or bar.shape != (2,) \
            or bar.dtype != torch.int32 or pre.dtype != torch.float32:
        raise ValueError("persistent_sums: w2_t needs contiguous rows, pre fp32 [2, k], "
                         "bar int32 [2]")
    gated = w_up is not None
    args = (x, ids, w1, w_up if gated else w1, b1 if b1 is not None else w1, w2_t, pre[0],
            pre[1], sums, bar, d, d_out, k, w1.stride(0), (w_up if gated else w1).stride(0),
            w2_t.stride(0))
    meta = dict(ACT=tc.ACT_CODES[act], HAS_B1=b1 is not None, GATED=gated, BLOCK_N=block_n,
                BLOCK_D=block_d, BLOCK_M=block_m, BLOCK_O=block_o, TILES=tiles,
                num_warps=num_warps, num_stages=num_stages)
    if tc.INTERPRET:
        for phase in (1, 2):
            _persistent_kernel[(programs,)](*args, PHASE=phase, **meta)
        return sums
    compiled = _persistent_kernel.warmup(*args, PHASE=0, grid=(programs,), **meta)
    most = resident_programs(compiled, x.device)
    if programs > most:
        raise ValueError(f"persistent_sums: {programs} programs, but the GPU holds {most} of "
                         "this config at once")
    _persistent_kernel[(programs,)](*args, PHASE=0, **meta)
    return sums


LAYERS = 8  # weight sets per timing, read in turn: more bytes than the L2 holds


def bench(fn) -> tuple[float, float, float]:
    """Median and 20/80 percentiles (ms) of ``fn(i)``, over ``LAYERS`` weight sets."""
    return _time_layers(fn, LAYERS)


def _line(q, gb: float, what: str, extra: str = "") -> str:
    t, lo, hi = (v * 1e3 for v in q)
    return f"   {t:7.1f} us ({lo:.1f}-{hi:.1f}) {gb / t * 1e6:6.0f} GB/s  {what} {extra}"


# issue 4's operating points: (units, MLP density, d, gated with SiLU or ReLU with biases), as
# examples/down_kernel_study.py's
SHAPES = {"opt": (20480, 0.1, 5120, False), "llama": (14336, 0.5, 4096, True)}
# (BLOCK_N, BLOCK_D, BLOCK_O, warps, stages): 20 tiles
CONFIGS = [c for c in itertools.product((8, 16, 32), (256, 512), (512, 1024), (4, 8), (3,))
           if c[0] * max(c[1], c[2]) <= 16384]
# the persistent form: (up item BLOCK_N x BLOCK_D, down item BLOCK_M x BLOCK_O x TILES, warps,
# programs per multiprocessor): the shipped up and down tiles of OPT-13B at MLP density 0.1
# on an H200 (16 x 256; 32 x 512 x 4) and their neighbours, 18 configs, then smaller down tiles
# at 2-6 programs a multiprocessor, the fastest on an H100 (sixty-ninth session, 16 x 256 with
# 8 x 512 x 8 at 4 a multiprocessor: 28.8 us against the op's 23.7)
PERSISTENT = [(n, d, m, o, t, w, per)
              for n, d in ((16, 256), (32, 256))
              for m, o, t in ((32, 512, 4), (16, 512, 4), (32, 256, 4))
              for w, per in ((4, 1), (4, 2), (8, 1))] + [
    (16, 256, 8, 512, 8, 4, 4), (16, 256, 16, 256, 8, 4, 4), (16, 256, 16, 256, 8, 4, 6),
    (16, 128, 16, 256, 8, 4, 4), (16, 256, 16, 256, 4, 4, 3), (16, 256, 16, 256, 8, 8, 2)]
FORMS = ("onepass", "persistent")


def study(shape: str, configs=CONFIGS, forms=FORMS, persistent=PERSISTENT) -> None:
    n, density, d, gated = SHAPES[shape]
    act = "silu" if gated else "relu"
    dev, dt = "cuda", torch.float16
    w1s = [torch.randn(n, d, device=dev, dtype=dt) / 64 for _ in range(LAYERS)]
    wus = [torch.randn(n, d, device=dev, dtype=dt) / 64 for _ in range(LAYERS)] if gated else None
    w2s = [torch.randn(n, d, device=dev, dtype=dt) / 64 for _ in range(LAYERS)]
    b1 = None if gated else torch.randn(n, device=dev, dtype=dt)
    b2 = None if gated else torch.randn(d, device=dev, dtype=dt)
    k, ids = bucket_ids(n, density, dev)
    ids = ids.view(1, k)
    x = torch.randn(1, d, device=dev, dtype=dt)
    res = torch.randn(1, d, device=dev, dtype=dt)
    nw = torch.randn(d, device=dev, dtype=dt)
    nb = None if gated else torch.randn(d, device=dev, dtype=dt)
    norm = (res, nw, nb, 1e-5, gated)
    ws = torch.zeros(ops.workspace_numel(1, d, k, gated) + ops.norm_numel(1, d), device=dev)
    sums = torch.zeros(1, d, device=dev)

    def op(i):
        return sm.sparse_mlp(x, ids, w1s[i], b1, wus[i] if gated else None, w2s[i], b2, act,
                             workspace=ws, norm=norm)

    want = op(0)[1].float()
    gb = (3 if gated else 2) * k * d * 2 / 1e9
    print(f"== {shape}: k={k} of {n}, d={d}, {gb * 1e3:.1f} MB of weights", flush=True)
    print(_line(bench(op), gb, "op (up, down, add_norm_sums)"), flush=True)
    rows = []

    def timed(what, fn):
        """Time the form ``fn`` beside the op, with its largest error against the op's output."""
        try:
            got = fn(0)[1].float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            rows.append((bench(fn), what, f"err {err:.1e}"))
        except Exception as exc:  # a config the compiler refuses (shared memory, registers),
            # or a persistent grid larger than the GPU holds at once
            print(f"   {what}: {type(exc).__name__}: {str(exc)[:120]}", flush=True)

    for bn, bd, bo, warps, stages in configs if "onepass" in forms else ():
        cfg = dict(block_n=bn, block_d=bd, block_o=bo, num_warps=warps, num_stages=stages)

        def onepass(i, cfg=cfg):
            onepass_sums(x, ids, w1s[i], b1, wus[i] if gated else None, w2s[i], act, sums, **cfg)
            return tc.add_norm_sums(sums, b2, *norm[:4], rms=gated, clean=True)

        timed(f"onepass bn{bn} bd{bd} bo{bo} w{warps} s{stages}", onepass)
    pre = torch.zeros(2, k, device=dev)
    bar = torch.zeros(2, device=dev, dtype=torch.int32)
    sms = torch.cuda.get_device_properties(dev).multi_processor_count
    for bn, bd, bm, bo, tiles, warps, per in persistent if "persistent" in forms else ():
        cfg = dict(block_n=bn, block_d=bd, block_m=bm, block_o=bo, tiles=tiles,
                   num_warps=warps)

        def persist(i, cfg=cfg, programs=per * sms):
            persistent_sums(x, ids, w1s[i], b1, wus[i] if gated else None, w2s[i], act, sums,
                            pre, bar, programs, **cfg)
            return tc.add_norm_sums(sums, b2, *norm[:4], rms=gated, clean=True)

        timed(f"persistent up {bn}x{bd} down {bm}x{bo}x{tiles} w{warps} {per}/SM", persist)
    rows.sort()
    for q, what, extra in rows[:12]:
        print(_line(q, gb, what, extra), flush=True)
    print(_line(bench(op), gb, "op again (after the tiles)"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    parser.add_argument("--form", nargs="+", choices=FORMS, default=list(FORMS),
                        help="the one-launch forms to time beside the op")
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in args.shape:
        study(shape, forms=args.form)


if __name__ == "__main__":
    main()
