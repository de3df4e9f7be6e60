"""Time one decode step's attention over a long KV cache on a CUDA GPU: the split-K
``dejavu::decode_attention`` kernel against PyTorch's SDPA (flash, GQA without copies), fp16,
batch 1, each call replayed from a CUDA graph (no host time in the figures; the forty-ninth
session's plain timing measured the host's launch at short contexts), on the attention shape of
Llama-3-8B (32 query heads, 8 KV heads, head size 128) or
OPT-13B (40 heads, each its own KV head).

With ``--heads F`` it also times the kernel over a selection of that fraction of the query
heads (option ``decode_selected_heads``: the heads an output projection reads), which reads the
cache of the selected heads' KV heads only, each once, and checks those heads' rows against
the kernel over every head.

    python examples/decode_attention_bench.py [CONTEXT ...] [--shape opt] [--heads 0.5]
"""

from __future__ import annotations

import argparse
import functools

import torch
import torch.nn.functional as F

import dejavu_compile  # noqa: F401  (registers the ops and their CUDA kernels)

# (query heads, KV heads, head size)
SHAPES = {"llama": (32, 8, 128), "opt": (40, 40, 128)}


def selected_count(heads: int, fraction: float) -> int:
    """Query heads a selection of ``fraction`` of ``heads`` names (at least one)."""
    if not 0.0 < fraction <= 1.0:
        raise ValueError(f"--heads must be in (0, 1], got {fraction}")
    return max(1, round(fraction * heads))


def main(contexts: list[int], shape: str = "llama", fraction: float | None = None) -> None:
    from dejavu_compile.bench import graph_bench as do_bench

    heads, kv_heads, hd = SHAPES[shape]
    k_sel = None if fraction is None else selected_count(heads, fraction)
    sel = "" if k_sel is None else f" | {k_sel} heads us | GB/s"
    print(f"context | dejavu us | GB/s{sel} | sdpa us | GB/s | max |diff|")
    gen = torch.Generator().manual_seed(0)
    for n in contexts:
        q = torch.randn(1, heads, 1, hd, device="cuda", dtype=torch.float16)
        k = torch.randn(1, kv_heads, n, hd, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        scale = hd ** -0.5
        ours = torch.ops.dejavu.decode_attention(q, k, v, scale)
        theirs = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        diff = (ours.float() - theirs.float()).abs().max().item()
        nbytes = 2 * k.numel() * k.element_size()
        t_ours = 1e3 * do_bench(functools.partial(torch.ops.dejavu.decode_attention, q, k, v,
                                                  scale))
        t_sdpa = 1e3 * do_bench(functools.partial(F.scaled_dot_product_attention, q, k, v,
                                                  scale=scale, enable_gqa=True))
        row = f"{n} | {t_ours:.1f} | {nbytes / t_ours / 1e3:.0f}"
        if k_sel is not None:
            ids = torch.randperm(heads, generator=gen)[:k_sel].sort().values.to("cuda")[None]
            got = torch.ops.dejavu.decode_attention(q, k, v, scale, None, None, ids)
            diff = max(diff, (got[0, ids[0]].float() - ours[0, ids[0]].float()).abs().max().item())
            # the keys and values of each KV head that a selected head reads, once
            read = (ids[0] // (heads // kv_heads)).unique().numel()
            sel_bytes = read * 2 * n * hd * k.element_size()
            t_sel = 1e3 * do_bench(functools.partial(torch.ops.dejavu.decode_attention, q, k, v,
                                                     scale, None, None, ids))
            row += f" | {t_sel:.1f} | {sel_bytes / t_sel / 1e3:.0f}"
        print(f"{row} | {t_sdpa:.1f} | {nbytes / t_sdpa / 1e3:.0f} | {diff:.1e}", flush=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("contexts", type=int, nargs="*", default=[2048, 8192, 32768, 131072])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    p.add_argument("--heads", type=float, metavar="F",
                   help="also time the kernel over this fraction of the query heads")
    args = p.parse_args(argv)
    if args.heads is not None:
        try:  # checked before any GPU work
            selected_count(SHAPES[args.shape][0], args.heads)
        except ValueError as e:
            p.error(str(e))
    return args


if __name__ == "__main__":
    args = parse()
    main(args.contexts, args.shape, args.heads)
