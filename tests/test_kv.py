"""KV-cache selection: the scoring and selection ops against brute force, the policies, and
decoding from the gathered cache, alone and composed with projection sparsity."""

from __future__ import annotations

import pytest
import torch

from dejavu_compile import kv

from .conftest import VOCAB


def _brute_scores(q, k, scale):
    b, h, w, _ = q.shape
    kvh, t = k.shape[1], k.shape[2]
    group = h // kvh
    out = torch.zeros(b, kvh, t, dtype=torch.float64)
    for head in range(h):
        for j in range(w):
            pos = t - w + j
            keys = k[:, head // group, : pos + 1].double()  # [B, pos + 1, hd]
            logits = (q[:, head, j : j + 1].double() @ keys.transpose(-1, -2))[:, 0]
            probs = (logits * scale).softmax(-1)
            out[:, head // group, : pos + 1] += probs
    return out


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("h,kvh,w,t", [(4, 2, 5, 13), (3, 1, 1, 7), (6, 6, 7, 7)])
def test_kv_scores_match_brute_force(dtype, h, kvh, w, t):
    gen = torch.Generator().manual_seed(h * 100 + t)
    q = torch.randn(2, h, w, 8, generator=gen).to(dtype)
    k = torch.randn(2, kvh, t, 8, generator=gen).to(dtype)
    got = torch.ops.dejavu.kv_scores(q, k, 0.35)
    torch.testing.assert_close(got.double(), _brute_scores(q, k, 0.35), atol=1e-3, rtol=1e-3)
    # each observation query's probabilities sum to one, per query head
    torch.testing.assert_close(got.sum(-1), torch.full((2, kvh), float(w * h // kvh)),
                               atol=1e-3, rtol=1e-4)


def test_kv_select_keeps_sinks_window_and_top_scores():
    t, budget, sinks, window = 40, 12, 2, 3
    scores = torch.rand(1, 2, t, generator=torch.Generator().manual_seed(0)) * 0.01
    scores[0, 0, 20] = 5.0  # a spike: smoothing spreads it to its neighbours
    scores[0, 1, 9] = 5.0
    idx = torch.ops.dejavu.kv_select(scores, budget, sinks, window, 3)
    assert idx.shape == (1, 2, budget) and idx.dtype == torch.int64
    for head, spike in ((0, 20), (1, 9)):
        kept = idx[0, head].tolist()
        assert kept == sorted(kept) and len(set(kept)) == budget
        assert {0, 1, t - 3, t - 2, t - 1} <= set(kept)
        assert {spike - 1, spike, spike + 1} <= set(kept)
    assert torch.ops.dejavu.kv_select(scores, t + 5, sinks, window, 3).shape[-1] == t
    with pytest.raises(ValueError, match="below sinks"):
        torch.ops.dejavu.kv_select(scores, 4, sinks, window, 3)


def _ids(n, seed=0):
    return torch.randint(3, VOCAB, (1, n), generator=torch.Generator().manual_seed(seed))


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_dense_policy_equals_generate(tiny, arch):
    model = tiny(arch)
    ids = _ids(90)
    want = model.generate(ids, max_new_tokens=6, do_sample=False)[:, ids.shape[1]:]
    got, sel = kv.generate(model, ids, 6, "dense")
    assert torch.equal(got, want) and sel.kept_tokens == 90
    full, _ = kv.generate(model, ids, 6, "scored", keep=1.0)  # keeping all = dense
    assert torch.equal(full, want)


def test_policies_gather_the_budget(tiny):
    from transformers import DynamicCache

    model = tiny("llama")
    ids = _ids(200)
    for policy in ("scored", "shared", "window"):
        cache = DynamicCache(config=model.config)
        ctx = kv._scoring(model) if policy in kv.SCORED else kv.contextlib.nullcontext()
        with torch.no_grad(), ctx as scores:
            model.forward(input_ids=ids, past_key_values=cache, use_cache=True)
        full = [layer.keys.clone() for layer in cache.layers]
        sel = kv.select(cache, policy, 0.5, scores)
        assert sel.kept_tokens == 100
        for i, layer in enumerate(cache.layers):
            idx = sel.kept[i]
            assert layer.keys.shape[2] == 100 and layer.keys.is_contiguous()
            assert idx[..., :4].tolist() == [[[0, 1, 2, 3]] * idx.shape[1]]
            assert set(range(136, 200)) <= set(idx[0, 0].tolist())  # observation window
            torch.testing.assert_close(layer.keys[0, 1], full[i][0, 1, idx[0, 1]])
        if policy == "window":
            assert sel.kept[0][0, 0].tolist() == [0, 1, 2, 3, *range(104, 200)]
        if policy == "shared":  # one selection per layer, from the scores summed over KV heads
            for i, idx in sel.kept.items():
                assert torch.equal(idx[0, 0], idx[0, 1])
                want = torch.ops.dejavu.kv_select(scores[i].sum(1, keepdim=True), 100, kv.SINKS,
                                                  kv.WINDOW, kv.SHARED_SMOOTH)
                assert torch.equal(idx[0, 0], want[0, 0])
    assert model.config._attn_implementation == "sdpa"  # restored after scoring


def test_policies_share_one_prefill_and_decode_as_alone(tiny):
    """Every policy decodes from its own copy of one prefill: the same tokens as alone."""
    model = tiny("llama")
    ids = _ids(150)
    together = kv.generate_policies(model, ids, 5, kv.POLICIES, keep=0.5)
    assert list(together) == list(kv.POLICIES)
    for policy in kv.POLICIES:
        alone, sel = kv.generate(model, ids, 5, policy, keep=0.5)
        assert torch.equal(together[policy][0], alone)
        assert together[policy][1].kept_tokens == sel.kept_tokens
    with pytest.raises(ValueError, match="KV policy must be one of"):
        kv.generate_policies(model, ids, 2, ("dense", "random"))
    # the default is the per-layer selection (the admissible one on the retrieval trials)
    default, sel = kv.generate(model, ids, 5, keep=0.5)
    assert sel.policy == "shared" and torch.equal(default, together["shared"][0])


def test_kv_selection_composes_with_projection_sparsity(tiny):
    model = tiny("llama")
    ids = _ids(150)
    want, _ = kv.generate(model, ids, 5, "scored", keep=0.5)
    compiled = torch.compile(model, backend="dejavu",
                             options={"selector": "oracle", "mlp_density": 1.0})
    got, _ = kv.generate(model, ids, 5, "scored", keep=0.5, decode=compiled)
    assert torch.equal(got, want)
    import dejavu_compile

    assert dejavu_compile.report(model).counters["sparse_mlp[oracle]"] >= 2


def test_sliding_window_layers_are_refused(tiny):
    model = tiny("gemma3")
    with pytest.raises(NotImplementedError, match="sliding-window"):
        kv.generate(model, _ids(100), 3, "window", keep=0.5)


def _decode(model, ids, steps=3):
    out = model(ids[:, :-steps], use_cache=True)
    cache, logits = out.past_key_values, []
    for i in range(steps):
        pos = ids.shape[1] - steps + i
        logits.append(model(ids[:, pos:pos + 1], past_key_values=cache, use_cache=True).logits)
    return torch.cat(logits, 1)


def _decode_attention_calls(fn) -> tuple[object, int]:
    from torch.profiler import profile

    with profile() as prof:
        result = fn()
    return result, sum(e.count for e in prof.key_averages() if e.key == "dejavu::decode_attention")


@pytest.mark.parametrize("arch", ["llama", "opt"])
def test_decode_attention_matches_sdpa(tiny, arch):
    """``use_decode_attention`` routes each decode step's attention through the op (once per
    layer and step) and prefill through SDPA; the logits match SDPA's."""
    model = tiny(arch)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = _decode(model, ids)
        kv.use_decode_attention(model)
        got, calls = _decode_attention_calls(lambda: _decode(model, ids))
    assert calls == 3 * model.config.num_hidden_layers
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_decode_attention_blocks_are_discovered_and_sparsified(tiny):
    """The backend finds attention blocks around ``dejavu::decode_attention`` as around SDPA: with
    the oracle at half the heads, the compiled decode equals the eager model with the same op."""
    import dejavu_compile

    model = tiny("llama")
    kv.use_decode_attention(model)
    ids = torch.randint(0, VOCAB, (1, 10), generator=torch.Generator().manual_seed(1))
    opts = {"selector": "oracle", "mlp_density": 1.0, "attention_density": 1.0}
    with torch.no_grad():
        want = _decode(model, ids)
        compiled = torch.compile(model, backend="dejavu", options=opts)
        got, calls = _decode_attention_calls(lambda: _decode(compiled, ids))
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    assert calls > 0
    rep = dejavu_compile.report(model)
    decode_layers = [r for r in rep.layers if r.attention.selector == "oracle"]
    assert len(decode_layers) == model.config.num_hidden_layers


def test_decode_attention_with_padding_matches_sdpa(tiny):
    """A left-padded batch: the decode steps pass a boolean key mask to the op; generation is
    the same as with SDPA."""
    model = tiny("llama")
    ids = torch.randint(1, VOCAB, (2, 9), generator=torch.Generator().manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=0,
                  output_logits=True, return_dict_in_generate=True)
    with torch.no_grad():
        want = model.generate(ids, **kwargs)
        kv.use_decode_attention(model)
        got, calls = _decode_attention_calls(lambda: model.generate(ids, **kwargs))
    assert calls > 0
    assert torch.equal(got.sequences, want.sequences)
    torch.testing.assert_close(torch.stack(got.logits), torch.stack(want.logits), atol=1e-5,
                               rtol=1e-5)
