"""Lookahead (paper section 4.3): each predictor calibrated on the previous layer's input reads
that input and is scheduled right after it is computed, so it runs while the previous layer
computes instead of on the critical path of its own layer.

A profile block with ``input: previous`` at layer l reads the input of the same kind of block
at layer l-1 (for an MLP, layer l-1's normalised post-attention hidden state). The predictor's
``select_predictor`` node is rewired to that node and moved right after it. On CUDA it becomes
``predict_ahead`` (side stream, event ``slot``) and the block's first sparse op gets
``keep`` (that input, kept alive until the join) and ``slot`` (the event it waits on); fork and
join are in the graph as ops, so Inductor keeps them and CUDA-graph capture records them. On
CPU the predictor stays ``select_predictor``, in plain order.

With ``DejavuOptions.fold_predictors``, a predictor whose input a dense projection also reads
(for a lookahead attention predictor, the previous layer's K and V projections) is split
instead (``fold``): its first layer becomes a linear beside those projections, which the lower
pass stacks into one GEMV, and ``select_hidden`` ranks the units inline: one read of the input
and one launch fewer, no side stream.

``DejavuOptions.lookahead`` set to True or False requires the profile's predictors to read the
previous or their own input, and a mismatch is an error naming the layer.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dejavu_compile.profile import ProfileError

from .context import PassContext, fake_mode_of, fake_value, is_linear, is_op, set_val

OPS = torch.ops.dejavu
# the op of each block kind that first uses the selection, and where its keep/slot go
# (``lazy_qkv`` is the attention's query projection fused with lazy K/V, option fuse_qkv)
FIRST_CONSUMER = {"mlp": (("sparse_mlp", 9),),
                  "attention": (("sparse_head_proj", 6), ("lazy_qkv", 11))}


def _check_option(ctx: PassContext, layer: int, kind: str, source: str) -> None:
    want = ctx.options.lookahead
    if want is None:
        return
    if want and source != "previous":
        raise ProfileError(
            f"lookahead=True, but the profile's layer {layer} {kind} predictor was calibrated on "
            "its own input (input: same): recalibrate with `dejavu calibrate --lookahead`"
        )
    if not want and source == "previous":
        raise ProfileError(
            f"lookahead=False, but the profile's layer {layer} {kind} predictor was calibrated "
            f"on layer {layer - 1}'s input (input: previous): compile with lookahead on, or "
            "recalibrate with --no-lookahead"
        )


def uses_side_stream(x: fx.Node) -> bool:
    """Fork the predictor onto a side stream: on CUDA (CPU runs ops in order anyway)."""
    return fake_value(x).device.type == "cuda"


def _dense_readers(x: fx.Node) -> list[fx.Node]:
    return [u for u in x.users if is_linear(u) and u.args[0] is x]


def _has_bias(node: fx.Node) -> bool:
    return (len(node.args) > 2 and node.args[2] is not None) or node.kwargs.get("bias") is not None


def fold(graph: fx.Graph, node: fx.Node, fake_mode) -> bool:
    """Split ``select_predictor(x, w1, b1, ...)`` into ``linear(x, w1[, b1])`` beside the dense
    projections that read ``x`` (the lower pass stacks them into one GEMV) and
    ``select_hidden`` on its output; the bias goes into the linear when the projections have
    biases (so all of them can stack), else into ``select_hidden``. Returns False (graph
    unchanged) when no dense projection reads ``x`` or their biases cannot be matched."""
    x, w1, b1, w2, b2, act, k, group, *rest = node.args
    buckets = rest[0] if rest else node.kwargs.get("buckets", 1)
    readers = _dense_readers(x)
    biased = {_has_bias(u) for u in readers}
    if not readers or len(biased) != 1 or (biased == {True} and b1 is None):
        return False
    in_linear = biased == {True}
    with graph.inserting_before(node):
        h = graph.call_function(readers[0].target, (x, w1, b1) if in_linear else (x, w1))
        set_val(h, fake_mode)
        sel = graph.call_function(OPS.select_hidden.default,
                                  (h, None if in_linear else b1, w2, b2, act, k, group, buckets))
        set_val(sel, fake_mode)
    sel.meta["dejavu"] = dict(node.meta["dejavu"], folded=True)
    node.replace_all_uses_with(sel)
    graph.erase_node(node)
    return True


def _fold_if_asked(ctx: PassContext, graph: fx.Graph, node: fx.Node, kind: str, fake_mode) -> bool:
    """``fold`` the predictor when ``fold_predictors`` is on (counted); whether it was folded."""
    if not (ctx.options.fold_predictors and fold(graph, node, fake_mode)):
        return False
    ctx.counters.add(f"folded[{kind}]")
    return True


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    graph = gm.graph
    predictors = [n for n in graph.nodes if is_op(n, "select_predictor")]
    if not predictors:
        return gm
    fake_mode = fake_mode_of(gm)
    for node in predictors:
        meta = node.meta["dejavu"]
        layer, kind = meta["layer"], meta["block"]
        source = ctx.plan[(layer, kind)].input
        _check_option(ctx, layer, kind, source)
        if source != "previous":
            _fold_if_asked(ctx, graph, node, kind, fake_mode)
            continue
        x = ctx.inputs.get((layer - 1, kind))
        if x is None:
            raise ProfileError(
                f"profile: layer {layer} {kind} predictor reads layer {layer - 1}'s input "
                f"(input: previous), but this graph has no layer {layer - 1} {kind} block"
            )
        # move the predictor's weights and the predictor right after the input it reads
        anchor = x
        for arg in node.args[1:]:
            if isinstance(arg, fx.Node) and arg.op == "get_attr":
                anchor.append(arg)
                anchor = arg
        anchor.append(node)
        node.args = (x, *node.args[1:])
        meta["input_layer"] = layer - 1
        if not _fold_if_asked(ctx, graph, node, kind, fake_mode) and uses_side_stream(x):
            _fork_join(graph, node, x, 2 * layer + (kind == "attention"), kind, fake_mode)
        ctx.counters.add(f"lookahead[{kind}]")
    graph.lint()
    gm.recompile()
    return gm


def _fork_join(graph: fx.Graph, node: fx.Node, x: fx.Node, slot: int, kind: str,
               fake_mode) -> None:
    """Run ``node``'s predictor on the side stream and make its first consumer join it."""
    with graph.inserting_after(node):
        ahead = graph.call_function(OPS.predict_ahead.default, (*node.args, slot))
    ahead.meta.update(node.meta)
    set_val(ahead, fake_mode)
    node.replace_all_uses_with(ahead)
    graph.erase_node(node)
    consumers = [(u, n_args) for u in ahead.users for name, n_args in FIRST_CONSUMER[kind]
                 if is_op(u, name)]
    if len(consumers) != 1:
        names = " or ".join(f"dejavu.{name}" for name, _ in FIRST_CONSUMER[kind])
        raise RuntimeError(f"lookahead: expected one {names} reading the predictor, found "
                           f"{len(consumers)}")
    consumer, n_args = consumers[0]
    consumer.args = (*consumer.args[:n_args], x, slot)
    for user in list(ahead.users):  # lazy K/V reads the heads too: it joins as well
        if is_op(user, "lazy_kv"):
            user.args = (*user.args[:9], x, slot)
