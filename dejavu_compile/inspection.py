"""Inspection: write what the backend did to a model's decode step.

``export(model, out, profile=...)`` compiles one prefill and one decode step with the same passes
the backend runs, then writes, for the decode graph:

- ``graph.py``: the transformed FX graph as readable Python (shapes in the annotations);
- ``graph.svg``: a diagram of layers and blocks (sparse or dense, density, predictor edges,
  lookahead where a predictor reads an earlier layer's input), drawn from a networkx graph;
- ``graph.onnx``: the transformed graph; ``dejavu`` ops are nodes of the custom ONNX domain
  ``dejavu`` carrying ``layer``, ``block``, ``selector``, ``density`` and ``k`` as attributes,
  the dense parts keep standard ONNX ops;
- ``report.yaml``: the compile report, per layer: blocks matched, densities, predictor recall,
  bytes read per decoded token dense and sparse.
"""

from __future__ import annotations

import html
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import networkx as nx
import torch
import torch.fx as fx
import yaml

from dejavu_compile.passes.lookahead import is_op

from .backend import register_model, transform
from .config import DejavuOptions
from .report import CompileReport, GraphReport, build_graph_report

ONNX_DOMAIN = "dejavu"
ONNX_OPSET = 17
PROMPT_TOKENS = 8  # prompt length of the traced prefill; the decode graph does not depend on it


@dataclass
class Captured:
    """One graph the backend transformed, with its inputs, pass context and report."""

    gm: fx.GraphModule
    example_inputs: list[Any]
    ctx: Any
    report: GraphReport


def capture(model: torch.nn.Module, options: DejavuOptions,
            ids: torch.Tensor | None = None) -> list[Captured]:
    """Run one prefill and one decode step of ``model`` through the passes (inner compiler:
    none) and return every graph Dynamo produced, transformed."""
    captured: list[Captured] = []

    def backend(gm, example_inputs):
        ctx = transform(gm, example_inputs, options)
        captured.append(Captured(gm, list(example_inputs), ctx,
                                 build_graph_report(ctx, index=len(captured))))
        return gm.forward

    if ids is None:
        vocab = model.config.vocab_size
        ids = (torch.arange(PROMPT_TOKENS) * 7919 % (vocab - 3) + 3).unsqueeze(0)
    device = next(model.parameters()).device
    ids = ids.to(device)
    register_model(model)
    torch._dynamo.reset()
    try:
        compiled = torch.compile(model, backend=backend)
        with torch.no_grad():
            out = compiled(ids, use_cache=True)
            nxt = out.logits[:, -1:].argmax(-1)
            compiled(nxt, past_key_values=out.past_key_values, use_cache=True)
    finally:
        torch._dynamo.reset()
    return captured


def decode_graph(captured: list[Captured]) -> Captured:
    """The decode graph covering the most layers (the whole decode step when Dynamo does not
    split the model)."""
    decode = [c for c in captured if c.report.decode]
    if not decode:
        raise RuntimeError("no decode graph was compiled: does the model return a KV cache?")
    return max(decode, key=lambda c: len(c.report.layers))


def graph_python(gm: fx.GraphModule) -> str:
    """The graph as readable Python: a module class with shapes and dtypes annotated."""
    return gm.print_readable(print_output=False, include_stride=False, include_device=True)


def _dejavu_nodes(gm: fx.GraphModule) -> list[fx.Node]:
    return [n for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "dejavu"]


def block_graph(c: Captured) -> nx.DiGraph:
    """Layers and blocks as a networkx graph: the residual chain embed -> attention -> MLP ->
    ... -> head, with one predictor node per predicted block and an edge from the block whose
    input it reads (the previous layer's, with lookahead)."""
    g = nx.DiGraph()
    g.add_node("embed", label="embeddings", kind="io", layer=None)
    prev = "embed"
    for row in c.report.layers:
        for kind, b in (("attention", row.attention), ("mlp", row.mlp)):
            if b is None:
                continue
            name = f"L{row.layer}.{kind}"
            sparse = b.selector != "dense"
            label = f"layer {row.layer} {kind}: " + (
                f"{b.selector} {b.k}/{b.units} ({b.kept:.2f})" if sparse else "dense")
            g.add_node(name, label=label, kind=kind, layer=row.layer, sparse=sparse,
                       density=b.kept, selector=b.selector, reason=b.reason)
            g.add_edge(prev, name, kind="residual")
            prev = name
    g.add_node("head", label="norm + LM head", kind="io", layer=None)
    g.add_edge(prev, "head", kind="residual")

    inputs = {node: key for key, node in c.ctx.inputs.items()}
    for node in _dejavu_nodes(c.gm):
        meta = node.meta.get("dejavu", {})
        folded = is_op(node, "select_hidden")
        if not (is_op(node, "select_predictor") or is_op(node, "predict_ahead") or folded) \
                or not meta:
            continue
        layer, kind = meta["layer"], meta["block"]
        pred = f"L{layer}.{kind}.predictor"
        src = node.args[0]
        while folded and src not in inputs and isinstance(src, torch.fx.Node) and src.args:
            src = src.args[0]  # a folded predictor: its hidden comes from a linear of the input
        src_layer, src_kind = inputs.get(src, (layer, kind))
        lookahead = src_layer != layer
        g.add_node(pred, label=f"predictor k={meta['k']}", kind="predictor", layer=layer,
                   lookahead=lookahead)
        g.add_edge(f"L{src_layer}.{src_kind}", pred,
                   kind="lookahead" if lookahead else "predictor-input")
        g.add_edge(pred, f"L{layer}.{kind}", kind="indices")
    return g


_COLORS = {"io": "#dddddd", "dense": "#e8e8e8", "sparse": "#f4a259", "predictor": "#8cb8e0"}
_EDGE_STYLE = {
    "residual": 'stroke="#444" stroke-width="1.5"',
    "predictor-input": 'stroke="#3a78b5" stroke-dasharray="4 3"',
    "lookahead": 'stroke="#c0392b" stroke-width="1.5" stroke-dasharray="6 3"',
    "indices": 'stroke="#3a78b5"',
}


def _box(g: nx.DiGraph, name: str, pos) -> tuple[float, float, float, float]:
    """Centre and half sizes of a node's box."""
    x, y = pos[name]
    w = _PREDICTOR_W if g.nodes[name]["kind"] == "predictor" else _BOX_W
    return x + w / 2, y + _BOX_H / 2, w / 2, _BOX_H / 2


def _clip(cx: float, cy: float, hw: float, hh: float, dx: float, dy: float) -> tuple[float, float]:
    """Where a line arriving at a box's centre along (dx, dy) crosses the box's border."""
    t = min(hw / abs(dx) if dx else float("inf"), hh / abs(dy) if dy else float("inf"))
    return cx - t * dx, cy - t * dy


_BOX_W, _PREDICTOR_W, _BOX_H, _ROW_H = 230, 190, 30, 48


def svg_text(g: nx.DiGraph) -> str:
    """Draw ``block_graph``'s output: one row per layer (attention, MLP, their predictors)."""
    cols = {"attention": 30, "mlp": 300, "predictor:attention": 570, "predictor:mlp": 570}
    layers = sorted({d["layer"] for _, d in g.nodes(data=True) if d.get("layer") is not None})
    row = {layer: i + 1 for i, layer in enumerate(layers)}
    pos = {"embed": (30, 10), "head": (300, 10 + _ROW_H * (len(layers) + 1))}
    for name, d in g.nodes(data=True):
        if d["kind"] in ("attention", "mlp"):
            pos[name] = (cols[d["kind"]], 10 + _ROW_H * row[d["layer"]])
        elif d["kind"] == "predictor":
            kind = name.split(".")[1]
            dy = -_ROW_H // 4 if kind == "attention" else _ROW_H // 4
            pos[name] = (cols[f"predictor:{kind}"], 10 + _ROW_H * row[d["layer"]] + dy)
    width, height = 800, 20 + _ROW_H * (len(layers) + 2)
    parts = [
        '<?xml version="1.0" encoding="UTF-8"?>',
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'viewBox="0 0 {width} {height}" font-family="sans-serif" font-size="11">',
        '<title>dejavu-compile: the transformed decode graph, by layer and block</title>',
        '<defs><marker id="arrow" viewBox="0 0 10 10" refX="10" refY="5" markerWidth="6" '
        'markerHeight="6" orient="auto-start-reverse"><path d="M 0 0 L 10 5 L 0 10 z" '
        'fill="#444"/></marker></defs>',
    ]
    for u, v, d in g.edges(data=True):
        ux, uy, uw, uh = _box(g, u, pos)
        vx, vy, vw, vh = _box(g, v, pos)
        x1, y1 = _clip(ux, uy, uw, uh, ux - vx, uy - vy)
        x2, y2 = _clip(vx, vy, vw, vh, vx - ux, vy - uy)
        parts.append(
            f'<line x1="{x1:.1f}" y1="{y1:.1f}" x2="{x2:.1f}" y2="{y2:.1f}" '
            f'{_EDGE_STYLE[d["kind"]]} marker-end="url(#arrow)"><title>{d["kind"]}</title></line>'
        )
    for name, d in g.nodes(data=True):
        x, y = pos[name]
        if d["kind"] == "predictor":
            fill, w = _COLORS["predictor"], _PREDICTOR_W
        elif d["kind"] == "io":
            fill, w = _COLORS["io"], _BOX_W
        else:
            fill, w = _COLORS["sparse" if d["sparse"] else "dense"], _BOX_W
        label = d["label"] + (" (lookahead)" if d.get("lookahead") else "")
        tip = d.get("reason") or label
        parts.append(
            f'<g id="{html.escape(name)}"><rect x="{x}" y="{y}" width="{w}" height="{_BOX_H}" '
            f'rx="4" fill="{fill}" stroke="#555"/><text x="{x + 6}" y="{y + 19}">'
            f'{html.escape(label)}</text><title>{html.escape(tip)}</title></g>'
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def _camel(name: str) -> str:
    return "".join(p.capitalize() for p in name.split("_"))


def _register_onnx_symbolics() -> None:
    """One ONNX symbolic per ``dejavu`` op, built from its schema: tensors become inputs (absent
    optional ones are listed in the ``inputs`` attribute), everything else attributes."""
    from torch.onnx import register_custom_op_symbolic
    from torch.onnx._internal.torchscript_exporter import symbolic_helper as sh

    for name in torch.ops.dejavu:
        schema = getattr(torch.ops.dejavu, name).default._schema

        def symbolic(g, *args, schema=schema, name=name):
            inputs, attrs, present = [], {}, []
            for arg, value in zip(schema.arguments, args, strict=True):
                ty = str(arg.type)
                if "Tensor" in ty:
                    if value is None or sh._is_none(value):
                        continue
                    inputs.append(value)
                    present.append(arg.name)
                elif ty.startswith("bool"):
                    attrs[f"{arg.name}_i"] = int(sh._maybe_get_const(value, "b"))
                elif ty.startswith("int"):
                    attrs[f"{arg.name}_i"] = sh._maybe_get_const(value, "i")
                elif ty.startswith("float"):
                    attrs[f"{arg.name}_f"] = sh._maybe_get_const(value, "f")
                else:
                    attrs[f"{arg.name}_s"] = sh._maybe_get_const(value, "s")
            return g.op(f"{ONNX_DOMAIN}::{_camel(name)}", *inputs, inputs_s=",".join(present),
                        outputs=len(schema.returns), **attrs)

        register_custom_op_symbolic(f"dejavu::{name}", symbolic, 1)


class _Graph(torch.nn.Module):
    """The decode graph with the model's weights as buffers (ONNX initializers) and the rest
    of its inputs (token ids, positions, mask, KV cache) as arguments."""

    def __init__(self, gm: fx.GraphModule, example_inputs: list[Any], weights: set[int]):
        super().__init__()
        self.gm = gm
        self.slots: list[tuple[str, Any]] = []
        self.names: list[str] = []
        placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
        for i, (node, value) in enumerate(zip(placeholders, example_inputs, strict=True)):
            if isinstance(value, torch.Tensor) and id(value) in weights:
                self.register_buffer(f"w{i}", value.detach())
                self.slots.append(("buffer", f"w{i}"))
            elif isinstance(value, torch.Tensor):
                self.slots.append(("input", len(self.names)))
                self.names.append(node.name)
            else:
                self.slots.append(("const", value))

    def forward(self, *inputs):
        args = []
        for kind, ref in self.slots:
            args.append(getattr(self, ref) if kind == "buffer" else
                        inputs[ref] if kind == "input" else ref)
        out = self.gm(*args)
        return tuple(out) if isinstance(out, (list, tuple)) else out


def write_onnx(c: Captured, path: Path, model: torch.nn.Module) -> None:
    """Export the transformed graph to ONNX, ``model``'s parameters and buffers as initializers,
    and annotate each ``dejavu`` node with the block it serves (layer, block, selector, density,
    k), read from the FX nodes in the same order."""
    import onnx

    _register_onnx_symbolics()
    weights = {id(t) for t in (*model.parameters(), *model.buffers())}
    module = _Graph(c.gm, c.example_inputs, weights)
    inputs = tuple(v for (kind, _), v in zip(module.slots, c.example_inputs, strict=True)
                   if kind == "input")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, inputs, str(path), dynamo=False, opset_version=ONNX_OPSET,
                          custom_opsets={ONNX_DOMAIN: 1}, input_names=module.names,
                          do_constant_folding=False)
    proto = onnx.load(str(path))
    fx_nodes = _dejavu_nodes(c.gm)
    onnx_nodes = [n for n in proto.graph.node if n.domain == ONNX_DOMAIN]
    want = [_camel(n.target._schema.name.split("::")[1]) for n in fx_nodes]
    got = [n.op_type for n in onnx_nodes]
    if want != got:
        raise RuntimeError(f"ONNX export reordered the dejavu ops: FX {want} vs ONNX {got}")
    for fx_node, node in zip(fx_nodes, onnx_nodes, strict=True):
        meta = fx_node.meta.get("dejavu", {})
        have = {a.name for a in node.attribute}
        for key, value in meta.items():
            if key in have:  # the op's own argument (k) already says it
                continue
            node.attribute.append(onnx.helper.make_attribute(key, value))
    onnx.checker.check_model(proto)
    onnx.save(proto, str(path))


def report_dict(report: CompileReport, profile=None) -> dict[str, Any]:
    """The compile report as plain data, with the profile's measured predictor quality."""
    out = report.to_dict()
    if profile is not None:
        out["profile"] = {"model": profile.model.name,
                          "path": str(profile.path) if profile.path else None}
        for row in out["layers"]:
            layer = profile.layer(row["layer"])
            for kind in ("attention", "mlp"):
                spec = layer.block(kind)
                if row[kind] is not None and spec.selector == "predictor":
                    row[kind].update(recall=spec.recall, precision=spec.precision,
                                     input=spec.input)
    return out


def export(model: torch.nn.Module, out: str | Path, *, ids: torch.Tensor | None = None,
           onnx: bool = True, **options) -> dict[str, Path]:
    """Write ``graph.py``, ``graph.svg``, ``graph.onnx`` and ``report.yaml`` for ``model``'s
    decode step into ``out``; ``options`` are the backend's (``profile=...`` or
    ``selector=..., mlp_density=...``). Returns the paths written."""
    from .backend import _checked_options

    opts = _checked_options(model, DejavuOptions.from_mapping({**options, "inner": "eager"}))
    profile = opts.profile
    captured = capture(model, opts, ids)
    main = decode_graph(captured)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"graph.py": out / "graph.py", "graph.svg": out / "graph.svg",
             "report.yaml": out / "report.yaml"}
    paths["graph.py"].write_text(graph_python(main.gm))
    paths["graph.svg"].write_text(svg_text(block_graph(main)))
    report = CompileReport([c.report for c in captured])
    paths["report.yaml"].write_text(yaml.safe_dump(report_dict(report, profile), sort_keys=False))
    if onnx:
        paths["graph.onnx"] = out / "graph.onnx"
        write_onnx(main, paths["graph.onnx"], model)
    return paths
