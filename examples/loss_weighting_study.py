"""Does weighting the predictor's loss by neuron importance help? For SmolLM2-135M layers
4 / 16 / 26: the held-out relative error of the MLP output when only the selected half of the
neurons is kept, for the oracle (true top half by |h|), a predictor trained with the plain
binary loss and one trained with ``calibrate.importance_weights`` (the calibrator's loss).

    python examples/loss_weighting_study.py [--layers 4 16 26] [--tokens 16384]

Each predictor keeps the epoch with the lowest held-out error (rank 128, 12 epochs, one top-k
over all neurons); recall of the true top half is printed beside it.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from dejavu_compile import calibrate as cal
from dejavu_compile.models import documentation_text, load_model


def output_error(h, keep, down_w) -> float:
    """Mean over tokens of |y - y_kept| / |y|, y = h W_down^T."""
    y, kept = h @ down_w.t(), (h * keep) @ down_w.t()
    return ((y - kept).norm(dim=1) / y.norm(dim=1)).mean().item()


def train(x, h, down_w, tr, val, weighted: bool, rank=128, epochs=12):
    torch.manual_seed(0)
    k, h_abs = h.shape[1] // 2, h.abs()
    labels = cal.top_mask(h_abs, k).float()
    weights = cal.importance_weights(h_abs, down_w.norm(dim=0)) if weighted else None
    mean, std = x[tr].mean(0), x[tr].std(0).clamp_min(1e-6)
    xs = (x - mean) / std
    pred = cal.Predictor(x.shape[1], rank, h.shape[1])
    opt = torch.optim.Adam(pred.parameters(), lr=cal.LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    best = (float("inf"), 0.0)
    for _ in range(epochs):
        for b in tr[torch.randperm(len(tr))].split(cal.BATCH):
            loss = F.binary_cross_entropy_with_logits(
                pred(xs[b]), labels[b], weight=None if weights is None else weights[b])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        with torch.no_grad():
            scores = pred(xs[val])
            err = output_error(h[val], cal.top_mask(scores, k).float(), down_w)
            if err < best[0]:
                best = (err, cal.recall_at(scores, h_abs[val], k))
    return best


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 26])
    parser.add_argument("--tokens", type=int, default=cal.DEFAULT_TOKENS)
    args = parser.parse_args()
    torch.manual_seed(0)
    loaded = load_model("smollm2-135m")
    ids = loaded.encode(documentation_text("calibration"), args.tokens)
    for trace in cal.record(loaded.model, ids, layers=args.layers):
        x, h = trace.x.float(), trace.h.float()
        down_w = trace.down.weight.detach().float()
        perm = torch.randperm(x.shape[0])
        val, tr = perm[: x.shape[0] // 10], perm[x.shape[0] // 10:]
        oracle = output_error(h[val], cal.top_mask(h[val].abs(), h.shape[1] // 2).float(), down_w)
        row = [f"oracle {oracle:.3f}"]
        for name, weighted in (("plain", False), ("importance-weighted", True)):
            err, recall = train(x, h, down_w, tr, val, weighted)
            row.append(f"{name} {err:.3f} (recall {recall:.3f})")
        print(f"layer {trace.layer}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
