"""Sparsify: replace each matched block by a selector and ``torch.ops.dejavu.*`` sparse ops.

Only decode graphs are rewritten: those whose queries are one new token per sequence. Graphs of
prefill (several new tokens, static or symbolic) stay dense and say so in the report.

MLP: ``down(act(first(x)) [* up(x)])`` becomes ``sparse_mlp(x, idx, ...)`` with ``idx`` from the
oracle (true top-k), the layer's predictor or fixed ids; with the ``gate`` selector the gate
projection stays dense and feeds ``select_gate`` and ``sparse_mlp_gated`` (only the kept rows of
up and down are read); with ``threshold`` (TEAL) each projection becomes an input-gathered GEMV
over its largest-magnitude inputs (``select_magnitude`` + ``sparse_head_out`` with one unit per
row), the activation nodes in between unchanged. Attention: the query projection becomes
``sparse_head_proj`` (zeros for unselected heads, so the attention code in between is unchanged)
and the output projection ``sparse_head_out``; keys and values stay dense so the KV cache is
complete, unless option ``lazy_kv`` computes them for the selected heads only
(``dejavu::lazy_kv``). The oracle needs the dense attention output to rank heads, so with it
only the output projection is sparse. Down and output projections are passed as ``aten.t``
views here; the lower pass replaces those views by weights re-laid out once.

The plan (per layer and block: selector, density, k) comes from the profile or the options and
is checked against the discovered shapes; a profile that does not fit raises ``ProfileError``.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch
import torch.fx as fx

from dejavu_compile.profile import BlockProfile, ProfileError, kept_units

from .context import PassContext, add_constant, fake_mode_of, fake_value, set_val

OPS = torch.ops.dejavu
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


@dataclass
class BlockPlan:
    """How one block is computed: selector, kept fraction and the top-k it implies."""

    kind: str  # "mlp" | "attention"
    selector: str  # "dense" | "oracle" | "predictor"
    density: float = 1.0
    units: int = 0  # neurons, heads, or KV groups
    k: int = 0  # units kept per token
    group: int = 1  # heads per unit (attention at KV-group granularity)
    activation: str = "none"  # predictor hidden activation
    input: str = "same"  # the predictor's input: its block's, or the previous layer's (lookahead)
    buckets: int = 1  # the predictor's top-k is taken per bucket of units (profile ``buckets``)
    reason: str = ""  # why a block stays dense

    @property
    def kept_fraction(self) -> float:
        return self.k / self.units if self.selector != "dense" and self.units else 1.0


def _identity_errors(ctx: PassContext) -> None:
    """Refuse a profile calibrated on another model, naming the first layer that differs."""
    ident = ctx.profile.model
    disc = ctx.discovery
    if not disc.named_layers and len(disc.layers) < ident.num_layers:
        raise ProfileError(
            f"this graph holds {len(disc.layers)} of the {ident.num_layers} layers of "
            f"{ident.name!r} and its weights carry no layer numbers, so per-layer settings "
            "cannot be matched: compile with dejavu_compile.compile(model, profile=...), which "
            "registers the model's parameter names"
        )
    for kind, blocks in (("mlp", disc.mlp), ("attention", disc.attention)):
        for layer, block in blocks.items():
            if layer >= ident.num_layers:
                raise ProfileError(
                    f"profile for {ident.name!r} has {ident.num_layers} layers but the model has "
                    f"layer {layer}: is it a profile for another model?"
                )
            checks = [("hidden_size", ident.hidden_size, block.hidden_size)]
            if kind == "mlp":
                checks.append(("intermediate_size", ident.intermediate_size, block.units))
            else:
                checks += [
                    ("num_heads", ident.num_heads, block.num_heads),
                    ("num_kv_heads", ident.num_kv_heads, block.num_kv_heads),
                    ("head_dim", ident.head_dim, block.head_dim),
                ]
            for name, want, got in checks:
                if want != got:
                    raise ProfileError(
                        f"profile for {ident.name!r} does not fit this model: layer {layer} "
                        f"{kind} has {name}={got}, the profile says {want}"
                    )


def _unsupported(block) -> str:
    weights = [lin.weight for lin in block.linears()]
    for w in weights:
        if w.dtype not in SUPPORTED_DTYPES:
            return f"weight dtype {w.dtype} is not supported (expected one of {SUPPORTED_DTYPES})"
    if len({w.device for w in weights}) != 1:
        return "weights on different devices"
    return ""


def make_plan(ctx: PassContext) -> dict[tuple[int, str], BlockPlan]:
    """Per (layer, kind): the plan for every discovered block."""
    disc, opts, prof = ctx.discovery, ctx.options, ctx.profile
    if prof is not None:
        _identity_errors(ctx)
    granularity = prof.attention_granularity if prof is not None else opts.attention_granularity
    tokens = disc.tokens
    plan = {}
    for kind, blocks in (("mlp", disc.mlp), ("attention", disc.attention)):
        for layer, block in blocks.items():
            if kind == "mlp":
                units, group = block.units, 1
            elif granularity == "group":
                units, group = block.num_kv_heads, block.num_heads // block.num_kv_heads
            else:
                units, group = block.num_heads, 1
            if prof is not None:
                spec = prof.layer(layer).block(kind)
            else:
                density = opts.mlp_density if kind == "mlp" else opts.attention_density
                spec = BlockProfile(selector="oracle", density=density) if density else BlockProfile()
            selector = spec.selector
            if selector != "dense" and opts.selector in ("oracle", "fixed", "gate", "threshold"):
                selector = opts.selector
            reason = ""
            if selector == "dense":
                reason = "dense by profile" if prof is not None else "no density given"
            elif tokens != 1:
                count = "a symbolic number of" if tokens is None else tokens
                selector, reason = "dense", f"prefill graph ({count} new tokens) runs dense"
            elif layer in opts.dense_layers:
                selector, reason = "dense", "listed in dense_layers"
            elif why := _unsupported(block):
                selector, reason = "dense", why
            elif selector == "gate" and kind == "mlp" and block.up is None:
                raise ProfileError(
                    f"layer {layer}, mlp selector 'gate' needs a gated MLP "
                    "(act(gate(x)) * up(x)); this block has one first projection")
            elif selector == "predictor" and spec.units != units:
                raise ProfileError(
                    f"profile: layer {layer}, {kind} predictor has units={spec.units} but the "
                    f"model's block has {units} ({granularity} granularity)"
                )
            buckets = spec.buckets if selector == "predictor" else 1
            plan[(layer, kind)] = BlockPlan(
                kind=kind,
                selector=selector,
                density=spec.density,
                units=units,
                k=units if selector == "dense" else kept_units(spec.density, units, buckets),
                buckets=buckets,
                group=group if kind == "attention" else 1,
                activation=spec.activation,
                reason=reason,
                input=spec.input if selector == "predictor" else "same",
            )
    return plan


def _predictor_nodes(gm, ctx, layer: int, kind: str, block, fake_mode) -> list[fx.Node | None]:
    """get_attr nodes for the predictor tensors (w1, b1, w2, b2) of one block, checked."""
    prefix = f"layers.{layer}.{kind}."
    tensors = {}
    for name in ("w1", "b1", "w2", "b2"):
        t = ctx.predictors.get(prefix + name)
        if t is None and name.startswith("w"):
            raise ProfileError(f"profile: predictor tensor {prefix + name!r} is missing")
        tensors[name] = t
    w1, w2 = tensors["w1"], tensors["w2"]
    plan = ctx.plan[(layer, kind)]
    if w1.dim() != 2 or w1.shape[1] != block.hidden_size:
        raise ProfileError(
            f"profile: layer {layer}, {kind} predictor w1 has shape {tuple(w1.shape)}, expected "
            f"[rank, {block.hidden_size}]"
        )
    if w2.dim() != 2 or w2.shape != (plan.units, w1.shape[0]):
        raise ProfileError(
            f"profile: layer {layer}, {kind} predictor w2 has shape {tuple(w2.shape)}, expected "
            f"[{plan.units}, {w1.shape[0]}]"
        )
    ref = block.linears()[0].weight
    nodes = []
    for name in ("w1", "b1", "w2", "b2"):
        t = tensors[name]
        if t is None:
            nodes.append(None)
            continue
        t = _on_device(ctx, prefix + name, t, ref)
        nodes.append(add_constant(gm, ctx, f"L{layer}_{kind}_{name}", t, fake_mode))
    return nodes


# (predictor file, its mtime, tensor name, device, dtype) -> the tensor on that device, while a
# graph holds it: every graph of a model (the recompilations too) shares one copy, and the
# fold of predictors into stacked projections (``passes/lower.py``) finds the same tensor again
_ON_DEVICE: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _on_device(ctx: PassContext, name: str, t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    path = ctx.profile.predictor_path() if ctx.profile is not None else None
    if path is None or not path.is_file():
        return t.to(device=like.device, dtype=like.dtype)
    key = (str(path), path.stat().st_mtime_ns, name, str(like.device), like.dtype)
    cached = _ON_DEVICE.get(key)
    if cached is None or cached.shape != t.shape:
        cached = t.to(device=like.device, dtype=like.dtype, copy=True)
        _ON_DEVICE[key] = cached
    return cached


def _fixed_ids(gm, ctx, x: fx.Node, plan: BlockPlan, name: str, fake_mode) -> fx.Node:
    """The ``fixed`` selector: units 0..k-1 for every row (times the KV group, as heads)."""
    from dejavu_compile.kernels.reference import expand_groups

    rows = tuple(fake_value(x).shape[:-1])
    ids = expand_groups(torch.arange(plan.k).unsqueeze(0), plan.group)[0]
    ids = ids.to(fake_value(x).device).expand(*rows, ids.numel()).contiguous()
    return add_constant(gm, ctx, name, ids, fake_mode)


def _union(ctx: PassContext, x: fx.Node) -> bool:
    """Whether the sparse op reading ``x`` computes the batch's union selection: for more than
    one decoded row, unless ``batch_selection`` is ``"row"`` (always passed, by position: the
    lookahead pass appends its arguments after it)."""
    val = fake_value(x)
    rows = val.numel() // val.shape[-1]
    return ctx.options.batch_selection == "union" and rows > 1


def _call(graph: fx.Graph, fake_mode, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    set_val(node, fake_mode)
    return node


def _tag(layer: int, plan: BlockPlan, *nodes: fx.Node) -> None:
    """Record on each inserted node which block it serves (read by export and lookahead)."""
    for node in nodes:
        node.meta["dejavu"] = {"layer": layer, "block": plan.kind, "selector": plan.selector,
                               "density": plan.density, "k": plan.k, "units": plan.units}


def _erase_dead(graph: fx.Graph, nodes) -> None:
    pending = set(nodes)
    changed = True
    while changed:
        changed = False
        for node in list(pending):
            if not node.users:
                graph.erase_node(node)
                pending.discard(node)
                changed = True


def _rewrite_mlp(gm, ctx, block, plan: BlockPlan, fake_mode) -> None:
    graph = gm.graph
    first, up, down = block.first, block.up, block.down
    up_w = up.weight_node if up is not None else None
    if plan.selector == "threshold":
        _rewrite_mlp_threshold(gm, ctx, block, plan, fake_mode)
        return
    if plan.selector == "gate":
        with graph.inserting_before(down.node):
            w2_t = _call(graph, fake_mode, torch.ops.aten.t.default, down.weight_node)
            idx = _call(graph, fake_mode, OPS.select_gate.default, first.node, block.act, plan.k)
            out = _call(graph, fake_mode, OPS.sparse_mlp_gated.default, block.input, idx,
                        first.node, up_w, w2_t, down.bias_node, block.act,
                        _union(ctx, block.input))
        _tag(block.layer, plan, idx, out)
        down.node.replace_all_uses_with(out)
        _erase_dead(graph, [down.node, *block.chain])
        ctx.counters.add("sparse_mlp[gate]")
        return
    with graph.inserting_before(down.node):
        w2_t = _call(graph, fake_mode, torch.ops.aten.t.default, down.weight_node)
        if plan.selector == "oracle":
            idx = _call(graph, fake_mode, OPS.select_mlp_oracle.default, block.input,
                        first.weight_node, first.bias_node, up_w, block.act, plan.k)
        elif plan.selector == "fixed":
            idx = _fixed_ids(gm, ctx, block.input, plan, f"L{block.layer}_mlp_fixed", fake_mode)
        else:
            w1, b1, w2, b2 = _predictor_nodes(gm, ctx, block.layer, "mlp", block, fake_mode)
            idx = _call(graph, fake_mode, OPS.select_predictor.default, block.input,
                        w1, b1, w2, b2, plan.activation, plan.k, 1, plan.buckets)
        out = _call(graph, fake_mode, OPS.sparse_mlp.default, block.input, idx,
                    first.weight_node, first.bias_node, up_w, w2_t, down.bias_node, block.act,
                    _union(ctx, block.input))
    _tag(block.layer, plan, idx, out)
    down.node.replace_all_uses_with(out)
    _erase_dead(graph, [down.node, *block.chain])
    ctx.counters.add(f"sparse_mlp[{plan.selector}]")


def _rewrite_mlp_threshold(gm, ctx, block, plan: BlockPlan, fake_mode) -> None:
    """TEAL: each projection reads only the rows (of its transposed weight) of its input's
    largest-magnitude activations: ``k_in`` of the d input channels for the first projection(s),
    ``plan.k`` of the N hidden units for the down projection. The activation (and gate product)
    nodes of the graph stay as they are, fed by the sparse projections."""
    graph = gm.graph
    hidden = block.down.input
    k_in = kept_units(plan.density, block.hidden_size)
    with graph.inserting_before(block.first.node):
        ix = _call(graph, fake_mode, OPS.select_magnitude.default, block.input, k_in)
        _tag(block.layer, plan, ix)
        for lin in [block.first] + ([block.up] if block.up is not None else []):
            w_t = _call(graph, fake_mode, torch.ops.aten.t.default, lin.weight_node)
            y = _call(graph, fake_mode, OPS.sparse_head_out.default, block.input, ix, w_t,
                      lin.bias_node, 1, _union(ctx, block.input))
            _tag(block.layer, plan, y)
            lin.node.replace_all_uses_with(y)
    with graph.inserting_before(block.down.node):
        ih = _call(graph, fake_mode, OPS.select_magnitude.default, hidden, plan.k)
        w_t = _call(graph, fake_mode, torch.ops.aten.t.default, block.down.weight_node)
        out = _call(graph, fake_mode, OPS.sparse_head_out.default, hidden, ih, w_t,
                    block.down.bias_node, 1, _union(ctx, hidden))
    _tag(block.layer, plan, ih, out)
    block.down.node.replace_all_uses_with(out)
    linears = [block.first.node, block.down.node] + ([block.up.node] if block.up else [])
    for node in linears:
        graph.erase_node(node)
    ctx.counters.add("sparse_mlp[threshold]")


def _rewrite_attention(gm, ctx, block, plan: BlockPlan, fake_mode) -> None:
    graph = gm.graph
    q, o, hd = block.q, block.o, block.head_dim
    if plan.selector in ("predictor", "fixed"):
        with graph.inserting_before(q.node):
            if plan.selector == "fixed":
                idx = _fixed_ids(gm, ctx, block.input, plan, f"L{block.layer}_attention_fixed",
                                 fake_mode)
            else:
                w1, b1, w2, b2 = _predictor_nodes(gm, ctx, block.layer, "attention", block,
                                                  fake_mode)
                idx = _call(graph, fake_mode, OPS.select_predictor.default, block.input,
                            w1, b1, w2, b2, plan.activation, plan.k, plan.group,
                            plan.buckets)
            q_new = _call(graph, fake_mode, OPS.sparse_head_proj.default, block.input, idx,
                          q.weight_node, q.bias_node, hd, _union(ctx, block.input))
        _tag(block.layer, plan, idx, q_new)
        q.node.replace_all_uses_with(q_new)
        graph.erase_node(q.node)
        if ctx.options.lazy_kv:
            _lazy_kv(gm, ctx, block, plan, idx, q_new, fake_mode)
    with graph.inserting_before(o.node):
        wo_t = _call(graph, fake_mode, torch.ops.aten.t.default, o.weight_node)
        if plan.selector == "oracle":
            idx = _call(graph, fake_mode, OPS.select_heads_oracle.default, o.input, wo_t, hd,
                        plan.k, plan.group)
        o_new = _call(graph, fake_mode, OPS.sparse_head_out.default, o.input, idx, wo_t,
                      o.bias_node, hd, _union(ctx, o.input))
        if plan.selector != "oracle":
            # the query projection read these ids first: the kernel before this op's never
            # writes them (the oracle's are computed right here, from the attention's output)
            o_new.kwargs = {"early": True}
    _tag(block.layer, plan, idx, o_new)
    o.node.replace_all_uses_with(o_new)
    graph.erase_node(o.node)
    ctx.counters.add(f"sparse_attention[{plan.selector}]")


def _cache_write(lin) -> tuple[fx.Node, fx.Node, fx.Node] | str:
    """(the cache write, the cache, the positions) of a K or V projection whose only path is
    ``linear -> view(B, n, H, hd) -> transpose(1, 2) -> cache.index_copy_(2, pos, .)``; else
    why not."""
    node = lin.node
    for step in ("view", "transpose"):
        users = list(node.users)
        if len(users) != 1 or users[0].op != "call_method" or users[0].target != step:
            return f"the projection's output goes through more than a {step}"
        node = users[0]
    if tuple(node.args[1:]) not in ((1, 2), (2, 1)):
        return "the heads are not moved to dim 1"
    users = list(node.users)
    if len(users) != 1 or users[0].op != "call_method" or users[0].target != "index_copy_":
        return "the keys or values do not go straight to a static cache's index_copy_"
    write = users[0]
    if len(write.args) != 4 or write.args[1] != 2 or write.args[3] is not node or write.users:
        return "the cache write is not index_copy_(2, positions, states)"
    return write, write.args[0], write.args[2]


def _lazy_kv(gm, ctx, block, plan: BlockPlan, idx: fx.Node, q_new: fx.Node, fake_mode) -> None:
    """Replace the block's K/V projections and cache writes by ``dejavu::lazy_kv`` (option
    ``lazy_kv``); a block whose graph does not have the expected shape keeps them, counted in
    ``lazy_kv_skipped[...]``. With option ``fuse_qkv`` the query projection ``q_new`` joins
    them in ``dejavu::lazy_qkv`` where it can (``_fuse_query``)."""
    graph = gm.graph
    found = [_cache_write(lin) for lin in (block.k, block.v)]
    why = next((f for f in found if isinstance(f, str)), None)
    if why is None:
        (k_write, keys, pos), (v_write, values, v_pos) = found
        x_node = block.k.input  # the query projection's input too (its node is gone now)
        x = fake_value(x_node)
        cache = fake_value(keys)
        if v_pos is not pos:
            why = "keys and values are written at different positions"
        elif block.num_kv_heads != block.num_heads:
            why = "K/V heads are shared by several query heads"
        elif x.dim() != 3 or cache.dim() != 4 or cache.shape[1] != block.num_heads \
                or cache.shape[3] != block.head_dim or block.v.input is not x_node:
            why = "unexpected shapes"
    if why is not None:
        ctx.counters.add(f"lazy_kv_skipped[{why}]")
        return
    args = (block.k.input, idx, block.k.weight_node, block.k.bias_node, block.v.weight_node,
            block.v.bias_node, keys, values, pos)
    node = _fuse_query(gm, ctx, block, q_new, args, fake_mode) if ctx.options.fuse_qkv else None
    if node is None:
        with graph.inserting_before(min(k_write, v_write)):  # the earlier write, in graph order
            node = _call(graph, fake_mode, OPS.lazy_kv.default, *args)
    _tag(block.layer, plan, node)
    for write in (k_write, v_write):
        transpose = write.args[3]
        view = transpose.args[0]
        graph.erase_node(write)
        _erase_dead(graph, [transpose, view, view.args[0]])
    ctx.lazy_kv_layers.add(block.layer)
    ctx.counters.add("lazy_kv")


def _mutates(node: fx.Node) -> bool:
    """Whether ``node`` may write to a tensor or have another side effect: impure by FX's
    account, an in-place method or function (name ending in ``_``) or an op whose schema
    mutates (FX counts every method call as pure)."""
    if node.op == "call_method":
        return str(node.target).endswith("_")
    if node.op != "call_function":
        return node.op != "get_attr"
    schema = getattr(node.target, "_schema", None)
    return node.is_impure() or getattr(node.target, "__name__", "").endswith("_") \
        or (schema is not None and schema.is_mutable)


def _hoist(node: fx.Node, before: fx.Node, nodes: list, moved: set) -> bool:
    """Make ``node`` come before ``before`` in the graph, moving it and the inputs it needs that
    come later (the cache positions are computed from the cache's length by an ``arange`` and
    an add after the query projection in Hugging Face's static-cache graphs). Only ops without
    side effects move, and only past ops without side effects (a moved read must not pass a
    write); False when that does not hold. ``nodes``: the graph's nodes before any move;
    ``moved``: the nodes moved so far."""
    at, limit = nodes.index(node), nodes.index(before)
    if node in moved or at < limit:
        return True
    if node.op not in ("call_function", "call_method") or _mutates(node) \
            or any(_mutates(m) for m in nodes[limit:at]):
        return False
    if not all(_hoist(n, before, nodes, moved) for n in node.all_input_nodes):
        return False
    before.prepend(node)
    moved.add(node)
    return True


def _fuse_query(gm, ctx, block, q_new: fx.Node, args: tuple, fake_mode) -> fx.Node | None:
    """``dejavu::lazy_qkv`` in place of the query projection ``q_new`` (``sparse_head_proj``),
    taking the lazy K/V op's arguments ``args`` too: one op whose output replaces the query's;
    None (counted in ``fuse_qkv_skipped[...]``) when the block cannot be fused so."""
    graph = gm.graph
    x, idx, wk, bk, wv, bv, keys, values, pos = args
    _, _, wq, bq, _, union = q_new.args
    nodes, moved = list(graph.nodes), set()
    why = None
    if union:
        why = "a batch's union selection"  # lazy K/V selects per sequence
    elif (bq is None) != (bk is None) or (bq is None) != (bv is None):
        why = "the query, key and value projections do not all have biases, or all lack them"
    elif fake_value(wq).shape != fake_value(wk).shape:
        why = "the query and key projections differ in shape"
    elif not all(_hoist(a, q_new, nodes, moved) for a in args if isinstance(a, fx.Node)):
        why = "the cache or positions are computed after the query projection by an op that " \
            "cannot move"
    if why is not None:
        ctx.counters.add(f"fuse_qkv_skipped[{why}]")
        return None
    with graph.inserting_before(q_new):
        node = _call(graph, fake_mode, OPS.lazy_qkv.default, x, idx, wq, bq, wk, bk, wv, bv,
                     keys, values, pos)
    node.meta.update({k: v for k, v in q_new.meta.items() if k != "val"})
    q_new.replace_all_uses_with(node)
    graph.erase_node(q_new)
    ctx.counters.add("fuse_qkv")
    return node


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    ctx.plan = make_plan(ctx)
    fake_mode = fake_mode_of(gm)
    disc = ctx.discovery
    for kind, blocks in (("mlp", disc.mlp), ("attention", disc.attention)):
        ctx.inputs.update({(layer, kind): block.input for layer, block in blocks.items()})
    for (layer, kind), plan in sorted(ctx.plan.items()):
        if plan.selector == "dense":
            continue
        if kind == "mlp":
            _rewrite_mlp(gm, ctx, disc.mlp[layer], plan, fake_mode)
        else:
            _rewrite_attention(gm, ctx, disc.attention[layer], plan, fake_mode)
    gm.graph.lint()
    gm.recompile()
    return gm
