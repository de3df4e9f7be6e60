"""Quickstart: SmolLM2-135M decoding through sparse MLPs chosen per token, next to dense.

    python examples/quickstart.py [--density 0.5] [--selector oracle] [--tokens 48]

Compiles the model with the dejavu backend (oracle selector: the true top-k neurons of each
token, the quality ceiling of contextual sparsity), generates from the same prompt dense and
sparse, prints both texts with tokens per second, the held-out perplexity of each (teacher-forced
decoding on Python documentation text) and the compile report.
"""

from __future__ import annotations

import argparse
import copy
import time

import torch

import dejavu_compile
from dejavu_compile.evaluate import score_decode, windows
from dejavu_compile.models import documentation_text, load_model

PROMPT = "Python's list comprehensions are"


def generate(model, loaded, prompt: str, tokens: int) -> tuple[str, float]:
    ids = loaded.encode(prompt)
    mask = torch.ones_like(ids)
    with torch.no_grad():
        # Warm up: compiles prefill, the first decode step and the graph general in cache length.
        model.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, max_new_tokens=tokens,
                             min_new_tokens=tokens, do_sample=False)
        seconds = time.perf_counter() - start
    text = loaded.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
    return text, tokens / seconds


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--density", type=float, default=0.5, help="MLP density (kept fraction)")
    parser.add_argument("--tokens", type=int, default=48, help="tokens to generate")
    parser.add_argument("--eval-windows", type=int, default=4, help="held-out windows of 128")
    parser.add_argument("--inner", default="eager", choices=("eager", "inductor"))
    args = parser.parse_args()

    torch.manual_seed(0)
    loaded = load_model(args.model)
    dense = loaded.model
    sparse = copy.deepcopy(dense)
    # The first layer is kept dense, as in the paper: its input changes most. The inner compiler
    # is eager here: Inductor works too, but compiling 30 layers costs minutes on 2 CPU cores.
    dejavu_compile.compile(sparse, selector="oracle", mlp_density=args.density, dense_layers=[0],
                           inner=args.inner)

    dense_text, dense_tps = generate(dense, loaded, PROMPT, args.tokens)
    sparse_text, sparse_tps = generate(sparse, loaded, PROMPT, args.tokens)
    print(f"prompt: {PROMPT!r}\n")
    print(f"dense  ({dense_tps:.1f} tok/s, eager): {dense_text!r}\n")
    print(f"dejavu ({sparse_tps:.1f} tok/s, MLP density {args.density}, oracle): {sparse_text!r}\n")
    print("(CPU speed says little: the dejavu ops run their PyTorch reference here, and the\n"
          " oracle computes the dense MLP to choose neurons. Speed is measured on GPU by\n"
          " `dejavu bench`.)\n")

    ids = loaded.encode(documentation_text("held_out"), 128 * args.eval_windows)
    chunks = windows(ids, 128, args.eval_windows)
    base = score_decode(dense, chunks)
    ours = score_decode(sparse, chunks)
    change = 100 * (ours.perplexity / base.perplexity - 1)
    print(f"held-out perplexity ({sum(c.shape[1] for c in chunks)} tokens, Python docs): "
          f"dense {base.perplexity:.3f}, dejavu {ours.perplexity:.3f} ({change:+.1f}%), "
          f"top-1 agreement {100 * ours.agreement(base):.1f}%\n")

    report = dejavu_compile.report(sparse)
    print(report)
    mlp_dense = sum(r.mlp.dense_bytes for r in report.layers if r.mlp)
    mlp_sparse = sum(r.mlp.sparse_bytes for r in report.layers if r.mlp)
    print(f"\nMLP weight bytes read per decoded token: {mlp_sparse / mlp_dense:.2f} of dense "
          f"(the oracle's own dense read not counted: a predictor replaces it)")


if __name__ == "__main__":
    main()
