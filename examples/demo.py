"""The main job on a real model, on CPU: calibrate if there is no profile, compile, generate,
print quality and sparsity.

    python examples/demo.py [--model smollm2-135m] [--profile profiles/smollm2-135m.yaml]

With no profile at the given path, runs ``dejavu calibrate`` first (about 6 minutes for
SmolLM2-135M on 2 cores). Then compiles the model with the profile's learned predictors,
generates next to the dense model, and prints the held-out perplexity of dense, oracle (the
profile's densities with perfect selection) and the profile, with the bytes each token reads.
"""

from __future__ import annotations

import argparse
import copy
from pathlib import Path

import torch

import dejavu_compile
from dejavu_compile.calibrate import calibrate
from dejavu_compile.evaluate import DEFAULT_WINDOW, evaluate_profile, windows
from dejavu_compile.models import documentation_text, load_model

PROMPT = "The Python documentation says that a list"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--profile", default=None, help="default: profiles/MODEL.yaml")
    parser.add_argument("--tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--windows", type=int, default=4, help="held-out windows of 128 tokens")
    args = parser.parse_args()
    path = Path(args.profile or f"profiles/{args.model}.yaml")

    torch.manual_seed(0)
    loaded = load_model(args.model)
    if not path.is_file():
        print(f"no profile at {path}: calibrating {args.model} (dejavu calibrate)")
        ids = loaded.encode(documentation_text("calibration"), 16384)
        calibrate(loaded.model, ids, loaded.name, path)
    profile = dejavu_compile.load_profile(path)

    sparse = copy.deepcopy(loaded.model)
    dejavu_compile.compile(sparse, profile=profile, inner="eager")
    ids = loaded.encode(PROMPT)
    with torch.no_grad():
        for name, model in (("dense", loaded.model), ("dejavu", sparse)):
            out = model.generate(ids, attention_mask=torch.ones_like(ids), do_sample=False,
                                 max_new_tokens=args.tokens, min_new_tokens=args.tokens)
            text = loaded.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
            # The prompt, then the continuation quoted as a Python string (its newlines shown).
            print(f"{name:>6}: {PROMPT!r} + {text!r}")

    held = loaded.encode(documentation_text("held_out"), DEFAULT_WINDOW * args.windows)
    result = evaluate_profile(loaded.model, windows(held, DEFAULT_WINDOW, args.windows), profile)
    dense = result["dense_ppl"]
    print(f"\nheld-out perplexity over {result['tokens']} decoded tokens (Python docs):")
    for key in ("dense_ppl", "oracle_ppl", "sparse_ppl"):
        print(f"  {key[:-4]:>7}: {result[key]:.3f} ({100 * (result[key] / dense - 1):+.1f}%)")
    print(f"  top-1 agreement with dense: {100 * result['top1_agreement']:.1f}%")
    sparse_layers = [r for r in profile.layers if r.mlp.sparse]
    print(f"\nsparsity: {len(sparse_layers)} of {len(profile.layers)} MLPs sparse; MLP weight bytes "
          f"read per token {result['mlp_bytes_fraction']:.2f} of dense (predictors included); "
          f"all weights {result['bytes_per_token_sparse'] / 2**20:.1f} MiB of "
          f"{result['bytes_per_token_dense'] / 2**20:.1f} MiB")
    print()
    print(dejavu_compile.report(sparse))


if __name__ == "__main__":
    main()
