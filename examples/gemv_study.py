"""``dejavu::gemv`` (kernels/dense.py) against cuBLAS ``F.linear`` on a GPU: one row, fp16, at
the dense projection shapes of the end-to-end models, each call replayed in a CUDA graph
(``triton.testing.do_bench_cudagraph``).

Replaying one matrix leaves part of it in L2 between replays (50 MB on an H200), so matrices
below that size read faster than from memory: the end-to-end profile (``dejavu bench
--breakdown``, mode ``dejavu_gemv``) is the measure that counts. Run on a CUDA machine:
``TRITON_INTERPRET=0 python examples/gemv_study.py``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
from dejavu_compile.kernels import dense

from dejavu_compile.bench import copy_bandwidth, shape_configs


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


def main() -> None:
    bw = copy_bandwidth() / 1e9
    print(f"copy bandwidth {bw:.0f} GB/s")
    for name, (n, d) in shapes().items():
        x = torch.randn(1, 1, d, device="cuda", dtype=torch.float16)
        w = torch.randn(n, d, device="cuda", dtype=torch.float16) / d ** 0.5
        b = torch.randn(n, device="cuda", dtype=torch.float16) if name.startswith("opt") else None
        err = (dense.gemv(x, w, b).float() - F.linear(x, w, b).float()).abs().max().item()
        t_k = triton.testing.do_bench_cudagraph(lambda x=x, w=w, b=b: dense.gemv(x, w, b), rep=200)
        t_c = triton.testing.do_bench_cudagraph(lambda x=x, w=w, b=b: F.linear(x, w, b), rep=200)
        gb = n * d * 2 / 1e9
        print(f"{name:14s} {n}x{d}: gemv {t_k * 1e3:7.1f} us ({gb / t_k / 1e-3 / bw * 100:4.0f}% "
              f"of copy)  cuBLAS {t_c * 1e3:7.1f} us ({gb / t_c / 1e-3 / bw * 100:4.0f}%)  "
              f"max err {err:.2e}  {dense._gemv_kernel.best_config}")


if __name__ == "__main__":
    main()
