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

``DejavuOptions.lookahead`` set to True or False requires the profile's predictors to read the
previous or their own input, and a mismatch is an error naming the layer.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from dejavu_compile.profile import ProfileError

from .context import PassContext, fake_mode_of, fake_value, set_val

OPS = torch.ops.dejavu
# the op of each block kind that first uses the selection, and where its keep/slot go
FIRST_CONSUMER = {"mlp": ("sparse_mlp", 8), "attention": ("sparse_head_proj", 5)}


def is_op(node: fx.Node, name: str) -> bool:
    """Whether ``node`` calls ``torch.ops.dejavu.<name>`` (by schema name: OpOverload objects
    looked up at import time are not always the ones a later lookup returns)."""
    schema = getattr(node.target, "_schema", None)
    return schema is not None and schema.name == f"dejavu::{name}"


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
        if uses_side_stream(x):
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
    name, n_args = FIRST_CONSUMER[kind]
    consumers = [u for u in ahead.users if is_op(u, name)]
    if len(consumers) != 1:
        raise RuntimeError(f"lookahead: expected one dejavu.{name} reading the predictor, found "
                           f"{len(consumers)}")
    consumer = consumers[0]
    consumer.args = (*consumer.args[:n_args], x, slot)
