"""GPU only (skipped elsewhere): lookahead on a side stream under Inductor and CUDA graphs gives
results identical to the same graph run on one stream, over many decode steps (no race), in
PyTorch's deterministic mode (which the sparse kernels honour); programmatic dependent launch
gives the results of plain launches; every supported family's default pipeline on CUDA gives
the masked reference's logits."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

import dejavu_compile
from dejavu_compile import bench

from .conftest import ARCHS, deterministic_algorithms, load_example, prompt

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

STEPS = 200


@torch.no_grad()
def _teacher_forced_logits(model, forward, tokens: torch.Tensor, steps: int = STEPS
                           ) -> torch.Tensor:
    """Logits of every decode step of ``tokens`` [1, P + steps] after a P-token prefill, with a
    static cache (the CUDA-graph path of ``dejavu bench``)."""
    from dejavu_compile.bench import _prefilled

    prompt = tokens.shape[1] - steps
    cache, mask = _prefilled(model, tokens[:, :prompt], tokens.shape[1] + 1)
    out = []
    for i in range(steps):
        pos = torch.tensor([prompt + i], device="cuda")
        logits = forward(input_ids=tokens[:, prompt + i - 1 : prompt + i], past_key_values=cache,
                         cache_position=pos, position_ids=pos[None], attention_mask=mask,
                         use_cache=True).logits
        out.append(logits[:, -1].float().clone())
    return torch.cat(out)


def _differ(a: torch.Tensor, b: torch.Tensor) -> str:
    """Where two runs' logits [steps, vocab] differ: the largest difference and the steps."""
    steps = ((a - b).abs().amax(-1) > 0).nonzero().flatten().tolist()
    if not steps:
        return "identical"
    return (f"max {(a - b).abs().max().item()}, in {len(steps)} of {a.shape[0]} steps, "
            f"the first {steps[:8]}")


def _replayed(model, options: dict, tokens: torch.Tensor, steps: int, after_warm_up=None
              ) -> torch.Tensor:
    """The teacher-forced logits of ``model``'s step compiled anew with ``options`` and
    replayed through ``CapturedStep``, after one warm-up run of the compiled step (the first
    call re-lays out the weights in place, so its run reads other layouts than every later
    one). ``after_warm_up``, if given, is called between the two (to clear what a spy
    recorded in the warm-up)."""
    torch._dynamo.reset()
    fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True, options=options)
    _teacher_forced_logits(model, fwd, tokens, steps)  # warm-up: the in-place re-layout
    if after_warm_up is not None:
        after_warm_up()
    return _teacher_forced_logits(model, dejavu_compile.CapturedStep(fwd), tokens, steps)


def test_lookahead_side_stream_has_no_race(tmp_path, monkeypatch):
    from dejavu_compile.kernels import lookahead

    from dejavu_compile.bench import random_profile

    model = bench.small_llama(6)
    profile = random_profile(model, 0.25, 0.5, 64, tmp_path / "ahead.yaml", lookahead=True)
    tokens = torch.randint(0, 512, (1, 32 + STEPS), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(0))
    results = {}
    # in deterministic mode the same graph gives the same bits every run, so any difference the
    # side stream makes is a race (stale or unwritten indices)
    with deterministic_algorithms():
        # The first compilation re-lays out and stacks the model's parameters in place
        # (passes/lower.py), so the run that makes it reads other layouts than every later
        # run, in the eager prefill and in its first step: it is a warm-up, not compared.
        for run, side in (("warm-up", False), ("one stream", False), ("one stream again", False),
                          ("side stream", True)):
            monkeypatch.setattr(lookahead, "SIDE_STREAM", side)
            torch._dynamo.reset()
            fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                                options={"profile": profile, "cudagraphs": True})
            results[run] = _teacher_forced_logits(model, fwd, tokens)
    assert torch.equal(results["one stream again"], results["one stream"]), (
        "two one-stream runs differ, the step is not deterministic: "
        + _differ(results["one stream again"], results["one stream"])
        + "; the warm-up against the first: " + _differ(results["warm-up"], results["one stream"]))
    assert torch.equal(results["side stream"], results["one stream"]), (
        "side stream differs from one stream: "
        + _differ(results["side stream"], results["one stream"]))
    # the side stream runs at a higher priority than the default one (0)
    side = lookahead._side_stream(torch.device("cuda"))
    assert side.priority < 0, side.priority
    # every decode graph moved layers 1-5's MLP predictors ahead
    count = dejavu_compile.report(model).counters["lookahead[mlp]"]
    assert count >= 2 * 5 and count % 5 == 0, count


def test_step_variants_match_the_default_step(tmp_path, monkeypatch):
    """The decode step under CUDA graphs with the bench's kernel variants (the row-storing
    kernels, ``dense_gemv`` said, the split-K decode attention with its mask read in place
    and its chunks merged in the same launch (option ``merge_attention``), which the lower
    pass puts in place of SDPA, and the output projections read on their original layout,
    option ``out_layout``) gives the logits of the step with SDPA and the default kernels, to
    the tolerance of fp16 sums added in another order; so does the step with zero-filled
    buffers instead of the workspaces kept zero, and a combine launch after the split kernel
    (option ``workspaces`` off and ``merge_attention`` at its default, off).

    The fixed selector keeps the selection apart from the numerics: with the profile's random
    predictors, sums added in another order flip near-tied units in and out of the top-k, and
    each flip changes the logits far beyond that tolerance. On the H200 at ``6ee37d2`` the
    predicted selection differed by up to 0.85 (of 2.4) between the variants and by 0.17
    between the default step with and without CUDA graphs; with fixed units, by 0.0024."""
    from dejavu_compile.bench import kernel_switches, random_profile

    profile = random_profile(bench.small_llama(6), 0.25, 0.5, 64, tmp_path / "variants.yaml")
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(1))
    results = {}
    counts = {}
    # the fill and default runs read the output projections on the transposed layout (the
    # default, "auto", keeps the original one at this head density on CUDA since f3ed8fc):
    # its kernel is the one that sums into the workspaces, zero-filled or kept zero
    for run, mode, extra in (("fill", "dejavu_sparse", {"workspaces": False,
                                                        "out_layout": "transposed"}),
                             ("default", "dejavu_sparse", {"decode_attention": "never",
                                                           "dense_gemv": False,
                                                           "out_layout": "transposed"}),
                             ("variants", "dejavu_store", {"dense_gemv": True,
                                                           "merge_attention": True,
                                                           "out_layout": "original"})):
        # a model of its own each run (the same seeded weights): an earlier run's in-place
        # re-layout of the output projections would be read as it is (passes/lower.py), not
        # on the original layout that the variants ask for
        model = bench.small_llama(6)
        torch._dynamo.reset()
        fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                            options={"profile": profile, "selector": "fixed", "cudagraphs": True,
                                     **extra})
        with kernel_switches(mode):
            _teacher_forced_logits(model, fwd, tokens, 24)  # warm-up: the in-place re-layout
            results[run] = _teacher_forced_logits(model, fwd, tokens, 24)
        counts[run] = dejavu_compile.report(model).counters  # this run's graphs
    counters = counts["variants"]
    assert counters["dense_gemv"] > 0 and counters["decode_attention"] > 0, counters
    # dense_gemv left None runs on CUDA: the fill run's dense projections are ours too
    assert counts["fill"]["dense_gemv"] > 0 and not counts["default"].get("dense_gemv")
    # the variants' decode attentions merge their chunks in one launch (the fill run's with a
    # combine launch of their own), and the sparse MLPs of the default step run on a
    # workspace left zero (no zero-fill launch)
    fill = counts["fill"]
    assert fill["decode_attention"] > 0 and "decode_attention_merged" not in fill, fill
    assert counters["decode_attention_merged"] == counters["decode_attention"], counters
    assert counts["default"]["workspace[mlp]"] > 0, counts["default"]
    assert counters["out_layout_original"] > 0, counters
    assert not any("out_layout_original" in counts[run] for run in ("fill", "default")), counts
    scale = results["default"].abs().max().item()
    for run in ("variants", "fill"):  # the zero-filled buffers and combine launches too
        torch.testing.assert_close(results[run], results["default"], atol=2e-2 * scale,
                                   rtol=2e-2)


def test_graph_splits_match_one_graph(tmp_path):
    """The decode step cut into three CUDA graphs (option ``graph_splits``; Inductor's graph
    partition runs each ``dejavu::graph_split`` between two graphs) gives the logits of the
    step captured whole, with the fixed selector (see the test above) and the same kernels."""
    from dejavu_compile.bench import random_profile

    model = bench.small_llama(6)
    profile = random_profile(model, 0.25, 0.5, 64, tmp_path / "split.yaml")
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(2))
    results, counters = {}, {}
    for run, splits in (("whole", ()), ("cut", (2, 4))):
        torch._dynamo.reset()
        fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                            options={"profile": profile, "selector": "fixed", "cudagraphs": True,
                                     "graph_splits": splits})
        _teacher_forced_logits(model, fwd, tokens, 24)  # warm-up: the in-place re-layout
        results[run] = _teacher_forced_logits(model, fwd, tokens, 24)
        counters[run] = dejavu_compile.report(model).counters
    assert counters["cut"].get("graph_split", 0) > 0 and "graph_split" not in counters["whole"]
    scale = results["whole"].abs().max().item()
    torch.testing.assert_close(results["cut"], results["whole"], atol=2e-2 * scale, rtol=2e-2)


def test_graph_splits_with_lookahead_match_one_graph(tmp_path):
    """With lookahead predictors on the side stream, a cut moves the fork it would cross to
    just after it (passes/lower.py::graph_splits): every graph joins its own side-stream work,
    capture succeeds, and the logits follow those of the step captured whole. Deterministic
    mode, so the two differ only where the cut changes Inductor's fusion; a rounding there can
    flip a near tie in a predictor's top-k, hence the looser bound than with fixed indices. A
    fork out of order (a predictor reading an unwritten input, or a consumer not waiting for
    its ids) would give unrelated logits."""
    from dejavu_compile.bench import random_profile

    model = bench.small_llama(6)
    profile = random_profile(model, 0.25, 0.5, 64, tmp_path / "ahead.yaml", lookahead=True)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(3))
    results, counters = {}, {}
    with deterministic_algorithms():
        for run, splits in (("whole", ()), ("cut", (2, 4))):
            torch._dynamo.reset()
            fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                                options={"profile": profile, "cudagraphs": True,
                                         "graph_splits": splits})
            _teacher_forced_logits(model, fwd, tokens, 24)  # warm-up: the in-place re-layout
            results[run] = _teacher_forced_logits(model, fwd, tokens, 24)
            counters[run] = dejavu_compile.report(model).counters
    cut = counters["cut"]
    assert cut.get("graph_split", 0) > 0 and cut.get("graph_split_fork_moved", 0) > 0, cut
    assert "graph_split_skipped" not in cut, cut
    scale = results["whole"].abs().max().item()
    assert (results["cut"] - results["whole"]).abs().max().item() <= 0.1 * scale, \
        _differ(results["cut"], results["whole"])
    agree = (results["cut"].argmax(-1) == results["whole"].argmax(-1)).float().mean().item()
    assert agree >= 0.9, agree


@pytest.mark.parametrize("ahead,splits,copies", [(False, (), 1), (True, (), 1),
                                                 (True, (2, 4), 1), (True, (), 2)],
                         ids=["fixed", "lookahead", "segments", "copies"])
def test_captured_step_matches_the_compiled_step(tmp_path, ahead, splits, copies):
    """``CapturedStep`` (dejavu's own CUDA graph around the whole compiled call) gives the
    logits of the compiled step it wraps, step after step (the tokens and positions copied in,
    the static cache written in place), and captures once per cache: two prefilled caches, two
    captures, each replayed for its own steps (the first dropped with its cache, once the
    second's replays let that go). With fixed indices, with lookahead predictors
    whose side stream forks and joins inside the capture, and with ``graph_splits``: each
    capture cut into three graphs at the ``dejavu::graph_split`` ops, replayed in turn; and with
    two captures per cache replayed in turn (``copies=2``). Deterministic mode: the same
    kernels give the same bits."""
    from dejavu_compile.bench import random_profile

    model = bench.small_llama(6)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(4))
    if ahead:
        options = {"profile": random_profile(model, 0.25, 0.5, 64, tmp_path / "ahead.yaml",
                                             lookahead=True), "graph_splits": splits}
    else:
        options = {"selector": "fixed", "mlp_density": 0.25, "attention_density": 0.5}
    fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True, options=options)
    with deterministic_algorithms():
        _teacher_forced_logits(model, fwd, tokens, 24)  # warm-up: the in-place re-layout
        want = _teacher_forced_logits(model, fwd, tokens, 24)
        step = dejavu_compile.CapturedStep(fwd, copies=copies)
        first = _teacher_forced_logits(model, step, tokens, 24)
        second = _teacher_forced_logits(model, step, tokens, 24)  # a new cache
    assert step.captured == 1  # the first cache's capture went with it (CapturedStep._purge)
    assert step.segments == [len(splits) + 1]
    counters = dejavu_compile.report(model).counters
    if ahead:
        assert counters.get("lookahead[mlp]", 0) > 0
    if splits:
        assert counters.get("graph_split", 0) >= 2 and "graph_split_skipped" not in counters
    for got in (first, second):
        assert torch.equal(got, want), _differ(got, want)


def test_generate_replays_the_captured_step():
    """``dejavu_compile.compile(model, capture=True)``: ``generate`` with a static cache gives
    the tokens of the model compiled without capture (deterministic mode), its decode steps
    replayed from one capture (the prefill runs as it is, the first two decode steps compile,
    the second because the first re-laid out the weights in place, the third captures)."""
    import copy

    model = bench.small_llama(6)
    twin = copy.deepcopy(model)
    options = {"selector": "fixed", "mlp_density": 0.25, "attention_density": 0.5}
    ids = torch.randint(0, 512, (1, 32), device="cuda",
                        generator=torch.Generator("cuda").manual_seed(5))
    settings = dict(max_new_tokens=24, do_sample=False, cache_implementation="static",
                    pad_token_id=0)
    with deterministic_algorithms(), torch.no_grad():
        want = dejavu_compile.compile(twin, **options).generate(ids, **settings)
        torch._dynamo.reset()  # the twin's compiled code is not offered to the other model
        dejavu_compile.compile(model, capture=True, **options)
        got = model.generate(ids, **settings)
    assert model.forward.captured == 1
    assert torch.equal(got, want), (got, want)


def test_auto_out_layout_at_low_head_density_matches_the_transposed_one(tmp_path):
    """Option ``out_layout="auto"`` (the default) on CUDA at head density 0.25 leaves each
    sparse output projection on its original layout (the column-reading kernel) and gives the
    logits of ``"transposed"``, under CUDA graphs, to the tolerance of fp16 sums added in
    another order (the fixed selector: the same heads either way)."""
    results, kept = {}, {}
    tokens = torch.randint(0, 512, (1, 32 + 16), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(2))
    for layout in ("transposed", "auto"):
        model = bench.small_llama(4)  # the same seeded weights each time
        torch._dynamo.reset()
        fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                            options={"selector": "fixed", "mlp_density": 0.5,
                                     "attention_density": 0.25, "cudagraphs": True,
                                     "out_layout": layout})
        _teacher_forced_logits(model, fwd, tokens, 16)  # warm-up: the in-place re-layout
        results[layout] = _teacher_forced_logits(model, fwd, tokens, 16)
        kept[layout] = dejavu_compile.report(model).counters.get("out_layout_original", 0)
    assert kept["transposed"] == 0 and kept["auto"] > 0, kept
    scale = results["transposed"].abs().max().item()
    torch.testing.assert_close(results["auto"], results["transposed"], atol=2e-2 * scale,
                               rtol=2e-2)


def test_programmatic_launch_matches_the_reference(monkeypatch):
    """With ``DEJAVU_PDL=1`` (programmatic dependent launch, Hopper and later) a selector
    followed by the sparse MLP (right after it on a workspace, with no fill between, and then
    with its own fill), a dense GEMV of its output and the head kernels, captured in a CUDA
    graph and replayed on a new input each time, gives the ids of plain launches exactly (the
    selector has no atomics) and outputs within the reference's tolerance: no kernel reads its
    predecessor's output before that one finished (the last replay's ids would give other
    outputs)."""
    from dejavu_compile.kernels import dense, heads, ops, predictor, sparse_mlp
    from dejavu_compile.kernels import reference as ref
    from dejavu_compile.kernels.triton_common import PDL_ENV, programmatic

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    gen = torch.Generator("cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) / shape[-1] ** 0.5).half()

    d, n, rank, heads_n, head_dim = 1024, 4096, 64, 16, 64
    x, attn = rand(1, 1, d), rand(1, 1, heads_n * head_dim)
    inputs = [rand(1, 1, d) for _ in range(12)]
    w1p, w2p = rand(rank, d), rand(n, rank)
    w1, w_up, w2_t = rand(n, d), rand(n, d), rand(n, d)
    wo_t = rand(heads_n * head_dim, d)
    wg = rand(3 * d, d)  # a dense GEMV of the MLP's output, its predecessor's
    wo = wo_t.t().contiguous().t()  # the same values on the original layout's storage
    assert heads.reads_columns(wo, head_dim)
    hidx = torch.tensor([[[1, 4, 6, 9, 12, 15]]], device="cuda")
    workspace = torch.zeros(ops.workspace_numel(1, d, n // 4, True), device="cuda")

    def step():
        ids = predictor.select_predictor(x, w1p, None, w2p, None, "relu", n // 4, 1, 32)
        y_ws = sparse_mlp.sparse_mlp(x, ids, w1, None, w_up, w2_t, None, "silu",
                                     workspace=workspace)
        y = sparse_mlp.sparse_mlp(x, ids, w1, None, w_up, w2_t, None, "silu")
        g = dense.gemv(y, wg, None)  # its first weights before its wait, y after
        z = heads.sparse_head_out(attn, hidx, wo_t, None, head_dim)
        z_cols = heads.sparse_head_out(attn, hidx, wo, None, head_dim)  # out_layout original
        return ids, y_ws, y, z, z_cols, g

    results = {}
    for on in (False, True):
        monkeypatch.setenv(PDL_ENV, "1" if on else "0")
        assert programmatic() == on
        step()  # compile and autotune outside the capture
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        results[on] = []
        for value in inputs:
            x.copy_(value)
            graph.replay()  # once: a replay that read the last one's ids would show
            torch.cuda.synchronize()
            results[on].append([t.clone() for t in out])
    want_z = ref.sparse_head_out(attn.double(), hidx, wo_t.double(), None, head_dim)
    for i, value in enumerate(inputs):
        ids = results[False][i][0]
        assert torch.equal(results[True][i][0], ids)
        want_y = ref.sparse_mlp(value.double(), ids, w1.double(), None, w_up.double(),
                                w2_t.double(), None, "silu")
        for on in (False, True):
            for got in results[on][i][1:3]:
                torch.testing.assert_close(got.double(), want_y, atol=2e-3, rtol=2e-3)
            for got in results[on][i][3:5]:
                torch.testing.assert_close(got.double(), want_z, atol=2e-3, rtol=2e-3)
            y, g = results[on][i][2], results[on][i][5]
            torch.testing.assert_close(g.double(), y.double() @ wg.double().t(), atol=2e-3,
                                       rtol=2e-3)
    assert not any(torch.equal(results[False][0][0], r[0]) for r in results[False][1:])
    assert not workspace.any()


def _small_opt(layers: int, hidden: int = 1024) -> torch.nn.Module:
    import transformers as tf

    cfg = tf.OPTConfig(vocab_size=512, hidden_size=hidden, ffn_dim=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=16,
                       word_embed_proj_dim=hidden, max_position_embeddings=1024)
    torch.manual_seed(0)
    model = tf.OPTForCausalLM(cfg).to("cuda", torch.float16).eval()
    with torch.no_grad():  # random biases, so a dropped one shows
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.normal_(0, 0.05)
    return model


def test_lazy_kv_matches_dense_kv(tmp_path):
    """Lazy K/V (option ``lazy_kv``) on a small OPT with lookahead predictors (heads 0.5): the
    logits of every step agree with those of dense K/V (the same selections; K/V computed by
    another kernel, so compared by cosine), under Inductor's CUDA graphs and replayed through
    ``CapturedStep``, whose capture gives the compiled lazy step's bits. The predictors change
    their heads from step to step, so missing positions are filled in.

    Both runs keep cuBLAS for the other dense projections (``dense_gemv`` off): the random
    predictors' top-k turns a rounding change into other selections, whose neurons weigh
    what they weigh. On an H200 (2026-12-04) the GEMV alone, K/V dense both ways, moved 16 of
    24 steps below cosine 0.9999 (min 0.983), and lazy against dense K/V with the GEMV on 4
    of 24 (min 0.991); with it off, lazy against dense K/V none."""
    from dejavu_compile.bench import random_profile

    model = _small_opt(6)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(4))
    profile = random_profile(model, 0.25, 0.5, 64, tmp_path / "p.yaml", lookahead=True)
    runs = {}
    with deterministic_algorithms():
        for lazy in (False, True):
            torch._dynamo.reset()
            fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                                options={"profile": profile, "lazy_kv": lazy,
                                         "fuse_qkv": False, "dense_gemv": False})
            _teacher_forced_logits(model, fwd, tokens, 24)  # warm-up: the in-place re-layout
            runs[lazy] = _teacher_forced_logits(model, fwd, tokens, 24)
        captured = _teacher_forced_logits(model, dejavu_compile.CapturedStep(fwd), tokens, 24)
    counters = dejavu_compile.report(model).counters
    assert counters.get("lazy_kv", 0) >= 5 and counters.get("lookahead[attention]", 0) > 0
    cos = torch.nn.functional.cosine_similarity(runs[True], runs[False], dim=-1)
    assert cos.min() > 0.999, cos
    assert torch.equal(captured, runs[True]), _differ(captured, runs[True])


def test_fused_query_matches_the_lazy_step():
    """Option ``fuse_qkv`` on a small OPT with lazy K/V, replayed through ``CapturedStep``:
    the query computed in the lazy K/V launch gives the logits of the step whose query has a
    launch of its own, to the tolerance of fp16 sums added in another order. The fixed
    selector keeps the selections equal: with predictors, a query one rounding apart can flip
    a near-tie of a later layer's predictor (in the twenty-first session, with lookahead
    predictors, one step of 24 came out at cosine 0.9988 against dense K/V). The kernel itself,
    with selections that change every step and so missing positions to fill, is checked
    against the reference in ``tests/test_lazy_kv.py``."""
    model = _small_opt(6)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(6))
    runs = {}
    with deterministic_algorithms():
        for fuse in (False, True):
            runs[fuse] = _replayed(model, {"selector": "fixed", "mlp_density": 0.25,
                                           "attention_density": 0.5, "lazy_kv": True,
                                           "fuse_qkv": fuse, "cudagraphs": False}, tokens, 24)
            counters = dejavu_compile.report(model).counters  # this model's graphs so far
            assert (counters.get("fuse_qkv", 0) >= 5) if fuse else "fuse_qkv" not in counters
    want = runs[False]
    torch.testing.assert_close(runs[True], want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("merge", [False, True], ids=["combine", "merged"])
def test_selected_heads_attention_matches_every_head(merge):
    """Option ``decode_selected_heads`` on a small OPT's lazy step with the query in the lazy
    K/V launch (the fixed selector at heads 0.5, replayed through ``CapturedStep``): each
    layer's decode attention computes the 8 heads of 16 that its output projection reads, and
    the logits are those of the step that computes all 16, to the tolerance of fp16 sums over
    other chunks of the cache; so with the chunks merged in the split kernel (option
    ``merge_attention``) as with a combine launch."""
    model = _small_opt(6)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7))
    runs = {}
    for selected in (False, True):
        runs[selected] = _replayed(model, {"selector": "fixed", "mlp_density": 0.25,
                                           "attention_density": 0.5, "lazy_kv": True,
                                           "cudagraphs": False, "merge_attention": merge,
                                           "decode_selected_heads": selected}, tokens, 24)
    counters = dejavu_compile.report(model).counters  # both runs' graphs
    assert counters.get("decode_selected_heads", 0) >= 5, counters
    want = runs[False]
    torch.testing.assert_close(runs[True], want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_a_captured_step_lets_a_dropped_cache_go():
    """``CapturedStep`` keeps no cache of its own (module docstring, "Caches in the output"):
    each replay hands out the call's cache as ``past_key_values``; a cache its caller dropped
    is freed, with its lazy K/V state, once the step has replayed another cache's capture, and
    the captures made with it go at the next call. A third cache, which the allocator may put
    at the first one's addresses (the same key), is run as it is and captured anew: its logits
    are those of the step without capture, where a replay of the first cache's graphs would
    read and write its freed lazy state."""
    import gc

    from dejavu_compile.kernels import kv_state

    from dejavu_compile.bench import _prefilled

    model = _small_opt(6)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(9))
    fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                        options={"selector": "fixed", "mlp_density": 0.25,
                                 "attention_density": 0.5, "lazy_kv": True,
                                 "cudagraphs": False})
    _teacher_forced_logits(model, fwd, tokens, 24)  # warm-up: the in-place re-layout
    want = _teacher_forced_logits(model, fwd, tokens, 24)
    step = dejavu_compile.CapturedStep(fwd)
    gc.collect()
    before = kv_state.live_states()
    runs = [_teacher_forced_logits(model, step, tokens, 24) for _ in range(3)]
    gc.collect()
    assert step.captured == 1
    # the last cache's alone, still in its output: a state per layer's keys tensor
    assert kv_state.live_states() == before + model.config.num_hidden_layers
    scale = want.abs().max().item()
    for got in runs:
        torch.testing.assert_close(got, want, atol=2e-2 * scale, rtol=2e-2)
    def call(forward, cache, mask, i: int):  # decode step i after a 32-token prefill
        pos = torch.tensor([32 + i], device="cuda")
        return forward(input_ids=tokens[:, 31 + i : 32 + i], past_key_values=cache,
                       cache_position=pos, position_ids=pos[None], attention_mask=mask,
                       use_cache=True)

    with torch.no_grad():
        cache, mask = _prefilled(model, tokens[:, :32], tokens.shape[1] + 1)
        ref = [call(fwd, cache, mask, i).logits.float().clone() for i in range(3)]
        del cache
        cache, mask = _prefilled(model, tokens[:, :32], tokens.shape[1] + 1)
        for i in range(3):  # run, capture, replay
            out = call(step, cache, mask, i)
            assert out.past_key_values is cache
            torch.testing.assert_close(out.logits.float(), ref[i], atol=2e-2 * scale, rtol=2e-2)


def test_programmatic_launch_in_the_captured_lazy_step():
    """The bench's ``dejavu_captured_lazy_pdl`` step on a small OPT: lazy K/V, replayed through
    ``CapturedStep``, with ``DEJAVU_PDL=1`` gives the logits of the same step launched plainly,
    to the tolerance of fp16 sums added in another order (atomics). The fixed selector keeps
    the selections equal (see ``test_step_variants_match_the_default_step``); so this checks
    every kernel of the step against its predecessors in one stream, not a side stream's."""
    from dejavu_compile.kernels.triton_common import programmatic

    from dejavu_compile.bench import kernel_switches

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    model = _small_opt(6)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(5))
    options = {"selector": "fixed", "mlp_density": 0.25, "attention_density": 0.5,
               "lazy_kv": True, "fuse_qkv": False, "cudagraphs": False}
    runs = {}
    for mode in ("dejavu_captured_lazy", "dejavu_captured_lazy_pdl"):
        with kernel_switches(mode):
            assert programmatic() == mode.endswith("_pdl")
            runs[mode] = _replayed(model, options, tokens, 24)
    assert dejavu_compile.report(model).counters.get("lazy_kv", 0) >= 5
    want = runs["dejavu_captured_lazy"]
    torch.testing.assert_close(runs["dejavu_captured_lazy_pdl"], want,
                               atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def _off_and_on(model, tokens: torch.Tensor, steps: int, base: dict, option: str,
                mode: str) -> tuple[dict, dict]:
    """The teacher-forced logits of the step replayed through ``CapturedStep`` and Inductor's
    code for the step, compiled with ``base`` and the switch ``option`` off, then on (keys
    False and True), under ``kernel_switches(mode)``."""
    from torch._inductor.utils import run_and_get_code

    from dejavu_compile.bench import kernel_switches

    runs, codes = {}, {}
    for on in (False, True):
        torch._dynamo.reset()
        fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                            options={**base, option: on})
        # no cached graph: its code would not pass through the hook
        with kernel_switches(mode), torch._inductor.config.patch(fx_graph_cache=False):
            _, codes[on] = run_and_get_code(_teacher_forced_logits, model, fwd, tokens, steps)
            runs[on] = _teacher_forced_logits(model, dejavu_compile.CapturedStep(fwd), tokens,
                                              steps)
    return runs, codes


def _small_lazy_step(seed: int, fuse_qkv: bool) -> tuple:
    """(model, tokens, options) of the small lazy step the captured-step tests compare: a
    4-layer OPT of width 2048, 32 prompt and 16 decoded tokens, the fixed selector at MLP
    0.25 and heads 0.5 with lazy K/V (the query fused in or not), compiled without graphs;
    skips the test before Hopper (programmatic dependent launch)."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    model = _small_opt(4, hidden=2048)
    tokens = torch.randint(0, 512, (1, 32 + 16), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(seed))
    base = {"selector": "fixed", "mlp_density": 0.25, "attention_density": 0.5,
            "lazy_kv": True, "fuse_qkv": fuse_qkv, "cudagraphs": False}
    return model, tokens, base


def test_multi_kernel_in_the_captured_lazy_step():
    """The bench's ``dejavu_captured_lazy_mk_pdl`` step on an OPT whose rows (2048) are too long
    for Inductor's one-pass layer norm by default: with option ``multi_kernel`` Inductor's code
    holds multi-kernels (each reduction compiled both ways, the faster kept at the first call,
    before the capture), and the replayed step gives the logits of the step without them, to
    the tolerance of fp16 sums added in another order."""
    model, tokens, base = _small_lazy_step(6, fuse_qkv=False)
    runs, codes = _off_and_on(model, tokens, 16, base, "multi_kernel",
                              "dejavu_captured_lazy_mk_pdl")
    marker = "async_compile.multi_kernel("
    assert any(marker in c for c in codes[True]) and not any(marker in c for c in codes[False])
    torch.testing.assert_close(runs[True], runs[False],
                               atol=2e-2 * runs[False].abs().max().item(), rtol=2e-2)


def test_positions_from_length_in_the_captured_step():
    """The bench's ``dejavu_captured_qkv_lenpos_pdl`` step on the small OPT of
    ``test_multi_kernel_in_the_captured_lazy_step``: with option ``positions_from_length``
    (each lazy block reads its cache length as its position, the lengths moved on in one
    foreach op at the end) the replayed step gives the logits of the step without it, to the
    tolerance of fp16 sums added in another order."""
    model, tokens, base = _small_lazy_step(7, fuse_qkv=True)
    runs, _ = _off_and_on(model, tokens, 16, base, "positions_from_length",
                          "dejavu_captured_qkv_lenpos_pdl")
    torch.testing.assert_close(runs[True], runs[False],
                               atol=2e-2 * runs[False].abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("lazy,fuse,norm", [
    (False, False, "plain"), (False, True, "plain"), (True, False, "plain"),
    (True, True, "plain"), (False, False, "late"), (True, True, "late"),
    (True, True, "exit")],
    ids=["dense_kv-kv", "dense_kv-qkv", "lazy_kv-kv", "lazy_kv-qkv", "dense_kv-kv-late",
         "lazy_kv-qkv-late", "lazy_kv-qkv-exit"])
def test_uncaptured_step_under_programmatic_launch(lazy, fuse, norm):
    """The step of ``test_multi_kernel_in_the_captured_lazy_step``'s small OPT (the fixed
    selector at MLP 0.25 and heads 0.5; K/V dense or lazy, with the query fused in or not),
    compiled without graphs and called step by step under the bench's switches for its
    ``*_pdl`` mode (programmatic launch on Hopper): in each of four runs, the logits of the same
    step compiled and run with no kernel launched programmatically (``DEJAVU_PDL=0``, option
    ``inductor_pdl`` off), to the tolerance of fp16 sums added in another order.
    ``CapturedStep``'s first call with a cache runs this way, and so do Inductor's CUDA graphs'
    first calls. ``norm``: how the add-norm and finish kernels launch
    (``DEJAVU_NORM_LAUNCH``: plainly, the default, or programmatically starting their
    successor last); "exit": those two programmatically and no kernel starting its successor
    before its programs exit (``DEJAVU_PDL_START=exit``, the bench's ``*_exit_pdl`` modes).

    On an H200 (forty-fifth session, BENCHMARKS.md) such runs were up to 0.80
    apart in 6 of 8 runs with lazy K/V and 4 of 8 with dense K/V (about 0.07 allowed), and
    right in every run with the add-norm and finish kernels launched plainly
    (``examples/race_study.py``)."""
    from dejavu_compile.kernels.triton_common import NORM_LAUNCH_ENV

    from dejavu_compile.bench import kernel_switches

    model = _small_opt(4, hidden=2048)
    tokens = torch.randint(0, 512, (1, 32 + 16), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(6))
    options = {"selector": "fixed", "mlp_density": 0.25, "attention_density": 0.5,
               "fuse_qkv": fuse, "cudagraphs": False, "lazy_kv": lazy}
    mode = "dejavu_captured_qkv_pdl" if fuse else "dejavu_captured_lazy_pdl"
    if norm == "exit":  # the bench mode sets DEJAVU_PDL_START and DEJAVU_NORM_LAUNCH itself
        assert fuse
        mode = "dejavu_captured_qkv_exit_pdl"

    def compiled(extra: dict):
        torch._dynamo.reset()
        return torch.compile(model.forward, backend="dejavu", fullgraph=True,
                             options={**options, **extra})

    with kernel_switches(mode):  # the environment restored afterwards
        os.environ["DEJAVU_PDL"] = "0"
        fwd = compiled({"inductor_pdl": False})
        _teacher_forced_logits(model, fwd, tokens, 16)  # compiles, tunes, re-lays out
        want = _teacher_forced_logits(model, fwd, tokens, 16)
        os.environ["DEJAVU_PDL"] = "1"
        if norm != "exit":
            os.environ[NORM_LAUNCH_ENV] = norm
        fwd = compiled({})
        _teacher_forced_logits(model, fwd, tokens, 16)
        runs = [_teacher_forced_logits(model, fwd, tokens, 16) for _ in range(4)]
    lazy_ops = dejavu_compile.report(model).counters.get("lazy_kv", 0)
    assert lazy_ops >= 3 if lazy else lazy_ops == 0
    for got in runs:
        torch.testing.assert_close(got, want, atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def _ranked_by_bias(profile_path) -> None:
    """Make every predictor of the profile at ``profile_path`` rank its units by its output
    bias alone: distinct small integers within each bucket, the output layer's weights scaled
    down so that what they add (at most about 0.1 on random inputs) never reorders two of
    them. The predictors
    still run, one layer ahead on the side stream, but sums added in another order can no
    longer flip a near-tied unit in or out of the top-k: on the H200 at ``dc97a69`` such flips
    moved 7 of the small Llama's 12288 logits by up to 0.065 between two compiles of the same
    step."""
    from safetensors.torch import load_file, save_file

    from dejavu_compile.profile import default_buckets

    file = profile_path.parent / f"{profile_path.stem}.safetensors"
    tensors = load_file(str(file))
    gen = torch.Generator().manual_seed(0)
    for name in [n for n in tensors if n.endswith(".b2")]:
        units = tensors[name].numel()
        per = units // default_buckets(units)
        tensors[name] = torch.cat([torch.randperm(per, generator=gen)
                                   for _ in range(units // per)]).float()
        tensors[name[: -len("b2")] + "w2"] *= 1e-4
    save_file(tensors, str(file))


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_inductor_pdl_in_the_captured_step(tmp_path, arch):
    """The bench's ``dejavu_captured_qkv_ipdl_pdl`` step on a small OPT (lazy K/V, the query
    fused in), and Llama-3-8B's ``dejavu_captured_ahead`` step on a small Llama (lookahead
    predictors on a side stream, rotary embeddings in Inductor's kernels), with option
    ``inductor_pdl``: Inductor's own kernels wait for their predecessors and start their
    successors programmatically (its code holds ``gdc_wait``; without the option it does not),
    and the replayed step, every dejavu kernel launched programmatically beside them, gives the
    logits of the step without the option, to the tolerance of fp16 sums added in another
    order (atomics). Every Inductor kernel waits, and one launched right after a dejavu op
    waits before it touches memory."""
    from dejavu_compile.bench import random_profile

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    if arch == "opt":
        model = _small_opt(6)
        base = {"selector": "fixed", "mlp_density": 0.25, "attention_density": 0.5,
                "lazy_kv": True, "fuse_qkv": True, "cudagraphs": False}
    else:
        model = bench.small_llama(6)
        path = tmp_path / "ahead.yaml"
        profile = random_profile(model, 0.5, 1.0, 64, path, lookahead=True)
        _ranked_by_bias(path)
        base = {"profile": profile, "cudagraphs": False}
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(7))
    runs, codes = _off_and_on(model, tokens, 24, base, "inductor_pdl",
                              "dejavu_captured_qkv_ipdl_pdl")
    marker = "gdc_wait()"
    assert any(marker in c for c in codes[True]) and not any(marker in c for c in codes[False])
    # a kernel that starts early and never waits could finish before its predecessor, and its
    # successor's wait would not cover that one: every kernel of the step waits
    kernels = [k for c in codes[True] for k in c.split("async_compile.triton(")[1:]]
    assert kernels and all(marker in k for k in kernels), [
        k[:80] for k in kernels if marker not in k]
    # and the launch right after a dejavu op (whose kernels let their successor start before
    # they read and write) waits before it touches memory
    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    after_ops = study.after_ops(codes[True])
    assert after_ops and not any(after_ops.values()), after_ops
    counters = dejavu_compile.report(model).counters
    if arch == "opt":
        assert counters.get("fuse_qkv", 0) >= 5
    else:
        assert counters.get("lookahead[mlp]", 0) > 0
    torch.testing.assert_close(runs[True], runs[False],
                               atol=2e-2 * runs[False].abs().max().item(), rtol=2e-2)


@pytest.mark.parametrize("arch", ["opt", "llama"])
def test_early_ids_in_the_captured_lookahead_step(tmp_path, monkeypatch, arch):
    """``DEJAVU_EARLY_IDS=1`` (bench modes ``*_early_pdl``): the up kernel of each MLP whose
    predictor ran a layer ahead, and the output projection of each sparse attention, load
    their ids and first weights before their wait. In the captured lookahead steps of the
    bench (a small OPT with lazy K/V and the query fused in, its attention sparse; a small
    Llama, its attention dense), every kernel launched programmatically, the up kernels run
    that way only with the switch, and the replayed step gives the logits of the step without
    it, to the tolerance of fp16 sums added in another order. The predictors rank by their
    biases (``_ranked_by_bias``), so no near-tied unit can flip between the two."""
    from dejavu_compile.kernels import sparse_mlp

    from dejavu_compile.bench import kernel_switches, random_profile

    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("programmatic dependent launch needs Hopper or later")
    model = _small_opt(6) if arch == "opt" else bench.small_llama(6)
    path = tmp_path / "ahead.yaml"
    profile = random_profile(model, 0.25 if arch == "opt" else 0.5, 0.5 if arch == "opt" else 1.0,
                             64, path, lookahead=True)
    _ranked_by_bias(path)
    options = {"profile": profile, "cudagraphs": False}
    if arch == "opt":
        options.update(lazy_kv=True, fuse_qkv=True)
    real, early = sparse_mlp.launch, []

    def spy(kernel, grid, *args, **meta):
        if kernel is sparse_mlp._up_kernel:
            early.append(meta["EARLY"])
        return real(kernel, grid, *args, **meta)

    monkeypatch.setattr(sparse_mlp, "launch", spy)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(8))
    runs = {}
    for mode in ("dejavu_captured_qkv_pdl", "dejavu_captured_qkv_early_pdl"):
        early.clear()
        with kernel_switches(mode):
            runs[mode] = _replayed(model, options, tokens, 24)
        assert set(early) == {mode.endswith("_early_pdl")}, (mode, early)
    assert dejavu_compile.report(model).counters.get("lookahead[mlp]", 0) > 0
    want = runs["dejavu_captured_qkv_pdl"]
    torch.testing.assert_close(runs["dejavu_captured_qkv_early_pdl"], want,
                               atol=2e-2 * want.abs().max().item(), rtol=2e-2)


def test_fused_norms_in_the_captured_opt_step(tmp_path, monkeypatch):
    """Option ``fuse_norm`` (bench mode ``dejavu_captured_qkv_norm_pdl``) in the captured
    lookahead step of a small OPT with lazy K/V: each sparse layer's output projection and MLP
    launch their kernels with the norm (``NORM``) on their workspaces, the MLP still joining
    its predictor's side stream, and the replayed step gives the logits of the step without the
    option, to the tolerance of fp16 sums added in another order. The same with the norms in
    add-norm launches after the ops (``dejavu_captured_qkv_normk_pdl``: neither kernel has the
    norm), with the output projection's only (``dejavu_captured_qkv_normm_pdl``), and with the
    add-norm launches finishing the kernels' unfinished sums (``dejavu_captured_qkv_norms_pdl``:
    neither kernel has the norm or its finish). Those runs read the output projections on the
    transposed layout; on the original one (option ``out_layout`` at its default, ``"auto"``)
    the column kernel stores finished outputs, the add-norm launch reads them, and the logits
    are the same to that tolerance."""
    from dejavu_compile.kernels import heads, sparse_mlp

    from dejavu_compile.bench import kernel_switches, random_profile

    model = _small_opt(6)
    path = tmp_path / "ahead.yaml"
    profile = random_profile(model, 0.25, 0.5, 64, path, lookahead=True)
    _ranked_by_bias(path)
    # the transposed layout: on the original one (option out_layout "auto" at head density 0.5
    # on CUDA) the output projection's column kernel stores finished outputs and the add-norm
    # launch reads them, whatever the mode (the last run below)
    options = {"profile": profile, "cudagraphs": False, "lazy_kv": True, "fuse_qkv": True,
               "out_layout": "transposed"}
    normed = []
    for module in (sparse_mlp, heads.tc):
        real = module.launch

        def spy(kernel, grid, *args, real=real, **meta):
            if kernel in (sparse_mlp._down_kernel, heads._head_out_kernel,
                          heads._head_out_cols_kernel):
                normed.append((kernel.fn.__name__, meta.get("NORM")))
            return real(kernel, grid, *args, **meta)

        monkeypatch.setattr(module, "launch", spy)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(8))
    runs = {}

    def replay(model, mode, **extra):
        """The replayed step's logits under ``mode``, with ``normed`` holding the launches
        after the warm-up (the first warm-up's in-place re-layout reads the output
        projections' strided views as they are, so with the column kernel, once: relayout
        "in_place")."""
        with kernel_switches(mode):
            return _replayed(model, {**options, **extra}, tokens, 24, after_warm_up=normed.clear)

    # the mode, and whether the down and the output projection's kernels finish the norm
    for mode, fuse, in_kernel in (("dejavu_captured_qkv_pdl", False, (False, False)),
                                  ("dejavu_captured_qkv_norm_pdl", True, (True, True)),
                                  ("dejavu_captured_qkv_normk_pdl", True, (False, False)),
                                  ("dejavu_captured_qkv_normm_pdl", True, (True, False)),
                                  ("dejavu_captured_qkv_norms_pdl", True, (False, False))):
        runs[mode] = replay(model, mode, fuse_norm=fuse)
        assert set(normed) == {("_down_kernel", in_kernel[0]),
                               ("_head_out_kernel", in_kernel[1])}, (mode, set(normed))
        counters = dejavu_compile.report(model).counters
        assert counters.get("fuse_norm[sparse_mlp]", 0) > 0 or not fuse
        assert counters.get("lookahead[mlp]", 0) > 0
    # the default layout ("auto": the original one at head density 0.5 on CUDA), on a model of
    # its own (the same seeded weights; the runs above re-laid theirs out in place): the
    # column kernel stores finished outputs (no NORM) and the add-norm launch reads them
    model = _small_opt(6)
    runs["original"] = replay(model, "dejavu_captured_qkv_pdl", out_layout="auto",
                              fuse_norm=True)
    assert set(normed) == {("_down_kernel", False), ("_head_out_cols_kernel", None)}, normed
    counters = dejavu_compile.report(model).counters
    assert counters.get("out_layout_original", 0) > 0, counters
    assert counters.get("fuse_norm[sparse_head_out]", 0) > 0, counters
    want = runs["dejavu_captured_qkv_pdl"]
    for mode in ("dejavu_captured_qkv_norm_pdl", "dejavu_captured_qkv_normk_pdl",
                 "dejavu_captured_qkv_normm_pdl", "dejavu_captured_qkv_norms_pdl", "original"):
        torch.testing.assert_close(runs[mode], want, atol=2e-2 * want.abs().max().item(),
                                   rtol=2e-2, msg=mode)


def test_fused_rms_norms_in_the_captured_llama_step(tmp_path, monkeypatch):
    """Option ``fuse_rms_norm`` (on by default; bench mode ``dejavu_captured_ahead_rms_pdl``)
    in the captured lookahead step of a small Llama, its attention dense: each sparse MLP's
    down kernel runs without its finish and an RMS add-norm launch finishes its sums, and the
    replayed step gives the logits of the step without the option, to the tolerance of fp16
    sums added in another order."""
    from dejavu_compile.kernels import triton_common as tc

    from dejavu_compile.bench import kernel_switches, random_profile

    model = bench.small_llama(6)
    path = tmp_path / "ahead.yaml"
    profile = random_profile(model, 0.5, 1.0, 64, path, lookahead=True)
    _ranked_by_bias(path)
    launched, real = [], tc._launch_add_norm

    def spy(*args, **kwargs):
        launched.append((kwargs.get("sums"), kwargs.get("rms")))
        return real(*args, **kwargs)

    monkeypatch.setattr(tc, "_launch_add_norm", spy)
    tokens = torch.randint(0, 512, (1, 32 + 24), device="cuda",
                           generator=torch.Generator("cuda").manual_seed(8))
    runs = {}
    for fuse in (False, True):
        launched.clear()
        with kernel_switches("dejavu_captured_ahead_rms_pdl"):
            runs[fuse] = _replayed(model, {"profile": profile, "cudagraphs": False,
                                           "fuse_rms_norm": fuse}, tokens, 24)
        assert set(launched) == ({(True, True)} if fuse else set()), launched
        counters = dejavu_compile.report(model).counters
        assert counters.get("fuse_norm_rms", 0) > 0 or not fuse
        assert counters.get("lookahead[mlp]", 0) > 0
    torch.testing.assert_close(runs[True], runs[False],
                               atol=2e-2 * runs[False].abs().max().item(), rtol=2e-2)


# fp32 on the GPU: the kernels' sums in another order (atomics), Triton's approximate exp and
# rsqrt; the logits of these tiny models are of order 1
GPU_FP32 = dict(atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("arch", ARCHS)
def test_each_family_matches_the_masked_reference_on_the_gpu(tiny, arch):
    """Every supported family through the default pipeline on CUDA (the Triton sparse
    kernels, the dense projections through ``dejavu::gemv``, the split-K decode attention, the
    fused norms where the family has them), in fp32 so that the oracle picks the units it
    picks on the CPU: the logits of the eager model masked to the oracle's selection, as
    ``tests/test_backend.py`` checks on the CPU."""
    from .test_backend import oracle_against_masked_reference

    model = tiny(arch).cuda()
    got, want, dense = oracle_against_masked_reference(model, prompt().cuda())
    counters = dejavu_compile.report(model).counters
    torch.testing.assert_close(got, want, **GPU_FP32)
    assert not torch.allclose(got, dense, atol=1e-3), "sparsity had no effect"
    assert counters.get("dense_gemv", 0) > 0 and counters.get("decode_attention", 0) > 0, \
        counters


def test_graph_bench_reads_what_the_current_stream_wrote_last():
    """``bench.graph_bench``'s first call of its function sees a value the current stream
    writes after a long kernel (``torch.cuda._sleep``), as a study's inputs are made just
    before it times them: ``triton.testing.do_bench_cudagraph`` alone runs the function on a
    new stream that would read the value before that write."""
    ids = torch.zeros(1, dtype=torch.int64, device="cuda")
    seen = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    first = torch.full((1,), -1, dtype=torch.int64, device="cuda")
    torch.cuda.synchronize()
    torch.cuda._sleep(200_000_000)  # on the order of 0.1 s of GPU cycles
    ids.fill_(7)
    calls = []

    def fn():
        seen.copy_(ids)
        if not calls:  # the warm-up call, before any capture
            first.copy_(seen)
        calls.append(1)

    bench.graph_bench(fn, rep=5)
    assert first.item() == 7 and seen.item() == 7
