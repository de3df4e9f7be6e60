"""Variants of the transposed gathered GEMV (the down and output projections) timed on a GPU.

``out[o] = sum_n relu(pre[n]) * W[ids[n], o]``, W [N, d_out] fp16 row-major (a selected
row contiguous), against the package's ``_down_kernel`` as autotuned. Two variants keep the
products in a 2-d accumulator and reduce over rows once per program (the package's kernel
reduced once per tile until this study): ``acc2d`` unrolls its tiles, ``loop`` runs them in a
loop that Triton software-pipelines. Prints the 12 fastest of each shape with GB/s on the
bytes read. About 3 minutes per shape on an H200 (compiling each config):

    python examples/down_kernel_study.py            # needs a CUDA GPU

``--flags`` times the package's own ``_down_kernel`` on the Llama-3-8B down projection at
density 0.5 (``--shape opt``: OPT-13B's at 0.1) as the decode step runs it (gated with SiLU,
or ReLU with biases; zeroing the pre-activations it read, leaving its sums to the add-norm
launch after it) against the form that finishes its output and plainer forms,
over a grid of fixed configs (``--tiles``: others, beyond the autotuner's candidates), and
the whole op (up and down kernels) against its up kernel: what the step's extra work costs,
and whether the autotuned tile is the best one for it.
"""
import argparse
import itertools

import torch
import triton
import triton.language as tl
from dejavu_compile.kernels import sparse_mlp as sm

from dejavu_compile.bench import bucket_ids, graph_bench


@triton.jit
def _v_acc2d(pre_ptr, idx_ptr, w_ptr, out_ptr, DOUT, K, stride_w,
             BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr, TILES: tl.constexpr,
             EVICT: tl.constexpr):
    pid_n, pid_o = tl.program_id(0), tl.program_id(1)
    offs_o = pid_o * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_o = offs_o < DOUT
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for t in tl.static_range(TILES):
        offs_n = (pid_n * TILES + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < K
        n = tl.load(idx_ptr + offs_n, mask=mask_n, other=-1).to(tl.int64)
        valid = n >= 0
        if EVICT:
            w = tl.load(w_ptr + n[:, None] * stride_w + offs_o[None, :],
                        mask=valid[:, None] & mask_o[None, :], other=0.0,
                        eviction_policy="evict_first")
        else:
            w = tl.load(w_ptr + n[:, None] * stride_w + offs_o[None, :],
                        mask=valid[:, None] & mask_o[None, :], other=0.0)
        h = tl.maximum(tl.load(pre_ptr + offs_n, mask=mask_n, other=0.0), 0.0)
        acc += w.to(tl.float32) * h[:, None]
    tl.atomic_add(out_ptr + offs_o, tl.sum(acc, 0), mask=mask_o, sem="relaxed")

@triton.jit
def _v_loop(pre_ptr, idx_ptr, w_ptr, out_ptr, DOUT, K, stride_w, PER,
            BLOCK_N: tl.constexpr, BLOCK_D: tl.constexpr):
    pid_n, pid_o = tl.program_id(0), tl.program_id(1)
    offs_o = pid_o * BLOCK_D + tl.arange(0, BLOCK_D)
    mask_o = offs_o < DOUT
    acc = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    for t in range(0, PER):
        offs_n = (pid_n * PER + t) * BLOCK_N + tl.arange(0, BLOCK_N)
        mask_n = offs_n < K
        n = tl.load(idx_ptr + offs_n, mask=mask_n, other=-1).to(tl.int64)
        w = tl.load(w_ptr + n[:, None] * stride_w + offs_o[None, :],
                    mask=(n >= 0)[:, None] & mask_o[None, :], other=0.0)
        h = tl.maximum(tl.load(pre_ptr + offs_n, mask=mask_n, other=0.0), 0.0)
        acc += w.to(tl.float32) * h[:, None]
    tl.atomic_add(out_ptr + offs_o, tl.sum(acc, 0), mask=mask_o, sem="relaxed")

LAYERS = 8  # weight sets per timing, read in turn: more bytes than the L2 holds


def bench(fn):
    def body():
        for i in range(LAYERS):
            fn(i)
    return graph_bench(body, rep=100) / LAYERS




SHAPES = [("llama down .5", 14336, 7168, 4096), ("llama down .1", 14336, 1434, 4096),
          ("opt down .1", 20480, 2048, 5120), ("opt out .5", 5120, 2560, 5120),
          ("llama out .5", 4096, 2048, 4096)]
ACC2D = [c for c in itertools.product((16, 32, 64), (128, 256, 512), (2, 4, 8, 16), (4, 8), (0, 1))
         if c[0] * c[1] * c[2] <= 32 * 512 * 8 and c[0] * c[1] <= 16384 and (not c[4] or c[1] == 256)]
LOOP = list(itertools.product((16, 32), (256, 512), (8, 16, 32), (4, 8)))


def study(name: str, n: int, k: int, dout: int) -> None:
    ws = [torch.randn(n, dout, device="cuda", dtype=torch.float16) for _ in range(LAYERS)]
    ids = torch.randperm(n, device="cuda")[:k].sort().values
    pre = torch.randn(1, 1, k, device="cuda")
    out = torch.zeros(1, 1, dout, device="cuda")
    ref = torch.relu(pre.view(k)) @ ws[0][ids].float()
    res = [(bench(lambda i: sm._launch_down(pre, ids.view(1, k), None, ws[i], out, "relu",
                                            False, False)),
            "current autotuned", str(sm._down_kernel.best_config))]
    for bn, bd, tiles, warps, ev in ACC2D:
        grid = (triton.cdiv(k, bn * tiles), triton.cdiv(dout, bd))

        def acc2d(i, bn=bn, bd=bd, tiles=tiles, warps=warps, ev=ev, grid=grid):
            _v_acc2d[grid](pre, ids, ws[i], out, dout, k, dout, BLOCK_N=bn, BLOCK_D=bd,
                           TILES=tiles, EVICT=ev, num_warps=warps)

        out.zero_()
        acc2d(0)
        err = ((out.view(-1) - ref).abs().max() / ref.abs().max()).item()
        res.append((bench(acc2d), f"acc2d bn{bn} bd{bd} t{tiles} w{warps} ev{ev}",
                    f"err {err:.1e}"))
    for bn, bd, per, warps in LOOP:
        grid = (triton.cdiv(k, bn * per), triton.cdiv(dout, bd))

        def loop(i, bn=bn, bd=bd, per=per, warps=warps, grid=grid):
            _v_loop[grid](pre, ids, ws[i], out, dout, k, dout, per, BLOCK_N=bn, BLOCK_D=bd,
                          num_warps=warps)

        res.append((bench(loop), f"loop bn{bn} bd{bd} per{per} w{warps}", ""))
    gb = k * dout * 2 / 1e9
    print(f"== {name}: k={k} dout={dout}, {gb * 1e3:.1f} MB", flush=True)
    res.sort()
    for t, what, extra in [r for r in res if r[1].startswith("current")] + res[:12]:
        print(f"   {t * 1e3:7.1f} us {gb / t * 1e3:6.0f} GB/s  {what} {extra}", flush=True)


def down_step(pre, ids, w2_t, b1, b2, act: str, workspace, clean: bool = True,
              plain: bool = False, finish: bool | None = None) -> torch.Tensor:
    """The package's down kernel as the decode step runs it on a workspace (its launcher,
    ``sparse_mlp._launch_down``; pin a config with ``tuning.pinned``), over ``pre`` [2, 1, k]
    (pre-activations; up values of a gated MLP, ``act`` silu) of one row's ``ids`` [1, k] and
    ``W2_t`` [N, d], with ``b1``/``b2`` (None for a gated MLP). ``clean``: the last program to
    read each tile of ``pre`` zeroes it; ``finish`` (by default as ``clean``): it finishes its
    output (returned, in W's dtype) and leaves the sums and counters zero, otherwise it leaves
    the fp32 sums (returned) for a kernel after it. The default decode step, whose add-norm
    launch finishes the sums (``DEJAVU_NORM_FINISH`` "sums"), cleans and does not finish.
    ``plain``: ReLU, no gate, no biases."""
    from dejavu_compile.kernels import triton_common as tc

    finish = clean if finish is None else finish
    (k, d), gated = (ids.shape[1], w2_t.shape[1]), act == "silu"
    _, sums, cnt, fin, cl = tc.workspace_targets(workspace, 1, d, (1 + gated) * k, k,
                                                 w2_t.dtype)
    bias = not gated and not plain
    sm._launch_down(pre, ids, b1 if bias else None, w2_t, sums[None], "relu" if plain else act,
                    gated and not plain, False, fin=fin, b2=b2 if bias and finish else None,
                    cnt=cnt, clean=cl if clean else None, finish=finish)
    return fin if finish else sums


# the last two: the fastest on OPT-13B's shape in the seventy-third and seventy-fourth
# sessions (H100, BENCHMARKS.md), 128 x 64 not among the autotuner's candidates until then
FLAG_CONFIGS = [(16, 512, 16, 4), (16, 512, 8, 4), (16, 512, 4, 4), (32, 512, 8, 8),
                (32, 512, 4, 4), (32, 256, 8, 4), (64, 256, 8, 8), (64, 128, 8, 4),
                (32, 128, 16, 4), (16, 256, 16, 4), (16, 1024, 8, 8), (16, 1024, 4, 4),
                (32, 128, 4, 4), (16, 512, 4, 8), (16, 256, 4, 4), (32, 256, 4, 8),
                (64, 128, 4, 4), (128, 64, 4, 4)]


# the decode step's sparse MLP at issue 4's operating points: (units, MLP density, d, gated
# with SiLU or ReLU with biases); the step's selector keeps 64 and 13 of each 128 units
FLAG_SHAPES = {"llama": (14336, 0.5, 4096, True), "opt": (20480, 0.1, 5120, False)}


def tile(text: str) -> tuple[int, int, int, int]:
    """A fixed config given as ``NxDxTxW``: BLOCK_N, BLOCK_D, TILES and warps, each a power of
    two (``--tiles``)."""
    parts = text.lower().split("x")
    try:
        values = tuple(int(v) for v in parts)
    except ValueError:
        values = ()
    if len(values) != 4 or any(v < 1 or v & (v - 1) for v in values):
        raise argparse.ArgumentTypeError(
            f"{text!r}: a tile is BLOCK_N x BLOCK_D x TILES x warps, four powers of two "
            f"joined by 'x' (16x512x4x4)")
    return values


def flags_study(shape: str = "llama", step_only: bool = False, configs=None) -> None:
    """The package's down kernel with the decode step's flags, and the whole sparse MLP;
    ``step_only``: the down kernel in the step's form only, not the plainer forms too;
    ``configs``: the fixed configs to time (``(BLOCK_N, BLOCK_D, TILES, warps)``; default
    ``FLAG_CONFIGS``)."""
    from dejavu_compile.kernels import ops, tuning

    n, density, d, gated = FLAG_SHAPES[shape]
    act = "silu" if gated else "relu"
    w1s = [torch.randn(n, d, device="cuda", dtype=torch.float16) / 64 for _ in range(LAYERS)]
    # a plain MLP has no up projection: its up kernel reads W1 in both places
    wus = [torch.randn(n, d, device="cuda", dtype=torch.float16) / 64
           for _ in range(LAYERS)] if gated else w1s
    w2s = [torch.randn(n, d, device="cuda", dtype=torch.float16) / 64 for _ in range(LAYERS)]
    b1 = None if gated else torch.randn(n, device="cuda", dtype=torch.float16)
    b2 = None if gated else torch.randn(d, device="cuda", dtype=torch.float16)
    # the same count from every bucket of 128 neurons, as the bucketed selector picks them
    k, ids = bucket_ids(n, density)
    ids = ids.view(1, k)
    x = torch.randn(1, d, device="cuda", dtype=torch.float16)
    ws = torch.zeros(ops.workspace_numel(1, d, k, gated=True), device="cuda")
    gb, n_up = k * d * 2 / 1e9, 2 if gated else 1
    full = bench(lambda i: sm.sparse_mlp(x, ids, w1s[i], b1, wus[i] if gated else None, w2s[i],
                                         b2, act, workspace=ws))
    print(f"== {shape}: k={k} of {n}, d={d}; whole sparse MLP (up + down, workspace): "
          f"{full * 1e3:.1f} us, {(n_up + 1) * gb / full * 1e3:.0f} GB/s", flush=True)
    pre = torch.randn(2, 1, k, device="cuda")
    up = bench(lambda i: sm._launch_up(x, ids, w1s[i], wus[i], pre[0],
                                       pre[1] if gated else pre[0], pre[None], gated, False))
    print(f"   up kernel alone: {up * 1e3:.1f} us, {n_up * gb / up * 1e3:.0f} GB/s "
          f"({sm._up_kernel.best_config})", flush=True)

    def step_form(i, clean=True, plain=False, finish=None):
        down_step(pre, ids, w2s[i], b1, b2, act, ws, clean=clean, plain=plain, finish=finish)

    what = "gated, SiLU" if gated else "ReLU, biases"
    # the first the default step's: the add-norm launch after it finishes the sums; before the
    # seventy-fourth session the study's first (and --step-only's) form was the finishing one
    forms = [(f"step form ({what}, clean, sums left to the add-norm)",
              dict(clean=True, finish=False)),
             (f"{what}, finish, clean", dict(clean=True)),
             (f"{what}, no finish or clean", dict(clean=False)),
             ("ReLU, no gate, bias, finish or clean", dict(clean=False, plain=True))]
    for name, kw in forms[:1] if step_only else forms:
        auto = bench(lambda i, kw=kw: step_form(i, **kw))
        print(f"-- down kernel, {name}: autotuned {auto * 1e3:.1f} us "
              f"{gb / auto * 1e3:.0f} GB/s ({sm._down_kernel.best_config})", flush=True)
        for bn, bd, tiles, warps in configs or FLAG_CONFIGS:
            cfg = triton.Config({"BLOCK_N": bn, "BLOCK_D": bd, "TILES": tiles},
                                num_warps=warps, num_stages=3)
            with tuning.pinned("sparse_mlp._down_kernel", cfg):
                t = bench(lambda i, kw=kw: step_form(i, **kw))
            print(f"   {t * 1e3:7.1f} us {gb / t * 1e3:6.0f} GB/s  bn{bn} bd{bd} t{tiles} "
                  f"w{warps}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--flags", action="store_true",
                        help="the package's down kernel in the decode step's form")
    parser.add_argument("--shape", choices=sorted(FLAG_SHAPES), default="llama",
                        help="with --flags: Llama-3-8B at MLP density 0.5 or OPT-13B at 0.1")
    parser.add_argument("--step-only", action="store_true",
                        help="with --flags: the down kernel in the step's form only")
    parser.add_argument("--tiles", nargs="+", type=tile, metavar="NxDxTxW",
                        help="with --flags: time these fixed configs (BLOCK_N x BLOCK_D x "
                             "TILES x warps, any, not only the autotuner's candidates) instead "
                             "of the study's own 18")
    args = parser.parse_args(argv)
    if args.tiles and not args.flags:
        parser.error("--tiles goes with --flags")
    torch.manual_seed(0)
    if args.flags:
        flags_study(args.shape, args.step_only, args.tiles)
        return
    for shape in SHAPES:
        study(*shape)


if __name__ == "__main__":
    main()
