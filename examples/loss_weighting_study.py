"""Does weighting the predictor's loss by neuron importance help? For SmolLM2-135M layers
4 / 16 / 26: the held-out relative error of the MLP output when only the selected half of the
neurons is kept, for the oracle (true top half by |h|), a predictor trained with the plain
binary loss and one trained with ``calibrate.importance_weights`` (the calibrator's loss).

    python examples/loss_weighting_study.py [--layers 4 16 26] [--tokens 16384]

Each predictor is ``calibrate.train_predictor``'s (rank 128, 12 epochs, one top-k over all
neurons), keeping the epoch with the lowest held-out error; recall of the true top half is
printed beside it.
"""

from __future__ import annotations

import argparse

import torch

from dejavu_compile import calibrate as cal
from dejavu_compile.models import documentation_text, load_model


def output_error(h, keep, down_w) -> float:
    """Mean over tokens of |y - y_kept| / |y|, y = h W_down^T."""
    y, kept = h @ down_w.t(), (h * keep) @ down_w.t()
    return ((y - kept).norm(dim=1) / y.norm(dim=1)).mean().item()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 26])
    parser.add_argument("--tokens", type=int, default=cal.DEFAULT_TOKENS)
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m")
    ids = loaded.encode(documentation_text("calibration"), args.tokens)
    for trace in cal.record(loaded.model, ids, layers=args.layers):
        h, down_w = trace.h.float(), trace.down.weight.detach().float()
        k = h.shape[1] // 2
        row = []
        for name, weighted in (("plain", False), ("importance-weighted", True)):
            pred, quality = cal.train_predictor(
                trace, 128, 12, weighted=weighted,  # the epoch with the lowest held-out error
                keep_by=lambda scores, val, h=h, k=k, down_w=down_w: -output_error(
                    h[val], cal.top_mask(scores, k).float(), down_w))
            val_h = quality["val_h"].float()
            if not row:  # the oracle on the same held-out tokens
                oracle = output_error(val_h, cal.top_mask(val_h.abs(), k).float(), down_w)
                row.append(f"oracle {oracle:.3f}")
            with torch.no_grad():
                kept = cal.top_mask(pred(quality["val_x"]), k).float()
            row.append(f"{name} {output_error(val_h, kept, down_w):.3f} "
                       f"(recall {quality['recall']:.3f})")
        print(f"layer {trace.layer}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
