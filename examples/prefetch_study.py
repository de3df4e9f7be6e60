"""The sparse MLP with and without the up kernel prefetching the down kernel's rows into L2.

Inside the decode step the down kernel is the slowest gathered projection per byte (OPT-13B at
MLP density 0.1: 14.5 us a layer for 21 MB, 1.5 TB/s; BENCHMARKS.md), and it reads the rows of
the very neurons the up kernel has just read. ``DEJAVU_PREFETCH`` (``triton_common``) has the
up kernel's programs ask L2 for those rows as they finish. This study times the whole MLP as
the kernel sweep does (``dejavu bench --blocks mlp``: a CUDA graph over 8 layers' weights, a
workspace kept zero, the shipped tiles of this GPU) at each prefetch level, the levels in turn
and then in reverse, so that drift over the run does not pass for a difference:

    TRITON_INTERPRET=0 python examples/prefetch_study.py --models opt-13b llama-3-8b   # CUDA

Prints one line per model, density and level (median us of the two passes, GB/s on the
weights' bytes) and, with ``--json``, writes them.
"""
from __future__ import annotations

import argparse
import json
import os

import torch
from dejavu_compile.kernels import ops, sparse_mlp, tuning
from dejavu_compile.kernels.triton_common import PREFETCH_ENV, PREFETCH_LEVELS

from dejavu_compile import bench

DENSITIES = (0.1, 0.25, 0.5)


def study(name: str, densities, levels, dtype=torch.float16) -> list[dict]:
    """Rows of ``{model, density, k, level, us, us_each, gbs}`` for the sparse MLP of model
    ``name`` at each density and prefetch level."""
    cfg = bench.shape_configs()[name]
    act = "relu" if cfg.model_type == "opt" else "silu"
    sets, d, n, gated = bench._mlp_weights(cfg, dtype)
    x = torch.randn(1, 1, d, device="cuda", dtype=dtype)
    esize = torch.finfo(dtype).bits // 8
    rows = []
    for density in densities:
        k, idx = bench.random_ids(n, density)
        nbytes = k * (3 if gated else 2) * d * esize
        workspace = torch.zeros(ops.workspace_numel(1, d, k, gated), device="cuda")

        def mlp(i, idx=idx, workspace=workspace):
            w1, w_up, w2_t = sets[i]
            return sparse_mlp.sparse_mlp(x, idx, w1, None, w_up, w2_t, None, act,
                                         workspace=workspace)

        times: dict[str, list[float]] = {level: [] for level in levels}
        for level in list(levels) + list(reversed(levels)):
            os.environ[PREFETCH_ENV] = level
            times[level].append(bench._time_layers(mlp, bench.LAYERS)[0] * 1e3)
        for level in levels:
            us = sorted(times[level])[len(times[level]) // 2]
            rows.append({"model": name, "density": density, "k": k, "level": int(level),
                         "us": us, "us_each": times[level],
                         "gbs": nbytes / (us * 1e-6) / 1e9})
            print(f"{name} density {density} ({k} neurons) prefetch {level}: {us:.2f} us "
                  f"({', '.join(f'{t:.2f}' for t in times[level])}), "
                  f"{rows[-1]['gbs']:.0f} GB/s", flush=True)
    os.environ.pop(PREFETCH_ENV, None)
    return rows


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=["opt-13b", "llama-3-8b"],
                   choices=sorted(bench.shape_configs()))
    p.add_argument("--densities", nargs="+", type=float, default=list(DENSITIES))
    p.add_argument("--levels", nargs="+", default=list(PREFETCH_LEVELS), choices=PREFETCH_LEVELS)
    p.add_argument("--json", help="write the rows here")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("prefetch_study needs a CUDA GPU (the prefetch is inline PTX)")
    bench.check_densities(args.densities)
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: {tuning.seed_shipped(gpu)} shipped tuning keys", flush=True)
    rows = [r for name in args.models for r in study(name, args.densities, args.levels)]
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"gpu": gpu, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
