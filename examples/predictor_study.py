"""How well can a cheap selector rank a gated MLP's neurons? Recall of the true top half of
|act(gate) * up| on held-out calibration tokens, per layer, for learned predictors and for
training-free images of the gate and up projections.

    python examples/predictor_study.py [--model smollm2-135m] [--layers 4 16 26] [--tokens N]
                                       [--cache DIR]

Selectors compared (all at density 0.5, one top-k over all neurons):

- the trained predictor of ``dejavu calibrate`` (rank 128, 12 epochs), rank 256, 30 epochs;
- the same predictor trained with a ranking loss instead of the binary one: pairwise (logistic
  loss on 512 sampled pairs of a top-half and a bottom-half neuron per token), listwise
  (softmax cross-entropy towards the top half) and a regression on each token's standardised
  log |h|;
- the same predictor reading the residual stream (the input of the norm before the MLP)
  instead of the MLP's input;
- |act(gate x)|: the exact gate alone (what the ``gate`` selector ranks by);
- |act(gate x) * U_r(x)|: the exact gate times a rank-r SVD image of the up projection;
- |act(G_r(x)) * U_r(x)|: rank-r SVD images of both.

``--cache`` reuses the activations ``dejavu calibrate --cache`` recorded (same text, tokens).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from dejavu_compile.kernels.reference import activate

from dejavu_compile import calibrate as cal
from dejavu_compile.models import documentation_text, load_model


def low_rank(w: torch.Tensor, rank: int):
    """x -> x W_r^T for the best rank-``rank`` approximation W_r of ``w`` [out, in]."""
    u, s, v = torch.linalg.svd(w.float(), full_matrices=False)
    left, right = u[:, :rank] * s[:rank], v[:rank]
    return lambda x: (x @ right.t()) @ left.t()


def pairwise_loss(scores, labels, magnitudes, pairs: int = 512):
    """Logistic loss on sampled (top-half, bottom-half) neuron pairs of each token."""
    top = labels.bool()
    pos = torch.multinomial(top.float(), pairs, replacement=True)
    neg = torch.multinomial((~top).float(), pairs, replacement=True)
    return F.softplus(scores.gather(1, neg) - scores.gather(1, pos)).mean()


def listwise_loss(scores, labels, magnitudes):
    """Softmax cross-entropy of each token's scores towards its top half."""
    return -(F.log_softmax(scores, 1) * labels).sum(1).mean() / labels.sum(1).mean()


def regression_loss(scores, labels, magnitudes):
    """Squared error to each token's standardised log |h|."""
    z = torch.log(magnitudes + 1e-6)
    return F.mse_loss(scores, (z - z.mean(1, keepdim=True)) / z.std(1, keepdim=True))


LOSSES = {"pairwise": pairwise_loss, "listwise": listwise_loss, "regression": regression_loss}
# the norm whose output is the MLP's input, in the Llama and Gemma 3 families
MLP_NORMS = ("post_attention_layernorm", "pre_feedforward_layernorm")


def residual_hooks(model, layers) -> tuple[dict, list]:
    """Pre-hooks that keep the input of each layer's MLP norm (the residual stream): rows per
    layer, and the handles."""
    kept, handles = {layer: [] for layer in layers}, []
    for layer in layers:
        norm = next((mod for name, mod in model.named_modules()
                     if name.endswith(f"layers.{layer}.{MLP_NORMS[0]}")
                     or name.endswith(f"layers.{layer}.{MLP_NORMS[1]}")), None)
        if norm is None:
            raise SystemExit(f"layer {layer}: no MLP norm named {MLP_NORMS}")
        handles.append(norm.register_forward_pre_hook(
            lambda mod, args, layer=layer: kept[layer].append(
                args[0].reshape(-1, args[0].shape[-1]).half())))
    return kept, handles


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--layers", type=int, nargs="+", default=[4, 16, 26])
    parser.add_argument("--tokens", type=int, default=cal.DEFAULT_TOKENS)
    parser.add_argument("--cache", type=Path, help="recorded activations (dejavu calibrate --cache)")
    args = parser.parse_args()

    torch.manual_seed(0)
    loaded = load_model(args.model)
    ids = loaded.encode(documentation_text("calibration"), args.tokens)
    residual, handles = residual_hooks(loaded.model, args.layers)
    try:
        traces = {t.layer: t for t in cal.record(loaded.model, ids, args.cache,
                                                 layers=args.layers)}
    finally:
        for handle in handles:
            handle.remove()
    for layer in args.layers:
        trace = traces[layer]
        if trace.up is None:
            raise SystemExit(f"layer {layer}: not a gated MLP")
        x, h = trace.x.float(), trace.h.float().abs()
        val = slice(x.shape[0] - x.shape[0] // 10, None)  # train_predictor's split is random
        k = round(0.5 * h.shape[1])
        xv, hv = x[val], h[val]
        with torch.no_grad():
            gate = activate(xv @ trace.first.weight.float().t(), trace.act)
            row = {"gate": cal.recall_at(gate.abs(), hv, k)}
            for r in (32, 64, 128):
                up_r = low_rank(trace.up.weight, r)(xv)
                gate_r = activate(low_rank(trace.first.weight, r)(xv), trace.act)
                row[f"gate*up_r{r}"] = cal.recall_at((gate * up_r).abs(), hv, k)
                row[f"gate_r{r}*up_r{r}"] = cal.recall_at((gate_r * up_r).abs(), hv, k)
        for name, rank, epochs in (("trained r128", 128, 12), ("trained r256", 256, 12),
                                   ("trained r128 e30", 128, 30)):
            row[name] = cal.train_predictor(trace, rank, epochs)[1]["recall"]
        for name, loss in LOSSES.items():
            row[f"r128 {name}"] = cal.train_predictor(trace, 128, 12, loss_fn=loss)[1]["recall"]
        stream = torch.cat(residual[layer])
        if stream.shape[0] >= x.shape[0]:  # not with --cache: then only record's discovery ran
            stream = stream[-x.shape[0]:]  # the rows of the recorded sequences
            on_stream = cal.MLPTrace(layer, stream, trace.h, trace.first, trace.up, trace.down,
                                     trace.act)
            row["r128 residual stream"] = cal.train_predictor(on_stream, 128, 12)[1]["recall"]
        print(f"layer {layer}: " + ", ".join(f"{n} {v:.3f}" for n, v in row.items()), flush=True)


if __name__ == "__main__":
    main()
