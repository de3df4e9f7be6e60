"""Lower: give the sparse ops the weight layout they read fast, once, and check they can run.

The sparsify pass hands down and output projections to the ops as ``aten.t`` views of the
``[out, in]`` weights; gathering a neuron's column of such a view strides through memory. Here
each view becomes a constant holding the weight re-laid out as ``[in, out]`` contiguous (paper
section 4.4), made once per weight tensor and shared by every graph of the model (each decode graph
and any recompilation), so the extra memory is one copy of each sparsified down / output
projection, reported as ``relayout_bytes``.

Which implementation runs is chosen by the op's dispatcher from the tensors' device: the
reference on CPU, the registered Triton kernels on CUDA.
"""

from __future__ import annotations

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from .context import PassContext, add_constant, fake_mode_of

# weight -> (its version counter when re-laid out, the [in, out] copy)
_RELAYOUT = WeakIdKeyDictionary()
DEJAVU_NAMESPACE = "dejavu"


def relayout(weight: torch.Tensor) -> tuple[torch.Tensor, bool]:
    """``weight.t()`` stored contiguously, cached per weight tensor until it is modified; the
    flag says whether this call made the copy."""
    cached = _RELAYOUT.get(weight)
    if cached is not None and cached[0] == weight._version:
        return cached[1], False
    copy = weight.detach().t().contiguous()
    _RELAYOUT[weight] = (weight._version, copy)
    return copy, True


def _is_dejavu(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "namespace", None) == DEJAVU_NAMESPACE


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
        copy, new = relayout(weight)
        with graph.inserting_before(node):
            const = add_constant(gm, ctx, "relayout", copy, fake_mode)
        node.replace_all_uses_with(const)
        graph.erase_node(node)
        ctx.counters.add("relayout")
        if new:  # copies are shared between graphs: count each once
            ctx.counters.add("relayout_bytes", copy.numel() * copy.element_size())
    graph.lint()
    gm.recompile()
    return gm
