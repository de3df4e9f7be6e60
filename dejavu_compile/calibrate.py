"""Calibration: record each MLP's input and activations on real text, train one low-rank
predictor per layer, measure its recall, choose per-layer densities for a byte budget, and write
the profile (YAML) with the predictor weights (safetensors beside it).

Blocks are found by the same discovery pass the backend runs (data flow, not class names); the
recording hooks then sit on the modules that own the discovered weights.

Attention stays dense here: on SmolLM2-135M the oracle at head density 0.5 costs +74% perplexity
(issue 3), so heads of these small models do not pay.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.weak import WeakIdKeyDictionary
from tqdm import tqdm

from .profile import (
    BUCKET_UNITS,
    BlockProfile,
    LayerProfile,
    ModelIdentity,
    Profile,
    default_buckets,
    kept_units,
    save_profile,
)

log = logging.getLogger("dejavu_compile")

DEFAULT_TOKENS = 16384
DEFAULT_RANK = 128
DEFAULT_EPOCHS = 12
DEFAULT_TARGET_DENSITY = 0.6  # MLP bytes read per token, predictors included, as a fraction
TRAIN_DENSITY = 0.5  # labels: the true top half of each token's neurons
DENSITY_STEPS = (1.0, 0.9, 0.8, 0.7, 0.6, 0.5, 0.4, 0.3)
CONTEXT = 256  # tokens per calibration sequence
LR, BATCH = 1e-2, 128
# ``importance_weights``: a neuron's loss weight for a token is this floor plus its importance
# (|h| times the norm of its down-projection column, over the token's mean), capped. On
# SmolLM2-135M it lowers the held-out error of the MLP output at density 0.5 by 7-10% and
# raises next-token agreement, but not perplexity (README), so it is an option, off by default.
IMPORTANCE_FLOOR, IMPORTANCE_CAP = 0.5, 8.0
SENSITIVITY_TOKENS = 512  # tokens of calibration text each sensitivity forward pass scores
CALIBRATION_SELECTORS = ("predictor", "gate", "threshold")
# weights of the greedy allocation against the uniform spread tried by ``blend_allocation``,
# and the byte overshoot it allows (a blend keeps a predictor on a layer one side left dense)
BLEND_STEPS = (0.0, 0.25, 0.5, 0.75, 1.0)
# With a perplexity budget (``max_ppl_increase``): the last VALIDATION_TOKENS calibration tokens
# are held out (not recorded, not trained on) and the byte targets tried on them, densest first
VALIDATION_TOKENS = 512
SEARCH_STEPS = tuple(round(1.0 - 0.05 * i, 2) for i in range(1, 15))  # 0.95 .. 0.30
BLEND_SLACK = 0.01
DEFAULT_SELECTORS = ("predictor",)


@dataclass
class MLPTrace:
    """What one MLP block saw on the calibration text."""

    layer: int
    x: torch.Tensor  # [T, d] block input
    h: torch.Tensor  # [T, N] hidden activations act(W1 x) [* W_up x]
    first: torch.nn.Module
    up: torch.nn.Module | None
    down: torch.nn.Module
    act: str


def find_mlp_modules(model, sample: torch.Tensor) -> list[tuple[int, dict]]:
    """Discover the MLP blocks of ``model`` from its Dynamo graph and return, per layer, the
    modules owning the discovered weights and the activation."""
    from dejavu_compile.passes import discover
    from dejavu_compile.passes.context import PassContext

    from .config import DejavuOptions

    found = []

    def backend(gm, example_inputs):
        opts = DejavuOptions(selector="oracle")
        names = WeakIdKeyDictionary({p: n for n, p in model.named_parameters()})
        ctx = PassContext.build(gm, example_inputs, opts, None, {}, names)
        discover.run(gm, ctx)
        found.append(ctx.discovery)
        return gm.forward

    owner = {id(mod.weight): mod for mod in model.modules()
             if isinstance(getattr(mod, "weight", None), torch.Tensor)}
    torch._dynamo.reset()
    with torch.no_grad():
        torch.compile(model, backend=backend)(sample)
    torch._dynamo.reset()
    blocks = []
    for disc in found:
        for layer, block in sorted(disc.mlp.items()):
            blocks.append((layer, {
                "first": owner[id(block.first.weight)],
                "up": owner[id(block.up.weight)] if block.up is not None else None,
                "down": owner[id(block.down.weight)],
                "act": block.act,
            }))
    if not blocks:
        raise ValueError("no MLP block found in the model: nothing to calibrate")
    return blocks


CACHE_TOKENS = "tokens.json"  # the fingerprint of the tokens a cache folder's activations are of


def _fingerprint(ids: torch.Tensor) -> dict:
    data = ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes()
    return {"tokens": int(ids.shape[-1]), "sha256": hashlib.sha256(data).hexdigest()}


def _check_cache_tokens(cache_dir: Path, want: dict, recorded: bool) -> None:
    """Refuse a cache folder whose activations are of other tokens than those of fingerprint
    ``want`` (or of tokens it cannot tell: recorded before the fingerprint was kept)."""
    path = cache_dir / CACHE_TOKENS
    if not path.is_file():
        if recorded:
            raise ValueError(f"cache {cache_dir} holds activations without the fingerprint of "
                             f"their tokens ({CACHE_TOKENS}): delete it or use another folder")
        return
    have = json.loads(path.read_text())
    if have != want:
        raise ValueError(f"cache {cache_dir} holds activations of other calibration tokens "
                         f"({have['tokens']} tokens, sha256 {have['sha256'][:12]}; these are "
                         f"{want['tokens']}, {want['sha256'][:12]}): another text, token count "
                         f"or held-out split; delete it or use another folder")


@torch.no_grad()
def record(model, ids: torch.Tensor, cache_dir: Path | None = None,
           progress: bool = True, layers=None) -> list[MLPTrace]:
    """Run the dense model over ``ids`` [1, T] in sequences of ``CONTEXT`` tokens and record
    every MLP's input and hidden activations (only those of ``layers`` when given: memory grows
    with tokens x layers). With ``cache_dir``, recorded layers are saved with a fingerprint of
    ``ids`` and a rerun on the same tokens resumes from them; a cache of other tokens (another
    text, count or held-out split) is an error, not reused."""
    blocks = find_mlp_modules(model, ids[:, :8])
    if layers is not None:
        blocks = [(layer, mods) for layer, mods in blocks if layer in set(layers)]
    traces = {layer: {"x": [], "h": []} for layer, _ in blocks}
    cached = cache_dir is not None and all((cache_dir / f"mlp{layer}.pt").is_file()
                                           for layer, _ in blocks)
    if cache_dir is not None:
        fingerprint = _fingerprint(ids)
        _check_cache_tokens(cache_dir, fingerprint, recorded=any(cache_dir.glob("mlp*.pt")))
    if not cached:
        if cache_dir is not None:
            # the tokens first: a run stopped between two layers leaves a cache that says what
            # it is of
            cache_dir.mkdir(parents=True, exist_ok=True)
            (cache_dir / CACHE_TOKENS).write_text(json.dumps(fingerprint))
        handles = []
        for layer, mods in blocks:
            def keep_x(mod, args, layer=layer):
                traces[layer]["x"].append(args[0].reshape(-1, args[0].shape[-1]).half())

            def keep_h(mod, args, layer=layer):
                traces[layer]["h"].append(args[0].reshape(-1, args[0].shape[-1]).half())

            handles.append(mods["first"].register_forward_pre_hook(keep_x))
            handles.append(mods["down"].register_forward_pre_hook(keep_h))
        try:
            chunks = range(0, ids.shape[1] - 1, CONTEXT)
            for start in tqdm(chunks, desc="record", disable=not progress, leave=False):
                model(ids[:, start : start + CONTEXT])
        finally:
            for h in handles:
                h.remove()
        for layer in traces:
            traces[layer] = {k: torch.cat(v) for k, v in traces[layer].items()}
            if cache_dir is not None:
                torch.save(traces[layer], cache_dir / f"mlp{layer}.pt")
    else:
        traces = {layer: torch.load(cache_dir / f"mlp{layer}.pt") for layer, _ in blocks}
    return [MLPTrace(layer, traces[layer]["x"], traces[layer]["h"], mods["first"], mods["up"],
                     mods["down"], mods["act"]) for layer, mods in blocks]


class Predictor(torch.nn.Module):
    """d -> rank -> units, ReLU between (the profile's ``activation: relu``)."""

    def __init__(self, d: int, rank: int, units: int):
        super().__init__()
        self.w1 = torch.nn.Linear(d, rank)
        self.w2 = torch.nn.Linear(rank, units)

    def forward(self, x):
        return self.w2(F.relu(self.w1(x)))

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        """The weights as the profile stores them: fp16, which keeps shipped profiles small
        (the backend casts them to the model's dtype)."""
        named = {"w1": self.w1.weight, "b1": self.w1.bias, "w2": self.w2.weight, "b2": self.w2.bias}
        return {prefix + k: v.detach().half() for k, v in named.items()}


def top_mask(scores: torch.Tensor, k: int, buckets: int = 1) -> torch.Tensor:
    """Boolean [T, N]: each row's ``k`` largest scores (the top ``k / buckets`` of each bucket
    when ``buckets`` > 1: what the backend's predictor selects, ``reference.bucket_topk``)."""
    from dejavu_compile.kernels.reference import bucket_topk

    ids = scores.topk(k, dim=1).indices if buckets == 1 else bucket_topk(scores, k, buckets)
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(1, ids, True)


def recall_at(pred_scores: torch.Tensor, true_scores: torch.Tensor, k: int,
              buckets: int = 1) -> float:
    """Mean fraction of the true (global) top-k that the predicted top-k contains, the
    prediction taken per bucket when ``buckets`` > 1."""
    hit = top_mask(pred_scores, k, buckets) & top_mask(true_scores, k)
    return hit.sum().item() / (k * true_scores.shape[0])


def importance_weights(h_abs: torch.Tensor, down_norms: torch.Tensor) -> torch.Tensor:
    """Loss weights [T, N]: ``IMPORTANCE_FLOOR`` plus each neuron's importance (|h| times the
    norm of its down-projection column) over the token's mean, capped at ``IMPORTANCE_CAP`` (a
    heavy tail would leave the loss to a few neurons); a token whose importance is not finite
    (overflowed activations) gets plain weights."""
    importance = h_abs * down_norms
    ratio = importance / importance.mean(1, keepdim=True).clamp_min(1e-12)
    ratio = torch.where(torch.isfinite(ratio).all(1, keepdim=True), ratio, 1.0)
    return IMPORTANCE_FLOOR + ratio.clamp_max(IMPORTANCE_CAP)


def train_predictor(trace: MLPTrace, rank: int, epochs: int, seed: int = 0,
                    held_out: float = 0.1, buckets: int = 1, weighted: bool = False,
                    keep_by=None, loss_fn=None) -> tuple[Predictor, dict]:
    """Train a predictor of the top-``TRAIN_DENSITY`` neurons of ``trace`` with a binary loss
    (with ``weighted``, each neuron's term weighted by its importance: ``importance_weights``),
    or with ``loss_fn(scores, labels, magnitudes)`` of a batch when given (the study of other
    losses, ``examples/predictor_study.py``); keep the epoch with the best held-out recall (of
    its selection per bucket), or the highest ``keep_by(scores, val)`` (held-out scores and the
    held-out token indices) when given. Returns it and its quality."""
    torch.manual_seed(seed)
    x, target = trace.x.float(), trace.h.float().abs()
    n_val = max(1, int(held_out * x.shape[0]))
    perm = torch.randperm(x.shape[0])
    val, tr = perm[:n_val], perm[n_val:]
    units = target.shape[1]
    k = kept_units(TRAIN_DENSITY, units, buckets)
    labels = top_mask(target, k).float()
    weights = (importance_weights(target, trace.down.weight.detach().float().norm(dim=0))
               if weighted else None)
    # Standardise inputs with calibration statistics, folded into w1/b1 after training.
    mean, std = x[tr].mean(0), x[tr].std(0).clamp_min(1e-6)
    pred = Predictor(x.shape[1], rank, units)
    opt = torch.optim.Adam(pred.parameters(), lr=LR)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, epochs)
    best, best_recall, best_state = -float("inf"), -1.0, None
    xs = (x - mean) / std
    for _ in range(epochs):
        pred.train()
        for batch in tr[torch.randperm(len(tr))].split(BATCH):
            if loss_fn is not None:
                loss = loss_fn(pred(xs[batch]), labels[batch], target[batch])
            else:
                loss = F.binary_cross_entropy_with_logits(
                    pred(xs[batch]), labels[batch],
                    weight=None if weights is None else weights[batch])
            opt.zero_grad()
            loss.backward()
            opt.step()
        sched.step()
        pred.eval()
        with torch.no_grad():
            scores = pred(xs[val])
            r = recall_at(scores, target[val], k, buckets)
            score = r if keep_by is None else keep_by(scores, val)
        if score > best:
            best, best_recall = score, r
            best_state = {n: t.clone() for n, t in pred.state_dict().items()}
    pred.load_state_dict(best_state)
    with torch.no_grad():  # fold the standardisation into the first layer
        pred.w1.bias -= (pred.w1.weight * (mean / std)).sum(1)
        pred.w1.weight /= std
        scores = pred(x[val])
        k_pred = top_mask(scores, k, buckets)
        truth = top_mask(target[val], k)
        precision = (k_pred & truth).sum().item() / max(1, k_pred.sum().item())
    return pred, {"recall": best_recall, "precision": precision, "val_x": x[val], "val_h": trace.h[val],
                  "buckets": buckets}


@torch.no_grad()
def recall_by_density(pred: Predictor, quality: dict,
                      densities=DENSITY_STEPS) -> dict[float, float]:
    """Recall of the true top-k by the predictor's top-k at each density (default: the steps),
    on the held-out calibration tokens of ``train_predictor``."""
    h = quality["val_h"].float().abs()
    scores, buckets = pred(quality["val_x"]), quality.get("buckets", 1)
    return {d: recall_at(scores, h, kept_units(d, h.shape[1], buckets), buckets)
            for d in densities}


def _keep_top(t: torch.Tensor, scores: torch.Tensor, density: float,
              buckets: int = 1) -> torch.Tensor:
    """``t`` [..., N] with all but each row's top ``density`` of ``scores`` [rows, N] zeroed
    (taken per bucket when ``buckets`` > 1)."""
    k = kept_units(density, t.shape[-1], buckets)
    return t * top_mask(scores, k, buckets).reshape(t.shape).to(t.dtype)


@torch.no_grad()
def _sensitivity(model, traces: list[MLPTrace], ids: torch.Tensor, desc: str, hooks,
                 progress: bool) -> dict[int, dict[float, float]]:
    """The increase of the model's mean next-token loss on ``ids`` [1, T] when one layer at a
    time runs a selector at each density step below 1.0 (every other layer dense): one forward
    pass per (layer, density). ``hooks(trace, density)`` installs the selector and returns the
    hook handles, removed after the pass."""

    def loss() -> float:
        return model(ids, labels=ids).loss.item()

    base = loss()
    out = {}
    for trace in tqdm(traces, desc=desc, disable=not progress, leave=False):
        out[trace.layer] = {1.0: 0.0}
        for density in (d for d in DENSITY_STEPS if d < 1.0):
            handles = hooks(trace, density)
            try:
                out[trace.layer][density] = loss() - base
            finally:
                for handle in handles:
                    handle.remove()
    return out


def predictor_hooks(predictors: dict[int, Predictor],
                    sources: dict[int, torch.nn.Module] | None = None, buckets: int = 1):
    """``hooks(trace, density)`` that make one layer's MLP keep only its predictor's top-k
    neurons (see ``loss_sensitivity``) and return the hook handles."""

    def hooks(trace, density):
        pred, seen = predictors[trace.layer], {}

        def keep_x(mod, args):
            seen["x"] = args[0]

        def mask_h(mod, args):
            scores = pred(seen["x"].reshape(-1, seen["x"].shape[-1]).float())
            return (_keep_top(args[0], scores, density, buckets),)

        source = (sources or {}).get(trace.layer, trace.first)
        return [source.register_forward_pre_hook(keep_x),
                trace.down.register_forward_pre_hook(mask_h)]

    return hooks


def loss_sensitivity(model, traces: list[MLPTrace], predictors: dict[int, Predictor],
                     ids: torch.Tensor, progress: bool = True,
                     sources: dict[int, torch.nn.Module] | None = None, buckets: int = 1,
                     ) -> dict[int, dict[float, float]]:
    """Measured sensitivity of each layer to its predictor (see ``_sensitivity``): the MLP keeps
    only the predictor's top-k neurons. ``sources`` names, per layer, the module whose input the
    predictor reads (default: the layer's first projection; with lookahead, the previous
    layer's); ``buckets`` as the profile will say."""
    hooks = predictor_hooks(predictors, sources, buckets)
    return _sensitivity(model, traces, ids, "sensitivity", hooks, progress)


def joint_loss(model, traces: list[MLPTrace], ids: torch.Tensor, densities: dict[int, float],
               hooks) -> float:
    """The model's mean next-token loss on ``ids`` with every layer below density 1.0 running
    its selector at once (``hooks`` as for ``_sensitivity``)."""
    return allocation_loss(model, traces, ids, density_options(densities, "predictor"),
                           {"predictor": hooks})


@torch.no_grad()
def allocation_loss(model, traces: list[MLPTrace], ids: torch.Tensor,
                    chosen: dict[int, Option], hooks_by_selector: dict) -> float:
    """The model's mean next-token loss on ``ids`` with every layer's chosen option at once:
    each layer below density 1.0 runs its option's selector (``hooks_by_selector[selector]``,
    each as for ``_sensitivity``)."""
    handles = []
    try:
        for trace in traces:
            o = chosen.get(trace.layer)
            if o is not None and o.selector != "dense" and o.density < 1.0:
                handles += hooks_by_selector[o.selector](trace, o.density)
        return model(ids, labels=ids).loss.item()
    finally:
        for handle in handles:
            handle.remove()


def blend_allocation(adaptive: dict[int, float], flat: dict[int, float], dense_bytes: dict,
                     predictor_bytes: dict, target: float, loss, steps=BLEND_STEPS
                     ) -> tuple[dict[int, float], dict[float, float]]:
    """Per-layer predictor densities between the greedy allocation (``adaptive``, weight 1) and
    the uniform spread (``flat``, weight 0), the weight chosen by ``loss(densities)``: the joint
    loss with every layer sparse at once, which the greedy allocation (one layer at a time)
    does not see. Blends reading more than ``target`` of the bytes are skipped. Returns the
    densities and the loss of each weight tried."""
    total = sum(dense_bytes.values())
    tried, best = {}, None
    for w in steps:
        dens = {layer: round(w * adaptive.get(layer, 1.0) + (1 - w) * flat.get(layer, 1.0), 4)
                for layer in dense_bytes}
        used = sum(d * dense_bytes[layer] + (predictor_bytes.get(layer, 0) if d < 1.0 else 0)
                   for layer, d in dens.items())
        if used > target * total * (1 + BLEND_SLACK):
            continue
        tried[w] = loss(dens)
        if best is None or tried[w] < tried[best[0]]:
            best = (w, dens)
    if best is None:
        return adaptive, tried
    return best[1], tried


def gate_hooks():
    """``hooks(trace, density)`` that make one gated layer's MLP keep the top-k neurons by
    |act(gate)| and return the hook handles."""
    from dejavu_compile.kernels.reference import activate

    def hooks(trace, density):
        seen = {}

        def keep_g(mod, args, output):
            seen["g"] = output

        def mask_h(mod, args):
            h = args[0]
            score = activate(seen["g"].float(), trace.act).abs().reshape(-1, h.shape[-1])
            return (_keep_top(h, score, density),)

        return [trace.first.register_forward_hook(keep_g),
                trace.down.register_forward_pre_hook(mask_h)]

    return hooks


def gate_sensitivity(model, traces: list[MLPTrace], ids: torch.Tensor,
                     progress: bool = True) -> dict[int, dict[float, float]]:
    """Like ``loss_sensitivity`` for the gate selector: one layer's MLP keeps the top-k neurons
    by |act(gate)| (gated MLPs only; others are left out)."""
    gated = [t for t in traces if t.up is not None]
    return _sensitivity(model, gated, ids, "gate sensitivity", gate_hooks(), progress)


def threshold_hooks():
    """``hooks(trace, density)`` that make one layer's MLP projections each keep their
    largest-magnitude input activations, the density's fraction per token (TEAL)."""

    def keep_inputs(mod, args, density):
        t = args[0]
        return (_keep_top(t, t.reshape(-1, t.shape[-1]).abs().float(), density),)

    def hooks(trace, density):
        mods = [m for m in (trace.first, trace.up, trace.down) if m is not None]
        return [m.register_forward_pre_hook(
            lambda mod, args: keep_inputs(mod, args, density)) for m in mods]

    return hooks


def threshold_sensitivity(model, traces: list[MLPTrace], ids: torch.Tensor,
                          progress: bool = True) -> dict[int, dict[float, float]]:
    """Like ``loss_sensitivity`` for the training-free threshold selector (TEAL): one layer's
    MLP projections each keep their largest-magnitude input activations, the density's fraction
    per token (a per-token quantile threshold: decode graphs need a static count)."""
    return _sensitivity(model, traces, ids, "threshold sensitivity", threshold_hooks(), progress)


@torch.no_grad()
def gate_recall(trace: MLPTrace, tokens: int = 2048) -> dict[float, float]:
    """Recall of the true top-k (|h|) by the gate's top-k (|act(gate)|), per density step."""
    from dejavu_compile.kernels.reference import activate

    x, h = trace.x[:tokens].float(), trace.h[:tokens].float().abs()
    first = trace.first
    bias = first.bias.float() if first.bias is not None else None
    g = activate(F.linear(x, first.weight.float(), bias), trace.act).abs()
    return {d: recall_at(g, h, kept_units(d, h.shape[1])) for d in DENSITY_STEPS}


def module_bytes(*mods: torch.nn.Module | None) -> int:
    """Bytes of the parameters of ``mods`` (None skipped)."""
    return sum(p.numel() * p.element_size() for m in mods if m is not None for p in m.parameters())


def mlp_bytes(trace: MLPTrace) -> int:
    return module_bytes(trace.first, trace.up, trace.down)


@dataclass(frozen=True)
class Option:
    """One way to run a layer's MLP: selector, density, bytes read per token, measured loss
    increase."""

    selector: str  # "dense" | "predictor" | "gate"
    density: float
    cost: float
    error: float


def allocate_options(options: dict[int, list[Option]], target: float,
                     dense_layers: tuple[int, ...] = (0,)) -> dict[int, Option]:
    """Per layer, the option (selector and density) meeting ``target`` (bytes read, selectors
    included, as a fraction of the dense MLP bytes), greedily: start dense and repeatedly take,
    over all layers, the cheaper option with the least added error per byte saved."""
    current = {layer: next(o for o in opts if o.selector == "dense")
               for layer, opts in options.items()}
    total = sum(o.cost for o in current.values())
    while sum(o.cost for o in current.values()) > target * total:
        best, choice = math.inf, None
        for layer, opts in options.items():
            if layer in dense_layers:
                continue
            cur = current[layer]
            for o in opts:
                saved = cur.cost - o.cost
                if saved <= 0:
                    continue
                ratio = (o.error - cur.error) / saved
                if ratio < best:
                    best, choice = ratio, (layer, o)
        if choice is None:
            raise ValueError(f"target density {target} cannot be met with densities down to "
                             f"{DENSITY_STEPS[-1]}")
        current[choice[0]] = choice[1]
    return current


def predictor_options(errors: dict[float, float], dense: int, predictor: int) -> list[Option]:
    """The predictor's options for one layer: density d reads d of the MLP and the predictor."""
    return [Option("dense", 1.0, dense, 0.0)] + [
        Option("predictor", d, d * dense + predictor, errors[d]) for d in DENSITY_STEPS if d < 1.0]


def gate_options(errors: dict[float, float], gate: int, rest: int) -> list[Option]:
    """The gate selector's options: the gate read densely, up and down at density d."""
    return [Option("gate", d, gate + d * rest, errors[d]) for d in DENSITY_STEPS if d < 1.0]


def allocate(errors: dict[int, dict[float, float]], dense_bytes: dict[int, int],
             predictor_bytes: dict[int, int], target: float,
             dense_layers: tuple[int, ...] = (0,)) -> dict[int, float]:
    """Per-layer predictor density meeting ``target`` (see ``allocate_options``)."""
    options = {layer: predictor_options(errors[layer], dense_bytes[layer], predictor_bytes[layer])
               for layer in errors}
    return {layer: o.density for layer, o in allocate_options(options, target, dense_layers).items()}


def uniform(errors: dict, dense_bytes: dict, predictor_bytes: dict, target: float,
            dense_layers: tuple[int, ...] = (0,)) -> dict[int, float]:
    """The same byte budget spread uniformly over the sparse layers (the baseline to beat)."""
    total = sum(dense_bytes.values())
    fixed = sum(dense_bytes[layer] for layer in dense_layers if layer in dense_bytes)
    rest = [layer for layer in errors if layer not in dense_layers]
    left = target * total - fixed - sum(predictor_bytes[layer] for layer in rest)
    d = left / sum(dense_bytes[layer] for layer in rest)
    if not 0 < d <= 1:
        raise ValueError(f"target {target} leaves uniform density {d:.3f}")
    return {layer: (1.0 if layer in dense_layers else round(d, 4)) for layer in errors}


def uniform_gate(traces: list[MLPTrace], target: float,
                 dense_layers: tuple[int, ...] = (0,)) -> dict[int, float]:
    """The gate selector's uniform spread: one density for every sparse layer's up and down."""
    dense = {t.layer: mlp_bytes(t) for t in traces}
    gate = {t.layer: module_bytes(t.first) for t in traces}
    rest = [t.layer for t in traces if t.layer not in dense_layers]
    fixed = sum(dense[layer] for layer in dense_layers if layer in dense)
    left = target * sum(dense.values()) - fixed - sum(gate[layer] for layer in rest)
    d = left / sum(dense[layer] - gate[layer] for layer in rest)
    if not 0 < d <= 1:
        raise ValueError(f"target {target} leaves uniform gate density {d:.3f}")
    return {t.layer: (1.0 if t.layer in dense_layers else round(d, 4)) for t in traces}


@dataclass
class Calibration:
    profile: Profile
    uniform_profile: Profile
    predictors: dict[str, torch.Tensor]
    quality: dict[int, dict]
    # joint loss on the sensitivity tokens per weight of the greedy allocation in its blend
    # with the uniform spread (predictor-only calibrations; see ``blend_allocation``)
    blend: dict[float, float] = dataclasses.field(default_factory=dict)
    greedy: dict[int, float] = dataclasses.field(default_factory=dict)  # densities before it
    target_density: float = DEFAULT_TARGET_DENSITY  # the byte target the profile was made for
    # with max_ppl_increase: each byte target tried -> the perplexity increase on the held-out
    # tokens (a fraction: 0.03 is +3%) of the allocation kept for it, the better of the
    # adaptive one and the uniform spread; and the uniform spread's own
    search: dict[float, float] = dataclasses.field(default_factory=dict)
    search_uniform: dict[float, float] = dataclasses.field(default_factory=dict)
    # whether the written profile is the uniform spread, which did better than the adaptive
    # allocation (on the held-out tokens, or with mixed selectors and a byte budget by joint
    # loss on the sensitivity tokens); its ``-uniform`` twin is then the same allocation
    uniform_kept: bool = False


def calibrate(model, ids: torch.Tensor, name: str, out: str | Path, *,
              target_density: float | None = None, max_ppl_increase: float | None = None,
              rank: int = DEFAULT_RANK,
              epochs: int = DEFAULT_EPOCHS, cache_dir: str | Path | None = None,
              lookahead: bool = False, selectors: tuple[str, ...] = DEFAULT_SELECTORS,
              bucket_units: int = BUCKET_UNITS, weighted_loss: bool = False,
              progress: bool = True) -> Calibration:
    """Calibrate ``model`` on token ids [1, T]; write ``out`` (YAML) and its predictor file, and
    ``out``'s ``-uniform`` twin (same predictors, the same bytes spread uniformly).

    With ``lookahead``, the predictor of each layer after the first is trained on the previous
    layer's MLP input (paper section 4.3) and the profile says ``input: previous``; the first
    layer's reads its own input.

    ``selectors`` are the candidates per layer: ``predictor`` (learned), ``gate`` (gated MLPs:
    the gate projection read densely selects) and ``threshold`` (TEAL, training-free: every
    projection keeps its largest-magnitude inputs); the allocation picks, per layer, the
    selector and density that save the most bytes for the least measured loss.

    Predictors take their top-k per bucket of at most ``bucket_units`` neurons (0: one top-k
    over all neurons); recall and sensitivity are measured on that selection. ``weighted_loss``
    weights their training loss by neuron importance (``train_predictor``).

    With predictors only, the written allocation is the blend of the greedy one and the uniform
    spread with the lowest joint loss on the sensitivity tokens (``blend_allocation``; the
    losses tried are in ``Calibration.blend``), so it is never worse there than uniform.

    The budget is ``target_density`` (MLP bytes read per token, selectors included, as a
    fraction of dense; ``DEFAULT_TARGET_DENSITY`` when neither is given) or
    ``max_ppl_increase`` (0.03: at most +3% perplexity). With the latter, the last
    ``VALIDATION_TOKENS`` of ``ids`` are held out; the allocation is made for each byte target
    of ``SEARCH_STEPS``, densest first, and the sparsest whose perplexity on the held-out
    tokens stays within the budget is written (every layer dense if none does). The search
    stops at the first target over budget (a lower target's greedy allocation extends a
    higher one's); ``Calibration.search`` holds what each target tried gave.

    The uniform spread of the same bytes is a candidate too: with ``max_ppl_increase`` each
    target keeps whichever of the two does better on the held-out tokens, and with a byte
    budget and more than the predictor selector (no blend there) whichever has the lower joint
    loss on the sensitivity tokens (``Calibration.blend`` weights 1 and 0). Measured on
    SmolLM2-135M the adaptive allocation over mixed selectors lost to the uniform gate spread
    on the evaluation text (README), so the written profile is never the worse of the two on
    what the calibrator can measure; ``Calibration.uniform_kept`` says which it is."""
    unknown = set(selectors) - set(CALIBRATION_SELECTORS)
    if unknown or not selectors:
        raise ValueError(f"selectors must be among {CALIBRATION_SELECTORS}, got {selectors}")
    # checked before the activations are recorded and the predictors trained (minutes)
    if ids.ndim != 2 or ids.shape[0] != 1 or ids.shape[1] < 2:
        raise ValueError(f"ids must be token ids [1, T] with T >= 2, got shape {tuple(ids.shape)}")
    if target_density is not None and not 0 < target_density <= 1:
        raise ValueError(f"target_density is MLP bytes read per token as a fraction of dense, "
                         f"in (0, 1], got {target_density!r}")
    for what, value, least in (("rank", rank, 1), ("epochs", epochs, 1),
                               ("bucket_units", bucket_units, 0)):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            raise ValueError(f"{what} must be an int >= {least}, got {value!r}")
    # one sequence per forward pass: no longer than the model's context
    context = getattr(model.config, "max_position_embeddings", None) or SENSITIVITY_TOKENS
    validation = None
    if max_ppl_increase is not None:
        if target_density is not None:
            raise ValueError("give target_density or max_ppl_increase, not both")
        if not max_ppl_increase >= 0:
            raise ValueError(f"max_ppl_increase must be >= 0 (0.03 is +3%), got "
                             f"{max_ppl_increase!r}")
        held = min(VALIDATION_TOKENS, context)
        if ids.shape[1] < 2 * held:
            raise ValueError(f"max_ppl_increase needs at least {2 * held} calibration tokens "
                             f"(the last {held} are held out to measure perplexity), got "
                             f"{ids.shape[1]}")
        ids, validation = ids[:, :-held], ids[:, -held:]
    elif target_density is None:
        target_density = DEFAULT_TARGET_DENSITY
    out = Path(out)
    traces = record(model, ids, Path(cache_dir) if cache_dir else None, progress)
    # the trace each predictor reads its input from
    inputs = {t.layer: t for t in traces}
    if lookahead:
        for prev, trace in zip(traces, traces[1:], strict=False):
            if prev.layer == trace.layer - 1:
                inputs[trace.layer] = prev
    sources = {layer: t.first for layer, t in inputs.items()}
    predictors, trained, pred_b, held_out, blend = {}, {}, {}, {}, {}
    dense_b = {trace.layer: mlp_bytes(trace) for trace in traces}
    quality: dict[int, dict] = {trace.layer: {} for trace in traces}
    learned = traces if "predictor" in selectors else []
    buckets = default_buckets(traces[0].h.shape[1], bucket_units) if traces else 1
    for trace in tqdm(learned, desc="train", disable=not progress, leave=False):
        pred, q = train_predictor(dataclasses.replace(trace, x=inputs[trace.layer].x), rank, epochs,
                                  buckets=buckets, weighted=weighted_loss)
        trained[trace.layer], held_out[trace.layer] = pred, q
        recalls = recall_by_density(pred, q)
        predictors.update(pred.tensors(f"layers.{trace.layer}.mlp."))
        esize = trace.first.weight.element_size()
        pred_b[trace.layer] = sum(p.numel() for p in pred.parameters()) * esize
        quality[trace.layer].update(recall=q["recall"], precision=q["precision"],
                                    recall_by_density=recalls)
        log.info("layer %d: recall %.3f precision %.3f", trace.layer, q["recall"], q["precision"])
    # Allocation spends the budget where the measured loss grows least per byte saved (the
    # block's own relative output error was tried first: it pushed the last layers of
    # SmolLM2-135M to density 0.3 and lost to the uniform spread, +33.5% vs +14.0% perplexity).
    sample = ids[:, :min(SENSITIVITY_TOKENS, context)]
    errors = loss_sensitivity(model, learned, trained, sample, progress, sources, buckets)
    options = {t.layer: [Option("dense", 1.0, dense_b[t.layer], 0.0)] for t in traces}
    for layer, deltas in errors.items():
        quality[layer]["loss_increase"] = deltas
        options[layer] = predictor_options(deltas, dense_b[layer], pred_b[layer])
    if "gate" in selectors:
        for layer, deltas in gate_sensitivity(model, traces, sample, progress).items():
            trace = next(t for t in traces if t.layer == layer)
            gate = module_bytes(trace.first)
            options[layer] += gate_options(deltas, gate, dense_b[layer] - gate)
            quality[layer]["gate_loss_increase"] = deltas
            quality[layer]["gate_recall_by_density"] = gate_recall(trace)
    if "threshold" in selectors:
        for layer, deltas in threshold_sensitivity(model, traces, sample, progress).items():
            options[layer] += [Option("threshold", d, d * dense_b[layer], deltas[d])
                               for d in DENSITY_STEPS if d < 1.0]
            quality[layer]["threshold_loss_increase"] = deltas
    ident = ModelIdentity.from_config(model.config, name)

    def build(chosen: dict[int, Option], path: Path) -> Profile:
        layers = []
        for layer in range(ident.num_layers):
            opt = chosen.get(layer)
            d = opt.density if opt is not None and opt.selector != "dense" else 1.0
            mlp = BlockProfile()
            if d < 1.0 and opt.selector == "threshold":
                mlp = BlockProfile(selector="threshold", density=d,
                                   units=ident.intermediate_size)
            elif d < 1.0 and opt.selector == "gate":
                mlp = BlockProfile(selector="gate", density=d, units=ident.intermediate_size,
                                   recall=quality[layer]["gate_recall_by_density"].get(d))
            elif d < 1.0:
                # Recall of the true top-k at the chosen density; with predicted and true sets of
                # the same size k, precision equals recall, so it is stored only for training's k.
                # (The uniform twin's densities fall between the measured steps: no recall.)
                ahead = inputs[layer].layer != layer
                mlp = BlockProfile(selector="predictor", density=d, units=ident.intermediate_size,
                                   rank=rank, activation="relu",
                                   input="previous" if ahead else "same", buckets=buckets,
                                   recall=recall_of(layer, d),
                                   precision=quality[layer]["precision"])
            layers.append(LayerProfile(index=layer, mlp=mlp))
        used = {k: v for k, v in predictors.items()
                if (o := chosen.get(int(k.split(".")[1]))) is not None
                and o.selector == "predictor"}
        prof = Profile(model=ident, layers=tuple(layers),
                       predictor_file=f"{path.stem}.safetensors" if used else None)
        return save_profile(prof, path, used or None)

    def recall_of(layer: int, d: float) -> float | None:
        """Held-out recall at density ``d`` (measured now if ``d`` is off the steps)."""
        if d in quality[layer]["recall_by_density"]:
            return quality[layer]["recall_by_density"][d]
        return recall_by_density(trained[layer], held_out[layer], (d,))[d]

    hooks_by = {"predictor": predictor_hooks(trained, sources, buckets), "gate": gate_hooks(),
                "threshold": threshold_hooks()}

    def allocation(target: float):
        """(chosen options, greedy options, uniform spread, its selector, blend losses, whether
        the chosen options are the uniform spread) for a byte target."""
        chosen = greedy_options = allocate_options(options, target)
        # the uniform twin spreads the same budget evenly, with the selector most layers chose
        kinds = [o.selector for o in chosen.values() if o.selector != "dense"]
        kind = max(set(kinds), key=kinds.count) if kinds else selectors[0]
        if kind == "gate":
            spread = uniform_gate(traces, target)
        elif kind == "threshold":  # no selector bytes: the budget itself, less the dense layers
            rest = sum(dense_b[t.layer] for t in traces if t.layer != 0)
            d = (target * sum(dense_b.values()) - dense_b.get(0, 0)) / rest
            spread = {t.layer: 1.0 if t.layer == 0 else round(d, 4) for t in traces}
        else:
            spread = uniform(errors, dense_b, pred_b, target)
        blend, flat_kept = {}, False
        if set(kinds) - {"predictor"} and validation is None:
            # no blend across selectors: the adaptive allocation or the uniform spread, by
            # joint loss on the sensitivity tokens
            flat = density_options(spread, kind)
            blend = {1.0: allocation_loss(model, traces, sample, chosen, hooks_by),
                     0.0: allocation_loss(model, traces, sample, flat, hooks_by)}
            log.info("allocation: joint loss %.4f adaptive, %.4f uniform", blend[1.0], blend[0.0])
            if blend[0.0] < blend[1.0]:
                chosen, flat_kept = flat, True
        elif set(kinds) == {"predictor"}:
            greedy = {layer: o.density for layer, o in chosen.items()}
            dens, blend = blend_allocation(
                greedy, spread, dense_b, pred_b, target,
                lambda dens: joint_loss(model, learned, sample, dens, hooks_by["predictor"]))
            log.info("allocation: joint loss %s (weight of the greedy allocation: loss)",
                     {w: round(v, 4) for w, v in blend.items()})
            chosen = density_options(dens, "predictor")
            flat_kept = bool(blend) and min(blend, key=blend.get) == 0.0  # weight 0: uniform
        return chosen, greedy_options, spread, kind, blend, flat_kept

    search: dict[float, float] = {}
    search_uniform: dict[float, float] = {}
    if validation is None:
        chosen, greedy_options, spread, kind, blend, uniform_kept = allocation(target_density)
    else:
        base = allocation_loss(model, traces, validation, {}, hooks_by)
        target_density, found = 1.0, allocation(1.0)
        for target in tqdm(SEARCH_STEPS, desc="budget", disable=not progress, leave=False):
            try:
                tried = allocation(target)
            except ValueError:  # below what the densities and selectors can reach
                break
            flat = density_options(tried[2], tried[3])
            adaptive_loss = allocation_loss(model, traces, validation, tried[0], hooks_by)
            uniform_loss = allocation_loss(model, traces, validation, flat, hooks_by)
            search_uniform[target] = math.exp(uniform_loss - base) - 1
            if uniform_loss < adaptive_loss:
                tried = (flat, *tried[1:5], True)
            search[target] = math.exp(min(adaptive_loss, uniform_loss) - base) - 1
            log.info("byte target %.2f: held-out perplexity %+.2f%% adaptive, %+.2f%% uniform",
                     target, 100 * (math.exp(adaptive_loss - base) - 1),
                     100 * search_uniform[target])
            if search[target] > max_ppl_increase:
                break
            target_density, found = target, tried
        chosen, greedy_options, spread, kind, blend, uniform_kept = found
    adaptive = build(chosen, out)
    twin = build(density_options(spread, kind), out.with_name(f"{out.stem}-uniform{out.suffix}"))
    return Calibration(adaptive, twin, predictors, quality, blend,
                       {layer: o.density for layer, o in greedy_options.items()},
                       target_density, search, search_uniform, uniform_kept)


def density_options(densities: dict[int, float], selector: str) -> dict[int, Option]:
    """Per-layer densities (a uniform spread, a blend) as allocation options of ``selector``,
    ``dense`` where the density is 1."""
    return {layer: Option(selector if d < 1.0 else "dense", d, 0.0, 0.0)
            for layer, d in densities.items()}

