"""Profiles (predictor mode, validation), generation, recompilation, graph breaks, batches."""

from __future__ import annotations

import pytest
import torch
import yaml

import dejavu_compile
from dejavu_compile import DejavuOptions, ProfileError, load_profile, save_profile
from dejavu_compile.backend import register_model
from dejavu_compile.profile import BlockProfile, LayerProfile, ModelIdentity, Profile

from .conftest import prompt
from .test_backend import (
    FP32,
    _capture,
    _decode_logits,
    _dejavu_nodes,
    _reference_logits,
    assert_compiled_equals_eager,
)


def _identity(model, name="tiny") -> ModelIdentity:
    return ModelIdentity.from_config(model.config, name)


def _random_predictor_profile(model, tmp_path, rank=8, density=0.5, dense_first=True,
                              lookahead=False, buckets=1):
    """Random predictors for every block (layer 0 dense unless ``dense_first`` is False); with
    ``lookahead``, layers after the first read the previous layer's input; MLP predictors take
    their top-k per bucket when ``buckets`` > 1."""
    ident = _identity(model)
    gen = torch.Generator().manual_seed(3)
    tensors, layers = {}, []
    for i in range(ident.num_layers):
        blocks = {}
        for kind, units in (("mlp", ident.intermediate_size), ("attention", ident.num_heads)):
            if dense_first and i == 0:
                blocks[kind] = BlockProfile()
                continue
            tensors[f"layers.{i}.{kind}.w1"] = torch.randn(rank, ident.hidden_size, generator=gen)
            tensors[f"layers.{i}.{kind}.w2"] = torch.randn(units, rank, generator=gen)
            tensors[f"layers.{i}.{kind}.b2"] = torch.randn(units, generator=gen)
            blocks[kind] = BlockProfile(selector="predictor", density=density, units=units,
                                        rank=rank, activation="relu", recall=0.5,
                                        input="previous" if lookahead and i > 0 else "same",
                                        buckets=buckets if kind == "mlp" else 1)
        layers.append(LayerProfile(index=i, **blocks))
    profile = Profile(model=ident, layers=tuple(layers), predictor_file="tiny.safetensors")
    path = tmp_path / "tiny.yaml"
    save_profile(profile, path, tensors)
    return path, tensors


def _predictor_reference_hooks(model, tensors, density, dense_first=True, lookahead=False,
                               buckets=1):
    """Eager hooks doing what a predictor profile means: per decoded token, the predictor's
    top-k heads (queries and output projection) and neurons (down projection input), predicted
    from the block's input or, with ``lookahead``, from the previous layer's (layer 0: its own);
    the neurons' top-k taken per bucket of units when ``buckets`` > 1."""

    def predict(x, layer, kind, units):
        w1, w2, b2 = (tensors[f"layers.{layer}.{kind}.{n}"] for n in ("w1", "w2", "b2"))
        logits = torch.relu(x @ w1.t()) @ w2.t() + b2
        b = buckets if kind == "mlp" else 1
        per = units // b
        rows = logits.reshape(-1, units).view(-1, b, per)  # each bucket's top share, by hand
        keep = torch.zeros_like(rows).scatter_(-1, rows.topk(max(1, round(density * per))).indices,
                                               1.0)
        return keep.reshape(logits.shape)

    handles, state = [], {}
    heads = model.config.num_attention_heads
    hd = model.model.layers[0].self_attn.head_dim
    skip = 0 if dense_first else None

    def source(layer, kind):
        return (layer - 1 if lookahead and layer > 0 else layer, kind)

    for layer, block in enumerate(model.model.layers):
        attn = block.self_attn

        def q_pre(mod, args, layer=layer):
            state[(layer, "attention")] = args[0]

        def q_hook(mod, args, out, layer=layer):
            if layer == skip:
                return None
            mask = predict(state[source(layer, "attention")], layer, "attention", heads)
            state[layer] = mask
            return out * mask.repeat_interleave(hd, dim=-1)

        def o_hook(mod, args, layer=layer):
            if layer == skip:
                return None
            return (args[0] * state[layer].repeat_interleave(hd, dim=-1),)

        def down_hook(mod, args, layer=layer):
            if layer == skip:
                return None
            mask = predict(state[source(layer, "mlp")], layer, "mlp", args[0].shape[-1])
            return (args[0] * mask,)

        def up_hook(mod, args, layer=layer):
            state[(layer, "mlp")] = args[0]

        handles += [attn.q_proj.register_forward_pre_hook(q_pre),
                    attn.q_proj.register_forward_hook(q_hook),
                    attn.o_proj.register_forward_pre_hook(o_hook),
                    block.mlp.up_proj.register_forward_pre_hook(up_hook),
                    block.mlp.down_proj.register_forward_pre_hook(down_hook)]
    return handles


@pytest.mark.parametrize("arch,buckets", [("llama", 1), ("gemma3", 1), ("llama", 4)])
def test_predictor_profile_matches_reference(tiny, arch, buckets, tmp_path):
    model = tiny(arch)
    path, tensors = _random_predictor_profile(model, tmp_path, buckets=buckets)
    ids = prompt()
    with torch.no_grad():
        want = _reference_logits(
            model, ids, lambda: _predictor_reference_hooks(model, tensors, 0.5, buckets=buckets))
        compiled = torch.compile(model, backend="dejavu", options={"profile": str(path)})
        got = _decode_logits(compiled, ids)
    torch.testing.assert_close(got, want, **FP32)
    rep = dejavu_compile.report(model)
    assert rep.layers[0].mlp.selector == "dense" and rep.layers[1].mlp.selector == "predictor"
    assert rep.layers[1].attention.k == 2
    assert rep.bytes_sparse < rep.bytes_dense


def test_report_counts_predictors_in_the_models_dtype(tiny, tmp_path):
    """Predictors stored in fp16 run cast to the model's dtype: an fp32 model reads 4 bytes per
    predictor parameter, and the report says so."""
    model = tiny("llama")
    path, tensors = _random_predictor_profile(model, tmp_path)
    prof = load_profile(path)
    save_profile(prof, path, {n: t.half() for n, t in tensors.items()})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu", options={"profile": str(path)}),
                       prompt())
    row = dejavu_compile.report(model).layers[1].mlp
    numel = sum(t.numel() for n, t in tensors.items() if n.startswith("layers.1.mlp."))
    assert row.selector_bytes == numel * 4


def test_profile_round_trips(tiny, tmp_path):
    model = tiny("llama")
    path, _ = _random_predictor_profile(model, tmp_path)
    loaded = load_profile(path)
    assert loaded.to_dict() == yaml.safe_load(path.read_text())
    assert loaded.layer(1).mlp.density == 0.5 and loaded.model.hidden_size == 64


@pytest.mark.parametrize(
    "edit,message",
    [
        (lambda d: d.pop("version"), "field 'version' is missing"),
        (lambda d: d.update(version=7), "field 'version' is 7"),
        (lambda d: d["model"].pop("hidden_size"), "model, field 'hidden_size' is missing"),
        (lambda d: d["layers"][1]["mlp"].update(density=1.5), "layer 1, mlp: density"),
        (lambda d: d["layers"][1]["mlp"].update(density="half"), "layer 1, mlp, field 'density'"),
        (lambda d: d["layers"][1]["attention"].update(selector="magic"), "layer 1, attention"),
        (lambda d: d["layers"].pop(), "'layers' must list each index 0..1"),
        (lambda d: d["layers"][0].update(extra=1), "layer 0 has unknown field"),
        (lambda d: d["layers"][1]["mlp"].update(buckets=5), "layer 1, mlp: buckets must be a "
                                                           "positive divisor of units"),
        (lambda d: d["layers"][0]["mlp"].update(buckets=2), "buckets apply to predictor blocks"),
    ],
)
def test_malformed_profile_names_the_field(tiny, tmp_path, edit, message):
    path, _ = _random_predictor_profile(tiny("llama"), tmp_path)
    doc = yaml.safe_load(path.read_text())
    edit(doc)
    path.write_text(yaml.safe_dump(doc))
    with pytest.raises(ProfileError, match=message):
        load_profile(path)


def test_not_yaml_profile_is_refused(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("version: [1\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        load_profile(path)


def test_compile_reads_the_profile_at_once(tiny, tmp_path):
    """``dejavu_compile.compile`` reads a profile path when called: a missing or malformed
    file is its error, not one Dynamo wraps at the model's first call."""
    model = tiny("llama")
    with pytest.raises(FileNotFoundError, match="profile not found"):
        dejavu_compile.compile(model, profile=str(tmp_path / "none.yaml"))
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [1\n")
    with pytest.raises(ProfileError, match="not valid YAML"):
        dejavu_compile.compile(model, profile=bad)
    path, _ = _random_predictor_profile(model, tmp_path)
    dejavu_compile.compile(model, profile=str(path))
    with torch.no_grad():
        _decode_logits(model, prompt(), steps=1)
    assert dejavu_compile.report(model).layers[1].mlp.selector == "predictor"


def test_compile_refuses_a_profile_of_other_shapes_at_once(tiny, tmp_path):
    """Through ``dejavu_compile.compile`` the model's config is checked before anything is
    traced; the model is left as it was."""
    path, _ = _random_predictor_profile(tiny("llama"), tmp_path)
    other = tiny("opt")  # same hidden size, 4 heads, but 4 KV heads instead of 2
    with pytest.raises(ProfileError, match="does not fit this model: its config has "
                                           "num_kv_heads=4, the profile says 2"):
        dejavu_compile.compile(other, profile=path)
    assert other.forward.__func__ is type(other).forward and other._compiled_call_impl is None


def test_export_reads_its_profile_once(tiny, tmp_path, monkeypatch):
    """``dejavu_compile.export`` hands the profile it read and checked to the graphs it
    traces: the file is read once, not again by each traced graph."""
    from dejavu_compile import backend

    model = tiny("llama")
    path, _ = _random_predictor_profile(model, tmp_path)
    reads = []
    monkeypatch.setattr(backend, "load_profile", lambda p: reads.append(p) or load_profile(p))
    paths = dejavu_compile.export(model, tmp_path / "graphs", onnx=False, profile=path)
    assert reads == [path] and paths["report.yaml"].is_file()


def test_profile_for_another_model_is_refused(tiny, tmp_path):
    path, _ = _random_predictor_profile(tiny("llama"), tmp_path)
    other = tiny("opt")  # same hidden size, 4 heads, but 4 KV heads instead of 2
    with torch.no_grad(), pytest.raises(Exception, match="layer 0 attention has num_kv_heads=4"):
        _decode_logits(torch.compile(other, backend="dejavu", options={"profile": str(path)}),
                       prompt(), steps=1)


@pytest.mark.parametrize(
    "options,message",
    [
        ({}, "needs options"),
        ({"selector": "oracle", "mlp_density": 0}, "mlp_density"),
        ({"selector": "oracle", "mlp_density": 1.2}, "mlp_density"),
        ({"selector": "predictor"}, "needs a profile"),
        ({"selector": "oracle", "bogus": 1}, "unknown dejavu option"),
        ({"selector": "oracle", "inner": "tvm"}, "inner"),
        ({"profile": "x.yaml", "mlp_density": 0.5}, "not both"),
        ({"selector": "oracle", "workspaces": "no"}, "'workspaces' must be True or False, got 'no'"),
        ({"selector": "oracle", "cudagraphs": 1}, "'cudagraphs' must be True or False"),
        ({"selector": "oracle", "lookahead": 0}, "'lookahead' must be True or False or None"),
    ],
)
def test_bad_options_are_clear(options, message):
    with pytest.raises((ValueError, TypeError), match=message):
        DejavuOptions.from_mapping(options)


def test_unmatched_attention_stays_dense_and_is_reported(tiny):
    model = tiny("llama")
    model.config._attn_implementation = "eager"  # softmax(QK^T)V in plain ops: no SDPA node
    assert_compiled_equals_eager(
        model, {"selector": "oracle", "mlp_density": 1.0, "attention_density": 0.5})
    rep = dejavu_compile.report(model)
    assert all(r.attention is None and r.mlp.selector == "oracle" for r in rep.layers)
    assert any("self_attn.q_proj.weight" in u for u in rep.unmatched)
    assert "q_proj" in str(rep)


def test_dense_layers_option_and_report_bytes(tiny):
    model = tiny("llama")
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu", options={
            "selector": "oracle", "mlp_density": 0.25, "dense_layers": [0]}), prompt(), steps=1)
    rep = dejavu_compile.report(model)
    first, second = rep.layers
    assert first.mlp.selector == "dense" and "dense_layers" in first.mlp.reason
    assert second.mlp.selector == "oracle" and second.mlp.k == 24
    mlp = model.model.layers[1].mlp
    weights = sum(p.numel() * 4 for p in mlp.parameters())
    assert second.mlp.dense_bytes == weights
    assert second.mlp.sparse_bytes == weights // 4
    params = {id(p): p for p in model.parameters()}
    assert rep.bytes_dense == sum(p.numel() * 4 for p in params.values())


def _count_graphs(model):
    return len(dejavu_compile.report(model).graphs)


@pytest.mark.parametrize("cache", [None, "static"])
def test_generate_works_and_does_not_recompile_per_step(tiny, cache):
    model = tiny("llama")
    ids = prompt()
    kwargs = dict(do_sample=False, cache_implementation=cache, max_new_tokens=12)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        dejavu_compile.compile(model, selector="oracle", mlp_density=1.0, attention_density=1.0,
                               inner="eager")
        got = model.generate(ids, **kwargs)
        again = model.generate(ids, **kwargs)
        graphs = _count_graphs(model)
        third = model.generate(ids, **kwargs)
    assert torch.equal(got, want) and torch.equal(again, want) and torch.equal(third, want)
    rows = dejavu_compile.report(model).layers
    assert all(r.attention.selector == "oracle" and r.mlp.selector == "oracle" for r in rows)
    # Prefill, the first decode step, at most one graph generalised over the cache length, and
    # the prefill again once: the first decode call re-lays out the down and output projections
    # in place, and the new strides recompile each graph that reads them, once.
    assert graphs <= 4, f"{graphs} graphs for two generations of 11 decode steps"
    assert _count_graphs(model) == graphs, "a repeated generation compiled new graphs"


def test_graph_break_each_graph_rewritten(tiny):
    model = tiny("llama")
    # A hook with a graph break between the two decoder layers splits the model in two graphs.
    model.model.layers[1].register_forward_pre_hook(lambda mod, args: torch._dynamo.graph_break())
    # Each layer then compiles as its own frame, whose weights' sources hold no layer number:
    # the names registered by the API (dejavu_compile.compile does this) supply it.
    register_model(model)
    backend, graphs = _capture({"selector": "oracle", "mlp_density": 0.5})
    ids = prompt()
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), ids, steps=1)
    decode = [(gm, ctx) for gm, ctx in graphs if ctx.discovery.tokens == 1]
    layers = sorted(layer for _, ctx in decode for layer in ctx.discovery.mlp)
    assert layers == [0, 1], "layer numbers must survive the graph break"
    # (the last layer's with the final RMS norm, fused: fuse_rms_norm)
    assert len(decode) >= 2 and all(
        sum(_dejavu_nodes(gm).count(op) for op in ("dejavu::sparse_mlp", "dejavu::sparse_mlp_norm"))
        == 1 for gm, _ in decode)


def test_batch_decode_is_per_row(tiny):
    model = tiny("qwen2")
    ids = prompt(batch=3)
    opts = {"selector": "oracle", "mlp_density": 0.3, "attention_density": 0.5,
            "batch_selection": "row", "inner": "eager"}  # the selections, not Inductor
    with torch.no_grad():
        compiled = torch.compile(model, backend="dejavu", options=opts)
        batched = _decode_logits(compiled, ids)
        rows = torch.cat([_decode_logits(compiled, ids[i : i + 1]) for i in range(3)])
    torch.testing.assert_close(batched, rows, **FP32)


def test_batch_decode_takes_the_union(tiny):
    """The default for a batch: every sparse op of the decode graph computes the union of the
    rows' selections. Rows that are the same sequence select the same units, so their union is
    each one's selection (the rest padding) and the batch decodes as one row alone; rows that
    differ get more units than alone."""
    model = tiny("qwen2")
    opts = {"selector": "oracle", "mlp_density": 0.3, "attention_density": 0.5,
            "inner": "eager"}  # the selections, not Inductor (other tests compile through it)
    backend, graphs = _capture(opts)
    same, ids = prompt().expand(3, -1), prompt(batch=3)
    with torch.no_grad():
        one = _decode_logits(torch.compile(model, backend="dejavu", options=opts), same[:1])
        torch._dynamo.reset()
        _decode_logits(torch.compile(model, backend=backend), ids, steps=1)
        torch._dynamo.reset()
        compiled = torch.compile(model, backend="dejavu", options=opts)
        torch.testing.assert_close(_decode_logits(compiled, same), one.expand(3, -1, -1), **FP32)
        union = _decode_logits(compiled, ids)
        rows = torch.cat([_decode_logits(compiled, ids[i : i + 1]) for i in range(3)])
    assert not torch.allclose(union, rows, atol=1e-4)
    decode = [gm for gm, ctx in graphs if ctx.discovery.tokens == 1]
    sparse = [n for gm in decode for n in gm.graph.nodes
              if n.op == "call_function" and str(n.target).startswith("dejavu.sparse_")]
    assert sparse and all(_union_flag(n) for n in sparse)


def _union_flag(node) -> bool:
    schema = node.target._schema
    position = [a.name for a in schema.arguments].index("union")
    # (an op with its norm, fuse_norm, takes its trailing arguments by keyword)
    return node.args[position] if position < len(node.args) else node.kwargs["union"]


def test_split_graph_without_layer_names_refuses_a_profile(tiny, tmp_path):
    model = tiny("llama")
    path, _ = _random_predictor_profile(model, tmp_path)
    model.model.layers[1].register_forward_pre_hook(lambda mod, args: torch._dynamo.graph_break())
    compiled = torch.compile(model, backend="dejavu", options={"profile": str(path)})
    with torch.no_grad(), pytest.raises(Exception, match="carry no layer numbers"):
        _decode_logits(compiled, prompt(), steps=1)
