"""``dejavu::gemv`` (kernels/dense.py) against cuBLAS ``F.linear`` on a GPU: one row, fp16, at
the dense projection shapes of the end-to-end models, each call replayed in a CUDA graph
(``bench.graph_bench``).

Replaying one matrix leaves part of it in L2 between replays (50 MB on an H200), so matrices
below that size read faster than from memory: the end-to-end profile (``dejavu bench
--breakdown``, mode ``dejavu_gemv``) is the measure that counts. Run on a CUDA machine:
``TRITON_INTERPRET=0 python examples/gemv_study.py``.

``--chain``: Llama-3-8B's dense attention projections of every layer back to back (each
layer's fused query, key and value, then its output projection on the query's part, each
reading the one before's output; the layers' own weights, 2.5 GB, so nothing stays in L2),
replayed in one CUDA graph: the GEMV launched programmatically (``DEJAVU_PDL=1``: each loads
its first weight slice before it waits for the one before), plainly (``DEJAVU_PDL=0``) and
cuBLAS. That is what programmatic launch can save between the GEMVs of a step.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from dejavu_compile.kernels import dense
from dejavu_compile.kernels.triton_common import PDL_ENV, programmatic

from dejavu_compile.bench import copy_bandwidth, graph_bench, shape_configs


def shapes() -> dict[str, tuple[int, int]]:
    """[N, d] of each dense one-row projection of the end-to-end models (``bench.shape_configs``):
    the fused Q, K and V, the output projection, the first MLP projection(s) (gate and up
    stacked for a gated MLP), the down projection; and Llama-3-8B's language-model head."""
    configs = shape_configs()
    out = {}
    for name, short in (("llama-3-8b", "llama"), ("opt-13b", "opt")):
        cfg = configs[name]
        d, heads = cfg.hidden_size, cfg.num_attention_heads
        head_dim = d // heads
        kv = getattr(cfg, "num_key_value_heads", heads) or heads
        ffn = getattr(cfg, "intermediate_size", None) or cfg.ffn_dim
        gated = hasattr(cfg, "intermediate_size")
        out[f"{short} qkv"] = ((heads + 2 * kv) * head_dim, d)
        out[f"{short} o"] = (d, heads * head_dim)
        out[f"{short} {'gate+up' if gated else 'fc1'}"] = ((2 if gated else 1) * ffn, d)
        if gated:
            out[f"{short} down"] = (d, ffn)
    llama = configs["llama-3-8b"]
    out["lm head"] = (llama.vocab_size, llama.hidden_size)
    return out


def chain_weights(layers: int, d: int, heads: int, kv_heads: int, head_dim: int, device,
                  dtype=torch.float16, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Each layer's fused query, key and value weight [(heads + 2 kv_heads) * head_dim, d] and
    output projection [d, heads * head_dim], scaled so that the chain keeps its values' size."""
    gen = torch.Generator(device).manual_seed(seed)

    def rand(n, k):
        return (torch.randn(n, k, generator=gen, device=device) / k ** 0.5).to(dtype)

    return [(rand((heads + 2 * kv_heads) * head_dim, d), rand(d, heads * head_dim))
            for _ in range(layers)]


def run_chain(x: torch.Tensor, weights, proj: Callable) -> torch.Tensor:
    """Each layer's query, key and value projection of ``x`` [1, 1, d], then its output
    projection of the query's part: ``x`` for the next layer."""
    for w_qkv, w_o in weights:
        x = proj(proj(x, w_qkv, None)[..., : w_o.shape[1]], w_o, None)
    return x


def chain_study(layers: int) -> None:
    cfg = shape_configs()["llama-3-8b"]
    d, heads = cfg.hidden_size, cfg.num_attention_heads
    weights = chain_weights(layers, d, heads, cfg.num_key_value_heads, d // heads, "cuda")
    x = torch.randn(1, 1, d, device="cuda", dtype=torch.float16)
    gb = sum(w.numel() * w.element_size() for pair in weights for w in pair) / 1e9
    bw = copy_bandwidth() / 1e9
    print(f"copy bandwidth {bw:.0f} GB/s; {layers} layers, {gb:.2f} GB of weights")
    want = run_chain(x, weights, F.linear).float()
    with mock.patch.dict(os.environ):  # the environment restored afterwards
        for name, pdl, proj in (("gemv, programmatic", "1", dense.gemv),
                                ("gemv, plain", "0", dense.gemv), ("cuBLAS", "0", F.linear)):
            os.environ[PDL_ENV] = pdl
            got = run_chain(x, weights, proj).float()  # autotunes outside the graph
            err = ((got - want).abs().max() / want.abs().max()).item()
            ms = graph_bench(lambda p=proj: run_chain(x, weights, p), rep=200)
            print(f"{name:20s} {ms * 1e3 / layers:7.1f} us a layer "
                  f"({gb / ms / 1e-3 / bw * 100:4.0f}% of copy; programmatic "
                  f"{proj is dense.gemv and programmatic()})  max err {err:.1e} of the largest")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--chain", action="store_true",
                        help="Llama-3-8B's dense attention projections of every layer back to "
                             "back, programmatic against plain launch and cuBLAS")
    parser.add_argument("--layers", type=int, default=32)
    args = parser.parse_args()
    if args.chain:
        chain_study(args.layers)
        return
    bw = copy_bandwidth() / 1e9
    print(f"copy bandwidth {bw:.0f} GB/s")
    for name, (n, d) in shapes().items():
        x = torch.randn(1, 1, d, device="cuda", dtype=torch.float16)
        w = torch.randn(n, d, device="cuda", dtype=torch.float16) / d ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.float16) if name.startswith("opt") else None
        err = (dense.gemv(x, w, b).float() - F.linear(x, w, b).float()).abs().max().item()
        t_k = graph_bench(lambda x=x, w=w, b=b: dense.gemv(x, w, b), rep=200)
        t_c = graph_bench(lambda x=x, w=w, b=b: F.linear(x, w, b), rep=200)
        gb = n * d * 2 / 1e9
        print(f"{name:14s} {n}x{d}: gemv {t_k * 1e3:7.1f} us ({gb / t_k / 1e-3 / bw * 100:4.0f}% "
              f"of copy)  cuBLAS {t_c * 1e3:7.1f} us ({gb / t_c / 1e-3 / bw * 100:4.0f}%)  "
              f"max err {err:.2e}  {dense._gemv_kernel.best_config}")


if __name__ == "__main__":
    main()
