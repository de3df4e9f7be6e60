"""Host time of one CUDA graph's launch by the graph's shape, on a GPU: the same number of tiny
kernels captured as a straight chain on one stream, as a chain that forks to a side stream and
joins back once per layer (as the lookahead predictors do), and each of those with every kernel
launched programmatically (programmatic dependent launch, as the ``*_pdl`` modes launch
dejavu's Triton kernels).

Why: the OPT-13B decode step replayed from one CUDA graph (``CapturedStep``) spent 0.12-0.46 ms
on the host before the GPU started (BENCHMARKS.md, twenty-ninth session), while a plain chain of
820 kernels launched in 6-27 us. This separates what the graph's shape costs the launch from
what the rest of the call costs (``examples/host_study.py`` measures the call).

Each graph holds ``--layers`` x ``--per-layer`` kernels on the main stream; the forked ones add
``--side`` kernels per layer on a side stream (forked from the layer's first kernel, joined
before the next layer's first), so they hold more kernels: the chain ``... long`` holds as many
as the forked graph. Each replay is timed on the host (``graph.replay()`` until it returns) and
then waited for; the medians over ``--replays`` follow ``WARM`` untimed ones, unpinned and then
pinned to each of ``--cpus`` in turn.

Run on a CUDA machine: ``TRITON_INTERPRET=0 python examples/graph_launch_study.py --cpus 0 5``.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import triton
import triton.language as tl
from dejavu_compile.kernels.triton_common import wait_inputs

from dejavu_compile import bench

WARM = 20


@triton.jit
def _tick(x, PDL: tl.constexpr):
    """One program adds 1 to ``x[0]`` (under programmatic launch, after the kernel before it)."""
    wait_inputs(PDL)
    tl.store(x, tl.load(x) + 1)


def tick(x: torch.Tensor, pdl: bool) -> None:
    if pdl:
        _tick[(1,)](x, PDL=True, launch_pdl=True)
    else:
        _tick[(1,)](x, PDL=False)


def capture(layers: int, per_layer: int, side: int, pdl: bool) -> torch.cuda.CUDAGraph:
    """A graph of ``layers`` x ``per_layer`` kernels on one stream and, with ``side``, that many
    more per layer on a side stream forked after the layer's first kernel and joined before the
    next layer's."""
    main_x = torch.zeros(1, device="cuda")
    side_x = torch.zeros(1, device="cuda")
    tick(main_x, pdl)  # compile outside the capture
    tick(main_x, False)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    stream, aside = torch.cuda.Stream(), torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        graph.capture_begin()
        for _ in range(layers):
            for k in range(per_layer):
                tick(main_x, pdl)
                if k == 0 and side:
                    aside.wait_stream(stream)
                    with torch.cuda.stream(aside):
                        for _ in range(side):
                            tick(side_x, pdl)
            if side:
                stream.wait_stream(aside)
        graph.capture_end()
    torch.cuda.current_stream().wait_stream(stream)
    graph._keep = (main_x, side_x)  # the captured kernels' tensors live as long as the graph
    return graph


def launch_us(graph: torch.cuda.CUDAGraph, replays: int) -> tuple[float, float]:
    """Medians (us) of the host's ``replay()`` and of the whole replay until the GPU is done."""
    host, whole = [], []
    for i in range(WARM + replays):
        torch.cuda.synchronize()
        start = time.perf_counter()
        graph.replay()
        returned = time.perf_counter()
        torch.cuda.synchronize()
        if i >= WARM:
            host.append(1e6 * (returned - start))
            whole.append(1e6 * (time.perf_counter() - start))
    return statistics.median(host), statistics.median(whole)


def shapes(layers: int, per_layer: int, side: int) -> dict[str, tuple[int, int, int, bool]]:
    """Each graph's (layers, kernels per layer on the main stream, on the side stream,
    programmatic)."""
    return {
        "chain": (layers, per_layer, 0, False),
        "chain long": (layers, per_layer + side, 0, False),
        "forked": (layers, per_layer, side, False),
        "chain, programmatic": (layers, per_layer, 0, True),
        "chain long, programmatic": (layers, per_layer + side, 0, True),
        "forked, programmatic": (layers, per_layer, side, True),
    }


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=40)
    p.add_argument("--per-layer", type=int, default=18)
    p.add_argument("--side", type=int, default=3)
    p.add_argument("--replays", type=int, default=200)
    p.add_argument("--cpus", nargs="*", type=int, default=[],
                   help="also time each graph pinned to each of these CPUs in turn")
    args = p.parse_args(argv)
    if min(args.layers, args.per_layer, args.replays) < 1 or args.side < 0:
        raise SystemExit("--layers, --per-layer and --replays must be >= 1, --side >= 0")
    try:
        bench.check_cpus(args.cpus or None, "--cpus")
    except ValueError as e:
        raise SystemExit(str(e)) from None
    if not torch.cuda.is_available():
        raise SystemExit("graph_launch_study needs a CUDA GPU")
    print("| graph | kernels | CPU | host us per launch | launch to GPU done us |")
    print("| --- | --- | --- | --- | --- |")
    for name, (layers, per_layer, side, pdl) in shapes(args.layers, args.per_layer,
                                                      args.side).items():
        graph = capture(layers, per_layer, side, pdl)
        kernels = layers * (per_layer + side)
        for cpu in [None, *args.cpus]:
            with bench.pinned(None if cpu is None else [cpu]):
                host, whole = launch_us(graph, args.replays)
            print(f"| {name} | {kernels} | {'any' if cpu is None else cpu} | {host:.1f} | "
                  f"{whole:.1f} |", flush=True)
        del graph


if __name__ == "__main__":
    main()
