"""Per-model sparsity profiles: a versioned YAML schema, loaded and validated.

A profile names the model it was calibrated on (identity and shapes), the attention granularity,
the predictor weight file (safetensors, next to the YAML) and, per layer and block, the selector,
the density (fraction of units kept per decoded token) and the measured predictor quality.

    version: 1
    model: {name: smollm2-135m, model_type: llama, hidden_size: 576, num_layers: 30,
            intermediate_size: 1536, num_heads: 9, num_kv_heads: 3, head_dim: 64}
    attention_granularity: head
    predictor_file: smollm2-135m.safetensors
    layers:
      - index: 0
        mlp: {selector: dense}
        attention: {selector: dense}
      - index: 1
        mlp: {selector: predictor, density: 0.5, units: 1536, rank: 128, activation: relu,
              input: same, buckets: 12, recall: 0.91, precision: 0.88}
        attention: {selector: dense}

``buckets`` (predictors only, default 1): the top-k is taken as the top ``k / buckets`` of each
of that many equal slices of the units (``kernels/reference.py::bucket_topk``).

Predictor tensors are named ``layers.{index}.{mlp|attention}.{w1,b1,w2,b2}``: w1 [rank, d],
w2 [units, rank], biases optional.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml

PROFILE_VERSION = 1
BLOCK_SELECTORS = ("dense", "oracle", "predictor", "gate", "threshold")
PREDICTOR_INPUTS = ("same", "previous")
PREDICTOR_ACTIVATIONS = ("none", "relu", "silu", "gelu", "gelu_tanh")
BLOCK_KINDS = ("mlp", "attention")


# A predictor's top-k is taken per bucket of this many units (at most) when the profile says
# ``buckets`` > 1: one GPU program scores and ranks a bucket in registers (kernels/predictor.py).
BUCKET_UNITS = 128


class ProfileError(ValueError):
    """A profile that is malformed or does not fit the model; the message names field and layer."""


def default_buckets(units: int, size: int = BUCKET_UNITS) -> int:
    """The fewest equal buckets of at most ``size`` units that divide ``units`` (1 when
    ``size`` is 0: a plain top-k over all units)."""
    if size <= 0 or units <= size:
        return 1
    buckets = -(-units // size)
    while units % buckets:
        buckets += 1
    return buckets


def kept_units(density: float, units: int, buckets: int = 1) -> int:
    """Units kept per token at ``density`` of ``units``: at least one per bucket, a multiple of
    ``buckets``, static for the compiled graph."""
    per = units // buckets
    return buckets * max(1, min(per, round(density * per)))


def _where(layer: int | None, block: str | None, key: str) -> str:
    parts = []
    if layer is not None:
        parts.append(f"layer {layer}")
    if block is not None:
        parts.append(block)
    parts.append(f"field {key!r}")
    return ", ".join(parts)


def _get(raw: dict, key: str, kind, layer=None, block=None, default=dataclasses.MISSING):
    if key not in raw:
        if default is dataclasses.MISSING:
            raise ProfileError(f"profile: {_where(layer, block, key)} is missing")
        return default
    value = raw[key]
    if value is None and default is None:
        return None
    ok = isinstance(value, kind) and not (kind in (int, float) and isinstance(value, bool))
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        value, ok = float(value), True
    if not ok:
        raise ProfileError(
            f"profile: {_where(layer, block, key)} must be {getattr(kind, '__name__', kind)}, "
            f"got {value!r}"
        )
    return value


@dataclass(frozen=True)
class ModelIdentity:
    """Identity and shapes of the model a profile was calibrated on."""

    name: str
    model_type: str
    hidden_size: int
    num_layers: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_config(cls, config, name: str) -> ModelIdentity:
        """The identity of a Hugging Face model from its config (OPT's ``ffn_dim`` included)."""
        heads = config.num_attention_heads
        return cls(
            name=name, model_type=config.model_type, hidden_size=config.hidden_size,
            num_layers=config.num_hidden_layers,
            intermediate_size=getattr(config, "intermediate_size", None) or config.ffn_dim,
            num_heads=heads, num_kv_heads=getattr(config, "num_key_value_heads", None) or heads,
            head_dim=getattr(config, "head_dim", None) or config.hidden_size // heads)

    def mismatch(self, other) -> str:
        """The first shape in which ``other`` (an identity, or anything with these six shape
        attributes, such as plan's ``ModelBytes``) differs from this identity, as
        ``"name=other's, the profile says this one's"``; empty when every shape agrees (names
        and types may differ: a profile fits any model of its shapes)."""
        for f in ("num_layers", "hidden_size", "intermediate_size", "num_heads", "num_kv_heads",
                  "head_dim"):
            want, got = getattr(self, f), getattr(other, f)
            if want != got:
                return f"{f}={got}, the profile says {want}"
        return ""


@dataclass(frozen=True)
class BlockProfile:
    """One block of one layer: how its units are selected and how many are kept."""

    selector: str = "dense"
    density: float = 1.0
    units: int | None = None
    rank: int | None = None
    activation: str = "none"
    input: str = "same"
    buckets: int = 1
    recall: float | None = None
    precision: float | None = None

    def __post_init__(self) -> None:
        if self.buckets < 1 or (self.units is not None and self.units % self.buckets):
            raise ProfileError(f"buckets must be a positive divisor of units ({self.units}), "
                               f"got {self.buckets!r}")
        if self.buckets > 1 and self.selector != "predictor":
            raise ProfileError(f"buckets apply to predictor blocks, not selector {self.selector!r}")
        if self.selector not in BLOCK_SELECTORS:
            raise ProfileError(f"selector must be one of {BLOCK_SELECTORS}, got {self.selector!r}")
        if not 0.0 < self.density <= 1.0:
            raise ProfileError(f"density must be in (0, 1], got {self.density!r}")
        if self.input not in PREDICTOR_INPUTS:
            raise ProfileError(f"input must be one of {PREDICTOR_INPUTS}, got {self.input!r}")
        if self.activation not in PREDICTOR_ACTIVATIONS:
            raise ProfileError(
                f"activation must be one of {PREDICTOR_ACTIVATIONS}, got {self.activation!r}"
            )
        if self.selector == "predictor" and (self.rank is None or self.units is None):
            raise ProfileError("a predictor block needs 'rank' and 'units'")

    @property
    def sparse(self) -> bool:
        return self.selector != "dense"


@dataclass(frozen=True)
class LayerProfile:
    index: int
    mlp: BlockProfile = field(default_factory=BlockProfile)
    attention: BlockProfile = field(default_factory=BlockProfile)

    def __post_init__(self) -> None:
        if self.attention.selector in ("gate", "threshold"):
            raise ProfileError(f"profile: layer {self.index}, attention field 'selector' is "
                               f"{self.attention.selector!r}, which only MLP blocks have")

    def block(self, kind: str) -> BlockProfile:
        return self.mlp if kind == "mlp" else self.attention


@dataclass(frozen=True)
class Profile:
    """A loaded profile. ``path`` is where it was read from (predictor files are relative to it)."""

    model: ModelIdentity
    layers: tuple[LayerProfile, ...]
    attention_granularity: str = "head"
    predictor_file: str | None = None
    version: int = PROFILE_VERSION
    path: Path | None = None

    def __post_init__(self) -> None:
        if self.version != PROFILE_VERSION:
            raise ProfileError(
                f"profile: field 'version' is {self.version}, this build reads {PROFILE_VERSION}"
            )
        if self.attention_granularity not in ("head", "group"):
            raise ProfileError(
                "profile: field 'attention_granularity' must be 'head' or 'group', "
                f"got {self.attention_granularity!r}"
            )
        seen = [layer.index for layer in self.layers]
        if sorted(seen) != list(range(self.model.num_layers)):
            raise ProfileError(
                f"profile: 'layers' must list each index 0..{self.model.num_layers - 1} once, "
                f"got {seen}"
            )
        first = min(seen, default=0)
        for kind in BLOCK_KINDS if seen else ():
            if self.layer(first).block(kind).input == "previous":
                raise ProfileError(
                    f"profile: layer {first}, {kind} field 'input' is 'previous' but layer "
                    f"{first} is the first: there is no earlier input (use 'same' or dense)"
                )
        uses_predictor = any(
            layer.block(kind).selector == "predictor" for layer in self.layers for kind in BLOCK_KINDS
        )
        if uses_predictor and not self.predictor_file:
            raise ProfileError("profile: field 'predictor_file' is needed by predictor blocks")

    def layer(self, index: int) -> LayerProfile:
        for layer in self.layers:
            if layer.index == index:
                return layer
        raise ProfileError(
            f"profile for {self.model.name!r} has no layer {index} "
            f"(it has {self.model.num_layers}): is it a profile for another model?"
        )

    def predictor_path(self) -> Path:
        base = self.path.parent if self.path is not None else Path.cwd()
        return base / str(self.predictor_file)

    def to_dict(self) -> dict[str, Any]:
        def block(b: BlockProfile) -> dict[str, Any]:
            out = {"selector": b.selector}
            if b.sparse:
                out.update(density=float(b.density), units=b.units)
            if b.selector == "predictor":
                out.update(rank=b.rank, activation=b.activation, input=b.input,
                           buckets=b.buckets)
            for key in ("recall", "precision"):
                if getattr(b, key) is not None:
                    out[key] = round(float(getattr(b, key)), 4)
            return out

        return {
            "version": self.version,
            "model": dataclasses.asdict(self.model),
            "attention_granularity": self.attention_granularity,
            "predictor_file": self.predictor_file,
            "layers": [
                {"index": layer.index, "mlp": block(layer.mlp), "attention": block(layer.attention)}
                for layer in sorted(self.layers, key=lambda x: x.index)
            ],
        }


def _parse_block(raw: Any, layer: int, kind: str) -> BlockProfile:
    if raw is None:
        return BlockProfile()
    if not isinstance(raw, dict):
        raise ProfileError(f"profile: layer {layer}, {kind} must be a mapping, got {raw!r}")
    known = {f.name for f in dataclasses.fields(BlockProfile)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise ProfileError(f"profile: layer {layer}, {kind} has unknown field(s) {unknown}")
    kwargs = {
        "selector": _get(raw, "selector", str, layer, kind, "dense"),
        "density": _get(raw, "density", float, layer, kind, 1.0),
        "units": _get(raw, "units", int, layer, kind, None),
        "rank": _get(raw, "rank", int, layer, kind, None),
        "activation": _get(raw, "activation", str, layer, kind, "none"),
        "input": _get(raw, "input", str, layer, kind, "same"),
        "buckets": _get(raw, "buckets", int, layer, kind, 1),
        "recall": _get(raw, "recall", float, layer, kind, None),
        "precision": _get(raw, "precision", float, layer, kind, None),
    }
    try:
        return BlockProfile(**kwargs)
    except ProfileError as err:
        raise ProfileError(f"profile: layer {layer}, {kind}: {err}") from None


def profile_from_dict(raw: Any, path: Path | None = None) -> Profile:
    """Validate a parsed YAML document and build a ``Profile``; errors name field and layer."""
    if not isinstance(raw, dict):
        raise ProfileError(f"profile: the document must be a mapping, got {type(raw).__name__}")
    version = _get(raw, "version", int)
    if version != PROFILE_VERSION:
        raise ProfileError(f"profile: field 'version' is {version}, this build reads {PROFILE_VERSION}")
    model_raw = _get(raw, "model", dict)
    model_kwargs = {}
    for f in dataclasses.fields(ModelIdentity):
        kind = str if f.type in ("str", str) else int
        model_kwargs[f.name] = _get(model_raw, f.name, kind, block="model")
    model = ModelIdentity(**model_kwargs)
    layers_raw = _get(raw, "layers", list)
    layers = []
    for pos, entry in enumerate(layers_raw):
        if not isinstance(entry, dict):
            raise ProfileError(f"profile: layers[{pos}] must be a mapping, got {entry!r}")
        index = _get(entry, "index", int, block=f"layers[{pos}]")
        unknown = sorted(set(entry) - {"index", "mlp", "attention"})
        if unknown:
            raise ProfileError(f"profile: layer {index} has unknown field(s) {unknown}")
        layers.append(
            LayerProfile(
                index=index,
                mlp=_parse_block(entry.get("mlp"), index, "mlp"),
                attention=_parse_block(entry.get("attention"), index, "attention"),
            )
        )
    return Profile(
        model=model,
        layers=tuple(layers),
        attention_granularity=_get(raw, "attention_granularity", str, default="head"),
        predictor_file=_get(raw, "predictor_file", str, default=None),
        version=version,
        path=path,
    )


def load_profile(path: str | Path) -> Profile:
    """Read and validate a profile YAML file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"profile not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        raise ProfileError(f"profile {path}: not valid YAML: {err}") from None
    try:
        return profile_from_dict(raw, path=path.resolve())
    except ProfileError as err:
        raise ProfileError(f"{path}: {err}") from None


def save_profile(profile: Profile, path: str | Path, predictors: dict[str, torch.Tensor] | None = None):
    """Write ``profile`` as YAML (and its predictor tensors as safetensors beside it)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    if predictors:
        if not profile.predictor_file:
            raise ProfileError("profile has predictor tensors but no 'predictor_file'")
        tensors = {k: v.detach().contiguous().cpu() for k, v in predictors.items()}
        save_file(tensors, str(path.parent / profile.predictor_file))
    path.write_text(yaml.safe_dump(profile.to_dict(), sort_keys=False))
    return dataclasses.replace(profile, path=path.resolve())


def load_predictors(profile: Profile) -> dict[str, torch.Tensor]:
    """The predictor tensors of ``profile`` (empty when it uses none)."""
    if not profile.predictor_file:
        return {}
    from safetensors.torch import load_file

    path = profile.predictor_path()
    if not path.is_file():
        raise ProfileError(f"profile: predictor_file {str(path)!r} does not exist")
    return load_file(str(path))
