"""The byte account of one decode step (second paper, section 3): what projection sparsity and
KV-cache sparsity each save, where they cross, and which to run.

Per decoded token (batch 1) a model reads its projection weights once (fixed), its KV cache
(growing with the context n), one embedding row, the norms and the LM head. Projection sparsity
keeps a fraction ``r_p`` of the projection bytes (plus the predictors it reads), KV sparsity a
fraction ``r_kv`` of the cache. The crossover is the context at which both save the same bytes:

    n* = (1 - r_p) * P / ((1 - r_kv) * C)

with P the projection bytes and C the cache bytes per token, both per layer (the layer count
cancels). The ideal speedup bound of a branch is dense bytes / branch bytes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DEFAULT_KV_KEEP = 0.3  # the second paper's KV keep ratio
DEFAULT_PROJECTION_KEEP = 0.5
SCOPES = ("all", "mlp")  # which projections the projection branch sparsifies
MODES = ("dense", "projection", "kv", "both")


@dataclass(frozen=True)
class ModelBytes:
    """Per-layer byte sizes of a decoder, from its dimensions (weights only; biases and norms
    are counted with the other reads)."""

    name: str
    num_layers: int
    hidden_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    gated: bool
    tied: bool
    dtype_bytes: int = 2

    def __post_init__(self) -> None:
        if isinstance(self.dtype_bytes, bool) or not isinstance(self.dtype_bytes, int) or \
                self.dtype_bytes < 1:
            raise ValueError(f"dtype_bytes must be an int >= 1 (2 for fp16), got "
                             f"{self.dtype_bytes!r}")

    @classmethod
    def from_config(cls, config, name: str, dtype_bytes: int = 2) -> ModelBytes:
        from .profile import ModelIdentity

        ident = ModelIdentity.from_config(config, name)
        return cls(
            name=name, num_layers=ident.num_layers, hidden_size=ident.hidden_size,
            num_heads=ident.num_heads, num_kv_heads=ident.num_kv_heads, head_dim=ident.head_dim,
            intermediate_size=ident.intermediate_size, vocab_size=config.vocab_size,
            gated=ident.model_type != "opt",  # OPT's MLP is fc1 -> ReLU -> fc2
            tied=bool(getattr(config, "tie_word_embeddings", False)), dtype_bytes=dtype_bytes)

    @property
    def attention_bytes(self) -> int:
        """q, k, v and o projections of one layer."""
        d, hd = self.hidden_size, self.head_dim
        return (2 * d * self.num_heads * hd + 2 * d * self.num_kv_heads * hd) * self.dtype_bytes

    @property
    def mlp_bytes(self) -> int:
        return (3 if self.gated else 2) * self.hidden_size * self.intermediate_size * self.dtype_bytes

    def projection_bytes(self, scope: str = "all") -> int:
        """Projection bytes of one layer the projection branch acts on."""
        if scope not in SCOPES:
            raise ValueError(f"scope must be one of {SCOPES}, got {scope!r}")
        return self.mlp_bytes + (self.attention_bytes if scope == "all" else 0)

    @property
    def kv_bytes_per_token(self) -> int:
        """Keys and values of one token in one layer."""
        return 2 * self.num_kv_heads * self.head_dim * self.dtype_bytes

    @property
    def other_bytes(self) -> int:
        """One embedding row, the norms and the LM head."""
        d = self.hidden_size
        return (d + self.vocab_size * d + (2 * self.num_layers + 1) * d) * self.dtype_bytes


def crossover_tokens(projection_saves: float, kv_bytes_per_token: float,
                     kv_keep: float) -> int | None:
    """Context length at which KV selection at ``kv_keep`` saves as many bytes per step as the
    projection branch's ``projection_saves`` (predictors already subtracted); None when KV
    saves nothing, 0 when the projection branch saves nothing."""
    if kv_keep >= 1.0 or kv_bytes_per_token <= 0:
        return None
    return max(0, round(projection_saves / ((1 - kv_keep) * kv_bytes_per_token)))


@dataclass(frozen=True)
class StepBytes:
    """Bytes one decode step reads, by kind."""

    projections: float
    predictors: float
    kv: float
    other: float

    @property
    def total(self) -> float:
        return self.projections + self.predictors + self.kv + self.other


@dataclass(frozen=True)
class Account:
    """A model's byte account at given keep ratios. ``predictor_bytes`` (all layers) are read
    by the projection branch on top of the kept projections."""

    model: ModelBytes
    projection_keep: float = DEFAULT_PROJECTION_KEEP
    kv_keep: float = DEFAULT_KV_KEEP
    scope: str = "all"
    predictor_bytes: int = 0
    costs_ms: dict[str, float] = field(default_factory=dict)  # fixed kernel cost per mode

    def __post_init__(self) -> None:
        for name in ("projection_keep", "kv_keep"):
            value = getattr(self, name)
            if not 0.0 < value <= 1.0:
                raise ValueError(f"{name} must be in (0, 1], got {value}")
        unknown = set(self.costs_ms) - set(MODES)
        if unknown:
            raise ValueError(f"costs for unknown modes {sorted(unknown)}; modes are {MODES}")

    def step(self, context: int, mode: str) -> StepBytes:
        """Bytes read by one decode step at ``context`` tokens in ``mode`` (see ``MODES``)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
        if context < 0:
            raise ValueError(f"context must be >= 0 tokens, got {context}")
        m, layers = self.model, self.model.num_layers
        dense_proj = (m.attention_bytes + m.mlp_bytes) * layers
        proj, predictors, kv = dense_proj, 0.0, float(m.kv_bytes_per_token * context * layers)
        if mode in ("projection", "both"):
            proj = dense_proj - (1 - self.projection_keep) * m.projection_bytes(self.scope) * layers
            predictors = float(self.predictor_bytes)
        if mode in ("kv", "both"):
            kv *= self.kv_keep
        return StepBytes(proj, predictors, kv, float(m.other_bytes))

    def bound(self, context: int, mode: str) -> float:
        """Ideal speedup of ``mode`` over dense at ``context``: dense bytes / mode bytes."""
        return self.step(context, "dense").total / self.step(context, mode).total

    def crossover(self) -> int | None:
        """The context where both branches save the same bytes (None if KV keeps everything)."""
        m = self.model
        saved_proj = (1 - self.projection_keep) * m.projection_bytes(self.scope) * m.num_layers
        return crossover_tokens(saved_proj - self.predictor_bytes,
                                m.kv_bytes_per_token * m.num_layers, self.kv_keep)

    def latency_ms(self, context: int, mode: str, bandwidth: float) -> float:
        """Predicted step time: bytes at ``bandwidth`` (bytes/s) plus the mode's fixed cost."""
        return self.step(context, mode).total / bandwidth * 1e3 + self.costs_ms.get(mode, 0.0)

    def choose(self, context: int, bandwidth: float, allowed=MODES) -> str:
        """The dispatch gate: the allowed mode with the least predicted latency at ``context``
        (bytes plus measured kernel costs; with no costs, the fewest bytes)."""
        return min(allowed, key=lambda mode: self.latency_ms(context, mode, bandwidth))


def account_from_profile(model: ModelBytes, profile, predictors: dict | None = None,
                         kv_keep: float = DEFAULT_KV_KEEP, costs_ms: dict | None = None) -> Account:
    """The account of a calibrated profile: its per-layer MLP and head densities give the
    projection keep (over all projections), its predictor tensors the predictor bytes."""
    from .profile import ProfileError  # here: that module loads torch, which plan does without

    wrong = profile.model.mismatch(model)
    if wrong:  # the densities are fractions of the profile's own MLP width and head count
        raise ProfileError(f"profile for {profile.model.name!r} does not fit {model.name!r}: "
                           f"its shape has {wrong}")
    d, hd, esize = model.hidden_size, model.head_dim, model.dtype_bytes
    q_o = 2 * d * model.num_heads * hd * esize
    kept = 0.0
    for layer in profile.layers:
        kept += layer.mlp.density * model.mlp_bytes
        kept += layer.attention.density * q_o + (model.attention_bytes - q_o)
    dense = (model.attention_bytes + model.mlp_bytes) * model.num_layers
    used = {f"layers.{layer.index}.{kind}." for layer in profile.layers
            for kind in ("mlp", "attention") if layer.block(kind).selector == "predictor"}
    pred = sum(t.numel() * esize for name, t in (predictors or {}).items()
               if name[: name.rfind(".") + 1] in used)
    return Account(model, kept / dense, kv_keep, "all", pred, costs_ms or {})


def table(account: Account, contexts: list[int], bandwidth: float | None = None) -> str:
    """The ``dejavu plan`` printout."""
    m = account.model
    mb = 1e-6
    lines = [
        f"{m.name}: {m.num_layers} layers; per layer projections "
        f"{(m.attention_bytes + m.mlp_bytes) * mb:.1f} MB (attention {m.attention_bytes * mb:.1f}, "
        f"MLP {m.mlp_bytes * mb:.1f}), KV cache {m.kv_bytes_per_token} B per token; other reads "
        f"(embedding row, norms, LM head) {m.other_bytes * mb:.1f} MB",
        f"projection keep {account.projection_keep:.4g} ({account.scope} projections), predictors "
        f"{account.predictor_bytes * mb:.1f} MB, KV keep {account.kv_keep}",
        "",
        f"{'context':>8} | {'proj dense':>10} {'proj sparse':>11} {'predictors':>10} | "
        f"{'KV dense':>9} {'KV sparse':>9} | {'other':>7} | {'dense MB':>9} | bound: "
        f"{'proj':>5} {'KV':>5} {'both':>5} | gate",
    ]
    for n in contexts:
        dense, proj = account.step(n, "dense"), account.step(n, "projection")
        kv = account.step(n, "kv")
        bounds = [account.bound(n, mode) for mode in ("projection", "kv", "both")]
        gate = account.choose(n, bandwidth) if bandwidth else min(
            MODES, key=lambda mode: account.step(n, mode).total)
        lines.append(
            f"{n:>8} | {dense.projections * mb:>10.1f} {proj.projections * mb:>11.1f} "
            f"{proj.predictors * mb:>10.1f} | {dense.kv * mb:>9.1f} {kv.kv * mb:>9.1f} | "
            f"{dense.other * mb:>7.1f} | {dense.total * mb:>9.1f} | {bounds[0]:>5.2f}x "
            f"{bounds[1]:>4.2f}x {bounds[2]:>4.2f}x | {gate}")
    cross = account.crossover()
    lines += ["", "byte crossover: " + (f"{cross:,} tokens (projection saves more below, KV above)"
                                        if cross is not None else "none (KV keep 1.0)")]
    return "\n".join(lines)
