"""Lower: give the sparse ops the weight layout they read fast, once, and check they can run.

The sparsify pass hands down and output projections to the ops as ``aten.t`` views of the
``[out, in]`` weights; gathering a neuron's column of such a view strides through memory. Each
such weight is stored as ``[in, out]`` contiguous (paper section 4.4), in one of two ways
(option ``relayout``):

- ``"in_place"`` (the default): the parameter itself is re-laid out, ``weight.data`` becomes
  the transposed view of a contiguous ``[in, out]`` copy and the original storage is freed, so
  no second copy of the matrix is kept; dense code (a prefill) reads the same view, which
  ``F.linear`` handles without a copy. Dynamo guards on the parameter's strides, so the swap
  cannot happen inside the compilation that asks for it: that graph reads the strided view
  (the kernels take any strides) for the one call it serves, the swap runs right after that
  call (``release_pending``), and Dynamo recompiles once on the next call, which finds the
  weight already re-laid out (``aten.t`` of it is then contiguous, nothing to do). At most one
  extra matrix exists at a time during the swap.
- ``"copy"``: a contiguous copy is kept beside the original (cached per weight and shared by
  every graph), reported as ``relayout_bytes``: what a model costs when its parameters must not
  change layout.

With option ``out_layout="original"`` (and with ``"auto"``, the default, on CUDA for the
layers that read at most ``ORIGINAL_LAYOUT_MAX_DENSITY`` of their heads, 0.8) the attention
output projections are left out of the re-layout: their sparse ops read the ``aten.t`` view of
the ``[d_out, H * head_dim]`` parameter as it is, where each output row's selected heads are
``head_dim`` contiguous values (``kernels/heads.py::_head_out_cols_kernel``, one program per
block of output rows, no atomics).

Dense projections that read the same input (the K and V projections beside a sparse Q, or Q,
K and V of a dense attention block, or gate and up of a dense gated MLP) become one linear on
their stacked weights, split after: one read of the input and one launch instead of two or three
(option ``fuse_linears``). The stacked matrix is the parameters' own storage: each parameter's
``data`` becomes its row slice of it, and no copy is kept. A parameter's storage cannot move
under the graph being compiled, so the stacking waits for the same moment as the in-place
re-layout and takes effect in the recompiled graph; a graph with no re-layout pending (nothing
recompiles it) fuses only parameters already stacked.

With option ``dense_gemv`` (by default on CUDA tensors), the dense projections of the discovered
blocks that a decode step computes for one row (stacked or not) become ``dejavu::gemv``, a
one-launch Triton GEMV on CUDA (``kernels/dense.py``) and ``F.linear`` on CPU (``True`` only);
the language-model head and every other linear stay with the inner compiler.

A decode step's attention (an SDPA call with one query token, no dropout, not causal, a
boolean or no mask shared by the heads) becomes ``dejavu::decode_attention`` (option
``decode_attention``; by default on CUDA): the split-K Triton kernel reads each KV head once for
its group of query heads, where SDPA reads the keys and values that Hugging Face's ``repeat_kv``
copied once per query head. The pass takes the keys and values from before that repeat, and a
query scaled by a constant before the call (OPT's) goes in unscaled with the constant in the
kernel's scale: one pointwise launch a layer less. With
option ``merge_attention`` it gives each call on CUDA a buffer of counters (a constant of the
graph, zero between calls) with which the kernel merges its chunks in the same launch.

Which implementation runs is chosen by the op's dispatcher from the tensors' device: the
reference on CPU, the registered Triton kernels on CUDA.
"""

from __future__ import annotations

import gc
import operator

import torch
import torch.fx as fx
from torch.fx.experimental.symbolic_shapes import statically_known_true
from torch.utils.weak import WeakIdKeyDictionary

from dejavu_compile.config import ORIGINAL_LAYOUT_MAX_DENSITY, SELECTED_HEADS_MIN_POSITIONS

from .context import (
    Linear,
    PassContext,
    add_constant,
    fake_mode_of,
    fake_value,
    is_op,
    set_val,
)
from .discover import SDPA_TARGETS, is_view

# weight -> (its version counter when re-laid out, the [in, out] copy)
_RELAYOUT = WeakIdKeyDictionary()
# parameters waiting for their in-place re-layout, and groups of parameters waiting to be
# stacked into one storage (see ``release_pending``)
_PENDING = WeakIdKeyDictionary()
_PENDING_STACKS: list[list[torch.Tensor]] = []


def _touch_holders(params) -> None:
    """Tell Dynamo that ``params`` changed. Dynamo trusts the tensors held in a dict whose
    version tag is unchanged and skips their guards (``skip_tensor_guards_with_matching_dict_tags``):
    torch 2.11 under CUDA graphs then reran the old graph on the re-laid-out weights (a stride
    assertion). So every plain dict that holds one of ``params`` is rebuilt in place (same items,
    same order, a new tag), and a module's ``_parameters`` dict is also replaced by a new dict
    object in the module (the form that made the H200 run at commit 2dc3667 recompile)."""
    ids = {id(p) for p in params}
    if not ids:
        return
    holders = [h for h in gc.get_referrers(*params)
               if type(h) is dict and any(id(v) in ids for v in h.values())]
    for holder in holders:
        items = list(holder.items())
        holder.clear()
        holder.update(items)
    if not holders:
        return
    held = {id(h) for h in holders}
    for owner in gc.get_referrers(*holders):  # the __dict__ of each module holding one
        if type(owner) is dict and id(owner.get("_parameters")) in held:
            owner["_parameters"] = dict(owner["_parameters"])


DEJAVU_NAMESPACE = "dejavu"


def relaid_out(weight: torch.Tensor) -> bool:
    """Whether ``weight`` ([out, in]) already has the [in, out] row-contiguous layout."""
    return weight.dim() == 2 and weight.t().is_contiguous()


def _keeps_original(t_node: fx.Node, shape, cuda: bool, layout: str) -> bool:
    """Whether option ``out_layout`` (``layout``) leaves the weight (of ``shape``, on CUDA or
    not) of the view ``t_node`` in its original ``[d_out, H * head_dim]`` layout: every use is
    an output projection of heads wide enough to read along its columns
    (``heads.reads_columns``), and with ``"auto"`` the weight is on CUDA (the CPU reference
    gathers a head's rows, which the transposed layout keeps contiguous) and each use reads at
    most ``ORIGINAL_LAYOUT_MAX_DENSITY`` of the heads."""
    from dejavu_compile.kernels.ops import COLUMN_HEAD_DIM

    if layout == "transposed" or (layout == "auto" and not cuda):
        return False

    def fits(user) -> bool:
        if not (is_op(user, "sparse_head_out") and user.args[2] is t_node):
            return False
        head_dim = user.args[4] if len(user.args) > 4 else user.kwargs.get("head_dim", 0)
        if head_dim < COLUMN_HEAD_DIM:
            return False
        if layout == "original":
            return True
        ids = fake_value(user.args[1])
        return ids is not None and \
            ids.shape[-1] <= ORIGINAL_LAYOUT_MAX_DENSITY * (shape[1] // head_dim)

    return bool(t_node.users) and all(fits(user) for user in t_node.users)


def release_pending() -> int:
    """Stack the parameter groups a lower pass asked to fuse (``stack_in_place``), then re-lay
    out in place every parameter it asked for: ``weight.data`` becomes the transposed view of its
    contiguous ``[in, out]`` copy. One group or weight at a time, so each original storage is
    freed before the next copy is made. Returns how many weights were re-laid out.

    Run by the compiled function right after the call of the compilation that asked (Dynamo
    then recompiles once, for the new strides), or by hand."""
    done, changed = 0, []
    while _PENDING_STACKS:
        group = _PENDING_STACKS.pop()
        stack_in_place(group)
        changed.extend(group)
    with torch.no_grad():
        for weight in list(_PENDING.keys()):
            del _PENDING[weight]
            if relaid_out(weight):
                continue
            weight.data = weight.detach().t().contiguous().t()
            _RELAYOUT.pop(weight, None)
            changed.append(weight)
            done += 1
    _touch_holders(changed)
    return done


def pending() -> bool:
    return len(_PENDING) > 0 or len(_PENDING_STACKS) > 0


def relayout(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``weight.t()`` stored contiguously, cached per weight tensor until it is modified; the
    flag says whether this call made the copy."""
    cached = _RELAYOUT.get(weight)
    if cached is not None and cached[0] == weight._version:
        return cached[1], False
    copy = weight.detach().t().contiguous()
    _RELAYOUT[weight] = (weight._version, copy)
    return copy, True


def stacked_view(tensors: list[torch.Tensor]) -> torch.Tensor | None:
    """``torch.cat(tensors)`` (along dim 0) without a copy when the tensors are consecutive row
    blocks of one contiguous storage (``stack_in_place`` made them so), else None."""
    first = tensors[0]
    offset, ptr = first.storage_offset(), first.untyped_storage().data_ptr()
    for t in tensors:
        if not t.is_contiguous() or t.untyped_storage().data_ptr() != ptr \
                or t.storage_offset() != offset:
            return None
        offset += t.numel()
    rows = sum(t.shape[0] for t in tensors)
    return torch.as_strided(first, (rows, *first.shape[1:]), (first[0].numel(), *first.stride()[1:]),
                            first.storage_offset())


def stack_in_place(tensors: list[torch.Tensor]) -> None:
    """Copy ``tensors`` into one stacked storage and make each one's ``data`` its row slice of
    it (the originals are freed)."""
    if stacked_view(tensors) is not None:
        return
    with torch.no_grad():
        whole = torch.cat([t.detach() for t in tensors])
        start = 0
        for t in tensors:
            t.data = whole[start:start + t.shape[0]]
            start += t.shape[0]


def _owned(node: fx.Node, value: torch.Tensor) -> bool:
    """A model parameter (graph input) or a tensor the passes attached (a predictor's weight):
    tensors whose storage may be re-laid out; not a user's plain tensor input."""
    return node.op == "get_attr" or isinstance(value, torch.nn.Parameter)


def _fusable(lins: list[Linear]) -> bool:
    first = lins[0].weight
    pairs = [(lin.weight_node, lin.weight) for lin in lins] + \
        [(lin.bias_node, lin.bias) for lin in lins if lin.bias is not None]
    return (
        all(_owned(node, value) for node, value in pairs)
        and len({id(lin.weight) for lin in lins}) == len(lins)
        and all(lin.weight.shape[1] == first.shape[1] and lin.weight.dtype == first.dtype
                and lin.weight.device == first.device for lin in lins)
        and len({lin.bias is None for lin in lins}) == 1
        and all(len(lin.node.args) >= 2 and not lin.node.kwargs for lin in lins)
    )


def fuse_linears(gm: fx.GraphModule, ctx: PassContext, fake_mode) -> dict[fx.Node, list]:
    """Replace dense linears that read the same node by one linear on their stacked weights
    (``stacked_view``; ``stack_in_place`` makes them stackable) and a split of its output.
    Returns each new linear with the weights it stacks."""
    graph = gm.graph
    fused_from: dict[fx.Node, list] = {}
    siblings: dict[fx.Node, list[Linear]] = {}
    for node in graph.nodes:
        lin = ctx.linear(node, gm)
        if lin is not None:
            siblings.setdefault(lin.input, []).append(lin)
    for x, lins in siblings.items():
        if len(lins) < 2 or not _fusable(lins):
            continue
        groups = [[lin.weight for lin in lins]]
        if lins[0].bias is not None:
            groups.append([lin.bias for lin in lins])
        views = [stacked_view(g) for g in groups]
        if any(v is None for v in views):
            # A parameter's storage offset cannot change under the graph being compiled
            # (Dynamo's fake copies of the inputs are fixed): stack after this graph's call,
            # together with the pending re-layout, whose new strides make Dynamo recompile.
            if ctx.counters.values.get("relayout_pending"):
                for group in groups:
                    _PENDING_STACKS.append(group)
                ctx.counters.add("fuse_pending", len(lins))
            continue
        weight, bias = views[0], views[1] if len(views) > 1 else None
        sizes = [lin.weight.shape[0] for lin in lins]
        with graph.inserting_before(lins[0].node):
            w_node = add_constant(gm, ctx, "fused_weight", weight, fake_mode)
            b_node = add_constant(gm, ctx, "fused_bias", bias, fake_mode) if bias is not None \
                else None
            fused = graph.call_function(lins[0].node.target, (x, w_node, b_node))
            set_val(fused, fake_mode)
            fused_from[fused] = [lin.weight for lin in lins]
            parts = graph.call_function(torch.split, (fused, sizes, -1))
            set_val(parts, fake_mode)
            outs = []
            for i in range(len(lins)):
                out = graph.call_function(operator.getitem, (parts, i))
                set_val(out, fake_mode)
                outs.append(out)
        for lin, out in zip(lins, outs, strict=True):
            out.meta.setdefault("stack_trace", lin.node.meta.get("stack_trace"))
            lin.node.replace_all_uses_with(out)
            graph.erase_node(lin.node)
        ctx.counters.add("fused_linears", len(lins))
    return fused_from


# dtypes the GEMV kernel reads (``kernels/dense.py``; the kernels' KERNEL_DTYPES)
_GEMV_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _one_row(node: fx.Node) -> bool:
    """Whether ``node``'s value is one row of features (a batch-1 decode step's activation)."""
    val = fake_value(node)
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return False
    shape = [int(s) if isinstance(s, int) else None for s in val.shape]
    return None not in shape and shape[-1] > 0 and val.numel() == shape[-1]


def dense_gemv(gm: fx.GraphModule, ctx: PassContext, fused_from: dict[fx.Node, list],
               cuda_only: bool) -> None:
    """Hand the dense projections of the discovered blocks (fused or not) that read one row to
    ``dejavu::gemv`` (``DejavuOptions.dense_gemv``); with ``cuda_only`` (the option left None)
    only those whose input is on a CUDA device. Other linears, the language-model head among
    them, stay with the inner compiler."""
    disc = ctx.discovery
    if disc is None:
        return
    # weight -> the block it belongs to, for the node's tag (read by export)
    ours = {id(lin.weight): (block.layer, kind)
            for kind, blocks in (("mlp", disc.mlp), ("attention", disc.attention))
            for block in blocks.values() for lin in block.linears()}
    graph = gm.graph
    for node in list(graph.nodes):
        lin = ctx.linear(node, gm)
        if lin is None:
            continue
        weights = fused_from.get(node, [lin.weight])
        owners = [ours[id(w)] for w in weights if id(w) in ours]
        if not owners or not _one_row(lin.input):
            continue
        x = fake_value(lin.input)
        if cuda_only and x.device.type != "cuda":
            continue
        if x.dtype not in _GEMV_DTYPES or lin.weight.dtype != x.dtype or (
                lin.bias is not None and lin.bias.dtype != x.dtype):
            continue
        with graph.inserting_before(node):
            new = graph.call_function(torch.ops.dejavu.gemv.default,
                                      (lin.input, lin.weight_node, lin.bias_node))
        new.meta.update(node.meta)
        units = lin.weight.shape[0]
        new.meta["dejavu"] = {"layer": owners[0][0], "block": owners[0][1], "selector": "dense",
                              "density": 1.0, "k": units, "units": units}
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        ctx.counters.add("dense_gemv")


def graph_splits(gm: fx.GraphModule, ctx: PassContext, fake_mode) -> None:
    """Cut the step before each layer of ``DejavuOptions.graph_splits`` that this graph holds:
    the input of the layer's first block (its attention's, else its MLP's) goes through
    ``dejavu::graph_split``, which the inner compiler runs between two CUDA graphs (or which
    cuts ``CapturedStep``'s capture).

    A lookahead predictor forked before the cut and joined after it would split one side
    stream's work across two graphs; it is moved to just after the cut and reads the cut as
    ``after`` (it still predicts from the earlier layer's input, which the first graph hands
    to the second), so it overlaps less of its layer's work. Where that cannot be done (a
    reader of the predictor before the cut) the cut is left out and counted
    (``graph_split_skipped``)."""
    from dejavu_compile.kernels.ops import CUDAGRAPH_UNSAFE

    if CUDAGRAPH_UNSAFE is None and ctx.options.cudagraphs:
        raise RuntimeError(f"option 'graph_splits' needs a torch with torch.Tag.cudagraph_unsafe "
                           f"(Inductor's graph partition); this is {torch.__version__}")
    # where dejavu::predict_ahead takes ``after``, from its schema
    after = [a.name for a in torch.ops.dejavu.predict_ahead.default._schema.arguments
             ].index("after")
    graph = gm.graph
    for layer in ctx.options.graph_splits:
        x = ctx.inputs.get((layer, "attention"), ctx.inputs.get((layer, "mlp")))
        order = {node: i for i, node in enumerate(graph.nodes)}  # earlier cuts moved nodes
        if x is None or x not in order:
            continue
        at = order[x]
        crossing = [n for n in graph.nodes if is_op(n, "predict_ahead") and n.users
                    and order[n] <= at < max(order[u] for u in n.users)]
        if any(order[u] <= at for n in crossing for u in n.users):
            ctx.counters.add("graph_split_skipped")
            continue
        with graph.inserting_after(x):
            cut = graph.call_function(torch.ops.dejavu.graph_split.default, (x,))
        set_val(cut, fake_mode)
        x.replace_all_uses_with(cut, delete_user_cb=lambda user, cut=cut: user is not cut)
        anchor = cut
        for fork in crossing:  # in graph order, each after the one before
            anchor.append(fork)
            anchor = fork
            # reading the cut keeps the fork after it in the inner compiler's schedule too
            # (Inductor reorders nodes to make fewer partitions)
            fork.args = (*fork.args[:after], cut)
            ctx.counters.add("graph_split_fork_moved")
        ctx.counters.add("graph_split")


# SDPA's arguments after query, key and value, in order, with their defaults
_SDPA_ARGS = (("attn_mask", None), ("dropout_p", 0.0), ("is_causal", False), ("scale", None),
              ("enable_gqa", False))
# the tensor methods ``repeat_kv``'s last step may be
_RESHAPES = {"reshape", "view"}


def _same(a, b) -> bool:
    """Whether two sizes are equal without a guard (symbolic sizes only when provably so)."""
    return statically_known_true(a == b)


def _same_shape(a, b) -> bool:
    return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))


def _may_match(a, b) -> bool:
    """Whether two sizes may be equal: not provably different. A growing cache gives its keys
    and values separate symbolic lengths; ``dejavu::decode_attention`` checks them at run time
    (``kernels/kv.py::check_decode``), as SDPA would."""
    return not statically_known_true(a != b)


def _kv_heads_source(node: fx.Node, heads: int) -> fx.Node | None:
    """The [B, KVH, L, D] tensor behind ``node``, the [B, heads, L, D] keys or values SDPA reads:
    the input of Hugging Face's ``repeat_kv`` (``x[:, :, None].expand(B, KVH, G, L, D).reshape(
    B, KVH * G, L, D)``), else ``node`` itself (read as is, each head its own KV head); None
    when ``node`` is not a 4-d tensor."""
    val = fake_value(node)
    if not isinstance(val, torch.Tensor) or val.dim() != 4:
        return None
    if not (node.op == "call_method" and node.target in _RESHAPES) \
            and not (node.op == "call_function" and node.target is torch.reshape):
        return node
    grouped = node.args[0]
    g_val = fake_value(grouped) if isinstance(grouped, fx.Node) else None
    if not (isinstance(grouped, fx.Node) and grouped.op == "call_method"
            and grouped.target == "expand" and isinstance(g_val, torch.Tensor)
            and g_val.dim() == 5 and g_val.stride(2) == 0):
        return node
    single = grouped.args[0]
    s_val = fake_value(single) if isinstance(single, fx.Node) else None
    if not (isinstance(s_val, torch.Tensor) and s_val.dim() == 5 and _same(s_val.shape[2], 1)
            and single.op == "call_function" and single.target is operator.getitem):
        return node
    source = single.args[0]
    src_val = fake_value(source) if isinstance(source, fx.Node) else None
    b, kvh, group, length, d = g_val.shape
    if not (isinstance(src_val, torch.Tensor)
            and _same_shape(src_val.shape, (b, kvh, length, d))
            and _same_shape(val.shape, (b, heads, length, d)) and _same(kvh * group, heads)
            and _same_shape(s_val.shape, (b, kvh, 1, length, d))):
        return node
    return source


# the shape-only steps between a query's scaling and SDPA (Hugging Face's ``view``, ``transpose``)
_QUERY_VIEWS = {"view", "reshape", "transpose", "contiguous"}
_MULS = (operator.mul, torch.mul, torch.ops.aten.mul.Tensor)


def _query_scale(q: fx.Node) -> tuple[fx.Node | None, float]:
    """(the multiply, its constant) when the query is a constant multiple of a tensor of the
    same shape, dtype and strides, seen through shape-only steps, each read only by the next
    (OPT scales its query before SDPA, which then gets ``scale=1.0``); else (None, 1.0)."""
    node = q
    while node.op == "call_method" and node.target in _QUERY_VIEWS and len(node.users) == 1 \
            and isinstance(node.args[0], fx.Node):
        node = node.args[0]
    if len(node.users) != 1 or node.kwargs or len(node.args) != 2 \
            or not ((node.op == "call_function" and node.target in _MULS)
                    or (node.op == "call_method" and node.target == "mul")):
        return None, 1.0
    a, b = node.args
    x, factor = (a, b) if isinstance(a, fx.Node) else (b, a)
    if not isinstance(x, fx.Node) or isinstance(factor, bool) \
            or not isinstance(factor, (int, float)):
        return None, 1.0
    x_val, out_val = fake_value(x), fake_value(node)
    if not (isinstance(x_val, torch.Tensor) and isinstance(out_val, torch.Tensor)
            and x_val.dtype == out_val.dtype and _same_shape(x_val.shape, out_val.shape)
            and _same_shape(x_val.stride(), out_val.stride())):
        return None, 1.0
    return node, float(factor)


def _key_mask(graph: fx.Graph, mask, batch, length, fake_mode) -> tuple[bool, fx.Node | None]:
    """(whether ``mask`` fits, the [B, L] bool node to pass) for SDPA's ``attn_mask``: None, or
    a bool [B or 1, 1, 1, L] shared by the heads and the one query."""
    if mask is None:
        return True, None
    val = fake_value(mask) if isinstance(mask, fx.Node) else None
    if not isinstance(val, torch.Tensor) or val.dtype != torch.bool or val.dim() != 4 \
            or not _same(val.shape[1], 1) or not _same(val.shape[2], 1) \
            or not _may_match(val.shape[3], length) \
            or not (_same(val.shape[0], batch) or _same(val.shape[0], 1)):
        return False, None
    keys = graph.call_function(operator.getitem, (mask, (slice(None), 0, 0, slice(None))))
    set_val(keys, fake_mode)
    if not _same(val.shape[0], batch):
        keys = graph.call_function(torch.Tensor.expand, (keys, batch, length))
        set_val(keys, fake_mode)
    return True, keys


def _erase_unused(graph: fx.Graph, nodes) -> None:
    """Erase ``nodes`` in order while nothing reads them (a chain, its last user first)."""
    for node in nodes:
        if isinstance(node, fx.Node) and node.op in ("call_method", "call_function") \
                and not node.users:
            graph.erase_node(node)


def decode_attention(gm: fx.GraphModule, ctx: PassContext, fake_mode) -> None:
    """Replace each decode-step SDPA call by ``dejavu::decode_attention`` (``DejavuOptions.
    decode_attention``), on the keys and values from before ``repeat_kv``. Calls it does not
    cover stay SDPA: several query tokens (a prefill), dropout, a causal flag, a float or
    per-head mask, other devices than the option allows."""
    graph = gm.graph
    everywhere = ctx.options.decode_attention == "always"
    for node in list(graph.nodes):
        if node.op != "call_function" or node.target not in SDPA_TARGETS or len(node.args) < 3:
            continue
        q, k, v = node.args[:3]
        extra = dict(zip((name for name, _ in _SDPA_ARGS), node.args[3:], strict=False))
        extra.update(node.kwargs)
        opts = {name: extra.get(name, default) for name, default in _SDPA_ARGS}
        if set(extra) - set(opts):
            continue
        q_val = fake_value(q) if isinstance(q, fx.Node) else None
        if not isinstance(q_val, torch.Tensor) or q_val.dim() != 4 \
                or not _same(q_val.shape[2], 1) or opts["dropout_p"] != 0.0 \
                or opts["is_causal"] is not False \
                or not isinstance(opts["scale"], (float, int, type(None))):
            continue
        if not everywhere and q_val.device.type != "cuda":
            continue
        heads = q_val.shape[1]
        key = k if opts["enable_gqa"] else _kv_heads_source(k, heads)
        value = v if opts["enable_gqa"] else _kv_heads_source(v, heads)
        k_val = fake_value(key) if key is not None else None
        v_val = fake_value(value) if value is not None else None
        if not (isinstance(k_val, torch.Tensor) and isinstance(v_val, torch.Tensor)) \
                or k_val.dim() != 4 or v_val.dim() != 4 \
                or not all(_may_match(a, b) for a, b in zip(k_val.shape, v_val.shape, strict=True)) \
                or not _same(q_val.shape[3], k_val.shape[3]) \
                or heads % k_val.shape[1] != 0 \
                or k_val.dtype != q_val.dtype or v_val.dtype != q_val.dtype:
            continue
        scale = opts["scale"] if opts["scale"] is not None else q_val.shape[3] ** -0.5
        # a query scaled by a constant before the call: the kernel multiplies by the product
        # (in fp32), one pointwise launch a layer less
        scaled, factor = _query_scale(q)
        with graph.inserting_before(node):
            fits, mask = _key_mask(graph, opts["attn_mask"], q_val.shape[0], k_val.shape[2],
                                   fake_mode)
            if not fits:
                continue
            counters = None
            slots = q_val.shape[0] * k_val.shape[1]
            if q_val.device.type == "cuda" and isinstance(slots, int) \
                    and ctx.options.merge_attention:
                # the kernel's own counters, zero between calls: it merges its chunks in the
                # same launch (kernels/decode_attention.py)
                counters = add_constant(gm, ctx, "attention_counters", torch.zeros(
                    slots, dtype=torch.int32, device=q_val.device), fake_mode)
                ctx.counters.add("decode_attention_merged")
            if scaled is not None:
                scaled.replace_all_uses_with(next(a for a in scaled.args
                                                  if isinstance(a, fx.Node)))
                graph.erase_node(scaled)
                scale *= factor
                ctx.counters.add("decode_attention_scale_folded")
            new = graph.call_function(torch.ops.dejavu.decode_attention.default,
                                      (q, key, value, float(scale), mask, counters))
        set_val(new, fake_mode)
        new.meta["stack_trace"] = node.meta.get("stack_trace")
        node.replace_all_uses_with(new)
        graph.erase_node(node)
        for kv in (k, v):  # the repeat's reshape, expand and indexing, now unread
            if kv is not key and kv is not value:
                _erase_unused(graph, [kv, kv.args[0], kv.args[0].args[0]])
        ctx.counters.add("decode_attention")


def _head_out_reader(node: fx.Node) -> tuple[fx.Node | None, bool]:
    """The ``sparse_head_out`` (or ``_norm``) op that reads ``node``'s value through a chain of
    views (the attention's transpose and reshape), or None; and whether nothing else reads
    that value on the way."""
    alone = True
    while True:
        outs = [u for u in node.users if u.args and u.args[0] is node
                and (is_op(u, "sparse_head_out") or is_op(u, "sparse_head_out_norm"))]
        alone = alone and len(node.users) == 1
        if outs:
            return outs[0], alone
        views = [u for u in node.users if is_view(u) and u.args[0] is node]
        if len(views) != 1:
            return None, False
        node = views[0]


def _heads_reason(node: fx.Node, order: dict) -> tuple[fx.Node | None, str]:
    """The ids of the heads that the output projection reading ``node`` (a
    ``dejavu::decode_attention``) selects, when the attention need compute only those; else
    None and why not ("" where no head-gathered projection reads the attention)."""
    q = fake_value(node.args[0])
    out, alone = _head_out_reader(node)
    if out is None:
        return None, ""  # no head selection to take
    if not alone:
        return None, "attention output read by more than its output projection"
    idx, head_dim = out.args[1], out.args[4]
    normed = is_op(out, "sparse_head_out_norm")
    at = 5 + 4 * normed
    union = out.args[at] if len(out.args) > at else out.kwargs.get("union", False)
    idx_val = fake_value(idx) if isinstance(idx, fx.Node) else None
    if not isinstance(idx_val, torch.Tensor) or order.get(idx, len(order)) > order[node]:
        return None, "ids computed after the attention"
    if not _same(head_dim, q.shape[3]):
        return None, "output projection's units are not the attention's heads"
    if union and not statically_known_true(q.shape[0] == 1):
        return None, "a batch's union selection"
    return idx, ""


def selected_heads(gm: fx.GraphModule, ctx: PassContext, min_positions: int = 0) -> None:
    """Option ``decode_selected_heads``: each ``dejavu::decode_attention`` whose output only a
    head-gathered output projection reads (through the heads' transpose and reshape) gets that
    projection's ids, and computes the KV groups of those heads only: the cache of a KV head
    that no selected head reads is not read (paper section 3: the heads not selected are not
    computed at all). With ``min_positions``, only an attention whose K/V cache is known to
    hold at least that many positions. Counted in ``decode_selected_heads``, or
    ``decode_selected_heads_skipped[why]`` for an attention with a head selection that it
    cannot take or that its cache is too short for."""
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    for node in gm.graph.nodes:
        if not is_op(node, "decode_attention") or len(node.args) > 6 \
                or "heads" in node.kwargs:
            continue
        idx, why = _heads_reason(node, order)
        if idx is not None and min_positions:
            length = fake_value(node.args[1]).shape[2]  # k: [B, KVH, L, D]
            if not statically_known_true(length >= min_positions):
                idx, why = None, (f"a K/V cache under {min_positions} positions"
                                  if isinstance(length, int)
                                  else "a K/V cache length that varies")
        if idx is None:
            if why:
                ctx.counters.add(f"decode_selected_heads_skipped[{why}]")
            continue
        args = list(node.args) + [None] * (6 - len(node.args))
        node.args = (*args, idx)
        ctx.counters.add("decode_selected_heads")


def workspaces(gm: fx.GraphModule, ctx: PassContext, fake_mode) -> None:
    """Give each sparse MLP and head-gathered output projection on CUDA with per-row ids a
    workspace: fp32 zeros, a constant of the graph, that its kernels add into and leave zero
    again, so the op launches no zero-fill (``kernels/sparse_mlp.py``, ``kernels/heads.py``; a
    batch's union selection and deterministic mode keep their own buffers, and the CPU
    reference needs none)."""
    from dejavu_compile.kernels.ops import norm_numel, workspace_numel

    graph = gm.graph
    for node in list(graph.nodes):
        normed = is_op(node, "sparse_mlp_norm") or is_op(node, "sparse_head_out_norm")
        mlp = is_op(node, "sparse_mlp") or is_op(node, "sparse_mlp_norm")
        if not (mlp or normed or is_op(node, "sparse_head_out")) or "workspace" in node.kwargs:
            continue
        # (x, ids, the [N, d_out] weight, the op's union argument, the gated MLP's up weight);
        # the norm ops take (residual, weight, bias, eps) before ``union``
        at = (0, 1, 5, 8 + 4 * normed, 4) if mlp else (0, 1, 2, 5 + 4 * normed, None)
        if len(node.args) <= at[2]:
            continue
        x, idx, w_t = (fake_value(a) if isinstance(a, fx.Node) else a
                       for a in (node.args[at[0]], node.args[at[1]], node.args[at[2]]))
        if not all(isinstance(t, torch.Tensor) for t in (x, idx, w_t)) \
                or x.device.type != "cuda":
            continue
        rows = x.numel() // x.shape[-1] if x.shape[-1] else 0
        union = bool(node.args[at[3]]) if len(node.args) > at[3] \
            else bool(node.kwargs.get("union"))
        sizes = (rows, w_t.shape[1], idx.shape[-1] if mlp else 0)
        if not all(isinstance(v, int) for v in sizes) or rows <= 0 or (union and rows > 1):
            continue
        gated = mlp and node.args[at[4]] is not None
        with graph.inserting_before(node):
            numel = workspace_numel(*sizes, gated=gated) + (norm_numel(*sizes[:2]) if normed else 0)
            workspace = add_constant(gm, ctx, "workspace", torch.zeros(
                numel, dtype=torch.float32, device=x.device), fake_mode)
        node.kwargs = {**node.kwargs, "workspace": workspace}
        ctx.counters.add("workspace[mlp]" if mlp else "workspace[attention]")


# (the op, its arguments before ``union``, the names of those after, in order)
_NORMED = {"sparse_mlp": ("sparse_mlp_norm", 8, ("union", "keep", "slot", "workspace")),
           "sparse_head_out": ("sparse_head_out_norm", 5, ("union", "workspace", "early"))}


def _inference_dropout(node) -> bool:
    """``F.dropout(x, p, training=False)``: the identity (Dynamo keeps the call)."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target in (torch.nn.functional.dropout, torch.dropout)):
        return False
    training = node.args[2] if len(node.args) > 2 else node.kwargs.get(
        "training", node.kwargs.get("train", node.target is torch.nn.functional.dropout))
    return training is False


def _method_or_function(node, methods: tuple[str, ...], functions: tuple) -> bool:
    """``node`` calls one of ``methods`` on a tensor or one of ``functions``."""
    return isinstance(node, fx.Node) and (
        (node.op == "call_method" and node.target in methods)
        or (node.op == "call_function" and node.target in functions))


def _same_rows(node) -> bool:
    """A ``view`` or ``reshape`` (the only user it may have between a residual add and its
    layer norm): the same values, in the same order, in another shape."""
    return _method_or_function(node, ("view", "reshape"), (torch.reshape,))


def _layer_norm_of(total: fx.Node):
    """The layer norm over the last dim, with a weight, that reads ``total`` (directly or
    through one view of it): (that norm, the view or None, weight, bias, eps); else None."""
    for user in total.users:
        reads = [user] + ([u for u in user.users] if _same_rows(user) else [])
        for node in reads:
            if not (node.op == "call_function" and node.target is torch.nn.functional.layer_norm):
                continue
            args = (list(node.args) + [None] * 5)[:5]
            names = ("input", "normalized_shape", "weight", "bias", "eps")
            inp, shape, weight, bias, eps = (node.kwargs.get(n, a)
                                             for n, a in zip(names, args, strict=True))
            eps = 1e-5 if eps is None else eps
            val = fake_value(total)
            if inp is not (total if node is user else user) or not isinstance(weight, fx.Node) \
                    or not isinstance(eps, float) or not isinstance(val, torch.Tensor) \
                    or list(shape) != [val.shape[-1]]:
                continue
            return node, (user if node is not user else None), weight, bias, eps
    return None


def _cast_to(node, dtype) -> bool:
    """``node`` is ``x.to(dtype)`` (positional or ``dtype=``), nothing else asked of it."""
    if not (isinstance(node, fx.Node) and node.op == "call_method" and node.target == "to"):
        return False
    if len(node.args) == 2 and not node.kwargs:
        return node.args[1] == dtype
    return len(node.args) == 1 and node.kwargs == {"dtype": dtype}


def _only_user(node: fx.Node):
    return next(iter(node.users)) if len(node.users) == 1 else None


def _rms_norm_of(total: fx.Node):
    """Llama's RMS norm (``LlamaRMSNorm``) reading ``total`` (directly or through one view):
    ``w * (x * rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)).to(dtype)`` with ``x =
    total.to(float32)``, every node between read by the next one only (``x`` by the square
    and the product), the weight [d] in the sum's dtype: (the product with the weight, the
    view or None, the weight, eps, the norm's nodes from its last); else None. Gemma's norm,
    ``(1 + w)`` in fp32, is no match."""
    val = fake_value(total)
    if not isinstance(val, torch.Tensor) or val.dim() == 0:
        return None
    d = val.shape[-1]
    for user in total.users:
        reads = [user] + ([u for u in user.users] if _same_rows(user) else [])
        for x in reads:
            if not (_cast_to(x, torch.float32) and x.args[0] is (total if x is user else user)
                    and len(x.users) == 2):
                continue
            square = next((u for u in x.users if _method_or_function(
                u, ("pow",), (torch.pow, operator.pow)) and u.args[1:] == (2,) and not u.kwargs),
                None)
            mean = _only_user(square) if square is not None else None
            if not (_method_or_function(mean, ("mean",), (torch.mean,)) and mean.args[0] is square
                    and tuple(mean.args[1:]) in ((-1,), ([-1],), (d - 1,), ([d - 1],))
                    and mean.kwargs == {"keepdim": True}):
                continue
            shift = _only_user(mean)
            if not (isinstance(shift, fx.Node) and shift.op == "call_function"
                    and shift.target in (operator.add, torch.add) and len(shift.args) == 2
                    and shift.args[0] is mean and isinstance(shift.args[1], float)
                    and not shift.kwargs):
                continue
            root = _only_user(shift)
            if not (_method_or_function(root, ("rsqrt",), (torch.rsqrt,)) and root.args == (shift,)
                    and not root.kwargs):
                continue
            scaled = _only_user(root)
            if not (isinstance(scaled, fx.Node) and scaled.op == "call_function"
                    and scaled.target in (operator.mul, torch.mul) and not scaled.kwargs
                    and set(scaled.args) == {x, root} and len(scaled.args) == 2
                    and set(x.users) == {square, scaled}):
                continue
            back = _only_user(scaled)
            if not (_cast_to(back, val.dtype) and back.args[0] is scaled):
                continue
            out = _only_user(back)
            if not (isinstance(out, fx.Node) and out.op == "call_function"
                    and out.target in (operator.mul, torch.mul) and len(out.args) == 2
                    and not out.kwargs and back in out.args):
                continue
            weight = out.args[1] if out.args[0] is back else out.args[0]
            w = fake_value(weight) if isinstance(weight, fx.Node) else None
            if not (isinstance(w, torch.Tensor) and tuple(w.shape) == (d,)
                    and w.dtype == val.dtype):
                continue
            chain = [out, back, scaled, root, shift, mean, square, x]
            return out, (user if x is not user else None), weight, shift.args[1], chain
    return None


def fuse_norms(gm: fx.GraphModule, ctx: PassContext, fake_mode) -> None:
    """Option ``fuse_norm``: ``ln(residual + op(...))``, the sparse MLP's or output
    projection's output through an inference dropout into a residual add, and that sum (or a
    view of it) into a layer norm with a weight, or (option ``fuse_rms_norm``, by default on
    with ``fuse_norm``) into Llama's RMS norm (``_rms_norm_of``; the op then gets
    ``rms=True`` and the count ``fuse_norm_rms``), becomes one ``dejavu::sparse_mlp_norm``
    or ``dejavu::sparse_head_out_norm`` returning (the sum, its norm); the sum's other
    readers (the next residual add) read the first. On CUDA one add-norm launch of ours
    follows the op and finishes its reducing kernel's sums
    (``kernels/triton_common.py::add_norm_sums``; ``DEJAVU_NORM_FINISH`` picks other places
    for a layer norm). Anything else (an RMS norm with ``fuse_rms_norm=False``; Gemma's, which
    scales by ``1 + w`` in fp32 and reads the op's output before the residual add; a norm
    without a weight; another user of the op's output) is left as it is
    (``fuse_norm_skipped``)."""
    graph = gm.graph
    order = {n: i for i, n in enumerate(graph.nodes)}
    for node in list(graph.nodes):
        name = next((k for k in _NORMED if is_op(node, k)), None)
        if name is None:
            continue
        new_name, n_args, after = _NORMED[name]
        out = node
        if _inference_dropout(_only_user(out)):
            out = _only_user(out)
        total = _only_user(out)
        if not (len(node.users) == 1 and total is not None and total.op == "call_function"
                and total.target in (operator.add, torch.add) and len(total.args) == 2
                and not total.kwargs and out in total.args):
            ctx.counters.add("fuse_norm_skipped")
            continue
        residual = total.args[1] if total.args[0] is out else total.args[0]
        found = _layer_norm_of(total) if residual is not out else None  # (not out + out)
        rms = found is None and residual is not out and ctx.options.rms_norms_fused \
            and _rms_norm_of(total)
        res, val = fake_value(residual) if isinstance(residual, fx.Node) else None, \
            fake_value(out)
        if not (found or rms) or not isinstance(res, torch.Tensor) or res.shape != val.shape \
                or res.dtype != val.dtype:
            ctx.counters.add("fuse_norm_skipped")
            continue
        if rms:
            norm, view, weight, eps, chain = rms
            bias = None
        else:
            (norm, view, weight, bias, eps), chain = found, [found[0]]
        if any(isinstance(a, fx.Node) and order[a] > order[total] for a in (weight, bias)):
            ctx.counters.add("fuse_norm_skipped")  # (defined after the add: not a parameter)
            continue
        kwargs = dict(zip(after, node.args[n_args:], strict=False))  # (trailing ones may be kwargs)
        kwargs.update(node.kwargs)
        if rms:
            kwargs["rms"] = True
        with graph.inserting_before(total):
            fused = graph.call_function(getattr(torch.ops.dejavu, new_name).default,
                                        (*node.args[:n_args], residual, weight, bias, eps),
                                        kwargs)
            set_val(fused, fake_mode)
            fused.meta["dejavu"] = dict(node.meta.get("dejavu", {}))
            parts = []
            for i in range(2):
                part = graph.call_function(operator.getitem, (fused, i))
                set_val(part, fake_mode)
                parts.append(part)
        normed = parts[1]
        if tuple(fake_value(norm).shape) != tuple(val.shape):
            with graph.inserting_before(norm):
                normed = graph.call_function(torch.reshape,
                                             (parts[1], tuple(fake_value(norm).shape)))
                set_val(normed, fake_mode)
        norm.replace_all_uses_with(normed)
        # the blocks' inputs as discovered (read by graph_splits and the export's labels)
        # name the nodes that now stand for the erased ones
        for key, block_input in list(ctx.inputs.items()):
            if block_input is norm or block_input is total:
                ctx.inputs[key] = normed if block_input is norm else parts[0]
        for gone in chain:  # the norm's nodes, its last first
            graph.erase_node(gone)
        if view is not None and not view.users:
            graph.erase_node(view)
        total.replace_all_uses_with(parts[0])
        graph.erase_node(total)
        if out is not node:
            graph.erase_node(out)
        graph.erase_node(node)
        ctx.counters.add(f"fuse_norm[{name}]")
        if rms:
            ctx.counters.add("fuse_norm_rms")


def _is_dejavu(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == DEJAVU_NAMESPACE


def _is_lazy(node) -> bool:
    return is_op(node, "lazy_kv") or is_op(node, "lazy_qkv")


def _position_chain(node) -> tuple[fx.Node, fx.Node, fx.Node] | None:
    """(arange, length, its ``add_``) when ``node`` is a layer's cache positions as Hugging
    Face's static cache computes them, ``arange(n) + length`` with ``length.add_(n)`` after,
    the length tensor read by nothing else; else None."""
    if not (isinstance(node, fx.Node) and node.op == "call_function"
            and node.target is operator.add and len(node.args) == 2 and not node.kwargs):
        return None
    arange, length = node.args
    if not (isinstance(arange, fx.Node) and arange.op == "call_function"
            and arange.target is torch.arange and len(arange.args) == 1
            and isinstance(arange.args[0], int) and set(arange.kwargs) <= {"device"}
            and len(arange.users) == 1 and isinstance(length, fx.Node)
            and length.op == "placeholder" and len(length.users) == 2):
        return None
    (bump,) = [u for u in length.users if u is not node] or [None]
    if not (bump is not None and bump.op == "call_method" and bump.target == "add_"
            and bump.args == (length, arange.args[0]) and not bump.kwargs and not bump.users):
        return None
    return arange, length, bump


def _lazy_positions(graph: fx.Graph) -> dict:
    """positions node -> its ``_position_chain``, in graph order, for each positions tensor
    that only lazy K/V ops read."""
    found = {}
    for node in graph.nodes:
        if _is_lazy(node):
            for arg in node.args:
                chain = _position_chain(arg)
                if chain is not None and all(_is_lazy(u) for u in arg.users):
                    found.setdefault(arg, chain)
    return found


def batch_positions(gm: fx.GraphModule, ctx: PassContext, fake_mode) -> None:
    """The lazy K/V ops' cache positions, one ``arange(n) + length`` and ``length.add_(n)``
    per layer in Hugging Face's static cache (one small kernel a layer in the step), become two
    foreach ops before the first of them: the positions of every layer, then every layer's
    length moved on. Each length tensor is read by its positions only, so moving its update
    earlier changes no value. Inductor can run a foreach op's tensors in one kernel on CUDA;
    its CPU code still has one a layer (option ``batch_positions``; on an H200 no gain beyond
    the spread, BENCHMARKS.md)."""
    graph = gm.graph
    found = _lazy_positions(graph)
    steps = {chain[0].args[0] for chain in found.values()}
    if len(found) < 2 or len(steps) != 1:
        return
    (step,) = steps
    order = {n: i for i, n in enumerate(graph.nodes)}
    first = min(found, key=order.__getitem__)
    aranges = [chain[0] for chain in found.values()]
    for arange in aranges:  # no inputs: they may run anywhere before their use
        first.prepend(arange)
    with graph.inserting_before(first):
        lengths = [chain[1] for chain in found.values()]
        stacked = graph.call_function(torch._foreach_add, (aranges, lengths))
        set_val(stacked, fake_mode)
        for i, positions in enumerate(found):
            item = graph.call_function(operator.getitem, (stacked, i))
            item.meta["val"] = stacked.meta["val"][i]
            positions.replace_all_uses_with(item)
        bumped = graph.call_function(torch._foreach_add_, (lengths, step))
    for positions, (_, _, bump) in found.items():
        graph.erase_node(bump)
        graph.erase_node(positions)
    bumped.meta["val"] = None  # in place, nothing returned
    ctx.counters.add("positions_batched", len(found))


def positions_from_length(gm: fx.GraphModule, ctx: PassContext) -> None:
    """In a one-token step, each lazy K/V op reads its layer's cache length itself as its
    position (``arange(1) + length`` holds the one value ``length`` holds), and every such
    layer's ``length.add_(1)`` moves to one foreach op before the graph's output, after the last
    op that reads a length: no kernel a layer for the positions and their bump, one for every
    layer's bump (option ``positions_from_length``). Each length is read by its positions and
    its bump only (``_position_chain``), so no value changes. A prefill (several new tokens)
    is left as it is."""
    graph = gm.graph
    found = {positions: chain for positions, chain in _lazy_positions(graph).items()
             if chain[0].args[0] == 1}
    if not found:
        return
    lengths = []
    for positions, (arange, length, bump) in found.items():
        positions.replace_all_uses_with(length)
        for node in (bump, positions, arange):
            graph.erase_node(node)
        lengths.append(length)
    with graph.inserting_before(graph.output_node()):
        bumped = graph.call_function(torch._foreach_add_, (lengths, 1))
    bumped.meta["val"] = None  # in place, nothing returned
    ctx.counters.add("positions_from_length", len(found))


def run(gm: fx.GraphModule, ctx: PassContext) -> fx.GraphModule:
    fake_mode = fake_mode_of(gm)
    graph = gm.graph
    for node in list(graph.nodes):
        if node.target is not torch.ops.aten.t.default or not node.users:
            continue
        if not all(_is_dejavu(user) for user in node.users):
            continue
        weight = ctx.tensor(node.args[0], gm)
        if weight is None:
            continue
        if relaid_out(weight):  # in place already: the view is the layout the kernels read
            ctx.counters.add("relayout_in_place")
            continue
        if _keeps_original(node, weight.shape, weight.is_cuda, ctx.options.out_layout):
            ctx.counters.add("out_layout_original")  # the op reads this view as it is
            continue
        if ctx.options.relayout == "in_place" and isinstance(weight, torch.nn.Parameter):
            _PENDING[weight] = True  # this graph reads the strided view, once
            ctx.counters.add("relayout_pending")
            continue
        copy, new = relayout(weight)
        with graph.inserting_before(node):
            const = add_constant(gm, ctx, "relayout", copy, fake_mode)
        node.replace_all_uses_with(const)
        graph.erase_node(node)
        ctx.counters.add("relayout")
        if new:  # copies are shared between graphs: count each once
            ctx.counters.add("relayout_bytes", copy.numel() * copy.element_size())
    fused_from = fuse_linears(gm, ctx, fake_mode) if ctx.options.fuse_linears else {}
    if ctx.options.dense_gemv is not False:
        dense_gemv(gm, ctx, fused_from, cuda_only=ctx.options.dense_gemv is None)
    if ctx.options.decode_attention != "never":
        decode_attention(gm, ctx, fake_mode)
        if ctx.options.decode_selected_heads is not False:
            selected_heads(gm, ctx, min_positions=0 if ctx.options.decode_selected_heads
                           else SELECTED_HEADS_MIN_POSITIONS)
    if ctx.options.fuse_norm:
        fuse_norms(gm, ctx, fake_mode)
    if ctx.options.workspaces:
        workspaces(gm, ctx, fake_mode)
    if ctx.options.positions_from_length and not ctx.options.graph_splits:
        positions_from_length(gm, ctx)  # (before batch_positions: a prefill's are left to it)
    if ctx.options.batch_positions and not ctx.options.graph_splits:
        batch_positions(gm, ctx, fake_mode)  # (a cut graph keeps a layer's positions in its part)
    if ctx.options.graph_splits:
        graph_splits(gm, ctx, fake_mode)
    graph.lint()
    gm.recompile()
    return gm
