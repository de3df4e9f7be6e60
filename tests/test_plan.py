"""The byte account: the second paper's published crossovers from model dimensions alone,
speedup bounds, the dispatch gate."""

from __future__ import annotations

import pytest

from dejavu_compile.bench import shape_configs
from dejavu_compile.plan import Account, ModelBytes


def _model(name: str) -> ModelBytes:
    return ModelBytes.from_config(shape_configs()[name], name)


@pytest.mark.parametrize(
    "name,proj,kv,scope,want",
    [
        ("llama-3.1-8b", 0.5, 0.3, "all", 76_069),
        ("llama-3.1-8b", 0.7, 0.3, "all", 45_641),
        ("llama-3.1-8b", 0.5, 0.5, "all", 106_496),
        ("qwen3-8b", 0.5, 0.3, "all", 67_291),
        ("mistral-7b", 0.5, 0.3, "all", 76_069),  # same layer shapes as Llama-3.1-8B
        ("llama-3.1-8b", 0.5, 0.3, "mlp", 61_440),  # feed-forward projections alone
        ("qwen3-8b", 0.5, 0.3, "mlp", 52_663),
    ],
)
def test_published_crossovers(name, proj, kv, scope, want):
    assert Account(_model(name), proj, kv, scope).crossover() == want


def test_llama_layer_bytes_match_the_paper():
    m = _model("llama-3.1-8b")
    assert m.attention_bytes + m.mlp_bytes == 436_207_616  # "436 MB per step" per layer
    assert m.kv_bytes_per_token == 4096  # "4096 n cache bytes"


def test_bounds_and_gate_follow_the_crossover():
    account = Account(_model("llama-3.1-8b"), 0.5, 0.3)
    cross = account.crossover()
    short, long = cross // 4, cross * 2
    assert account.bound(short, "projection") > account.bound(short, "kv") > 1.0
    assert account.bound(long, "kv") > account.bound(long, "projection") > 1.0
    for n in (short, cross, long):  # composition saves both terms
        assert account.bound(n, "both") > max(account.bound(n, "projection"),
                                              account.bound(n, "kv"))
    assert abs(account.step(cross, "projection").total - account.step(cross, "kv").total) < 4096 * 32
    # without measured costs the gate picks the fewest bytes: both branches together
    assert account.choose(short, 4e12) == "both"
    assert account.choose(short, 4e12, allowed=("dense", "projection", "kv")) == "projection"
    assert account.choose(long, 4e12, allowed=("dense", "projection", "kv")) == "kv"
    # a fixed cost of the projection branch moves the latency crossing below the byte crossover
    costly = Account(account.model, 0.5, 0.3, costs_ms={"projection": 1.0})
    assert costly.choose(cross - 10_000, 4e12, allowed=("projection", "kv")) == "kv"


def test_predictor_bytes_count_against_the_projection_branch():
    m = _model("llama-3.1-8b")
    plain, with_predictors = Account(m, 0.5, 0.3), Account(m, 0.5, 0.3, predictor_bytes=10**8)
    assert with_predictors.crossover() < plain.crossover()
    assert with_predictors.step(0, "projection").predictors == 10**8


def test_bad_keep_is_refused():
    with pytest.raises(ValueError, match="kv_keep"):
        Account(_model("qwen3-8b"), 0.5, 0.0)


def test_bad_sizes_are_refused():
    """A weight of 0 bytes divided by zero in the table; a negative context gave a row."""
    with pytest.raises(ValueError, match="dtype_bytes must be an int >= 1 .*, got 0"):
        ModelBytes.from_config(shape_configs()["opt-13b"], "opt-13b", 0)
    account = Account(_model("qwen3-8b"), 0.5, 0.3)
    assert account.step(0, "kv").kv == 0
    with pytest.raises(ValueError, match="context must be >= 0 tokens, got -5"):
        account.step(-5, "dense")


def test_plan_command_prints_the_account(capsys):
    from dejavu_compile.cli import main

    assert main(["plan", "llama-3.1-8b", "--context", "2048", "131072"]) == 0
    out = capsys.readouterr().out
    assert "byte crossover: 76,069 tokens" in out
    assert "436.2 MB" in out and "   2048 |" in out and "131072 |" in out


def test_compile_report_shows_the_gate(tiny):
    import torch

    import dejavu_compile

    from .conftest import prompt
    from .test_backend import _decode_logits

    model = tiny("llama")  # 2 layers, 2 KV heads of 16 dims, fp32
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend="dejavu", options={
            "selector": "fixed", "mlp_density": 0.25}), prompt(), steps=1)
    rep = dejavu_compile.report(model)
    gate = rep.dispatch(contexts=(1, 10**6), kv_keep=0.3)
    assert gate["kv_bytes_per_token"] == 2 * 2 * (2 * 16 * 4)
    saved = rep.bytes_dense - rep.bytes_sparse
    assert saved > 0 and gate["crossover"] == round(saved / (0.7 * 512))
    assert gate["choices"] == {1: "both", 10**6: "both"}
    # a fixed cost on the projection branch makes KV alone win at long context
    costly = rep.dispatch(contexts=(10**6,), kv_keep=0.3, costs_ms={"both": 1.0, "projection": 1.0},
                          bandwidth=1e12)
    assert costly["choices"][10**6] == "kv"
    assert "dispatch by bytes" in str(rep) and "they cross at" in str(rep)
    assert "keep 0.3 saves 358 B per context token" in str(rep)  # 0.7 x 512, rounded


def test_account_from_profile_counts_its_densities_and_refuses_other_shapes():
    """A profile's per-layer densities set the projection keep (Q and O by head density, K and
    V read whole), its used predictors the predictor bytes; a profile whose MLP width or head
    count differ from the model's is refused by name (its densities are fractions of them)."""
    import dataclasses

    import torch

    from dejavu_compile.plan import account_from_profile, table
    from dejavu_compile.profile import BlockProfile, LayerProfile, ModelIdentity, Profile, ProfileError

    m = ModelBytes("m", num_layers=2, hidden_size=8, num_heads=4, num_kv_heads=2, head_dim=2,
                   intermediate_size=16, vocab_size=10, gated=False, tied=True)
    ident = ModelIdentity("calibrated", "opt", 8, 2, 16, 4, 2, 2)
    profile = Profile(ident, (
        LayerProfile(0),  # dense
        LayerProfile(1, mlp=BlockProfile("predictor", 0.25, units=16, rank=4),
                     attention=BlockProfile("oracle", 0.5, units=4))), predictor_file="p.pt")
    predictors = {"layers.1.mlp.w1": torch.zeros(4, 8), "layers.1.mlp.w2": torch.zeros(16, 4),
                  "layers.0.mlp.w1": torch.zeros(100, 8)}  # layer 0 is dense: not read
    account = account_from_profile(m, profile, predictors)
    # per layer: MLP 2*8*16*2 = 512 B, Q+O 2*8*8*2 = 256 B, K+V 2*8*4*2 = 128 B
    assert m.mlp_bytes == 512 and m.attention_bytes == 384
    assert account.projection_keep == (896 + 0.25 * 512 + 0.5 * 256 + 128) / (2 * 896)
    assert account.predictor_bytes == (32 + 64) * 2
    assert "projection keep 0.7143 (all projections)" in table(account, [16])  # 1280 / 1792
    for field, value, says in (("intermediate_size", 32, 16), ("num_kv_heads", 4, 2),
                               ("num_layers", 3, 2)):
        other = dataclasses.replace(m, **{field: value})
        with pytest.raises(ProfileError, match=f"profile for 'calibrated' does not fit 'm': its "
                                               f"shape has {field}={value}, the profile says {says}"):
            account_from_profile(other, profile)
