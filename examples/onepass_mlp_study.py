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
- ``onepass``: ``_onepass_kernel`` then ``add_norm_sums``, over a grid of tiles.

Both read 8 layers' weights in turn (more than the L2 holds) in one CUDA graph. Prints each
form's time with GB/s on the weight bytes read, and its largest error against the op's
output. About a minute per shape (compiling each config):

    python examples/onepass_mlp_study.py            # needs a CUDA GPU

Measured on an H100 (fifty-sixth session, BENCHMARKS.md): the one launch is slower on both
shapes, at its best tile 29.7 against the op's 24.6 us on OPT-13B's (42.6 MB) and 72.5
against 67.1 on Llama-3-8B's (176 MB), so the package keeps its two kernels. Why was not
measured. Unlike the op's, each program here reads its rows over all of d in one loop, the
grid has fewer programs than either of the op's, and every program adds into every output
with atomics.
"""
import argparse
import itertools

import torch
import triton
import triton.language as tl
from dejavu_compile.kernels import ops
from dejavu_compile.kernels import sparse_mlp as sm
from dejavu_compile.kernels import triton_common as tc

from dejavu_compile.bench import _time_layers


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


LAYERS = 8  # weight sets per timing, read in turn: more bytes than the L2 holds


def bench(fn) -> tuple[float, float, float]:
    """Median and 20/80 percentiles (ms) of ``fn(i)``, over ``LAYERS`` weight sets."""
    return _time_layers(fn, LAYERS)


def _line(q, gb: float, what: str, extra: str = "") -> str:
    t, lo, hi = (v * 1e3 for v in q)
    return f"   {t:7.1f} us ({lo:.1f}-{hi:.1f}) {gb / t * 1e6:6.0f} GB/s  {what} {extra}"


# issue 4's operating points: (units, selected per bucket of 128, d, gated with SiLU or ReLU
# with biases), as examples/down_kernel_study.py's
SHAPES = {"opt": (20480, 13, 5120, False), "llama": (14336, 64, 4096, True)}
# (BLOCK_N, BLOCK_D, BLOCK_O, warps, stages): 20 tiles
CONFIGS = [c for c in itertools.product((8, 16, 32), (256, 512), (512, 1024), (4, 8), (3,))
           if c[0] * max(c[1], c[2]) <= 16384]


def study(shape: str, configs=CONFIGS) -> None:
    n, per_bucket, d, gated = SHAPES[shape]
    act = "silu" if gated else "relu"
    dev, dt = "cuda", torch.float16
    w1s = [torch.randn(n, d, device=dev, dtype=dt) / 64 for _ in range(LAYERS)]
    wus = [torch.randn(n, d, device=dev, dtype=dt) / 64 for _ in range(LAYERS)] if gated else None
    w2s = [torch.randn(n, d, device=dev, dtype=dt) / 64 for _ in range(LAYERS)]
    b1 = None if gated else torch.randn(n, device=dev, dtype=dt)
    b2 = None if gated else torch.randn(d, device=dev, dtype=dt)
    ids = torch.cat([b * 128 + torch.randperm(128, device=dev)[:per_bucket].sort().values
                     for b in range(n // 128)]).view(1, -1)
    k = ids.shape[1]
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
    for bn, bd, bo, warps, stages in configs:
        cfg = dict(block_n=bn, block_d=bd, block_o=bo, num_warps=warps, num_stages=stages)

        def onepass(i, cfg=cfg):
            onepass_sums(x, ids, w1s[i], b1, wus[i] if gated else None, w2s[i], act, sums, **cfg)
            return tc.add_norm_sums(sums, b2, *norm[:4], rms=gated, clean=True)

        try:
            got = onepass(0)[1].float()
            err = ((got - want).abs().max() / want.abs().max()).item()
            rows.append((bench(onepass), f"onepass bn{bn} bd{bd} bo{bo} w{warps} s{stages}",
                         f"err {err:.1e}"))
        except Exception as exc:  # a config the compiler refuses (shared memory, registers)
            print(f"   onepass bn{bn} bd{bd} bo{bo} w{warps} s{stages}: {type(exc).__name__}",
                  flush=True)
    rows.sort()
    for q, what, extra in rows[:12]:
        print(_line(q, gb, what, extra), flush=True)
    print(_line(bench(op), gb, "op again (after the tiles)"), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", nargs="+", choices=sorted(SHAPES), default=sorted(SHAPES))
    args = parser.parse_args()
    torch.manual_seed(0)
    for shape in args.shape:
        study(shape)


if __name__ == "__main__":
    main()
