"""End to end through torch.compile(backend="dejavu") on tiny random models of every family."""

from __future__ import annotations

import operator

import pytest
import torch

import dejavu_compile
from dejavu_compile import DejavuOptions, transform

from .conftest import ARCHS, prompt

FP32 = dict(atol=1e-5, rtol=1e-5)


def _decode_logits(model, ids, steps: int = 3, on_decode=None):
    """Greedy decode: prefill, then ``steps`` single-token steps; the logits of each.
    ``on_decode()`` runs between prefill and the first step (to install hooks)."""
    out = model(ids, use_cache=True)
    if on_decode is not None:
        on_decode()
    logits, cache = [out.logits[:, -1]], out.past_key_values
    nxt = out.logits[:, -1:].argmax(-1)
    for _ in range(steps):
        out = model(nxt, past_key_values=cache, use_cache=True)
        logits.append(out.logits[:, -1])
        cache, nxt = out.past_key_values, out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


def _reference_logits(model, ids, install):
    """``_decode_logits`` of the eager model with the hooks ``install()`` returns in place for
    the decode steps (the masked reference a compiled model is compared with)."""
    handles = []
    try:
        return _decode_logits(model, ids, on_decode=lambda: handles.extend(install()))
    finally:
        for h in handles:
            h.remove()


def _capture(options: dict):
    """A backend that runs the dejavu passes and keeps each rewritten graph and context."""
    graphs = []

    def backend(gm, example_inputs):
        ctx = transform(gm, example_inputs, DejavuOptions.from_mapping(options))
        graphs.append((gm, ctx))
        return gm.forward

    return backend, graphs


_DEJAVU_TARGETS = {getattr(torch.ops.dejavu, name).default for name in (
    "sparse_mlp", "select_mlp_oracle", "select_heads_oracle", "select_predictor",
    "sparse_head_proj", "sparse_head_out")}


def _dejavu_nodes(gm) -> list[str]:
    return [n.target.name() for n in gm.graph.nodes
            if n.op == "call_function" and getattr(n.target, "namespace", None) == "dejavu"]


def assert_compiled_equals_eager(model, options: dict, ids=None) -> None:
    """Decode with the eager model, then with the dejavu-compiled one; the logits must agree."""
    ids = prompt() if ids is None else ids
    with torch.no_grad():
        want = _decode_logits(model, ids)
        got = _decode_logits(torch.compile(model, backend="dejavu", options=options), ids)
    torch.testing.assert_close(got, want, **FP32)


@pytest.mark.parametrize("arch", ARCHS)
def test_density_one_equals_eager(tiny, arch):
    model = tiny(arch)
    assert_compiled_equals_eager(
        model, {"selector": "oracle", "mlp_density": 1.0, "attention_density": 1.0})
    rep = dejavu_compile.report(model)
    assert [r.layer for r in rep.layers] == [0, 1]
    assert all(r.mlp.selector == "oracle" and r.attention.selector == "oracle" for r in rep.layers)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("granularity", ["head", "group"])
def test_graph_holds_expected_ops(tiny, arch, granularity):
    model = tiny(arch)
    backend, graphs = _capture({"selector": "oracle", "mlp_density": 0.5, "attention_density": 0.5,
                                "attention_granularity": granularity, "relayout": "copy"})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), prompt(), steps=1)
    (prefill_gm, prefill_ctx), (gm, ctx) = graphs
    assert _dejavu_nodes(prefill_gm) == [] and prefill_ctx.discovery.tokens == 7
    assert ctx.discovery.tokens == 1
    names = _dejavu_nodes(gm)
    layers = model.config.num_hidden_layers
    # the norms after the sparse ops fuse into them (option fuse_norm, on by default): OPT's
    # layer norms, and the RMS norms of Llama, Mistral and Qwen2 (fuse_rms_norm, following
    # fuse_norm); Gemma's do not (its norm reads the op's output before the residual add)
    fused = 0 if arch == "gemma3" else layers
    assert names.count("dejavu::sparse_mlp") == layers - fused
    assert names.count("dejavu::sparse_mlp_norm") == fused
    assert names.count("dejavu::select_mlp_oracle") == layers
    assert names.count("dejavu::sparse_head_out") == layers - fused
    assert names.count("dejavu::sparse_head_out_norm") == fused
    assert names.count("dejavu::select_heads_oracle") == layers
    assert ctx.counters.values["relayout"] == 2 * layers
    assert not any(n.target is torch.ops.aten.t.default for n in gm.graph.nodes)
    block = ctx.discovery.attention[0]
    assert block.num_heads == model.config.num_attention_heads
    assert block.num_kv_heads == getattr(model.config, "num_key_value_heads", block.num_heads)
    plan = ctx.plan[(0, "attention")]
    assert plan.k * plan.group == (2 if granularity == "head" or block.num_kv_heads > 1 else 4)
    for node in gm.graph.nodes:
        if node.op == "get_attr" or node.target in _DEJAVU_TARGETS:
            assert isinstance(node.meta["val"], torch.Tensor), node


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_in_place_relayout_keeps_no_second_copy(tiny, arch):
    """The default re-layout swaps each down / output projection for the transposed view of its
    [in, out] copy after the first decode call; Dynamo recompiles once, the new graph reads the
    parameters as they are (no copy), and the outputs still match eager decoding."""
    model = tiny(arch)
    layers = model.config.num_hidden_layers
    before = {n: p.data_ptr() for n, p in model.named_parameters()}
    captured = []

    def backend(gm, example_inputs):
        compiled = dejavu_compile.backend.dejavu_backend(
            gm, example_inputs, options={"selector": "oracle", "mlp_density": 0.5,
                                         "attention_density": 0.5})
        captured.append(dejavu_compile.backend._REPORTS[-1].counters)
        return compiled

    with torch.no_grad():
        want = _decode_logits(model, prompt())
    swapped = [n for n, p in model.named_parameters() if not p.is_contiguous()]
    assert swapped == []
    compiled = torch.compile(model, backend=backend)
    with torch.no_grad():
        got = _decode_logits(compiled, prompt(), steps=3)
    swapped = sorted(n for n, p in model.named_parameters() if not p.is_contiguous())
    assert len(swapped) == 2 * layers
    assert all(n.endswith(("fc2.weight", "out_proj.weight", "down_proj.weight", "o_proj.weight"))
               for n in swapped), swapped
    params = dict(model.named_parameters())
    for name in swapped:
        assert params[name].t().is_contiguous() and params[name].data_ptr() != before[name]
    # first decode graph: asked for the swap; the recompiled one found it done
    decode = [c for c in captured if c.get("relayout_pending") or c.get("relayout_in_place")]
    assert decode[0].get("relayout_pending") == 2 * layers
    assert decode[-1].get("relayout_in_place") == 2 * layers
    assert not any(c.get("relayout") for c in captured)
    # Q, K and V (dense: the oracle selects heads at the output) are one linear on one storage
    assert decode[0].get("fuse_pending") == 3 * layers and not decode[0].get("fused_linears")
    assert decode[-1].get("fused_linears") == 3 * layers
    storages = {}
    for name, p in model.named_parameters():
        storages.setdefault(p.untyped_storage().data_ptr(), []).append(name.rsplit(".", 2)[-2:])
    shared = sorted(sorted(v) for v in storages.values() if len(v) > 1)
    kinds = ["weight", "bias"] if arch == "opt" else ["weight"]
    assert shared == sorted([[p, kind] for p in ("k_proj", "q_proj", "v_proj")]
                            for kind in kinds for _ in range(layers))
    # the eager model reads the same re-laid-out parameters
    with torch.no_grad():
        again = _decode_logits(model, prompt())
    torch.testing.assert_close(again, want, **FP32)
    with torch.no_grad():
        masked = _reference_logits(model, prompt(), lambda: _masked_reference(model, 0.5, 0.5))
    torch.testing.assert_close(got, masked, **FP32)


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_original_out_layout_leaves_the_output_projections_in_place(tiny, arch, monkeypatch):
    """``out_layout="original"``: the attention output projections that sparse ops read keep
    their ``[d_out, H * head_dim]`` parameters (the op reads the ``aten.t`` view, which the
    CUDA launcher sends to the column-reading kernel), the MLP's down projections are still
    re-laid out, and the logits are those of the transposed layout. ``"auto"`` (the default)
    keeps the transposed layout on CPU; on CUDA it would keep the original at head densities
    0.25 and 0.5 (1 and 2 heads of 4, within ``ORIGINAL_LAYOUT_MAX_DENSITY``), and not at 0.5
    under a limit of 0.25, as the lower pass decides it for these graphs."""
    from dejavu_compile.passes import lower

    layers = tiny(arch).config.num_hidden_layers

    def run(layout: str, density: float):
        model = tiny(arch)  # the same seeded weights each time
        captured = []

        def backend(gm, example_inputs):
            compiled = dejavu_compile.backend.dejavu_backend(
                gm, example_inputs, options={"selector": "fixed", "mlp_density": 0.5,
                                             "attention_density": density,
                                             "out_layout": layout})
            captured.append(dejavu_compile.backend._REPORTS[-1].counters)
            return compiled

        with torch.no_grad():
            logits = _decode_logits(torch.compile(model, backend=backend), prompt(), steps=3)
        swapped = sorted(n.rsplit(".", 2)[-2] for n, p in model.named_parameters()
                         if not p.is_contiguous())
        kept = max(c.get("out_layout_original", 0) for c in captured)
        return logits, swapped, kept

    decided = []  # what "auto" decides for these graphs' weights were they on CUDA
    real = lower._keeps_original

    def keeps(t_node, shape, cuda, layout):
        if layout == "auto" and all(lower.is_op(u, "sparse_head_out") for u in t_node.users):
            decided.append(real(t_node, shape, True, layout))
        return real(t_node, shape, cuda, layout)

    down = "fc2" if arch == "opt" else "down_proj"
    out = "out_proj" if arch == "opt" else "o_proj"
    monkeypatch.setattr(lower, "_keeps_original", keeps)
    want, swapped, kept = run("transposed", 0.5)
    assert swapped == sorted([down, out] * layers) and kept == 0
    for layout in ("original", "auto"):
        got, swapped, kept = run(layout, 0.5)
        torch.testing.assert_close(got, want, **FP32)
        original = layout == "original"  # on CPU, "auto" is the transposed layout
        assert swapped == (sorted([down] * layers) if original
                           else sorted([down, out] * layers)), layout
        assert kept == (layers if original else 0), layout
    assert decided and set(decided) == {True}, decided
    # what "auto" would decide on CUDA at other densities and limits (the runs above cover
    # the layouts themselves: each of these compiles the model once more)
    for density, limit, auto_keeps in ((0.25, None, True), (0.5, 0.25, False)):
        if limit is not None:
            monkeypatch.setattr(lower, "ORIGINAL_LAYOUT_MAX_DENSITY", limit)
        decided.clear()
        _, swapped, kept = run("auto", density)
        assert swapped == sorted([down, out] * layers) and kept == 0, density
        assert decided and set(decided) == {auto_keeps}, (density, decided)
    with pytest.raises(ValueError, match="out_layout"):
        dejavu_compile.config.DejavuOptions(out_layout="rows")


def test_original_out_layout_reads_a_weight_already_re_laid_out_as_it_is(tiny):
    """A model compiled with the transposed layout (its output projections re-laid out in
    place), then with ``out_layout="original"``: the second compilation reads the re-laid-out
    weights as they are (``relayout_in_place``, not ``out_layout_original``, which would
    claim the column-reading kernel) and decodes the same logits."""
    model = tiny("opt")
    layers = model.config.num_hidden_layers
    options = {"selector": "fixed", "mlp_density": 0.5, "attention_density": 0.5}
    logits, counters = [], []
    for layout in ("transposed", "original"):
        torch._dynamo.reset()
        captured = []

        def backend(gm, example_inputs, layout=layout, captured=captured):
            compiled = dejavu_compile.backend.dejavu_backend(
                gm, example_inputs, options={**options, "out_layout": layout})
            captured.append(dejavu_compile.backend._REPORTS[-1].counters)
            return compiled

        with torch.no_grad():
            logits.append(_decode_logits(torch.compile(model, backend=backend), prompt(),
                                         steps=2))
        counters.append(captured)
    assert not any(c.get("out_layout_original") for c in counters[1])
    assert max(c.get("relayout_in_place", 0) for c in counters[1]) == 2 * layers
    torch.testing.assert_close(logits[1], logits[0], **FP32)


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_dense_gemv_takes_the_blocks_one_row_projections(tiny, arch):
    """With ``dense_gemv``, each decode graph's dense block projections (Q, K and V, stacked
    once the recompiled graph finds them so, and the output projection) become
    ``dejavu::gemv``; the prefill's many rows and the language-model head stay linears; the
    logits are those of the same compilation without it. Left None (the default), it holds
    on CUDA only: on CPU the graphs keep their linears."""
    def run(dense_gemv: bool | None):
        torch._dynamo.reset()
        model = tiny(arch)
        captured = []

        def backend(gm, example_inputs):
            compiled = dejavu_compile.backend.dejavu_backend(
                gm, example_inputs, options={"selector": "oracle", "mlp_density": 0.5,
                                             "dense_gemv": dense_gemv})
            targets = [n.target for n in gm.graph.nodes if n.op == "call_function"]
            captured.append((dejavu_compile.backend._REPORTS[-1].counters, targets))
            return compiled

        with torch.no_grad():
            logits = _decode_logits(torch.compile(model, backend=backend), prompt(), steps=3)
        return model, logits, captured

    model, got, captured = run(True)
    _, want, plain = run(False)
    _, default, on_cpu = run(None)
    torch.testing.assert_close(got, want, **FP32)
    torch.testing.assert_close(default, want, **FP32)
    assert [t for _, t in on_cpu] == [t for _, t in plain]
    assert all(not c.get("dense_gemv") for c, _ in on_cpu)
    layers = model.config.num_hidden_layers
    gemv = torch.ops.dejavu.gemv.default
    counts = [c.get("dense_gemv", 0) for c, _ in captured]
    # prefill: none; first decode graph: Q, K, V and O apart; the recompiled one: QKV and O
    assert counts[0] == 0 and counts[1] == 4 * layers and counts[-1] == 2 * layers, counts
    for (counters, targets), (_, plain_targets) in zip(captured, plain, strict=True):
        assert targets.count(gemv) == counters.get("dense_gemv", 0)
        linears = [t for t in targets if t in (torch._C._nn.linear, torch.ops.aten.linear.default)]
        assert len(linears) + targets.count(gemv) == len(
            [t for t in plain_targets if t in (torch._C._nn.linear, torch.ops.aten.linear.default)])
    assert all(not c.get("dense_gemv") for c, _ in plain)
    assert sum(t.count(gemv) == 0 for _, t in captured[1:]) == 0  # every decode graph has some


def _static_decode_logits(model, ids, steps: int = 3, length: int | None = None):
    """``_decode_logits`` with a static cache (of ``length`` positions, by default the prompt,
    the steps and one more) and an all-ones mask over it (the CUDA-graph decode path of
    ``dejavu bench``): the decode steps' SDPA gets a boolean key mask."""
    from transformers import StaticCache

    length = length or ids.shape[1] + steps + 1
    cache = StaticCache(config=model.config, max_cache_len=length)
    mask = torch.ones(ids.shape[0], length, dtype=torch.long)
    out = model(ids, past_key_values=cache, cache_position=torch.arange(ids.shape[1]),
                use_cache=True)
    logits, nxt = [out.logits[:, -1]], out.logits[:, -1:].argmax(-1)
    for i in range(steps):
        pos = torch.tensor([ids.shape[1] + i])
        out = model(nxt, past_key_values=cache, cache_position=pos, position_ids=pos[None],
                    attention_mask=mask, use_cache=True)
        logits.append(out.logits[:, -1])
        nxt = out.logits[:, -1:].argmax(-1)
    return torch.stack(logits, 1)


@pytest.mark.parametrize("arch", ARCHS)
@pytest.mark.parametrize("static", [False, True], ids=["dynamic_cache", "static_cache"])
def test_decode_attention_takes_the_decode_steps_sdpa(tiny, arch, static):
    """With ``decode_attention="always"`` every decode graph's SDPA calls become
    ``dejavu::decode_attention`` on the keys and values from before ``repeat_kv`` (the graph
    reads no repeated copy), with the boolean key mask the step has (always one with a static
    cache), as [B, L]; the
    prefill keeps SDPA; the logits are those of SDPA. The default (``"cuda"``) leaves a CPU
    graph's SDPA alone (checked once). Inductor compiles Llama's graphs with the op (each
    cache); the other architectures' run eagerly, as the reference does (with Inductor on
    all, the ten cases took 3 minutes of the suite; alone, Llama's dynamic-cache case took
    18.6 s with it, the eager cases 8.8-12.7 s)."""
    from dejavu_compile.passes.context import fake_value
    from dejavu_compile.passes.discover import SDPA_TARGETS

    def run(where: str):
        torch._dynamo.reset()
        model = tiny(arch)
        captured = []

        def backend(gm, example_inputs):
            options = {"selector": "oracle", "mlp_density": 0.5}
            if where is not None:
                options["decode_attention"] = where
            if where != "always" or arch != "llama":  # the reference and the default's
                options["inner"] = "eager"  # check, and all but Llama: no Inductor
            compiled = dejavu_compile.backend.dejavu_backend(gm, example_inputs, options=options)
            calls = [n for n in gm.graph.nodes if n.op == "call_function"]
            captured.append((dejavu_compile.backend._REPORTS[-1].counters, calls))
            return compiled

        decode = _static_decode_logits if static else _decode_logits
        with torch.no_grad():
            logits = decode(torch.compile(model, backend=backend), prompt(), steps=3)
        return model, logits, captured

    model, got, captured = run("always")
    _, want, _ = run("never")
    torch.testing.assert_close(got, want, **FP32)
    layers = model.config.num_hidden_layers
    kv_heads = getattr(model.config, "num_key_value_heads", model.config.num_attention_heads)
    op = torch.ops.dejavu.decode_attention.default
    counts = [c.get("decode_attention", 0) for c, _ in captured]
    assert counts[0] == 0 and all(n == layers for n in counts[1:]), counts
    for _, calls in captured[1:]:
        assert not [n for n in calls if n.target in SDPA_TARGETS]
        attention = [n for n in calls if n.target is op]
        assert len(attention) == layers
        for node in attention:  # keys and values as cached: KV heads, not query heads
            _, k, v, _, mask, counters = (fake_value(a) if isinstance(a, torch.fx.Node) else a
                                          for a in node.args)
            assert counters is None  # on CUDA only
            assert k.shape[1] == v.shape[1] == kv_heads and k.shape[3] == v.shape[3]
            assert mask is None or (mask.dtype == torch.bool and mask.dim() == 2)
            if static:
                assert mask is not None
        assert not [n for n in calls if n.op == "call_method" and n.target == "expand"
                    and fake_value(n).dim() == 5]  # repeat_kv's expand is gone
    if arch == "llama" and not static:
        _, _, default = run(None)
        assert all(not c.get("decode_attention") for c, _ in default)


@pytest.mark.parametrize("arch,selector,density,why", [
    ("opt", "fixed", 0.5, None),  # 2 of 4 heads, one per KV head
    ("llama", "fixed", 0.25, None),  # 1 of 4 heads, groups of 2: one KV head read
    ("llama", "fixed", 0.5, None),  # 2 of 4 heads, both KV heads read once
    ("opt", "oracle", 0.5, "attention output read by more than its output projection"),
])
def test_decode_attention_computes_the_selected_heads_only(tiny, arch, selector, density, why):
    """Option ``decode_selected_heads``: each decode step's ``dejavu::decode_attention`` gets
    the ids its output projection reads, and the logits are those of the step that computes
    every head; where it cannot (the oracle's selection, which reads the attention's output to
    pick the heads) the call is left as it is and the report says why."""
    from dejavu_compile.passes.context import is_op

    def run(selected: bool):
        torch._dynamo.reset()
        seen = []

        def backend(gm, example_inputs):
            out = dejavu_compile.backend.dejavu_backend(
                gm, example_inputs, options={
                    "selector": selector, "mlp_density": 0.5, "attention_density": density,
                    "decode_attention": "always", "decode_selected_heads": selected,
                    "inner": "eager"})
            seen.append((dict(dejavu_compile.backend._REPORTS[-1].counters),
                         [n for n in gm.graph.nodes if is_op(n, "decode_attention")]))
            return out

        with torch.no_grad():
            logits = _static_decode_logits(torch.compile(tiny(arch), backend=backend), prompt(),
                                           steps=3)
        return logits, seen

    got, seen = run(True)
    want, _ = run(False)
    torch.testing.assert_close(got, want, **FP32)
    counters, calls = seen[-1]
    layers = 2
    assert len(calls) == layers
    if why is None:
        assert counters.get("decode_selected_heads") == layers, counters
        assert all(len(n.args) == 7 and isinstance(n.args[6], torch.fx.Node) for n in calls)
    else:
        assert counters.get(f"decode_selected_heads_skipped[{why}]") == layers, counters
        assert not counters.get("decode_selected_heads")
        assert all(len(n.args) == 6 for n in calls)


@pytest.mark.parametrize("cache", ["short", "long", "dynamic"])
def test_decode_selected_heads_by_default_from_a_long_cache(tiny, cache):
    """Option ``decode_selected_heads`` left None: a decode attention computes the selected
    heads only where its static cache holds at least ``SELECTED_HEADS_MIN_POSITIONS``
    positions, with the logits of the step that computes every head; a shorter cache, or one
    whose length varies between steps, keeps every head and the report says which."""
    from dejavu_compile.config import SELECTED_HEADS_MIN_POSITIONS as least

    def run(selected):
        torch._dynamo.reset()
        counters = []

        def backend(gm, example_inputs):
            given = {} if selected is None else {"decode_selected_heads": selected}
            out = dejavu_compile.backend.dejavu_backend(
                gm, example_inputs, options={
                    "selector": "fixed", "mlp_density": 0.5, "attention_density": 0.5,
                    "decode_attention": "always", "inner": "eager", **given})
            counters.append(dict(dejavu_compile.backend._REPORTS[-1].counters))
            return out

        model = torch.compile(tiny("opt"), backend=backend)
        with torch.no_grad():
            if cache == "dynamic":
                logits = _decode_logits(model, prompt(), steps=4)
            else:
                logits = _static_decode_logits(model, prompt(), steps=3,
                                               length=least - (cache == "short"))
        return logits, counters

    got, counters = run(None)
    torch.testing.assert_close(got, run(False)[0], **FP32)
    decodes = [c for c in counters if c.get("decode_attention")]
    assert decodes, counters
    layers = 2
    if cache == "long":
        assert decodes[-1].get("decode_selected_heads") == layers, decodes
        return
    assert not any(c.get("decode_selected_heads") for c in counters), counters
    short = f"decode_selected_heads_skipped[a K/V cache under {least} positions]"
    assert decodes[0].get(short) == layers, decodes
    if cache == "dynamic":  # recompiled for a length that varies
        varies = "decode_selected_heads_skipped[a K/V cache length that varies]"
        assert decodes[-1].get(varies) == layers, decodes


class _Attend(torch.nn.Module):
    """One SDPA call on its inputs, as a decode step makes it (keys repeated per query head)."""

    def forward(self, q, k, v, mask, causal: bool = False, dropout: float = 0.0,
                gqa: bool = False):
        if gqa:  # SDPA repeats the KV heads itself (what Hugging Face asks for without a mask)
            return torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout, enable_gqa=True)
        group = q.shape[1] // k.shape[1]
        b, kvh, length, d = k.shape
        k = k[:, :, None].expand(b, kvh, group, length, d).reshape(b, kvh * group, length, d)
        v = v[:, :, None].expand(b, kvh, group, length, d).reshape(b, kvh * group, length, d)
        return torch.nn.functional.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=causal, dropout_p=dropout)


@pytest.mark.parametrize("case", ["bool", "shared", "none", "gqa", "float", "per_head", "causal",
                                  "dropout", "prefill"])
def test_decode_attention_covers_what_it_computes_alike(case):
    """``decode_attention`` rewrites a one-query SDPA with a boolean key mask shared by the
    heads ([B or 1, 1, 1, L]) or none, on repeated KV heads or with ``enable_gqa``, and gives
    SDPA's result; a float or per-head mask, a
    causal flag, dropout or several queries keep SDPA."""
    torch.manual_seed(0)
    b, heads, kvh, length, d = 2, 4, 2, 9, 8
    q = torch.randn(b, heads, 5 if case == "prefill" else 1, d)
    k, v = torch.randn(b, kvh, length, d), torch.randn(b, kvh, length, d)
    keys = torch.rand(b, length) > 0.3
    keys[:, 0] = True
    mask = {"bool": keys[:, None, None], "shared": keys[:1, None, None], "none": None,
            "float": torch.where(keys, 0.0, -1e4)[:, None, None],
            "per_head": keys[:, None, None].expand(b, heads, 1, length).clone(),
            "causal": None, "dropout": None, "prefill": keys[:, None, None], "gqa": None}[case]
    extra = {"causal": case == "causal", "dropout": 0.5 if case == "dropout" else 0.0,
             "gqa": case == "gqa"}
    counters = []

    def backend(gm, example_inputs):
        out = dejavu_compile.backend.dejavu_backend(
            gm, example_inputs, options={"selector": "oracle", "mlp_density": 0.5,
                                         "decode_attention": "always", "inner": "eager"})
        counters.append(dejavu_compile.backend._REPORTS[-1].counters)
        return out

    got = torch.compile(_Attend(), backend=backend, fullgraph=True)(q, k, v, mask, **extra)
    rewritten = case in ("bool", "shared", "none", "gqa")
    assert counters[-1].get("decode_attention", 0) == (1 if rewritten else 0), counters
    if case != "dropout":
        torch.testing.assert_close(got, _Attend()(q, k, v, mask, **extra), **FP32)


class _ScaledAttend(torch.nn.Module):
    """OPT's form of a decode step's attention: the query scaled by a constant, viewed per head
    and transposed, then SDPA with ``scale=1.0`` (``keep`` also returns the scaled query)."""

    def forward(self, x, k, v, mask, factor, keep: bool = False):
        scaled = x * factor
        q = scaled.view(x.shape[0], -1, k.shape[1], k.shape[3]).transpose(1, 2)
        out = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                                               scale=1.0)
        return (out, scaled) if keep else out


@pytest.mark.parametrize("case", ["float", "int", "kept", "tensor"])
def test_decode_attention_takes_a_constant_query_scale_into_its_own(case):
    """A query multiplied by a Python number before a rewritten SDPA (OPT's ``q_proj(x) *
    scaling``): the multiply leaves the graph and the kernel gets the product of the scales,
    one pointwise launch a layer less, the same result. A scaled query that something else
    also reads, or a factor that is a tensor, stays as it is."""
    torch.manual_seed(0)
    b, heads, length, d = 2, 4, 9, 8
    x = torch.randn(b, 1, heads * d)
    k, v = torch.randn(b, heads, length, d), torch.randn(b, heads, length, d)
    mask = (torch.rand(b, length) > 0.3)[:, None, None]
    mask[..., 0] = True
    factor = {"float": d ** -0.5, "int": 2, "kept": d ** -0.5,
              "tensor": torch.tensor(d ** -0.5)}[case]
    keep = case == "kept"
    seen = []

    def backend(gm, example_inputs):
        out = dejavu_compile.backend.dejavu_backend(
            gm, example_inputs, options={"selector": "oracle", "mlp_density": 0.5,
                                         "decode_attention": "always", "inner": "eager"})
        seen.append((dejavu_compile.backend._REPORTS[-1].counters,
                     [n for n in gm.graph.nodes if n.op == "call_function"]))
        return out

    got = torch.compile(_ScaledAttend(), backend=backend, fullgraph=True)(x, k, v, mask, factor,
                                                                           keep)
    torch.testing.assert_close(got, _ScaledAttend()(x, k, v, mask, factor, keep), **FP32)
    counters, calls = seen[-1]
    assert counters.get("decode_attention") == 1
    folded = case in ("float", "int")
    assert counters.get("decode_attention_scale_folded", 0) == int(folded)
    (attention,) = [n for n in calls if n.target is torch.ops.dejavu.decode_attention.default]
    assert attention.args[3] == pytest.approx(factor if folded else 1.0)
    assert any(n.target is operator.mul for n in calls) != folded


def test_compile_leaves_room_for_the_relayout_recompiles(tiny):
    """Past Dynamo's recompile limit a frame runs uncompiled (dense): the API raises the limit,
    which the in-place re-layout's one recompile per graph and evaluation twins need."""
    with torch._dynamo.config.patch(recompile_limit=8):
        dejavu_compile.compile(tiny("llama"), selector="oracle", mlp_density=0.5)
        assert torch._dynamo.config.recompile_limit == dejavu_compile.backend.RECOMPILE_LIMIT
    assert torch._dynamo.config.recompile_limit >= 8  # restored, and still readable


def test_release_tells_dynamo_and_refuses_a_stale_graph():
    """The in-place re-layout rebuilds each dict holding a changed parameter (new version tag,
    same items and order), and a pre-re-layout graph called a second time raises."""
    from dejavu_compile.passes import lower
    from torch._dynamo.guards import dict_version

    lin = torch.nn.Linear(4, 3)
    held, order = lin._parameters, list(lin._parameters)
    other = {"w": lin.weight}  # any other dict holding the parameter
    before, other_before = dict_version(held), dict_version(other)
    lower._touch_holders([lin.weight])
    assert dict_version(held) != before and dict_version(other) != other_before
    # the module holds a new _parameters dict, with the same items in the same order
    assert lin._parameters is not held and list(lin._parameters) == order
    assert lin._parameters["weight"] is lin.weight and other["w"] is lin.weight
    run = dejavu_compile.backend._release_after(lambda *args: sum(args))
    assert run(1, 2) == 3
    with pytest.raises(RuntimeError, match="did not recompile"):
        run(1, 2)


def _masked_reference(model, mlp_density: float, head_density: float):
    """Hooks on the eager model that keep only the oracle's top-k of each token: MLP
    neurons by |hidden activation| at the down projection's input, heads by the norm of their
    output-projection contribution. Returns the hook handles."""
    heads = model.config.num_attention_heads

    def mlp_hook(mod, args):
        (h,) = args
        k = max(1, round(mlp_density * h.shape[-1]))
        top = h.abs().topk(k, dim=-1).indices
        return (h * torch.zeros_like(h).scatter_(-1, top, 1.0),)

    def head_hook(mod, args):
        (a,) = args
        hd = a.shape[-1] // heads
        contrib = torch.einsum("bthe,heo->btho", a.unflatten(-1, (heads, hd)),
                               mod.weight.t().reshape(heads, hd, -1))
        k = max(1, round(head_density * heads))
        top = contrib.pow(2).sum(-1).topk(k, dim=-1).indices
        mask = a.new_zeros(*a.shape[:-1], heads).scatter_(-1, top, 1.0)
        return (a * mask.repeat_interleave(hd, dim=-1),)

    handles = []
    for name, mod in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if leaf in ("down_proj", "fc2"):
            handles.append(mod.register_forward_pre_hook(mlp_hook))
        elif leaf in ("o_proj", "out_proj"):
            handles.append(mod.register_forward_pre_hook(head_hook))
    return handles


def oracle_against_masked_reference(model, ids, options: dict | None = None):
    """(dejavu's decode logits, the masked eager model's, the dense eager model's) of
    ``model`` on ``ids``, oracle selection at MLP density 0.4 and head density 0.5;
    ``options`` added to the backend's."""
    with torch.no_grad():
        dense = _decode_logits(model, ids)
        want = _reference_logits(model, ids, lambda: _masked_reference(
            model, mlp_density=0.4, head_density=0.5))
        compiled = torch.compile(model, backend="dejavu", options={
            "selector": "oracle", "mlp_density": 0.4, "attention_density": 0.5,
            **(options or {})})
        got = _decode_logits(compiled, ids)
    return got, want, dense


@pytest.mark.parametrize("arch", ARCHS)
def test_oracle_matches_masked_reference(tiny, arch):
    # the reference masks each row by its own selection
    got, want, dense = oracle_against_masked_reference(tiny(arch), prompt(batch=2),
                                                       {"batch_selection": "row"})
    torch.testing.assert_close(got, want, **FP32)
    assert not torch.allclose(got, dense, atol=1e-3), "sparsity had no effect"


@pytest.mark.parametrize("arch", ["llama", "gemma3"])
def test_gate_selector_matches_masked_reference(tiny, arch):
    """selector 'gate': top-k neurons by |act(gate)|, then only their up/down rows."""
    model = tiny(arch)
    ids = prompt()
    k = round(0.5 * model.config.intermediate_size)

    def hooks():
        handles = []
        for layer in model.model.layers:
            mlp, seen = layer.mlp, {}

            def gate_out(mod, args, out, seen=seen):
                seen["g"] = out

            def mask(mod, args, seen=seen, mlp=mlp):
                act = mlp.act_fn(seen["g"])
                top = torch.zeros_like(act).scatter_(-1, act.abs().topk(k, -1).indices, 1.0)
                return (args[0] * top,)

            handles += [mlp.gate_proj.register_forward_hook(gate_out),
                        mlp.down_proj.register_forward_pre_hook(mask)]
        return handles

    with torch.no_grad():
        want = _reference_logits(model, ids, hooks)
        got = _decode_logits(torch.compile(model, backend="dejavu", options={
            "selector": "gate", "mlp_density": 0.5}), ids)
    torch.testing.assert_close(got, want, **FP32)
    rep = dejavu_compile.report(model)
    row = rep.layers[1].mlp
    assert row.selector == "gate" and row.k == k
    # the gate is read densely, up and down at the kept fraction
    third = row.dense_bytes // 3
    assert row.selector_bytes == third and abs(row.sparse_bytes - third) <= 1


def test_gate_selector_needs_a_gated_mlp(tiny):
    model = tiny("opt")
    with torch.no_grad(), pytest.raises(Exception, match="needs a gated MLP"):
        _decode_logits(torch.compile(model, backend="dejavu", options={
            "selector": "gate", "mlp_density": 0.5}), prompt(), steps=1)


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_threshold_selector_matches_masked_reference(tiny, arch):
    """selector 'threshold' (TEAL): every MLP projection keeps its largest-magnitude inputs."""
    model = tiny(arch)
    ids = prompt()

    def keep_top(t, k):
        return t * torch.zeros_like(t).scatter_(-1, t.abs().topk(k, -1).indices, 1.0)

    def hooks():
        handles = []
        for layer in (model.model.layers if arch != "opt" else model.model.decoder.layers):
            if arch == "opt":
                firsts, down = [layer.fc1], layer.fc2
            else:
                firsts, down = [layer.mlp.gate_proj, layer.mlp.up_proj], layer.mlp.down_proj
            for lin in firsts:
                handles.append(lin.register_forward_pre_hook(
                    lambda mod, args: (keep_top(args[0], round(0.5 * args[0].shape[-1])),)))
            handles.append(down.register_forward_pre_hook(
                lambda mod, args: (keep_top(args[0], round(0.5 * args[0].shape[-1])),)))
        return handles

    with torch.no_grad():
        want = _reference_logits(model, ids, hooks)
        got = _decode_logits(torch.compile(model, backend="dejavu", options={
            "selector": "threshold", "mlp_density": 0.5}), ids)
    torch.testing.assert_close(got, want, **FP32)
    row = dejavu_compile.report(model).layers[1].mlp
    assert row.selector == "threshold" and row.selector_bytes == 0
    assert 0.45 * row.dense_bytes < row.sparse_bytes < 0.55 * row.dense_bytes


def test_readme_lists_every_option_with_its_default():
    """The README's options table names every field of ``DejavuOptions`` (one definition for
    API and CLI) with the default the code has."""
    import dataclasses
    import re
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    table = text[text.index("Options (`dejavu_compile.DejavuOptions`"):]
    table = table[:table.index("\n## ")]
    rows = {}
    for line in table.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) >= 3 and cells[0].startswith("`"):
            for name in re.findall(r"`(\w+)`", cells[0]):
                rows[name] = cells[1]
    for f in dataclasses.fields(DejavuOptions):
        if f.name == "version":
            continue
        assert f.name in rows, f"README's options table lacks {f.name!r}"
        want = "none" if f.default is None else f"`{f.default}`"
        assert rows[f.name].startswith(want), (f.name, rows[f.name], f.default)


def test_graph_splits_cut_the_step_before_the_layers_asked():
    """``graph_splits`` takes layer numbers from 1 and Inductor; it partitions Inductor's graph
    only with ``cudagraphs`` (without, ``CapturedStep`` makes the cuts)."""
    base = {"selector": "oracle", "mlp_density": 0.5}
    with pytest.raises(ValueError, match="graph_splits' needs inner='inductor'"):
        DejavuOptions.from_mapping({**base, "inner": "eager", "graph_splits": (2,)})
    plain = DejavuOptions.from_mapping({**base, "graph_splits": (2,)})
    assert "graph_partition" not in dejavu_compile.backend.inductor_patches(plain)
    for bad in ((0,), (1.5,), "3", (True,)):
        with pytest.raises(ValueError, match="graph_splits"):
            DejavuOptions.from_mapping({**base, "cudagraphs": True, "graph_splits": bad})
    opts = DejavuOptions.from_mapping({**base, "cudagraphs": True, "graph_splits": [3, 1, 3]})
    assert opts.graph_splits == (1, 3)
    assert dejavu_compile.backend.inductor_patches(opts)["graph_partition"] is True


def test_multi_kernel_option_reaches_inductor():
    """``multi_kernel`` sets Inductor's ``triton.multi_kernel`` for the rewritten graph (on CPU
    Inductor's C++ code has no use for it); off, the key is not set at all."""
    base = {"selector": "oracle", "mlp_density": 0.5}
    assert "triton.multi_kernel" not in dejavu_compile.backend.inductor_patches(
        DejavuOptions.from_mapping(base))
    opts = DejavuOptions.from_mapping({**base, "multi_kernel": True})
    assert dejavu_compile.backend.inductor_patches(opts)["triton.multi_kernel"] == 1
    with pytest.raises(TypeError, match="multi_kernel"):
        DejavuOptions.from_mapping({**base, "multi_kernel": 1})


@pytest.mark.parametrize("selector", ["fixed", "oracle"])
def test_attention_output_projection_is_marked_early_unless_its_ids_are_fresh(tiny, selector):
    """The sparsify pass marks an attention's output projection ``early`` (its ids are older
    than the kernel before it, so ``DEJAVU_EARLY_IDS`` may load them before the wait) when the
    query projection read the same ids first, as with fixed ids or a predictor, and not with
    the oracle, whose ids are computed right before it from the attention's output; the TEAL
    projections, whose ids are computed right before them too, are never marked."""
    model = tiny("llama")
    backend, graphs = _capture({"selector": selector, "mlp_density": 0.5,
                                "attention_density": 0.5})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), prompt(), steps=1)
    gm = graphs[-1][0]
    heads_out = (torch.ops.dejavu.sparse_head_out.default,  # (with its RMS norm: fuse_rms_norm)
                 torch.ops.dejavu.sparse_head_out_norm.default)
    outs = [n for n in gm.graph.nodes if n.op == "call_function" and n.target in heads_out]
    assert len(outs) == model.config.num_hidden_layers
    assert all(n.kwargs.get("early", False) is (selector == "fixed") for n in outs), [
        n.kwargs for n in outs]
    backend, graphs = _capture({"selector": "threshold", "mlp_density": 0.5})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), prompt(), steps=1)
    teal = [n for n in graphs[-1][0].graph.nodes if n.op == "call_function"
            and n.target in heads_out]
    assert teal and not any(n.kwargs.get("early", False) for n in teal)


def test_inductor_pdl_option_reaches_inductor(monkeypatch):
    """``inductor_pdl`` sets Inductor's ``triton.enable_pdl`` for the rewritten graph; off, the
    key is not set; by default it follows the dejavu kernels' programmatic launch (off on this
    machine) where Inductor has the switch; asked for, an Inductor without the switch is an
    error naming the option, not a silently plain launch."""
    from dejavu_compile.kernels import triton_common

    base = {"selector": "oracle", "mlp_density": 0.5}
    assert dejavu_compile.backend.inductor_has("triton.multi_kernel")
    assert not dejavu_compile.backend.inductor_has("triton.no_such_switch")
    default = DejavuOptions.from_mapping(base)
    assert default.inductor_pdl is None and not triton_common.programmatic()
    assert "triton.enable_pdl" not in dejavu_compile.backend.inductor_patches(default)
    monkeypatch.setattr(triton_common, "programmatic", lambda: True)  # a Hopper GPU
    assert dejavu_compile.backend.inductor_patches(default)["triton.enable_pdl"] is True
    off = DejavuOptions.from_mapping({**base, "inductor_pdl": False})
    assert "triton.enable_pdl" not in dejavu_compile.backend.inductor_patches(off)
    opts = DejavuOptions.from_mapping({**base, "inductor_pdl": True})
    assert dejavu_compile.backend.inductor_patches(opts)["triton.enable_pdl"] is True
    with pytest.raises(TypeError, match="inductor_pdl"):
        DejavuOptions.from_mapping({**base, "inductor_pdl": "yes"})
    monkeypatch.setattr(dejavu_compile.backend, "inductor_has", lambda key: False)  # older
    with pytest.raises(ValueError, match="inductor_pdl.*enable_pdl"):
        dejavu_compile.backend.inductor_patches(opts)
    assert "triton.enable_pdl" not in dejavu_compile.backend.inductor_patches(default)


def test_shipped_configs_are_seeded_for_each_cuda_gpu_of_the_inputs(monkeypatch, tiny):
    """Option ``shipped_configs`` (on by default): the backend seeds the shipped kernel configs
    for the GPU model of each CUDA device its graph's inputs are on; CPU inputs seed nothing,
    and with the option off nothing is seeded."""
    from dejavu_compile.kernels import tuning
    from torch._subclasses.fake_tensor import FakeTensorMode

    asked = []
    monkeypatch.setattr(tuning, "seed_shipped", lambda gpu: asked.append(gpu) or 3)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: f"GPU {device}")
    with FakeTensorMode():
        on_gpu = [torch.empty(2, device="cuda:0"), torch.empty(2, device="cuda:0"), 7]
    dejavu_compile.backend.seed_shipped_configs(on_gpu + [torch.empty(2)])
    assert asked == ["GPU cuda:0"]
    asked.clear()
    seeding = []
    real = dejavu_compile.backend.seed_shipped_configs
    monkeypatch.setattr(dejavu_compile.backend, "seed_shipped_configs",
                        lambda inputs: seeding.append(len(inputs)) or real(inputs))
    model = tiny("opt")
    ids = torch.randint(0, model.config.vocab_size, (1, 5))
    base = {"selector": "oracle", "mlp_density": 0.5}
    for shipped in (True, False):
        compiled = torch.compile(model, backend="dejavu",
                                 options={**base, "shipped_configs": shipped})
        with torch.no_grad():
            compiled(ids)
        assert bool(seeding) == shipped
        seeding.clear()
        torch._dynamo.reset()
    assert asked == []  # the inputs were on the CPU
    assert DejavuOptions.from_mapping(base).shipped_configs is True
    with pytest.raises(TypeError, match="shipped_configs"):
        DejavuOptions.from_mapping({**base, "shipped_configs": "yes"})


def test_graph_split_goes_before_the_layer_and_changes_nothing(tiny):
    """Each graph holding layer 1 gets one ``dejavu::graph_split`` on that layer's attention
    input, before every node that reads it; the logits are those without the cut (on CPU the
    inner compiler has no CUDA graphs to cut)."""

    def run(splits):
        torch._dynamo.reset()
        model = tiny("llama")
        captured = []

        def backend(gm, example_inputs):
            compiled = dejavu_compile.backend.dejavu_backend(
                gm, example_inputs, options={"selector": "oracle", "mlp_density": 0.5,
                                             "cudagraphs": True, "graph_splits": splits})
            captured.append((dejavu_compile.backend._REPORTS[-1].counters,
                             [n for n in gm.graph.nodes]))
            return compiled

        with torch.no_grad():
            logits = _decode_logits(torch.compile(model, backend=backend), prompt(), steps=2)
        return logits, captured

    got, captured = run((1,))
    want, _ = run(())
    torch.testing.assert_close(got, want, **FP32)
    for counters, nodes in captured:
        cuts = [n for n in nodes if n.op == "call_function"
                and str(n.target) == "dejavu.graph_split.default"]
        assert counters.get("graph_split", 0) == len(cuts) == 1
        x = cuts[0].args[0]
        assert set(x.users) == {cuts[0]}  # every reader of the layer's input reads the cut
        order = {n: i for i, n in enumerate(nodes)}
        first_sdpa = min(order[n] for n in nodes if n.op == "call_function"
                         and "attention" in str(n.target))
        assert order[cuts[0]] > first_sdpa  # after layer 0's attention, before layer 1's
        assert all(order[u] > order[cuts[0]] for u in cuts[0].users)


def _fork_graph(early_reader: bool):
    """x -> predict_ahead (a lookahead fork) -> relu(x) = h -> h + fork = join, and with
    ``early_reader`` a second reader of the fork before h."""
    import torch.fx as fx
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode()
    graph = fx.Graph()
    x = graph.placeholder("x")
    with mode:
        x.meta["val"] = torch.empty(1, 1, 8)
    fork = graph.call_function(torch.ops.dejavu.predict_ahead.default, (x,))
    if early_reader:
        early = graph.call_function(torch.neg, (fork,))
        early.meta["val"] = x.meta["val"]
    h = graph.call_function(torch.relu, (x,))
    h.meta["val"] = x.meta["val"]
    join = graph.call_function(torch.add, (h, fork))
    join.meta["val"] = x.meta["val"]
    graph.output((join, early) if early_reader else join)
    return fx.GraphModule(torch.nn.Module(), graph), mode, fork, h, join


def _split(gm, mode, inputs):
    from dejavu_compile.passes import lower
    from dejavu_compile.passes.context import PassContext

    opts = DejavuOptions(selector="oracle", mlp_density=0.5, cudagraphs=True, graph_splits=(1, 2))
    ctx = PassContext(opts, None, {}, [])
    ctx.inputs = inputs
    lower.graph_splits(gm, ctx, mode)
    gm.graph.lint()
    cuts = [n for n in gm.graph.nodes if str(n.target) == "dejavu.graph_split.default"]
    return ctx.counters.values, cuts


def test_graph_split_moves_a_lookahead_fork_it_would_cross_after_the_cut():
    """A lookahead predictor forked before a cut and joined after it would split one side
    stream's work across two graphs: the fork moves to just after the cut, still reading its
    earlier input, and no graph holds a fork without its join."""
    gm, mode, fork, h, join = _fork_graph(early_reader=False)
    counters, cuts = _split(gm, mode, {(1, "attention"): h, (2, "mlp"): join})
    assert [c.args[0] for c in cuts] == [h, join]
    assert counters.get("graph_split") == 2 and counters.get("graph_split_fork_moved") == 1
    assert "graph_split_skipped" not in counters
    order = {n: i for i, n in enumerate(gm.graph.nodes)}
    assert order[cuts[0]] < order[fork] < order[join]  # fork and join in the second graph
    # it still predicts from the earlier input, and reads the cut only to stay after it
    assert fork.args[0].op == "placeholder" and fork.args[-1] is cuts[0]
    assert join.args == (cuts[0], fork)


def test_graph_split_is_left_out_where_a_fork_cannot_move():
    """A fork read before the cut as well as after cannot move past it: that cut is skipped
    and counted, the others made."""
    gm, mode, fork, h, join = _fork_graph(early_reader=True)
    counters, cuts = _split(gm, mode, {(1, "attention"): h, (2, "mlp"): join})
    assert counters.get("graph_split_skipped") == 1  # layer 1: its fork is read before it
    assert [c.args[0] for c in cuts] == [join] and counters.get("graph_split") == 1
    assert "graph_split_fork_moved" not in counters
