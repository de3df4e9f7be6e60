"""Would one launch for the query, key and value rows of the selected heads read faster than
the two launches of the decode step? On OPT-13B's attention shape (d 5120, 40 heads of 128,
heads 0.5, a 256-position cache at position 200, every selected head's positions present unless
``--missing``), per layer:

- ``separate``: the step as it runs with lazy K/V: ``sparse_head_proj`` for the query (its
  zero-fill, kernel and finish) and ``lazy_kv`` for the keys and values;
- ``qkv gemv``: ``sparse_head_proj`` once over the stacked query, key and value weights with
  the selection repeated for each (what a fused launch would read, without the cache stores);
- ``lazy qkv``: the fused launch the step runs with option ``fuse_qkv`` (``lazy_qkv``: the
  query as a third matrix of the lazy K/V kernel's grid);
- ``kv gemv`` and ``lazy kv``: the keys and values alone, as a plain gathered GEMV and through
  ``lazy_kv``; ``q gemv``: the query alone;
- ``lazy kv GRID TILE`` and ``lazy qkv GRID TILE``: the lazy launches at each tile the
  autotuner chooses among (``lazy_kv.DECODE_TILES``), with their programs over every head
  (``heads``, the default) and over the selection's slots (``selection``, built in the
  thirty-first session), side by side (``lazy_kv.GRIDS``).

With ``--gemv``, two GEMV forms of the same bytes beside them (the question being whether a
lazy launch whose programs read whole weight rows, as ``dejavu::gemv`` does, would be faster
than the tensor-core tiles): ``qkv gemv store``, the stacked launch through
``_head_proj_store_kernel`` (``DEJAVU_STORE_ROWS=1``: each program covers all of d for its
rows and stores them, no atomics, no finish); and ``gathered gemv``, ``dejavu::gemv`` over a
copy of the selected rows made contiguous beforehand (``gathered_rows``), the bound of such a
form with no gather and no cache stores. In the forty-first session a chain of Llama-3-8B's
dense attention projections ran at 86% of copy bandwidth through ``dejavu::gemv``
(``examples/gemv_study.py --chain``), where the lazy launch reads at about 60%.

With ``--missing F``, a fraction F of the selected heads have their previous position missing
at every call, as in a step after one in which those heads were not selected (``MissingState``
puts that state back before each call, one step of all the layers, in three launches; their
time, ``state reset``, is taken off every variant): the lazy launches then also fill that
position, as they do in the decode step (were the selections at head density 0.5 independent
from step to step, half of the selected heads would have been left out the step before).
Without it (F 0) no lazy launch fills anything, so it times less work than the step's launch
does: in the forty-second session a row form of the lazy kernel ran 25.1 us a layer here
against 26.9 for the tiles, and made OPT-13B's step four times slower (BENCHMARKS.md).

With ``--beside``, each layer's two learned selectors of the next layer (the MLP's, rank 128
over its 20480 neurons at density 0.1 in buckets of 128, and the heads', over the 40 heads at
``--density``: ``Selectors``, the bench's random predictors' shapes) run on a side stream
while the variant runs, joined at the layer's end, as the lookahead step runs them; a
``selectors`` line times them alone. In the forty-third session's OPT-13B breakdown the lazy
launch took about 31 us a call in the step, where this study times it at about 27 alone,
with or without missing positions: the step runs it beside those selectors.

With ``--sweep``, ``lazy kv`` and ``lazy qkv`` again at each tile of ``SWEEP``, in the default
grid (``lazy_kv.default_grid()``: the selection's since the forty-third session). With
``--unsplit``, ``lazy qkv`` at each tile of ``UNSPLIT`` (d split over one or two programs,
narrow column tiles: as many programs with fewer or no atomics and no finish in the last
program), in place of the tiles of the two grids.

The lazy kernel's autotuner starts from the tiles shipped for the GPU
(``kernels/tuned/``), as the decode step does, so ``lazy qkv`` and ``lazy kv`` run the step's
tiles; the study prints the tile each grid ran (before the forty-third session it read no
shipped file, and its ``lazy qkv`` line ran whatever its own autotuner chose: 26.9 us a layer
with ``--missing 0`` and 29.7 with ``--missing 0.5`` in the next run, where each tile timed
alone moved by at most 1.0 us between the two: another tile chosen, BENCHMARKS.md).

Each variant runs over ``--layers`` copies of the weights in turn (a CUDA graph of repeated
calls, ``bench.graph_bench``), so the weights stream from memory as in a step
rather than staying in L2. Prints us a layer in each of ``--passes`` passes over the variants
and TB/s on the bytes of the selected rows at the fastest.
In the twentieth session's OPT-13B step the query and output projections, the up kernel and
the lazy K/V kernel ran at 2.0-2.4 TB/s (BENCHMARKS.md). In the twenty-first (H200): the two
launches 33.2-35.9 us a layer, the one GEMV 24.5-26.5, the fused launch 31.5 at the then tile
and 27.7 at its best. Run on a CUDA machine:
``TRITON_INTERPRET=0 python examples/qkv_study.py [--sweep]``.
"""

from __future__ import annotations

import argparse
import os
from unittest import mock

import torch
from dejavu_compile.kernels import dense, heads, kv_state, lazy_kv, predictor, tuning
from dejavu_compile.kernels.triton_common import STORE_ROWS_ENV

from dejavu_compile.bench import graph_bench
from dejavu_compile.profile import default_buckets, kept_units

D, H, HD, L, POS = 5120, 40, 128, 256, 200
MLP_UNITS, MLP_DENSITY, RANK = 20480, 0.1, 128  # the selectors of --beside
# tiles of the lazy kernels' tensor-core form (one position tile of 16) timed with --sweep
SWEEP = [{"BLOCK_P": 16, "DOT": True, "BLOCK_C": c, "BLOCK_K": kk, "SPLIT": sp, "num_warps": w,
          "num_stages": 3}
         for c in (32, 64, 128) for kk in (64, 128) for sp in (4, 8, 16) for w in (4, 8)
         if not (c == 32 and w == 8)]
# tiles timed with --unsplit: the programs of a column tile of 16 or 32 over the whole of d
# (SPLIT 1: no atomics, no workspace, no finish in a last program) or half of it
UNSPLIT = [{"BLOCK_P": 16, "DOT": True, "BLOCK_C": c, "BLOCK_K": kk, "SPLIT": sp, "num_warps": 4,
            "num_stages": st}
           for c in (16, 32) for kk in (128, 256) for sp in (1, 2) for st in (3, 4)]


def stacked_selection(idx: torch.Tensor, heads_per_matrix: int, matrices: int) -> torch.Tensor:
    """The head ids of ``idx`` [..., k] repeated for each of ``matrices`` weights stacked along
    their rows, ``heads_per_matrix`` heads each: [..., matrices * k], ascending within each."""
    return torch.cat([idx + m * heads_per_matrix for m in range(matrices)], dim=-1)


def gathered_rows(idx: torch.Tensor, head_dim: int) -> torch.Tensor:
    """The weight-row ids of the heads ``idx`` names (any shape, ids in order), each head's
    ``head_dim`` rows in turn: indexing a weight with them gives the selected rows contiguous."""
    offsets = torch.arange(head_dim, device=idx.device)
    return (idx.reshape(-1, 1) * head_dim + offsets).reshape(-1)


def storing_rows(fn):
    """``fn`` run with ``DEJAVU_STORE_ROWS=1`` (the head projection's row-storing kernel), the
    environment restored after each call."""
    def run(*args):
        with mock.patch.dict(os.environ, {STORE_ROWS_ENV: "1"}):
            return fn(*args)
    return run


def missing_heads(idx: torch.Tensor, fraction: float, seed: int = 0) -> torch.Tensor:
    """The selected heads (``idx`` [1, 1, k]) whose previous position is missing, as after a
    step in which they were not selected: ``round(fraction * k)`` of them, chosen at random
    (``seed``), ascending."""
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"the fraction of selected heads with a missing position must be in "
                         f"[0, 1], got {fraction}")
    chosen = idx.reshape(-1)
    order = torch.randperm(chosen.numel(), generator=torch.Generator().manual_seed(seed))
    return chosen[order[:round(fraction * chosen.numel())].to(chosen.device)].sort().values


class MissingState:
    """Puts the caches of the layers back in the state of a step after one in which the heads
    ``heads`` were not selected: position ``pos - 1`` of those heads zero in the keys and
    values (``keys_all``, ``values_all`` [layers, B, H, L, hd], each layer's cache a view of
    them), and their lazy states' valid prefixes (``valids``, one per layer) ``pos - 1``, so a
    lazy launch at ``pos`` fills that position. Three launches in all (a multi-tensor copy of
    the prefixes and a zero-fill of each cache's column at ``pos - 1``), whatever the number
    of layers."""

    def __init__(self, keys_all: torch.Tensor, values_all: torch.Tensor, valids, heads, pos):
        self.keys_all, self.values_all, self.valids = keys_all, values_all, list(valids)
        self.heads, self.pos = heads, pos
        for valid in self.valids:
            valid.fill_(pos)
            valid[:, heads] = pos - 1
        self.prefixes = [valid.clone() for valid in self.valids]
        self()

    def __call__(self) -> None:
        torch._foreach_copy_(self.valids, self.prefixes)
        for cache in (self.keys_all, self.values_all):
            cache[:, :, :, self.pos - 1].index_fill_(2, self.heads, 0)


def lazy_choices(entries) -> list[str]:
    """Lines naming the tile the lazy kernel ran for each of its tuning keys, from
    ``tuning.tuned()``'s entries of ``lazy_kv._decode_kernel``: the matrices (2 keys and
    values, 3 with the query), the grid and the tile."""
    lines = []
    for entry in entries:
        d, hd, mats, sel = entry["key"][:4]
        kw = entry["config"]["kwargs"]
        lines.append(f"  {'lazy qkv' if mats == 3 else 'lazy kv'} "
                     f"({'selection' if sel else 'heads'} grid, d {d}, head dim {hd}): "
                     f"C{kw['BLOCK_C']} K{kw['BLOCK_K']} S{kw['SPLIT']}")
    return lines


class Selectors:
    """A layer's two learned selectors as the lookahead step runs them on its side stream: the
    MLP's over ``mlp_units`` at ``mlp_density`` and the heads' over ``heads`` at
    ``head_density``, each a rank-``rank`` predictor (``predictor.select_predictor``, ReLU,
    biased first layer, the default buckets) with random weights of the bench's scale, on
    input ``x`` [1, 1, d]. Calling one runs both and returns their ids."""

    def __init__(self, x, mlp_units: int, mlp_density: float, heads: int, head_density: float,
                 rank: int = RANK, generator: torch.Generator | None = None):
        def rand(*shape, scale):
            return (torch.randn(*shape, generator=generator) * scale).to(x.device, x.dtype)

        self.x = x
        self.parts = []
        d = x.shape[-1]
        for units, density in ((mlp_units, mlp_density), (heads, head_density)):
            buckets = default_buckets(units)
            self.parts.append((rand(rank, d, scale=d**-0.5), rand(rank, scale=1.0),
                               rand(units, rank, scale=rank**-0.5),
                               kept_units(density, units, buckets), buckets))

    def __call__(self) -> list[torch.Tensor]:
        return [predictor.select_predictor(self.x, w1, b1, w2, None, "relu", k, 1, buckets)
                for w1, b1, w2, k, buckets in self.parts]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--density", type=float, default=0.5)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--sweep", action="store_true",
                        help="also time the lazy kernels at each tile of SWEEP")
    parser.add_argument("--gemv", action="store_true",
                        help="also time the row-storing stacked launch and dejavu::gemv over "
                             "the selected rows gathered beforehand")
    parser.add_argument("--unsplit", action="store_true",
                        help="time the fused launch at each tile of UNSPLIT instead of the "
                             "grids' tiles")
    parser.add_argument("--missing", type=float, default=0.0,
                        help="the fraction of the selected heads whose previous position is "
                             "missing (not selected the step before), put back before every "
                             "call; 0: every selected head's positions present")
    parser.add_argument("--beside", action="store_true",
                        help="run each layer's two selectors on a side stream beside every "
                             "variant, as the lookahead step does")
    parser.add_argument("--passes", type=int, default=2,
                        help="times each variant this many times, the passes in turn, to "
                             "show each time's spread beside the differences between variants")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("qkv_study needs a CUDA GPU")
    seeded = tuning.seed_shipped(torch.cuda.get_device_name())
    torch.manual_seed(0)
    dev, dt = "cuda", torch.float16
    k = round(args.density * H)
    idx = torch.randperm(H, device=dev)[:k].sort().values.view(1, 1, k)
    idx_kv, idx_qkv = stacked_selection(idx, H, 2), stacked_selection(idx, H, 3)
    x = torch.randn(1, 1, D, device=dev, dtype=dt)
    pos = torch.tensor([POS], device=dev)
    layers = []
    # the caches of every layer in one tensor each, so that --missing puts them back in one
    # launch; with --missing 0 every position of every head present
    keys_all = torch.randn(args.layers, 1, H, L, HD, device=dev, dtype=dt)
    values_all = torch.randn(args.layers, 1, H, L, HD, device=dev, dtype=dt)
    valids = []
    for layer in range(args.layers):
        w = torch.randn(3 * H * HD, D, device=dev, dtype=dt) * 0.02  # query, key, value rows
        b = torch.randn(3 * H * HD, device=dev, dtype=dt)
        keys, values = keys_all[layer], values_all[layer]
        state = kv_state.lazy_state(keys, D, dt)
        state.inputs.normal_()  # the earlier positions' inputs, read by a fill
        valids.append(state.valid)
        q, kk, v = (w[i * H * HD:(i + 1) * H * HD] for i in range(3))
        bq, bk, bv = (b[i * H * HD:(i + 1) * H * HD] for i in range(3))
        layers.append(dict(w=w, b=b, q=q, k=kk, v=v, bq=bq, bk=bk, bv=bv, kv=w[H * HD:],
                           bkv=b[H * HD:], keys=keys, values=values,
                           selectors=(Selectors(x, MLP_UNITS, MLP_DENSITY, H, args.density)
                                      if args.beside else None)))

    missing = missing_heads(idx, args.missing)
    reset = MissingState(keys_all, values_all, valids, missing, POS)

    def lazy(lay, config=None, grid=None):
        lazy_kv.lazy_kv(x, idx, lay["k"], lay["bk"], lay["v"], lay["bv"], lay["keys"],
                        lay["values"], pos, config=config, grid=grid)

    def fused(lay, config=None, grid=None):
        lazy_kv.lazy_qkv(x, idx, lay["q"], lay["bq"], lay["k"], lay["bk"], lay["v"], lay["bv"],
                         lay["keys"], lay["values"], pos, config=config, grid=grid)

    variants = {
        "separate": (3, lambda lay: (heads.sparse_head_proj(x, idx, lay["q"], lay["bq"], HD),
                                     lazy(lay))),
        "lazy qkv": (3, fused),
        "qkv gemv": (3, lambda lay: heads.sparse_head_proj(x, idx_qkv, lay["w"], lay["b"], HD)),
        "kv gemv": (2, lambda lay: heads.sparse_head_proj(x, idx_kv, lay["kv"], lay["bkv"], HD)),
        "lazy kv": (2, lazy),
        "q gemv": (1, lambda lay: heads.sparse_head_proj(x, idx, lay["q"], lay["bq"], HD)),
    }
    if args.gemv:
        rows = gathered_rows(idx_qkv, HD)
        for lay in layers:
            lay["gathered"], lay["gathered_b"] = lay["w"][rows].contiguous(), lay["b"][rows]
        variants["qkv gemv store"] = (3, storing_rows(
            lambda lay: heads.sparse_head_proj(x, idx_qkv, lay["w"], lay["b"], HD)))
        variants["gathered gemv"] = (3, lambda lay: dense.gemv(x, lay["gathered"],
                                                               lay["gathered_b"]))
    for cfg in [] if args.unsplit else lazy_kv.DECODE_TILES:  # each grid at each such tile
        name = "C{BLOCK_C} K{BLOCK_K} S{SPLIT}".format(**cfg)
        for grid in lazy_kv.GRIDS:
            variants[f"lazy kv {grid} {name}"] = (2, lambda lay, c=cfg, g=grid: lazy(lay, c, g))
            variants[f"lazy qkv {grid} {name}"] = (3, lambda lay, c=cfg, g=grid: fused(lay, c, g))
    for cfg in UNSPLIT if args.unsplit else []:
        name = "C{BLOCK_C} K{BLOCK_K} S{SPLIT} st{num_stages}".format(**cfg)
        variants[f"lazy qkv {name}"] = (3, lambda lay, c=cfg: fused(lay, c))
    if args.sweep:  # the lazy kernels at each tile of SWEEP, with and without the query
        for cfg in SWEEP:
            name = "C{BLOCK_C} K{BLOCK_K} S{SPLIT} w{num_warps}".format(**cfg)
            variants[f"lazy kv {name}"] = (2, lambda lay, c=cfg: lazy(lay, c))
            variants[f"lazy qkv {name}"] = (3, lambda lay, c=cfg: fused(lay, c))
    if args.beside:  # the selectors alone (the main stream idle while they run)
        variants = {"selectors": (0, lambda lay: None), **variants}
    if missing.numel():  # the reset alone, timed as the others and taken off each of them
        variants = {"state reset": (0, lambda lay: None), **variants}
    side = torch.cuda.Stream() if args.beside else None
    row_bytes = k * HD * D * 2  # one matrix's selected rows, fp16
    times = {name: [] for name in variants}
    for _ in range(args.passes):  # every variant once a pass, in the same order
        for name, (_, fn) in variants.items():
            def step(fn=fn, name=name):
                if missing.numel():
                    reset()
                main_stream = torch.cuda.current_stream()
                beside = side is not None and name != "state reset"
                for lay in layers:
                    if beside:  # forked from the main stream and joined back: one graph
                        side.wait_stream(main_stream)
                        with torch.cuda.stream(side):
                            lay["selectors"]()
                    fn(lay)
                    if beside:
                        main_stream.wait_stream(side)
            ms = graph_bench(step, rep=200, return_mode="median")
            times[name].append(ms * 1e3 / len(layers))
    print(f"OPT-13B attention, {k} of {H} heads, {len(layers)} layers of weights in turn, "
          f"us a layer in each of {args.passes} passes:")
    print(f"{seeded} tuning keys seeded from the shipped tiles; the lazy kernel ran, in "
          f"{lazy_kv.default_grid()!r}, the default grid:")
    print("\n".join(lazy_choices(tuning.tuned().get("lazy_kv._decode_kernel", []))))
    if args.beside:
        print(f"each layer's selectors (MLP {MLP_DENSITY} of {MLP_UNITS}, heads {k} of {H}, "
              f"rank {RANK}) on a side stream beside every variant; 'selectors' times them "
              f"alone")
    if missing.numel():
        print(f"{missing.numel()} of the {k} selected heads have position {POS - 1} missing at "
              f"every call; each variant's time is net of 'state reset' (its own line, the "
              f"pass's time of putting that state back)")
        reset_us = times["state reset"]
        print(f"  {'state reset':34s} {' '.join(f'{us:6.1f}' for us in reset_us)} us a layer")
        times = {name: [us - r for us, r in zip(t, reset_us, strict=True)] for name, t in times.items()
                 if name != "state reset"}
        variants.pop("state reset")
    for name, (matrices, _) in variants.items():
        nbytes = matrices * row_bytes
        best = min(times[name])
        if not nbytes:  # the selectors alone
            print(f"  {name:34s} {' '.join(f'{us:6.1f}' for us in times[name])} us a layer")
            continue
        print(f"  {name:34s} {' '.join(f'{us:6.1f}' for us in times[name])} us a layer  "
              f"{nbytes / 1e6:5.1f} MB  {nbytes / best / 1e6:5.2f} TB/s at the fastest pass")


if __name__ == "__main__":
    main()
