"""The lookahead pass: predictors read the previous layer's input, scheduled right after it."""

from __future__ import annotations

import pytest
import torch

import dejavu_compile
from dejavu_compile import ProfileError, load_profile
from dejavu_compile.profile import BlockProfile, LayerProfile, Profile

from .conftest import prompt
from .test_backend import FP32, _capture, _decode_logits, _reference_logits
from .test_profiles_and_generate import _predictor_reference_hooks, _random_predictor_profile

OPS = torch.ops.dejavu


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_predictors_read_the_previous_layers_input(tiny, arch, tmp_path):
    model = tiny(arch)
    path, _ = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    backend, graphs = _capture({"profile": str(path)})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), prompt(), steps=1)
    gm, ctx = graphs[-1]
    inputs = ctx.inputs
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    preds = {(n.meta["dejavu"]["layer"], n.meta["dejavu"]["block"]): n
             for n in gm.graph.nodes if n.target is OPS.select_predictor.default}
    assert set(preds) == {(0, "mlp"), (0, "attention"), (1, "mlp"), (1, "attention")}
    # layer 0 (no earlier input) predicts from its own input, layer 1 from layer 0's
    assert preds[(0, "mlp")].args[0] is inputs[(0, "mlp")]
    assert preds[(1, "mlp")].args[0] is inputs[(0, "mlp")]
    assert preds[(1, "attention")].args[0] is inputs[(0, "attention")]
    # scheduled ahead: before the previous layer's block computes
    sparse_mlp = [n for n in gm.graph.nodes  # OPT's with its layer norm (fuse_norm)
                  if n.target in (OPS.sparse_mlp.default, OPS.sparse_mlp_norm.default)]
    assert order[preds[(1, "mlp")]] < order[sparse_mlp[0]]
    head_proj = [n for n in gm.graph.nodes if n.target is OPS.sparse_head_proj.default]
    assert order[preds[(1, "attention")]] < order[head_proj[0]]
    assert ctx.counters.values == {**ctx.counters.values, "lookahead[mlp]": 1,
                                   "lookahead[attention]": 1}


@pytest.mark.parametrize("reorder", [False, True])
def test_inductor_keeps_the_predictors_ahead(tiny, tmp_path, reorder):
    """Inductor's code calls every predictor where the lookahead pass put it, ahead of the
    previous layer's sparse MLP. With ``reorder_for_locality`` on (Inductor's default, off in
    ``backend.inductor_patches`` unless the option asks), that post-grad pass moves the
    predictors of layer 1 back beside the ops that read them, after layer 0's sparse MLP."""
    from torch._inductor.utils import run_and_get_code

    model = tiny("llama")
    path, _ = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    compiled = torch.compile(model, backend="dejavu", options={
        "profile": str(path), "reorder_for_locality": reorder})
    with torch.no_grad():
        _, codes = run_and_get_code(_decode_logits, compiled, prompt(), 1)
    [code] = [c for c in codes if "dejavu.sparse_mlp" in c]
    calls = [line for line in code.splitlines() if "torch.ops.dejavu." in line
             and not line.strip().startswith(("#", "assert"))]
    predictors = [i for i, line in enumerate(calls) if "select_predictor" in line]
    mlps = [i for i, line in enumerate(calls) if "sparse_mlp" in line]
    assert len(predictors) == 4 and len(mlps) == 2, calls
    assert (max(predictors) < min(mlps)) == (not reorder), calls


def _lookahead_reference(model, tensors, ids):
    """Eager decoding with the predictors of a lookahead profile applied by hand, in order."""
    return _reference_logits(model, ids, lambda: _predictor_reference_hooks(
        model, tensors, 0.5, dense_first=False, lookahead=True))


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_lookahead_matches_sequential_reference(tiny, arch, tmp_path):
    model = tiny(arch)
    path, tensors = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    ids = prompt()
    with torch.no_grad():
        want = _lookahead_reference(model, tensors, ids)
        got = _decode_logits(torch.compile(model, backend="dejavu",
                                           options={"profile": str(path)}), ids)
    torch.testing.assert_close(got, want, **FP32)
    assert dejavu_compile.report(model).counters["lookahead[mlp]"] >= 1


def _side_stream_form(tiny, tmp_path, monkeypatch, **options):
    """A tiny Llama with a lookahead profile rewritten in the CUDA form (predict_ahead + joining
    consumer) on CPU, where the ops run in order; checks its logits against the sequential
    reference and returns its last rewritten graph and context."""
    from dejavu_compile.passes import lookahead

    monkeypatch.setattr(lookahead, "uses_side_stream", lambda x: True)
    model = tiny("llama")
    path, tensors = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    backend, graphs = _capture({"profile": str(path), **options})
    ids = prompt()
    with torch.no_grad():
        want = _lookahead_reference(model, tensors, ids)
        got = _decode_logits(torch.compile(model, backend=backend), ids)
    torch.testing.assert_close(got, want, **FP32)
    return graphs[-1]


def test_side_stream_form_joins_the_first_consumer(tiny, tmp_path, monkeypatch):
    """The CUDA form of the rewrite, built on CPU: same outputs as the sequential reference,
    keep and slot in place."""
    from dejavu_compile.passes import lookahead

    gm, ctx = _side_stream_form(tiny, tmp_path, monkeypatch)
    ahead = [n for n in gm.graph.nodes if lookahead.is_op(n, "predict_ahead")]
    assert len(ahead) == 2  # layer 1's MLP and attention predictors
    for node in ahead:
        kind = node.meta["dejavu"]["block"]
        ops = ("sparse_mlp", "sparse_mlp_norm") if kind == "mlp" else ("sparse_head_proj",)
        first = [u for u in node.users if any(lookahead.is_op(u, op) for op in ops)]
        # (an MLP with its RMS norm, fuse_rms_norm, takes them as keyword arguments)
        keep, slot = first[0].args[-2:] if not first[0].kwargs else (
            first[0].kwargs["keep"], first[0].kwargs["slot"])
        assert keep is ctx.inputs[(0, kind)] and slot == node.args[-1] >= 0


def test_graph_split_moves_the_side_stream_forks_it_crosses(tiny, tmp_path, monkeypatch):
    """The side-stream form with the step cut before layer 1: layer 1's predictors, forked in
    layer 0 and joined in layer 1, move to just after the cut and read it as ``after`` (so no
    graph holds a fork without its join); they still predict from layer 0's inputs, and the
    logits are the sequential reference's."""
    from dejavu_compile.passes import lookahead

    gm, ctx = _side_stream_form(tiny, tmp_path, monkeypatch, cudagraphs=True, graph_splits=(1,))
    assert ctx.counters.values.get("graph_split_fork_moved") == 2, ctx.counters.values
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    cut, = [n for n in gm.graph.nodes if lookahead.is_op(n, "graph_split")]
    for node in (n for n in gm.graph.nodes if lookahead.is_op(n, "predict_ahead")):
        kind = node.meta["dejavu"]["block"]
        assert node.args[0] is ctx.inputs[(0, kind)] and node.args[-1] is cut
        assert order[cut] < order[node] < min(order[u] for u in node.users)


def test_moved_forks_compile_with_the_graph_partition(tiny, tmp_path, monkeypatch):
    """The same through the whole backend on CPU: Inductor, with its graph partition on,
    compiles the moved forks, ``after`` and all, and the logits are the sequential reference's
    (on CPU the ops run in order whatever the schedule; tests/test_gpu.py checks the capture)."""
    from dejavu_compile.passes import lookahead

    monkeypatch.setattr(lookahead, "uses_side_stream", lambda x: True)
    model = tiny("llama")
    path, tensors = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    ids = prompt()
    with torch.no_grad():
        want = _lookahead_reference(model, tensors, ids)
        got = _decode_logits(torch.compile(model, backend="dejavu", options={
            "profile": str(path), "cudagraphs": True, "graph_splits": (1,)}), ids)
    torch.testing.assert_close(got, want, **FP32)
    decode = [g.counters for g in dejavu_compile.report(model).graphs if g.decode]
    assert decode and all(c.get("graph_split_fork_moved") == 2 for c in decode), decode


def test_lookahead_option_mismatch_is_refused(tiny, tmp_path):
    model = tiny("llama")
    same, _ = _random_predictor_profile(model, tmp_path)
    compiled = torch.compile(model, backend="dejavu",
                             options={"profile": str(same), "lookahead": True})
    # Dynamo wraps errors raised by a backend; the message is the profile error's
    with pytest.raises(Exception, match="layer 1 .*own input.*--lookahead"):
        _decode_logits(compiled, prompt(), steps=1)

    torch._dynamo.reset()
    ahead, _ = _random_predictor_profile(model, tmp_path / "ahead", lookahead=True)
    compiled = torch.compile(model, backend="dejavu",
                             options={"profile": str(ahead), "lookahead": False})
    with pytest.raises(Exception, match="layer 1 .*layer 0's input"):
        _decode_logits(compiled, prompt(), steps=1)


def test_first_layer_cannot_look_ahead(tiny, tmp_path):
    model = tiny("llama")
    path, _ = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    prof = load_profile(path)
    first = prof.layers[0]
    bad = LayerProfile(index=0, mlp=BlockProfile(**{**first.mlp.__dict__, "input": "previous"}))
    with pytest.raises(ProfileError, match="layer 0, mlp field 'input' is 'previous'"):
        Profile(model=prof.model, layers=(bad, *prof.layers[1:]),
                predictor_file=prof.predictor_file)


def test_fixed_selector_reads_first_units(tiny):
    model = tiny("llama")
    backend, graphs = _capture({"selector": "fixed", "mlp_density": 0.5, "attention_density": 0.5})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), prompt(), steps=1)
    gm, ctx = graphs[-1]
    mlp = [n for n in gm.graph.nodes
           if n.target in (OPS.sparse_mlp.default, OPS.sparse_mlp_norm.default)]
    ids = getattr(gm, mlp[0].args[1].target)
    assert ids.tolist() == [[list(range(48))]]
    assert not [n for n in gm.graph.nodes if n.target in (OPS.select_mlp_oracle.default,
                                                          OPS.select_predictor.default)]


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_folded_predictors_match_the_sequential_reference(tiny, arch, tmp_path, monkeypatch):
    """fold_predictors: each attention predictor's first layer is stacked with the K and V
    projections that read its input (one GEMV) and ranks with ``select_hidden``, inline; the
    MLP predictor of layer 1 (no dense projection reads its input) keeps the side stream. The
    outputs are the sequential reference's."""
    from dejavu_compile.passes import lookahead

    monkeypatch.setattr(lookahead, "uses_side_stream", lambda x: True)
    seen = []
    transform = dejavu_compile.backend.transform

    def recording(gm, example_inputs, options):
        ctx = transform(gm, example_inputs, options)
        seen.append((gm, ctx))
        return ctx

    monkeypatch.setattr(dejavu_compile.backend, "transform", recording)
    model = tiny(arch)
    path, tensors = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    ids = prompt()
    with torch.no_grad():
        want = _lookahead_reference(model, tensors, ids)
        got = _decode_logits(torch.compile(model, backend="dejavu", options={
            "profile": str(path), "fold_predictors": True}), ids)
    torch.testing.assert_close(got, want, **FP32)
    decode = [(gm, ctx) for gm, ctx in seen if ctx.discovery.tokens == 1]
    first, last = decode[0][1].counters.values, decode[-1][1].counters.values
    assert first["folded[attention]"] == last["folded[attention]"] == 2
    assert "folded[mlp]" not in last
    # after the in-place stacking, the recompiled graph reads predictor, K and V as one GEMV
    assert first.get("fuse_pending") == 6 and last.get("fused_linears") == 6
    gm = decode[-1][0]
    assert sum(lookahead.is_op(n, "select_hidden") for n in gm.graph.nodes) == 2
    assert sum(lookahead.is_op(n, "predict_ahead") for n in gm.graph.nodes) == 1


def test_fold_keeps_a_predictor_whose_bias_cannot_stack(tiny, tmp_path):
    """OPT's K and V projections have biases and these predictors have no first-layer bias:
    their stacked GEMV could not add one, so the predictors are not folded (and still run)."""
    model = tiny("opt")
    path, _ = _random_predictor_profile(model, tmp_path, dense_first=False, lookahead=True)
    backend, graphs = _capture({"profile": str(path), "fold_predictors": True})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), prompt(), steps=1)
    gm, ctx = graphs[-1]
    assert not any(key.startswith("folded") for key in ctx.counters.values)
    assert sum(n.target is OPS.select_predictor.default for n in gm.graph.nodes) == 4


def test_fold_needs_fused_linears():
    with pytest.raises(ValueError, match="fold_predictors' needs fuse_linears"):
        dejavu_compile.DejavuOptions(selector="oracle", mlp_density=0.5, fold_predictors=True,
                                     fuse_linears=False)


def test_waiting_tells_the_mlp_its_ids_came_from_a_predictor_ahead(monkeypatch):
    """The CUDA wrapper of a block's first sparse op joins the predictor's event ``slot`` and
    passes the ``workspace`` on; with ``tells_ahead`` it also says ``ahead=True`` when a slot
    is set (the ids were written a layer earlier), and nothing of it otherwise."""
    from dejavu_compile.kernels import lookahead

    joined, calls = [], []
    monkeypatch.setattr(lookahead, "join", lambda device, slot: joined.append(slot))

    def impl(*args, **kwargs):
        calls.append(kwargs)

    x, space = torch.zeros(2), torch.zeros(3)
    run, plain = lookahead.waiting(impl, 2, tells_ahead=True), lookahead.waiting(impl, 2)
    run(x, x)
    run(x, x, None, -1, space)
    run(x, x, None, 4)
    run(x, x, x, 5, space)
    run(x, x, slot=6, workspace=space)
    plain(x, x, None, 7, space)
    assert joined == [-1, -1, 4, 5, 6, 7]
    assert calls == [{}, {"workspace": space}, {"ahead": True},
                     {"workspace": space, "ahead": True}, {"workspace": space, "ahead": True},
                     {"workspace": space}]
