"""What every pass receives: the options, the profile, the real tensors behind the graph's
inputs, what discovery found, the report being built and the rewrite counters."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.fx as fx
from torch._dynamo.source import ConstantSource

from dejavu_compile.config import Counters, DejavuOptions
from dejavu_compile.profile import Profile

# Ops that compute a linear projection y = x W^T + b in a Dynamo graph.
LINEAR_TARGETS = (torch._C._nn.linear, torch.ops.aten.linear.default)


def is_linear(node: Any) -> bool:
    return isinstance(node, fx.Node) and node.op == "call_function" and node.target in LINEAR_TARGETS


def is_op(node: Any, name: str) -> bool:
    """Whether ``node`` calls ``torch.ops.dejavu.<name>``, by name: OpOverload objects looked up
    at import time are not always the ones a later lookup returns, and Dynamo's graphs record
    the op packet (``torch.ops.dejavu.<name>``) where later passes insert its overload."""
    if not isinstance(node, fx.Node) or node.op != "call_function":
        return False
    qualified = getattr(node.target, "_qualified_op_name", None)
    if qualified is None:
        schema = getattr(node.target, "_schema", None)
        qualified = schema.name if schema is not None else None
    return qualified == f"dejavu::{name}"


@dataclass
class Linear:
    """A matched linear node with the real weight (``[out, in]``) and bias behind it."""

    node: fx.Node
    weight_node: fx.Node
    weight: torch.Tensor
    bias_node: fx.Node | None
    bias: torch.Tensor | None

    @property
    def input(self) -> fx.Node:
        return self.node.args[0]

    def nbytes(self) -> int:
        total = self.weight.numel() * self.weight.element_size()
        if self.bias is not None:
            total += self.bias.numel() * self.bias.element_size()
        return total


@dataclass
class PassContext:
    """State shared by the passes of one backend call (one Dynamo graph)."""

    options: DejavuOptions
    profile: Profile | None
    predictors: dict[str, torch.Tensor]
    example_inputs: list[Any]
    values: dict[fx.Node, Any] = field(default_factory=dict)
    discovery: Any = None
    plan: dict = field(default_factory=dict)
    # (layer, kind) -> the node each block reads (its input), kept by sparsify before the
    # block's own nodes are erased
    inputs: dict = field(default_factory=dict)
    counters: Counters = field(default_factory=Counters)
    # layers whose K/V projections sparsify made lazy (option lazy_kv)
    lazy_kv_layers: set = field(default_factory=set)
    constants: int = 0
    # parameter -> its name in the user's model, for models registered by the API (lets graphs
    # split by Dynamo know their layer numbers); empty for a plain torch.compile call
    param_names: Any = field(default_factory=dict)

    @classmethod
    def build(cls, gm: fx.GraphModule, example_inputs, options, profile, predictors,
              param_names=None):
        ctx = cls(options, profile, predictors, list(example_inputs),
                  param_names=param_names if param_names is not None else {})
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for node, value in zip(placeholders, ctx.example_inputs, strict=True):
            ctx.values[node] = value
        return ctx

    def tensor(self, node: Any, gm: fx.GraphModule) -> torch.Tensor | None:
        """The real tensor behind a placeholder or get_attr node, else None."""
        if not isinstance(node, fx.Node):
            return None
        if node.op == "placeholder":
            value = self.values.get(node)
        elif node.op == "get_attr":
            value = _getattr_path(gm, node.target)
        else:
            return None
        return value if isinstance(value, torch.Tensor) else None

    def linear(self, node: fx.Node, gm: fx.GraphModule) -> Linear | None:
        """Describe a linear node whose weight (and bias) are real tensors, else None."""
        if not is_linear(node) or len(node.args) < 2:
            return None
        weight_node = node.args[1]
        bias_node = node.args[2] if len(node.args) > 2 else node.kwargs.get("bias")
        weight = self.tensor(weight_node, gm)
        if weight is None or weight.dim() != 2:
            return None
        bias = self.tensor(bias_node, gm) if bias_node is not None else None
        if bias_node is not None and bias is None:
            return None
        return Linear(node, weight_node, weight, bias_node, bias)


def _getattr_path(gm: fx.GraphModule, target: str):
    obj = gm
    for part in target.split("."):
        obj = getattr(obj, part)
    return obj


_INDEX = re.compile(r"\[\s*'?(\d+)'?\s*\]")
_DOTTED_INDEX = re.compile(r"\.(\d+)(?:\.|$)")
_PART = re.compile(r"\._(?:modules|parameters|buffers)\['([^']+)'\]|\.(\w+)|\[\s*'?(\w+)'?\s*\]")


def source_name(node: fx.Node) -> str | None:
    """Where Dynamo found a placeholder's value, e.g. ``L['self']._modules['model']...``."""
    grapharg = node.meta.get("grapharg")
    source = getattr(grapharg, "source", None)
    if source is None:
        return None
    name = source.name
    return name() if callable(name) else str(name)


def _where_from(node: fx.Node, ctx: PassContext | None) -> str | None:
    value = ctx.values.get(node) if ctx is not None else None
    if value is not None and value in ctx.param_names:
        return ctx.param_names[value]
    return source_name(node) if node.op == "placeholder" else str(node.target)


def parameter_name(node: fx.Node, ctx: PassContext | None = None) -> str:
    """A readable dotted name for a weight node: ``model.layers.3.mlp.down_proj.weight``."""
    value = ctx.values.get(node) if ctx is not None else None
    if value is not None and value in ctx.param_names:
        return ctx.param_names[value]
    src = _where_from(node, ctx)
    if not src:
        return node.name
    parts = [next(g for g in m.groups() if g is not None) for m in _PART.finditer(src)]
    return ".".join(p for p in parts if p != "self") or src


def layer_hint(node: fx.Node, ctx: PassContext | None = None) -> int | None:
    """The ModuleList index in a weight's name or source path (the layer number), if any."""
    src = _where_from(node, ctx)
    if not src:
        return None
    match = _INDEX.search(src) or _DOTTED_INDEX.search(src)
    return int(match.group(1)) if match else None


def fake_value(node: fx.Node):
    """A node's fake value: ``meta["val"]``, or ``meta["example_value"]`` in Dynamo's graphs."""
    return node.meta.get("val", node.meta.get("example_value"))


def fake_mode_of(gm: fx.GraphModule):
    """The fake mode of the graph's own fake values (not the ambient tracing context's)."""
    for node in gm.graph.nodes:
        mode = getattr(fake_value(node), "fake_mode", None)
        if mode is not None:
            return mode
    raise ValueError("graph carries no fake values: was it produced by Dynamo?")


def _set_fake(node: fx.Node, value) -> None:
    # Dynamo's graphs carry "example_value"; later tracers (AOT, export) read "val".
    node.meta["val"] = value
    node.meta["example_value"] = value


def set_val(node: fx.Node, fake_mode) -> None:
    """Set a node's fake value by running its target on its inputs' fake values."""

    def val(a):
        return fake_value(a) if isinstance(a, fx.Node) else a

    args = fx.node.map_aggregate(node.args, val)
    kwargs = fx.node.map_aggregate(node.kwargs, val)
    with fake_mode:
        _set_fake(node, node.target(*args, **kwargs))


def add_constant(gm: fx.GraphModule, ctx: PassContext, name: str, tensor: torch.Tensor, fake_mode):
    """Attach ``tensor`` to ``gm`` and return a get_attr node for it (inserted where the graph's
    insertion point is), with a valid ``meta["val"]``."""
    attr = f"_dejavu_{name}_{ctx.constants}"
    ctx.constants += 1
    # A buffer, so AOTAutograd lifts it as a static input (CUDA graphs then read it in place).
    # AOTAutograd maps every parameter and buffer of a Dynamo graph to the source it came from
    # (Note [Assumption on Dynamo Metadata]); ours come from the pass, so they get a constant one.
    gm.register_buffer(attr, tensor, persistent=False)
    sources = getattr(gm, "_param_name_to_source", None)
    if sources is not None:
        sources[attr] = ConstantSource(attr)
    node = gm.graph.get_attr(attr)
    _set_fake(node, fake_mode.from_tensor(tensor, static_shapes=True))
    return node
