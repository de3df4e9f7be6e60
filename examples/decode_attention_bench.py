"""Time one decode step's attention over a long KV cache on a CUDA GPU: the split-K
``dejavu::decode_attention`` kernel against PyTorch's SDPA (flash, GQA without copies), on the
Llama-3-8B attention shape (32 query heads, 8 KV heads, head size 128), fp16, batch 1.

    python examples/decode_attention_bench.py [CONTEXT ...]
"""

from __future__ import annotations

import functools
import sys

import torch
import torch.nn.functional as F
from triton.testing import do_bench

import dejavu_compile  # noqa: F401  (registers the ops and their CUDA kernels)


def main(contexts: list[int]) -> None:
    heads, kv_heads, hd = 32, 8, 128
    print("context | dejavu us | GB/s | sdpa us | GB/s | max |diff|")
    for n in contexts:
        q = torch.randn(1, heads, 1, hd, device="cuda", dtype=torch.float16)
        k = torch.randn(1, kv_heads, n, hd, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        scale = hd ** -0.5
        ours = torch.ops.dejavu.decode_attention(q, k, v, scale)
        theirs = F.scaled_dot_product_attention(q, k, v, scale=scale, enable_gqa=True)
        diff = (ours.float() - theirs.float()).abs().max().item()
        nbytes = 2 * k.numel() * k.element_size()
        t_ours = do_bench(functools.partial(torch.ops.dejavu.decode_attention, q, k, v, scale))
        t_sdpa = do_bench(functools.partial(F.scaled_dot_product_attention, q, k, v, scale=scale,
                                            enable_gqa=True))
        t_ours, t_sdpa = t_ours * 1e3, t_sdpa * 1e3
        print(f"{n} | {t_ours:.1f} | {nbytes / t_ours / 1e3:.0f} | {t_sdpa:.1f} | "
              f"{nbytes / t_sdpa / 1e3:.0f} | {diff:.1e}", flush=True)


if __name__ == "__main__":
    main([int(a) for a in sys.argv[1:]] or [2048, 8192, 32768, 131072])
