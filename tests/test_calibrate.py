"""Calibration on tiny models: end to end in seconds, planted patterns, allocation."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import dejavu_compile
from dejavu_compile import calibrate as cal
from dejavu_compile import load_profile

from .conftest import VOCAB, load_example, prompt
from .test_backend import _decode_logits


def test_calibration_end_to_end(tiny, tmp_path):
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    result = cal.calibrate(model, ids, "tiny-llama", tmp_path / "tiny.yaml", target_density=0.9,
                           rank=8, epochs=2, cache_dir=tmp_path / "cache", progress=False)
    assert sorted(result.quality) == [0, 1]
    assert all(0 <= q["recall"] <= 1 for q in result.quality.values())
    loaded = load_profile(tmp_path / "tiny.yaml")
    assert loaded.to_dict() == result.profile.to_dict()
    assert (tmp_path / "cache" / "mlp1.pt").is_file()
    uniform = load_profile(tmp_path / "tiny-uniform.yaml")
    assert uniform.layer(0).mlp.selector == "dense"
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu",
                                     options={"profile": str(tmp_path / "tiny.yaml")}), prompt())
    rep = dejavu_compile.report(model)
    sparse = [r.layer for r in rep.layers if r.mlp.selector == "predictor"]
    assert sparse == [r.index for r in loaded.layers if r.mlp.selector == "predictor"]
    # A rerun resumes from the recorded activations (the model is not run again).
    again = cal.record(model, ids, tmp_path / "cache", progress=False)
    assert torch.equal(again[1].x, cal.record(model, ids, None, progress=False)[1].x)


def test_activation_cache_is_of_its_tokens(tiny, tmp_path):
    """A cache folder resumes only a run on the same tokens: other tokens (another text, count
    or held-out split), or a cache that does not say what tokens it holds, is an error naming
    the folder, and nothing is reused."""
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 300), generator=torch.Generator().manual_seed(0))
    cache = tmp_path / "cache"
    first = cal.record(model, ids, cache, progress=False)
    again = cal.record(model, ids, cache, progress=False)
    assert torch.equal(again[1].h, first[1].h)
    with pytest.raises(ValueError, match="other calibration tokens.*300 tokens"):
        cal.record(model, ids[:, :-20], cache, progress=False)
    with pytest.raises(ValueError, match="other calibration tokens"):
        cal.record(model, ids.flip(1), cache, progress=False)
    (cache / cal.CACHE_TOKENS).unlink()
    with pytest.raises(ValueError, match="without the fingerprint"):
        cal.record(model, ids, cache, progress=False)
    assert cal.record(model, ids, tmp_path / "fresh", progress=False)[1].h.shape == first[1].h.shape


def test_calibration_with_lookahead(tiny, tmp_path):
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    result = cal.calibrate(model, ids, "tiny-llama", tmp_path / "ahead.yaml", target_density=0.9,
                           rank=8, epochs=2, lookahead=True, progress=False)
    layer = result.profile.layer(1).mlp
    assert layer.selector == "predictor" and layer.input == "previous"
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu", options={
            "profile": str(tmp_path / "ahead.yaml"), "lookahead": True}), prompt())
    assert dejavu_compile.report(model).counters["lookahead[mlp]"] >= 1


def test_calibration_with_buckets(tiny, tmp_path):
    """Predictors calibrated for a top-k per bucket say so in the profile, and the backend
    takes the same selection."""
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    result = cal.calibrate(model, ids, "tiny-llama", tmp_path / "b.yaml", target_density=0.9,
                           rank=8, epochs=2, bucket_units=32, progress=False)
    layer = result.profile.layer(1).mlp
    assert layer.selector == "predictor" and layer.buckets == 3  # 96 neurons, buckets of 32
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu", options={
            "profile": str(tmp_path / "b.yaml")}), prompt())
    rep = dejavu_compile.report(model)
    assert rep.layers[1].mlp.k % 3 == 0


def test_bucketed_recall_counts_the_global_top_k():
    true = torch.tensor([[9.0, 8.0, 7.0, 6.0, 1.0, 2.0, 3.0, 4.0]])
    # the global top four sit in the first bucket: two per bucket finds only half of them
    assert cal.recall_at(true, true, 4) == 1.0
    assert cal.recall_at(true, true, 4, buckets=2) == 0.5


def test_blend_keeps_the_lowest_joint_loss_within_budget():
    dense = {0: 100, 1: 100, 2: 100}
    pred = {0: 0, 1: 10, 2: 10}
    greedy, flat = {0: 1.0, 1: 0.4, 2: 0.8}, {0: 1.0, 1: 0.6, 2: 0.6}
    seen = []

    def loss(dens):  # lowest half way between the two
        seen.append(dens)
        return abs(dens[1] - 0.5)

    dens, tried = cal.blend_allocation(greedy, flat, dense, pred, 0.8, loss)
    assert dens == {0: 1.0, 1: 0.5, 2: 0.7} and min(tried, key=tried.get) == 0.5
    assert set(tried) == set(cal.BLEND_STEPS)
    # a budget below every blend leaves the greedy allocation, untried
    dens, tried = cal.blend_allocation(greedy, flat, dense, pred, 0.5, loss)
    assert dens == greedy and tried == {}


def test_calibration_keeps_the_best_blend(tiny, tmp_path):
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    result = cal.calibrate(model, ids, "tiny-llama", tmp_path / "b.yaml", target_density=0.9,
                           rank=8, epochs=2, progress=False)
    assert result.blend and set(result.blend) <= set(cal.BLEND_STEPS)
    w = min(result.blend, key=result.blend.get)
    for layer in result.profile.layers:  # the written densities are the kept blend
        flat = result.uniform_profile.layer(layer.index).mlp.density
        want = round(w * result.greedy[layer.index] + (1 - w) * flat, 4)
        assert layer.mlp.density == pytest.approx(want)
        if layer.mlp.selector == "predictor":  # recall measured at the blended density
            assert layer.mlp.recall is not None


@pytest.mark.parametrize("weighted", [False, True])
def test_predictor_recovers_a_planted_pattern(weighted):
    gen = torch.Generator().manual_seed(0)
    d, n, tokens = 32, 64, 4096
    mixing = torch.randn(n, 4, generator=gen) @ torch.randn(4, d, generator=gen)  # rank 4
    x = torch.randn(tokens, d, generator=gen)
    # Activations ranked by a rank-4 projection of the input (no ties): learnable exactly.
    h = torch.exp(0.3 * x @ mixing.t())
    down = torch.nn.Linear(n, d)
    trace = cal.MLPTrace(0, x.half(), h.half(), torch.nn.Linear(d, n), None, down, "relu")
    pred, quality = cal.train_predictor(trace, rank=8, epochs=8, weighted=weighted)
    assert quality["recall"] >= 0.9, quality["recall"]
    if weighted:  # the weights change what is learned
        plain, _ = cal.train_predictor(trace, rank=8, epochs=8)
        assert not torch.equal(pred.w2.weight, plain.w2.weight)
    # A random ranking scores about the density itself.
    random_recall = cal.recall_at(torch.randn(tokens, n, generator=gen), h.float(), n // 2)
    assert random_recall < 0.6


def test_predictor_trains_with_a_given_loss():
    """``loss_fn`` replaces the binary loss: called on each batch's scores, labels (the top
    half) and magnitudes |h|; a pairwise ranking loss learns the planted pattern too."""
    study = load_example(Path(__file__).parents[1] / "examples" / "predictor_study.py")
    gen = torch.Generator().manual_seed(0)
    d, n, tokens = 32, 64, 4096
    mixing = torch.randn(n, 4, generator=gen) @ torch.randn(4, d, generator=gen)
    x = torch.randn(tokens, d, generator=gen)
    h = torch.exp(0.3 * x @ mixing.t())
    trace = cal.MLPTrace(0, x.half(), h.half(), torch.nn.Linear(d, n), None,
                         torch.nn.Linear(n, d), "relu")
    seen = []

    def loss(scores, labels, magnitudes):
        seen.append((scores.shape, labels.sum(1).unique().tolist(), bool((magnitudes >= 0).all())))
        return study.pairwise_loss(scores, labels, magnitudes)

    _, quality = cal.train_predictor(trace, rank=8, epochs=8, loss_fn=loss)
    assert quality["recall"] >= 0.9, quality["recall"]
    assert seen and seen[0] == ((cal.BATCH, n), [n // 2], True)


def _calibrate_args(monkeypatch) -> dict:
    """The keyword arguments ``dejavu calibrate`` passes to the API, filled in by each call of
    ``cli.main`` (the fake calibration stops it before the report with a KeyboardInterrupt)."""
    from types import SimpleNamespace

    from dejavu_compile import models

    seen = {}

    def fake_calibrate(model, ids, name, out, **kw):
        seen.update(kw)
        raise KeyboardInterrupt

    loaded = SimpleNamespace(model=None, name="m", encode=lambda text, n: torch.ones(1, 300))
    monkeypatch.setattr(models, "load_model", lambda name: loaded)
    monkeypatch.setattr(cal, "calibrate", fake_calibrate)
    return seen


def test_cli_passes_the_weighted_loss_option(monkeypatch, tmp_path):
    from dejavu_compile import cli

    seen = _calibrate_args(monkeypatch)
    for flag, want in (([], False), (["--weighted-loss"], True)):
        with pytest.raises(KeyboardInterrupt):
            cli.main(["calibrate", "m", "--out", str(tmp_path / "p.yaml"), *flag])
        assert seen["weighted_loss"] is want


def test_cli_takes_one_budget(monkeypatch, tmp_path, capsys):
    """``--target-density`` or ``--max-ppl-increase``, passed through (neither: the API's
    default); both at once is a usage error."""
    from dejavu_compile import cli

    seen = _calibrate_args(monkeypatch)
    out = ["--out", str(tmp_path / "p.yaml")]
    for flags, want in (([], (None, None)), (["--target-density", "0.7"], (0.7, None)),
                        (["--max-ppl-increase", "0.03"], (None, 0.03))):
        with pytest.raises(KeyboardInterrupt):
            cli.main(["calibrate", "m", *out, *flags])
        assert (seen["target_density"], seen["max_ppl_increase"]) == want
    with pytest.raises(SystemExit):
        cli.main(["calibrate", "m", *out, "--target-density", "0.7", "--max-ppl-increase", "0.03"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_importance_weights():
    """Loss weights: the floor plus |h| x the down column's norm over the token's mean, capped;
    a token whose activations overflowed gets plain weights."""
    h = torch.tensor([[1.0, 3.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [float("inf"), 1.0, 0.0, 0.0]])
    norms = torch.tensor([1.0, 1.0, 2.0, 2.0])
    w = cal.importance_weights(h, norms)
    floor = cal.IMPORTANCE_FLOOR
    torch.testing.assert_close(w[0], torch.tensor([1.0, 3.0, 0.0, 0.0]) + floor)  # mean 1
    torch.testing.assert_close(w[1], torch.tensor([2 / 3, 2 / 3, 4 / 3, 4 / 3]) + floor)
    torch.testing.assert_close(w[2], torch.full((4,), 1.0 + floor))
    spike = torch.ones(1, 32)
    spike[0, 0] = 1e6  # about 32 times the mean
    assert cal.importance_weights(spike, torch.ones(32)).max() == floor + cal.IMPORTANCE_CAP


def test_allocation_meets_the_budget_and_prefers_insensitive_layers():
    steps = cal.DENSITY_STEPS
    errors = {0: {s: 0.0 for s in steps}, 1: {s: 1.0 - s for s in steps},
              2: {s: 0.1 * (1.0 - s) for s in steps}}
    dense = {0: 100, 1: 100, 2: 100}
    pred = {0: 5, 1: 5, 2: 5}
    chosen = cal.allocate(errors, dense, pred, target=0.8)
    assert chosen[0] == 1.0  # the first layer stays dense
    spent = sum(dense[i] if d == 1.0 else d * dense[i] + pred[i] for i, d in chosen.items())
    assert spent <= 0.8 * 300
    assert chosen[2] < chosen[1], chosen  # the less sensitive layer gives up more
    flat = cal.uniform(errors, dense, pred, target=0.8)
    assert flat[0] == 1.0 and flat[1] == flat[2]
    with pytest.raises(ValueError, match="cannot be met"):
        cal.allocate(errors, dense, pred, target=0.1)


def test_evaluate_profile_reports_the_eval_keys(tiny, tmp_path):
    from dejavu_compile.evaluate import evaluate_profile, plot_layers, windows

    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    result = cal.calibrate(model, ids, "tiny-llama", tmp_path / "tiny.yaml", target_density=0.9,
                           rank=8, epochs=1, progress=False)
    chunks = windows(ids[:, :96], 32, 3)
    out = evaluate_profile(model, chunks, result.profile, prefix=8)
    for key in ("dense_ppl", "sparse_ppl", "oracle_ppl", "top1_agreement",
                "bytes_per_token_dense", "bytes_per_token_sparse"):
        assert key in out
    assert out["tokens"] == 3 * 24
    assert out["bytes_per_token_sparse"] < out["bytes_per_token_dense"]
    assert 0 < out["mlp_bytes_fraction"] < 1.0
    assert 0.0 <= out["top1_agreement"] <= 1.0
    plot_layers(out, tmp_path / "layers.png")
    assert (tmp_path / "layers.png").stat().st_size > 1000


def test_allocation_picks_the_selector_per_layer():
    # layer 1: the predictor is cheap and accurate; layer 2: the predictor is useless but the
    # gate selector is accurate (it reads the gate, a third of the bytes, densely)
    steps = [d for d in cal.DENSITY_STEPS if d < 1.0]
    opts = {
        0: cal.predictor_options({d: 0.0 for d in steps}, 300, 10),
        1: cal.predictor_options({d: 0.01 * (1 - d) for d in steps}, 300, 10)
        + cal.gate_options({d: 0.05 * (1 - d) for d in steps}, 100, 200),
        2: cal.predictor_options({d: 5.0 * (1 - d) for d in steps}, 300, 10)
        + cal.gate_options({d: 0.02 * (1 - d) for d in steps}, 100, 200),
    }
    chosen = cal.allocate_options(opts, target=0.75)
    assert chosen[0].selector == "dense"
    assert chosen[1].selector == "predictor" and chosen[2].selector == "gate"
    assert sum(o.cost for o in chosen.values()) <= 0.75 * 900


def test_calibration_with_gate_selector(tiny, tmp_path):
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    result = cal.calibrate(model, ids, "tiny-llama", tmp_path / "gate.yaml", target_density=0.8,
                           selectors=("gate",), progress=False)
    layer = result.profile.layer(1).mlp
    assert layer.selector == "gate" and layer.density < 1.0 and 0 <= layer.recall <= 1
    assert result.profile.predictor_file is None
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu",
                                     options={"profile": str(tmp_path / "gate.yaml")}), prompt())
    assert dejavu_compile.report(model).counters["sparse_mlp[gate]"] >= 1
    assert load_profile(tmp_path / "gate-uniform.yaml").layer(1).mlp.selector == "gate"


@pytest.mark.parametrize("uniform_wins", [True, False])
def test_mixed_selectors_keep_the_better_of_adaptive_and_uniform(tiny, tmp_path, monkeypatch,
                                                                  uniform_wins):
    """With a byte budget and more than the predictor selector (no blend across selectors),
    the profile is the adaptive allocation or the uniform spread, whichever has the lower joint
    loss on the sensitivity tokens; both losses are recorded. The joint loss is replaced by one
    that favours the spread or the adaptive allocation."""
    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    spreads, density_options = [], cal.density_options
    monkeypatch.setattr(cal, "density_options",
                        lambda *a: spreads.append(density_options(*a)) or spreads[-1])

    def loss(model, traces, ids, chosen, hooks):
        flat = any(chosen is s for s in spreads)
        return 1.0 if flat == uniform_wins else 2.0

    monkeypatch.setattr(cal, "allocation_loss", loss)
    result = cal.calibrate(model, ids, "tiny-llama", tmp_path / "mixed.yaml", target_density=0.7,
                           selectors=("gate", "threshold"), progress=False)
    assert set(result.blend) == {0.0, 1.0}
    assert result.uniform_kept == uniform_wins
    twin = load_profile(tmp_path / "mixed-uniform.yaml")
    written = [(layer.mlp.selector, layer.mlp.density) for layer in result.profile.layers]
    spread = [(layer.mlp.selector, layer.mlp.density) for layer in twin.layers]
    greedy = [result.greedy.get(layer.index, 1.0) for layer in result.profile.layers]
    if uniform_wins:
        assert written == spread
    else:
        assert [d for _, d in written] == greedy


def test_calibration_with_threshold_selector(tiny, tmp_path):
    model = tiny("opt")
    ids = torch.randint(3, VOCAB, (1, 1024), generator=torch.Generator().manual_seed(0))
    result = cal.calibrate(model, ids, "tiny-opt", tmp_path / "teal.yaml", target_density=0.8,
                           selectors=("threshold",), progress=False)
    layer = result.profile.layer(1).mlp
    assert layer.selector == "threshold" and layer.density <= 0.6  # layer 0 stays dense
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu",
                                     options={"profile": str(tmp_path / "teal.yaml")}), prompt())
    assert dejavu_compile.report(model).counters["sparse_mlp[threshold]"] >= 1


def test_calibration_within_a_perplexity_budget(tiny, tmp_path, monkeypatch):
    """With ``max_ppl_increase`` the profile is the sparsest byte target whose perplexity on
    the held-out calibration tokens stays within the budget: every target tried is recorded,
    the kept one is within budget, the search stops at the first over it, and a budget no
    sparse allocation meets leaves every layer dense. The held-out tokens are not recorded."""
    import math

    model = tiny("llama")
    ids = torch.randint(3, VOCAB, (1, 1536), generator=torch.Generator().manual_seed(0))
    kw = dict(rank=8, epochs=2, progress=False)
    recorded, record = [], cal.record
    monkeypatch.setattr(cal, "record", lambda m, t, *a: recorded.append(t) or record(m, t, *a))
    loose = cal.calibrate(model, ids, "tiny-llama", tmp_path / "loose.yaml",
                          max_ppl_increase=math.inf, **kw)
    assert loose.search and all(t in cal.SEARCH_STEPS for t in loose.search)
    assert loose.target_density == min(loose.search) < 1.0  # the sparsest reachable
    assert loose.profile.layer(1).mlp.density < 1.0
    # each target kept the better of the adaptive allocation and the uniform spread
    assert set(loose.search_uniform) == set(loose.search)
    assert all(loose.search[t] <= loose.search_uniform[t] for t in loose.search)
    twin = load_profile(tmp_path / "loose-uniform.yaml")
    same = [a.mlp.density for a in loose.profile.layers] == [b.mlp.density for b in twin.layers]
    assert same or not loose.uniform_kept

    budget = sorted(loose.search.values())[len(loose.search) // 2]
    mid = cal.calibrate(model, ids, "tiny-llama", tmp_path / "mid.yaml",
                        max_ppl_increase=budget, **kw)
    kept = mid.search.get(mid.target_density, 0.0)
    assert kept <= budget
    stopped = min(mid.search)
    assert stopped == mid.target_density or mid.search[stopped] > budget

    strict = cal.calibrate(model, ids, "tiny-llama", tmp_path / "strict.yaml",
                           max_ppl_increase=0.0, **kw)
    if all(v > 0 for v in strict.search.values()):
        assert strict.target_density == 1.0
        assert all(layer.mlp.selector == "dense" for layer in strict.profile.layers)
    # the held-out tokens are left out of the recorded activations (and so of training)
    held = min(cal.VALIDATION_TOKENS, model.config.max_position_embeddings)
    assert recorded and all(torch.equal(t, ids[:, :-held]) for t in recorded)


def test_perplexity_budget_is_checked():
    ids = torch.ones(1, 600, dtype=torch.long)
    with pytest.raises(ValueError, match="not both"):
        cal.calibrate(_Configured(), ids, "m", "p.yaml", target_density=0.6,
                      max_ppl_increase=0.03)
    with pytest.raises(ValueError, match="must be >= 0"):
        cal.calibrate(_Configured(), ids, "m", "p.yaml", max_ppl_increase=-0.1)
    with pytest.raises(ValueError, match="at least 1024 calibration tokens"):
        cal.calibrate(_Configured(), ids, "m", "p.yaml", max_ppl_increase=0.03)


def test_bad_settings_are_refused_before_anything_is_recorded(monkeypatch):
    """A byte target outside (0, 1] (1.5 used to fail only after training, in the uniform
    spread), a rank or an epoch count below 1: refused before the activations are recorded
    (minutes on a real model)."""

    def record(*args, **kwargs):
        raise AssertionError("recorded before the settings were checked")

    monkeypatch.setattr(cal, "record", record)
    ids = torch.ones(1, 600, dtype=torch.long)
    for bad, match in (({"target_density": 0.0}, "target_density .* in \\(0, 1\\], got 0.0"),
                       ({"target_density": 1.5}, "got 1.5"),
                       ({"rank": 0}, "rank must be an int >= 1, got 0"),
                       ({"epochs": 2.5}, "epochs must be an int >= 1"),
                       ({"bucket_units": -1}, "bucket_units must be an int >= 0")):
        with pytest.raises(ValueError, match=match):
            cal.calibrate(_Configured(), ids, "m", "p.yaml", **bad)
    for shape in ((1, 1), (2, 300), (600,)):  # one token failed inside torch.cat, none in Dynamo
        with pytest.raises(ValueError, match="ids must be token ids") as info:
            cal.calibrate(_Configured(), torch.ones(shape, dtype=torch.long), "m", "p.yaml")
        assert str(info.value).endswith(f"got shape {shape}")


class _Configured:
    config = type("Config", (), {"max_position_embeddings": 2048})()
