"""Every candidate tile of one gathered kernel, timed as the kernel sweep times it.

The autotuner times each candidate alone, one call after an L2 flush; ``dejavu bench``'s kernel
sweep times the op as the decode step runs it, in a CUDA graph over 8 layers' weights. The
two can disagree: in the twenty-third session's sweeps the Llama-3-8B output projection took
11.8 us at density 0.8 and 19.6 us at 1.0, with the autotuner's choice at each. This study
pins each candidate of the named kernel in turn (``tuning.pinned``) and times the op in the
sweep's setting, beside cuBLAS dense and the autotuner's own choice, then writes the fastest
candidate per key in the form of ``kernels/tuned/*.json`` (``--json``), ready to merge into
the shipped file (``--ship JSON``, on any machine).

    python examples/tile_study.py --models opt-13b --kernel out --densities 0.8   # CUDA GPU

``--check`` runs each candidate once instead, synchronised and named first, without timing:
with ``CUDA_LAUNCH_BLOCKING=1`` the last tile printed is the one that faults. (The study of
``cols`` stopped with an illegal memory access as the autotuner tried the candidates on
Llama-3-8B's shape at head density 0.1, after OPT-13B's three densities, in three runs in the
sixty-fourth and sixty-sixth sessions; never with ``CUDA_LAUNCH_BLOCKING=1``. Its timings then
began on a stream that did not wait for the inputs; they now go through ``bench.graph_bench``,
which waits. BENCHMARKS.md.)

Kernels: ``up`` and ``down`` (the sparse MLP's two launches: the op is timed whole, the other
kernel at its autotuned tile), ``q`` (the head-gathered query projection), ``out`` (the output
projection, on its workspace) and ``cols`` (the output projection on the original layout,
option ``out_layout``: 15 candidates). About 30 candidates each otherwise; compiling them takes
most of a minute per density. ``mlp`` studies ``up`` and ``down`` in turn, then times the MLP
with each of the ``--pairs`` fastest tiles of one paired with each of the other's, both pinned,
and writes the fastest pair: a tile found with the other kernel autotuned need not be the best
beside another (OPT-13B's MLP at density 0.1 ran 17.9 us with a pair the autotuner chose, and
19.6 with the study's fastest down tile beside an autotuned up tile: BENCHMARKS.md,
twenty-fourth session).

``--step`` (with ``up``, ``down`` or ``mlp``) times the MLP as the default decode step runs it
instead of as the sweep does: the ids a bucketed selector keeps (the step's tuning keys:
OPT-13B's MLP at 0.1 keeps 2080 neurons, the sweep's 2048), OPT's biases, and the residual
add and norm after it, in the add-norm launch that finishes the down kernel's sums. The
sweep's form finishes them in the down kernel; on an H100 the down kernel's tiles ranked
differently in the two forms (BENCHMARKS.md, seventy-fourth session).
"""
from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch
import torch.nn.functional as F
from dejavu_compile.kernels import heads, ops, sparse_mlp, tuning
from triton.runtime.errors import OutOfResources

from dejavu_compile import bench

KERNELS = {"up": "sparse_mlp._up_kernel", "down": "sparse_mlp._down_kernel",
           "q": "heads._head_proj_kernel", "out": "heads._head_out_kernel",
           "cols": "heads._head_out_cols_kernel"}


def _case(cfg, kernel: str, density: float, dtype, step: bool = False):
    """``(op, dense, nbytes)``: the op of weight set ``i`` at ``density`` (the sweep's random
    ids and weights, ``bench.random_ids`` and the rest), cuBLAS dense on the same shape, and
    the bytes the op's weights take. ``step`` (the MLP's kernels only): the MLP as the
    default decode step runs it (``_step_mlp``)."""
    esize = torch.finfo(dtype).bits // 8
    if kernel in ("up", "down"):
        sets, d, n, gated = bench._mlp_weights(cfg, dtype)
        act = "silu" if gated else "relu"
        dev = sets[0][0].device
        x = torch.randn(1, 1, d, device=dev, dtype=dtype)
        if step:
            k, op, _ = _step_mlp(sets, x, n, gated, density, act)
        else:
            k, idx = bench.random_ids(n, density)
            workspace = torch.zeros(ops.workspace_numel(1, d, k, gated), device=dev)

            def op(i):
                w1, w_up, w2_t = sets[i]
                return sparse_mlp.sparse_mlp(x, idx, w1, None, w_up, w2_t, None, act,
                                             workspace=workspace)

        return op, bench._dense_mlp(sets, gated, x), k * (3 if gated else 2) * d * esize
    if step:
        raise ValueError(f"the step's form is the MLP's (up, down or mlp), not {kernel!r}'s")
    d = cfg.hidden_size
    n_heads, hd, x, attn, wq, wo_t, wo = bench.head_weights(cfg, dtype)
    k, idx = bench.random_ids(n_heads, density)
    if kernel == "q":
        return (lambda i: heads.sparse_head_proj(x, idx, wq[i], None, hd),
                lambda i: F.linear(x, wq[i]), k * hd * d * esize)
    if kernel == "cols":  # the Linear's own [d, H * hd] weight, read as its transposed view
        return (lambda i: heads.sparse_head_out(attn, idx, wo[i].t(), None, hd),
                lambda i: F.linear(attn, wo[i]), k * hd * d * esize)
    workspace = torch.zeros(ops.workspace_numel(1, d), device="cuda")
    return (lambda i: heads.sparse_head_out(attn, idx, wo_t[i], None, hd, workspace=workspace),
            lambda i: F.linear(attn, wo[i]), k * hd * d * esize)


def _step_mlp(sets, x, n: int, gated: bool, density: float, act: str):
    """``(k, op, reads)``: the sparse MLP of weight set ``i`` as the default decode step runs
    it at ``density``: the ids a bucketed selector keeps (``bench.bucket_ids``: OPT-13B's 0.1
    keeps 2080 of 20480, the step's tuning key, where the sweep's ``random_ids`` keeps 2048),
    OPT's biases, and the residual add and
    norm after it (a layer norm, or for a gated MLP an RMS norm), which the down kernel's
    unfinished sums feed (``DEJAVU_NORM_FINISH``, "sums" unless set); ``reads``: its ids,
    biases and norm arguments."""
    d, dev, dtype = x.shape[-1], x.device, x.dtype
    k, idx = bench.bucket_ids(n, density, dev)

    def rand(*shape, scale=1.0):
        return (torch.randn(*shape, device=dev) * scale).to(dtype)

    b1, b2 = (None, None) if gated else (rand(n, scale=0.1), rand(d, scale=0.1))
    norm = (rand(1, 1, d), 1 + rand(d, scale=0.1), None if gated else rand(d, scale=0.1), 1e-5,
            gated)
    workspace = torch.zeros(ops.workspace_numel(1, d, k, gated) + ops.norm_numel(1, d),
                            device=dev)

    def op(i):
        w1, w_up, w2_t = sets[i]
        return sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, workspace=workspace,
                                     norm=norm)

    return k, op, {"idx": idx, "b1": b1, "b2": b2, "norm": norm}


@torch.no_grad()
def study(model: str, kernel: str, density: float, dtype=torch.float16, top: int = 12,
          case=None, step: bool = False):
    """Rows (one per candidate, fastest first) and the best candidate's entry
    ``{"key": ..., "config": ...}`` for the key the op tunes; ``case``: ``_case``'s op, dense
    and bytes if already built (``pair_study``'s, which both MLP kernels share); ``step``:
    the MLP in the decode step's form (``_step_mlp``)."""
    name = KERNELS[kernel]
    tuner = tuning.autotuners()[name]
    op, dense, nbytes = case or _case(bench.shape_configs()[model], kernel, density, dtype,
                                      step)
    before = set(tuner.cache)
    chosen = bench._time_layers(op, bench.LAYERS)[0]  # the autotuner's choice
    keys = [key for key in tuner.cache if key not in before]
    dense_ms = bench._time_layers(dense, bench.LAYERS)[0]
    rows = []
    for config in list(tuner.configs):
        with tuning.pinned(name, config):
            try:
                ms = bench._time_layers(op, bench.LAYERS)[0]
            except OutOfResources as e:  # as the autotuner does: this tile does not fit
                print(f"  {tuning.config_data(config)}: {e}")
                continue
        rows.append({"config": tuning.config_data(config), "ms": ms,
                     "gbs": nbytes / (ms * 1e-3) / 1e9})
    rows.sort(key=lambda r: r["ms"])
    form = " (the step's form)" if step else ""
    print(f"\n{model} {kernel} density {density}{form}: {nbytes / 1e6:.1f} MB, cuBLAS dense "
          f"{dense_ms * 1e3:.1f} us, the autotuner's choice "
          f"{tuning.config_data(tuner.cache[keys[0]]) if keys else 'already chosen'} "
          f"{chosen * 1e3:.1f} us")
    for r in rows[:top]:
        print(f"  {r['ms'] * 1e3:7.1f} us {r['gbs']:6.0f} GB/s  {r['config']}")
    best = {"key": tuning.plain_key(keys[0]), "config": rows[0]["config"]} if keys else None
    return {"model": model, "kernel": name, "density": density, "bytes": nbytes,
            "form": "step" if step else "op", "dense_ms": dense_ms, "chosen_ms": chosen,
            "rows": rows}, best


@torch.no_grad()
def check(model: str, kernel: str, density: float, dtype=torch.float16, case=None,
          step: bool = False) -> int:
    """Each candidate of ``kernel`` pinned in turn and run once on every layer's weights, the
    GPU synchronised after it and its tile printed before it, with no timing: a candidate
    that faults is the last one printed (run with ``CUDA_LAUNCH_BLOCKING=1``, so that the
    fault is reported at its launch). For ``mlp``, the up kernel's candidates (the op runs
    both kernels). Returns how many ran."""
    studied = "up" if kernel == "mlp" else kernel
    name = KERNELS[studied]
    op, _, _ = case or _case(bench.shape_configs()[model], studied, density, dtype, step)
    ran = 0
    for config in list(tuning.autotuners()[name].configs):
        print(f"{model} {name} density {density}: {tuning.config_data(config)}", flush=True)
        with tuning.pinned(name, config):
            for i in range(bench.LAYERS):
                op(i)
            torch.cuda.synchronize()
        ran += 1
    print(f"{model} {name} density {density}: all {ran} candidates ran", flush=True)
    return ran


def pairs(op, up_rows: list[dict], down_rows: list[dict], top: int) -> list[dict]:
    """The sparse MLP ``op`` timed with each of the ``top`` fastest up tiles of ``up_rows``
    beside each of the ``top`` fastest down tiles of ``down_rows`` (``study``'s rows), both
    pinned: rows ``{"up", "down", "ms"}``, fastest first."""
    tuners = tuning.autotuners()

    def config(kernel: str, data: dict):
        return next(c for c in tuners[KERNELS[kernel]].configs if tuning.config_data(c) == data)

    rows = []
    for up in up_rows[:top]:
        for down in down_rows[:top]:
            with tuning.pinned(KERNELS["up"], config("up", up["config"])), \
                    tuning.pinned(KERNELS["down"], config("down", down["config"])):
                ms = bench._time_layers(op, bench.LAYERS)[0]
            rows.append({"up": up["config"], "down": down["config"], "ms": ms})
    return sorted(rows, key=lambda r: r["ms"])


@torch.no_grad()
def pair_study(model: str, density: float, top: int, dtype=torch.float16, step: bool = False):
    """``study`` of the up and then the down kernel, then ``pairs`` of their fastest tiles, all
    on one MLP case (the same weights and ids; ``step``: in the decode step's form): the three
    results and the fastest pair's entries (none for a kernel whose key was chosen before the
    study, as ``study`` gives)."""
    case = _case(bench.shape_configs()[model], "up", density, dtype, step)
    tuners = tuning.autotuners()
    before = {k: set(tuners[KERNELS[k]].cache) for k in ("up", "down")}
    # the up study's first call tunes the down kernel's key too, so the down study finds it
    # chosen: each kernel's key is the one new since before both studies
    up, down = (study(model, k, density, dtype, case=case, step=step)[0]
                for k in ("up", "down"))
    op, _, nbytes = case
    rows = pairs(op, up["rows"], down["rows"], top)
    form = " (the step's form)" if step else ""
    print(f"\n{model} mlp density {density}{form}: {top} x {top} pairs of tiles, fastest first")
    for r in rows[:top]:
        print(f"  {r['ms'] * 1e3:7.1f} us  up {r['up']['kwargs']}  down {r['down']['kwargs']}")
    best = [{"kernel": KERNELS[k], "key": tuning.plain_key(key), "config": rows[0][k]}
            for k in ("up", "down")
            for key in tuners[KERNELS[k]].cache if key not in before[k]]
    result = {"model": model, "kernel": "mlp pairs", "density": density, "bytes": nbytes,
              "form": "step" if step else "op",
              "rows": [{**r, "gbs": nbytes / (r["ms"] * 1e-3) / 1e9} for r in rows]}
    return [up, down, result], best


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", nargs="+", default=["opt-13b"],
                   choices=sorted(bench.shape_configs()))
    p.add_argument("--kernel", choices=sorted([*KERNELS, "mlp"]), help="required unless --ship")
    p.add_argument("--pairs", type=int, default=4,
                   help="with --kernel mlp: pair this many fastest tiles of each kernel")
    p.add_argument("--densities", nargs="+", type=float, default=[0.1, 0.5, 0.8])
    p.add_argument("--step", action="store_true",
                   help="with --kernel up, down or mlp: time the MLP as the default decode "
                        "step runs it (a bucketed selection's ids, OPT's biases, the residual "
                        "add and norm after it finishing the down kernel's sums), whose "
                        "tuning keys the step's are")
    p.add_argument("--json", help="write the rows and the fastest tile per key here")
    p.add_argument("--check", action="store_true",
                   help="only run each candidate once, synchronised, naming it first (no "
                        "timing): with CUDA_LAUNCH_BLOCKING=1, the tile that faults")
    p.add_argument("--ship", metavar="JSON",
                   help="merge a study's --json into kernels/tuned/ for the GPU it names and "
                        "exit (no GPU needed): a key already shipped takes the study's tile")
    p.add_argument("--to", metavar="FILE",
                   help="with --ship: the shipped file to merge into (default: the one of the "
                        "dejavu_compile that Python imports, which must then lie under the "
                        "current directory)")
    args = p.parse_args(argv)
    if args.to and not args.ship:
        p.error("--to goes with --ship")
    if args.ship:
        with open(args.ship) as f:
            data = json.load(f)
        if not isinstance(data, dict) or "gpu" not in data or "tuned" not in data:
            raise SystemExit(f"{args.ship} is not a tile study's --json (no 'gpu' and 'tuned')")
        target = Path(args.to) if args.to else tuning.shipped_path(data["gpu"])
        if not args.to and not target.resolve().is_relative_to(Path.cwd().resolve()):
            # An editable install of another checkout (a CI clone's virtual environment, say)
            # would have its file changed, not this directory's.
            raise SystemExit(f"the imported dejavu_compile ships {target}, outside this "
                             f"directory; name the file to merge into with --to FILE")
        for line in tuning.ship(data["gpu"], data["tuned"], target) or ["nothing changed"]:
            print(line)
        print(f"now say in {target}'s 'about' where these came from")
        return
    if args.kernel is None:
        p.error("--kernel is required (unless --ship)")
    if args.step and args.kernel not in ("up", "down", "mlp"):
        p.error(f"--step goes with --kernel up, down or mlp, not {args.kernel}")
    if not torch.cuda.is_available():
        raise SystemExit("tile_study needs a CUDA GPU")
    bench.check_densities(args.densities)
    if args.pairs < 1:
        raise SystemExit(f"--pairs must be at least 1, got {args.pairs}")
    if args.check:
        for model in args.models:
            for density in args.densities:
                check(model, args.kernel, density, step=args.step)
        return
    results, tuned = [], {}
    for model in args.models:
        for density in args.densities:
            if args.kernel == "mlp":
                done, entries = pair_study(model, density, args.pairs, step=args.step)
                results.extend(done)
            else:
                result, best = study(model, args.kernel, density, step=args.step)
                results.append(result)
                entries = [{"kernel": result["kernel"], **best}] if best is not None else []
            for e in entries:
                tuned.setdefault(e.pop("kernel"), []).append(e)
            if args.json:  # after each density: a run stopped by a time limit keeps them
                with open(args.json, "w") as f:
                    json.dump({"gpu": torch.cuda.get_device_name(), "results": results,
                               "tuned": tuned}, f, indent=1)


if __name__ == "__main__":
    main()
