"""The decode attention's two ways of merging its chunks, timed as a decode step runs them, on
a CUDA GPU: one launch per layer whose last program merges (``counters`` given, the lower
pass's option ``merge_attention``) against the split launch plus a combine launch (its
default). 32 layers, each with a cache
of its own, are captured in one CUDA graph and replayed, so launch gaps count as in a step.

For Llama-3-8B's attention (32 query heads, 8 KV heads) and OPT-13B's (40 and 40), head size
128, fp16, batch 1, at the cache lengths of a 128-token prompt's decoding, it prints the
microseconds per layer of each, the config the autotuner chose and the largest difference
between the two outputs.

    TRITON_INTERPRET=0 python examples/attention_merge_study.py [LENGTH ...]
"""

from __future__ import annotations

import sys

import torch
from dejavu_compile.kernels import decode_attention as da

LAYERS = 32
SHAPES = {"llama-3-8b": (32, 8), "opt-13b": (40, 40)}
HEAD = 128
REPLAYS = 50


def step_time(fn) -> float:
    """Microseconds per layer of ``fn`` (one call per layer) captured in a CUDA graph."""
    fn()  # autotune and compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(REPLAYS):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return 1e3 * start.elapsed_time(end) / REPLAYS / LAYERS


def compare(heads: int, kv_heads: int, n: int) -> str:
    """One row: both ways at ``n`` keys for ``heads`` query heads over ``kv_heads``."""
    q = torch.randn(1, heads, 1, HEAD, device="cuda", dtype=torch.float16)
    ks = [torch.randn(1, kv_heads, n, HEAD, device="cuda", dtype=torch.float16)
          for _ in range(LAYERS)]
    vs = [torch.randn_like(k) for k in ks]
    counters = torch.zeros(LAYERS * kv_heads, dtype=torch.int32, device="cuda")
    scale = HEAD ** -0.5
    outs: dict[bool, list[torch.Tensor]] = {}

    def layers(merge: bool) -> None:
        outs[merge] = [da.decode_attention(
            q, k, v, scale, counters=counters[i * kv_heads:(i + 1) * kv_heads] if merge else None)
            for i, (k, v) in enumerate(zip(ks, vs, strict=True))]

    t_merged = step_time(lambda: layers(True))
    merged_cfg = da._split_kernel.best_config
    t_split = step_time(lambda: layers(False))
    split_cfg = da._split_kernel.best_config
    diff = max((a.float() - b.float()).abs().max().item()
               for a, b in zip(outs[True], outs[False], strict=True))
    chunk, splits = da.chunking(kv_heads, n)
    return (f"{n} | {chunk} x {splits} | {t_merged:.2f} | {t_split:.2f} | {merged_cfg} | "
            f"{split_cfg} | {diff:.1e}")


def main(lengths: list[int] | None = None) -> None:
    if not torch.cuda.is_available():
        raise SystemExit("attention_merge_study needs a CUDA GPU")
    print("shape | length | chunk x splits | merged us/layer | split+combine us/layer | "
          "merged config | split config | max |diff|")
    for name, (heads, kv_heads) in SHAPES.items():
        for n in lengths or [129, 192, 256]:
            print(f"{name} | {compare(heads, kv_heads, n)}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]])
