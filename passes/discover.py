"""Discover: find each decoder layer's attention and MLP blocks from the graph's data flow.

Attention: each ``scaled_dot_product_attention`` node (or ``dejavu::decode_attention``); its
query, key and value are traced back to the nearest linear projections (through reshapes,
norms, rotary embeddings and the KV cache), which must share one input; its output is traced
forward through reshapes to the output projection. MLP: a linear whose input is
``act(linear(x))`` or ``act(linear(x)) * linear(x)``. Layer numbers come from the ModuleList
index in the weights' source path when every block has one (they then survive graph breaks),
otherwise from the blocks' order along the graph.

What is not matched stays dense; the reason is recorded for the compile report.
"""

from __future__ import annotations

import operator
from dataclasses import dataclass, field

import torch
import torch.fx as fx
import torch.nn.functional as F

from .context import Linear, PassContext, fake_value, is_linear, is_op, layer_hint, parameter_name

SDPA_TARGETS = (F.scaled_dot_product_attention, torch.ops.aten.scaled_dot_product_attention.default)


def is_attention(node: fx.Node) -> bool:
    """An SDPA call, or ``dejavu::decode_attention`` (``kv.use_decode_attention``), which takes
    SDPA's leading (query, key, value) arguments."""
    return (node.op == "call_function" and node.target in SDPA_TARGETS) \
        or is_op(node, "decode_attention")


# Ops that only move or re-view the heads between attention and the output projection.
VIEW_METHODS = {"transpose", "reshape", "view", "contiguous", "permute", "flatten"}
VIEW_FUNCTIONS = {torch.transpose, torch.reshape, torch.flatten, torch.permute}
MUL_TARGETS = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)
# Steps allowed when tracing q/k/v back to their projections, so a miss fails fast.
MAX_TRACE = 400


@dataclass
class MLPBlock:
    layer: int
    first: Linear  # W1 (plain MLP) or the gate projection (gated MLP)
    up: Linear | None  # the up projection of a gated MLP
    down: Linear
    act: str
    chain: list[fx.Node] = field(default_factory=list)  # nodes the sparse op replaces

    @property
    def input(self) -> fx.Node:
        return self.first.input

    @property
    def units(self) -> int:
        return self.first.weight.shape[0]

    @property
    def hidden_size(self) -> int:
        return self.first.weight.shape[1]

    def linears(self) -> list[Linear]:
        return [lin for lin in (self.first, self.up, self.down) if lin is not None]


@dataclass
class AttentionBlock:
    layer: int
    q: Linear
    k: Linear
    v: Linear
    o: Linear
    attention: fx.Node
    num_heads: int
    num_kv_heads: int
    head_dim: int
    tokens: int | torch.SymInt  # new tokens per sequence (queries) in this graph

    @property
    def input(self) -> fx.Node:
        return self.q.input

    @property
    def hidden_size(self) -> int:
        return self.q.weight.shape[1]

    def linears(self) -> list[Linear]:
        return [self.q, self.k, self.v, self.o]


@dataclass
class Discovery:
    """What discovery found in one graph."""

    mlp: dict[int, MLPBlock] = field(default_factory=dict)
    attention: dict[int, AttentionBlock] = field(default_factory=dict)
    unmatched: list[str] = field(default_factory=list)  # "name: reason", left dense
    tokens: int | None = None  # new tokens per sequence, see ``count_new_tokens``
    named_layers: bool = True  # layer numbers from weight names (False: from graph order only)

    @property
    def layers(self) -> list[int]:
        return sorted(set(self.mlp) | set(self.attention))

    def count_new_tokens(self) -> int | None:
        """New tokens per sequence when the graph fixes it, else None.

        Read from the queries' shape, or from 3-d MLP inputs in a graph without attention. A
        symbolic count is None: Dynamo specialises sizes 0 and 1, so a graph with a symbolic
        token count never runs a single-token decode step.
        """
        counts = [b.tokens for b in self.attention.values()]
        if not counts:
            vals = [fake_value(b.input) for b in self.mlp.values()]
            counts = [v.shape[-2] for v in vals if v is not None and v.dim() >= 3]
        counts = {c if isinstance(c, int) else None for c in counts}  # SymInts are unhashable
        return counts.pop() if len(counts) == 1 else None


def activation_of(node: fx.Node) -> str | None:
    """The activation a node applies ("relu", "silu", "gelu", "gelu_tanh"), else None."""
    if node.op == "call_function":
        target = node.target
        if target in (F.relu, torch.relu, torch.ops.aten.relu.default):
            return "relu"
        if target in (F.silu, torch.ops.aten.silu.default):
            return "silu"
        if target in (F.gelu, torch.ops.aten.gelu.default):
            approx = node.kwargs.get("approximate", node.args[1] if len(node.args) > 1 else "none")
            return "gelu_tanh" if approx == "tanh" else "gelu" if approx == "none" else None
    if node.op == "call_method" and node.target == "relu":
        return "relu"
    return None


def _is_identity(node: fx.Node) -> bool:
    """Ops that leave values unchanged at inference: dropout in eval mode, contiguous."""
    if node.op == "call_function" and node.target in (F.dropout, torch.dropout):
        training = node.kwargs.get("training", node.args[2] if len(node.args) > 2 else True)
        return training is False
    return node.op == "call_method" and node.target == "contiguous"


def is_view(node: fx.Node) -> bool:
    if node.op == "call_method":
        return node.target in VIEW_METHODS
    return node.op == "call_function" and node.target in VIEW_FUNCTIONS


def _is_inplace(node: fx.Node) -> bool:
    """An in-place op (``index_copy_``, ``copy_``, ...) writing into its first argument."""
    name = node.target if node.op == "call_method" else getattr(node.target, "__name__", "")
    return (node.op in ("call_method", "call_function") and isinstance(name, str)
            and name.endswith("_") and not name.startswith("_"))


def _nearest_linears(start, limit: int = MAX_TRACE) -> tuple[list[fx.Node], bool]:
    """Linear nodes reached first when walking back from ``start``; ok=False if the walk hit
    another attention op or ran too long (the value is not a projection of this layer).

    A tensor written in place (a static KV cache: ``cache.index_copy_(..., k)``) is traced
    through the values written into it, so keys and values reach their projections."""
    found, seen, stack = [], set(), [start]
    while stack:
        node = stack.pop()
        if not isinstance(node, fx.Node) or node in seen:
            continue
        seen.add(node)
        if len(seen) > limit:
            return found, False
        if is_linear(node):
            found.append(node)
            continue
        if is_attention(node):
            return found, False
        stack.extend(node.all_input_nodes)
        for user in node.users:
            if _is_inplace(user) and user.args and user.args[0] is node:
                stack.extend(n for n in user.all_input_nodes if n is not node)
    return found, True


def _stays_inside(start: fx.Node, stop: fx.Node) -> bool:
    """True when every use of ``start`` flows only into ``stop`` (nothing else reads it)."""
    seen, stack = set(), [start]
    while stack:
        node = stack.pop()
        if node in seen or node is stop:
            continue
        seen.add(node)
        if node.op == "output" or (node is not start and is_linear(node)) or not node.users:
            return False
        stack.extend(node.users)
    return True


def _sdpa_arg(node: fx.Node, pos: int, name: str):
    return node.args[pos] if len(node.args) > pos else node.kwargs.get(name)


def _match_attention(sdpa: fx.Node, gm, ctx: PassContext) -> tuple[dict | None, str]:
    lins = {}
    for pos, name in enumerate(("query", "key", "value")):
        found, ok = _nearest_linears(_sdpa_arg(sdpa, pos, name))
        if not ok or len(found) != 1:
            return None, f"{name} is not the output of one linear projection"
        lin = ctx.linear(found[0], gm)
        if lin is None:
            return None, f"{name} projection has no plain weight tensor"
        lins[name] = lin
    q, k, v = lins["query"], lins["key"], lins["value"]
    if not (q.input is k.input is v.input):
        return None, "query, key and value projections read different inputs"
    q_val = fake_value(_sdpa_arg(sdpa, 0, "query"))
    if q_val is None or q_val.dim() != 4:
        return None, "query is not [batch, heads, tokens, head_dim]"
    num_heads, head_dim = int(q_val.shape[1]), int(q_val.shape[3])
    if q.weight.shape[0] != num_heads * head_dim:
        return None, "query projection width is not heads * head_dim"
    if k.weight.shape[0] % head_dim or num_heads % (k.weight.shape[0] // head_dim):
        return None, "key projection width does not divide into KV heads"
    if not _stays_inside(q.node, sdpa):
        return None, "query projection is used outside attention"
    # Forward: attention output -> reshapes -> output projection.
    node = sdpa
    while len(node.users) == 1:
        (user,) = node.users
        if is_linear(user) and user.args[0] is node:
            o = ctx.linear(user, gm)
            if o is None or o.weight.shape[1] != num_heads * head_dim:
                return None, "output projection does not read heads * head_dim features"
            if node is sdpa:
                return None, "attention output reaches the output projection without a reshape"
            return dict(q=q, k=k, v=v, o=o, attention=sdpa, num_heads=num_heads,
                        num_kv_heads=k.weight.shape[0] // head_dim, head_dim=head_dim,
                        tokens=q_val.shape[2]), ""
        if not is_view(user):
            break
        node = user
    return None, "attention output does not reach one output projection through reshapes"


def _match_mlp(down: Linear, gm, ctx: PassContext) -> tuple[dict | None, str]:
    chain = []
    h = down.input
    while isinstance(h, fx.Node) and _is_identity(h) and len(h.users) == 1:
        chain.append(h)
        h = h.args[0]
    if not isinstance(h, fx.Node) or len(h.users) != 1:
        return None, "input is shared"
    act = activation_of(h)
    if act is not None:
        first = ctx.linear(h.args[0], gm)
        if first is None or len(first.node.users) != 1:
            return None, "activation input is not a single-use linear"
        return dict(first=first, up=None, act=act, chain=[first.node, h, *chain]), ""
    if h.op == "call_function" and h.target in MUL_TARGETS and len(h.args) == 2:
        for a, b in (h.args, h.args[::-1]):
            if not (isinstance(a, fx.Node) and isinstance(b, fx.Node)):
                continue
            act = activation_of(a)
            if act is None or len(a.users) != 1:
                continue
            gate, up = ctx.linear(a.args[0], gm), ctx.linear(b, gm)
            if gate is None or up is None or gate.input is not up.input:
                continue
            if len(gate.node.users) != 1 or len(up.node.users) != 1:
                continue
            if gate.weight.shape != up.weight.shape:
                continue
            return dict(first=gate, up=up, act=act, chain=[gate.node, a, up.node, h, *chain]), ""
    return None, "input is not act(linear(x)) or act(linear(x)) * linear(x)"


def _assign_layers(blocks: list[tuple[str, dict]], ctx: PassContext) -> tuple[list[int], bool]:
    """Layer numbers: ModuleList indices when every block has a consistent one, else graph
    order. The flag says whether the numbers are the model's own (names) or only the order."""
    hints = []
    for _, found in blocks:
        lins = [found[k] for k in ("q", "k", "v", "o", "first", "up", "down") if found.get(k)]
        ids = {layer_hint(lin.weight_node, ctx) for lin in lins}
        hints.append(ids.pop() if len(ids) == 1 else None)
    kinds = [kind for kind, _ in blocks]
    pairs = list(zip(kinds, hints, strict=True))
    if None not in hints and len(set(pairs)) == len(pairs):
        return hints, True
    layers, current = [], -1
    for kind, _ in blocks:
        if kind == "attention" or current < 0 or (kinds.count("attention") == 0):
            current += 1
        layers.append(current)
    return layers, False


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    order = {node: i for i, node in enumerate(gm.graph.nodes)}
    blocks: list[tuple[str, dict]] = []
    failures: list[str] = []
    claimed: set[fx.Node] = set()
    for node in gm.graph.nodes:
        if is_attention(node):
            found, why = _match_attention(node, gm, ctx)
            if found is None:
                failures.append(f"attention at {node.name}: {why}")
                continue
            blocks.append(("attention", found))
            claimed.update(found[k].node for k in ("q", "k", "v", "o"))
    for node in gm.graph.nodes:
        if node in claimed or not is_linear(node):
            continue
        down = ctx.linear(node, gm)
        if down is None:
            continue
        inner = down.input
        if not isinstance(inner, fx.Node) or inner.op in ("placeholder", "get_attr"):
            continue
        found, why = _match_mlp(down, gm, ctx)
        if found is None:
            continue
        found["down"] = down
        blocks.append(("mlp", found))
        claimed.update(lin.node for lin in (found["first"], found["up"], down) if lin is not None)
    blocks.sort(key=lambda b: order[(b[1].get("q") or b[1]["first"]).node])
    disc = Discovery()
    layers, disc.named_layers = _assign_layers(blocks, ctx)
    for (kind, found), layer in zip(blocks, layers, strict=True):
        if kind == "attention":
            disc.attention[layer] = AttentionBlock(layer=layer, **found)
        else:
            disc.mlp[layer] = MLPBlock(layer=layer, **found)
    for node in gm.graph.nodes:
        if is_linear(node) and node not in claimed:
            weight = node.args[1]
            name = parameter_name(weight, ctx) if isinstance(weight, fx.Node) else node.name
            disc.unmatched.append(f"{name}: not part of a matched attention or MLP block")
    disc.unmatched.extend(failures)
    disc.tokens = disc.count_new_tokens()
    ctx.discovery = disc
    ctx.counters.add("attention_blocks", len(disc.attention))
    ctx.counters.add("mlp_blocks", len(disc.mlp))
    ctx.counters.add("unmatched", len(disc.unmatched))
    return gm

