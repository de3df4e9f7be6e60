"""Inspection: graph.py, graph.svg, graph.onnx and report.yaml from ``dejavu_compile.export``,
and the per-pass dump folder."""

from __future__ import annotations

import xml.etree.ElementTree as ET

import onnx
import pytest
import torch
import yaml

import dejavu_compile
from dejavu_compile.inspection import ONNX_DOMAIN

from .conftest import prompt
from .test_profiles_and_generate import _random_predictor_profile


def _param_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_export_files_are_valid(tiny, arch, tmp_path):
    model = tiny(arch)
    path, _ = _random_predictor_profile(model, tmp_path)
    paths = dejavu_compile.export(model, tmp_path / "out", profile=str(path))
    report = yaml.safe_load(paths["report.yaml"].read_text())
    layers = report["layers"]
    sparse = {kind: [r["layer"] for r in layers if r[kind]["selector"] != "dense"]
              for kind in ("mlp", "attention")}
    assert sparse == {"mlp": [1], "attention": [1]}  # layer 0 dense in this profile
    assert layers[1]["mlp"]["recall"] == 0.5 and layers[1]["mlp"]["input"] == "same"

    proto = onnx.load(str(paths["graph.onnx"]))
    onnx.checker.check_model(proto)
    # the model's weights are initializers; the inputs are ids, positions, mask and cache
    assert proto.graph.initializer
    assert not any("parameters_weight" in i.name for i in proto.graph.input)
    assert any("past_key_values" in i.name for i in proto.graph.input)
    custom = [n for n in proto.graph.node if n.domain == ONNX_DOMAIN]
    by_type = {}
    for node in custom:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        by_type.setdefault(node.op_type, []).append(attrs)
        assert {"layer", "density", "k", "block", "selector"} <= set(attrs)
    # one sparse op per sparsified block (plus its selector), named by layer and density,
    # with its residual add and norm (option fuse_norm, on by default: OPT's layer norm,
    # Llama's RMS norm)
    norm = "Norm"
    assert [a["layer"] for a in by_type["SparseMlp" + norm]] == sparse["mlp"]
    assert [a["layer"] for a in by_type["SparseHeadOut" + norm]] == sparse["attention"]
    assert by_type["SparseMlp" + norm][0]["density"] == pytest.approx(0.5)
    assert by_type["SparseMlp" + norm][0]["k"] == layers[1]["mlp"]["units"] // 2
    standard = {n.op_type for n in proto.graph.node if n.domain in ("", "ai.onnx")}
    assert {"MatMul", "Softmax", "Gather"} <= standard  # the dense parts stay standard ONNX

    svg = ET.parse(paths["graph.svg"]).getroot()
    text = " ".join(t.text or "" for t in svg.iter("{http://www.w3.org/2000/svg}text"))
    for i in range(model.config.num_hidden_layers):
        assert f"layer {i} attention" in text and f"layer {i} mlp" in text
    assert "predictor" in text

    source = paths["graph.py"].read_text()
    compile(source, "graph.py", "exec")
    assert "torch.ops.dejavu.sparse_mlp" in source


def test_export_names_the_dense_gemv_nodes(tiny, tmp_path):
    """With ``dense_gemv`` the exported graph's ``Gemv`` nodes carry their block's layer and
    kind, density 1, like the sparse ops."""
    model = tiny("llama")
    paths = dejavu_compile.export(model, tmp_path / "out", selector="oracle", mlp_density=0.5,
                                  dense_gemv=True)
    proto = onnx.load(str(paths["graph.onnx"]))
    gemv = [{a.name: onnx.helper.get_attribute_value(a) for a in n.attribute}
            for n in proto.graph.node if n.domain == ONNX_DOMAIN and n.op_type == "Gemv"]
    layers = model.config.num_hidden_layers
    assert gemv and {(a["layer"], a["block"]) for a in gemv} == {
        (i, b"attention") for i in range(layers)}
    assert all(a["selector"] == b"dense" and a["density"] == 1.0 for a in gemv)


def test_svg_shows_lookahead_edges(tiny, tmp_path):
    from .test_profiles_and_generate import _random_predictor_profile as profile_of

    model = tiny("llama")
    path, _ = profile_of(model, tmp_path, dense_first=False, lookahead=True)
    paths = dejavu_compile.export(model, tmp_path / "out", onnx=False, profile=str(path))
    svg = ET.parse(paths["graph.svg"]).getroot()
    ns = "{http://www.w3.org/2000/svg}"
    text = [t.text for t in svg.iter(f"{ns}text")]
    assert sum("(lookahead)" in t for t in text) == 2  # layer 1's MLP and attention predictors
    edges = [t.text for line in svg.iter(f"{ns}line") for t in line.iter(f"{ns}title")]
    assert edges.count("lookahead") == 2 and edges.count("predictor-input") == 2


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_report_bytes_add_up_to_parameters_at_density_one(tiny, arch, tmp_path):
    model = tiny(arch)
    paths = dejavu_compile.export(model, tmp_path, onnx=False, selector="oracle",
                                  mlp_density=1.0, attention_density=1.0)
    report = yaml.safe_load(paths["report.yaml"].read_text())
    blocks = [r[kind] for r in report["layers"] for kind in ("mlp", "attention")]
    assert report["other_bytes"] + sum(b["dense_bytes"] for b in blocks) == _param_bytes(model)
    assert report["bytes_per_token_dense"] == _param_bytes(model)
    for b in blocks:
        assert b["selector"] == "oracle" and b["kept"] == 1.0
        assert b["sparse_bytes"] == b["dense_bytes"]


def test_dump_dir_holds_each_pass(tiny, tmp_path, monkeypatch):
    model = tiny("llama")
    dumped = tmp_path / "by-option"
    compiled = torch.compile(model, backend="dejavu", options={
        "selector": "oracle", "mlp_density": 0.5, "inner": "eager", "dump_dir": str(dumped)})
    with torch.no_grad():
        compiled(prompt())
    names = sorted(p.name for p in dumped.iterdir())
    assert [n.split("_", 1)[1] for n in names] == ["0_input.py", "1_discover.py",
                                                   "2_sparsify.py", "3_lookahead.py", "4_lower.py"]
    for p in dumped.iterdir():
        compile(p.read_text(), p.name, "exec")

    torch._dynamo.reset()
    monkeypatch.setenv("DEJAVU_DUMP_DIR", str(tmp_path / "by-env"))
    compiled = torch.compile(model, backend="dejavu", options={
        "selector": "oracle", "mlp_density": 0.5, "inner": "eager"})
    with torch.no_grad():
        compiled(prompt())
    assert len(list((tmp_path / "by-env").iterdir())) == 5


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_export_of_fused_norms_has_two_outputs(tiny, tmp_path, arch):
    """With ``fuse_norm``, a tiny OPT's sparse layer exports its output projection and MLP as
    ``SparseHeadOutNorm`` and ``SparseMlpNorm``, each with two outputs (the residual sum and
    its norm), in a model the ONNX checker accepts; with ``fuse_rms_norm`` (said here, on by
    default) a tiny Llama's do too, with the ``rms`` attribute set (0 for OPT's layer
    norms)."""
    model = tiny(arch)
    path, _ = _random_predictor_profile(model, tmp_path)
    option = "fuse_norm" if arch == "opt" else "fuse_rms_norm"
    paths = dejavu_compile.export(model, tmp_path / "out", profile=str(path), **{option: True})
    proto = onnx.load(str(paths["graph.onnx"]))
    onnx.checker.check_model(proto)
    fused = [n for n in proto.graph.node if n.domain == ONNX_DOMAIN and n.op_type.endswith("Norm")]
    assert sorted({n.op_type for n in fused}) == ["SparseHeadOutNorm", "SparseMlpNorm"]
    assert all(len(n.output) == 2 for n in fused)
    rms = int(arch == "llama")
    assert all({a.name: a.i for a in n.attribute}.get("rms") == rms for n in fused), fused
    text = paths["graph.py"].read_text()
    assert "torch.ops.dejavu.sparse_mlp_norm" in text and ("rms = True" in text) == bool(rms)
