"""Lazy K/V (option ``lazy_kv``, paper section 4.2): keys and values of the selected heads only,
a head's missing positions filled in from the kept inputs when it is next selected. The
reference against a dense projection, the Triton kernel (``TRITON_INTERPRET=1`` on CPU, compiled
on a GPU) against the reference, the pass on a tiny OPT, and the per-cache state."""

from __future__ import annotations

import gc
import operator
import os

import pytest
import torch
import torch.nn.functional as F
from dejavu_compile.kernels import kv_state, lazy_kv, ops
from dejavu_compile.kernels import reference as ref

from dejavu_compile import bench

DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _weights(heads, hd, d, dtype, gen, bias=True):
    def rand(*shape):
        return (torch.randn(*shape, generator=gen) * 0.2).to(DEVICE, dtype)

    return (rand(heads * hd, d), rand(heads * hd) if bias else None,
            rand(heads * hd, d), rand(heads * hd) if bias else None)


def _dense(xs, w, b, heads, hd):
    """[B, H, T, hd]: the dense projection of every position's input."""
    out = F.linear(xs.float(), w.float(), None if b is None else b.float())
    return out.view(xs.shape[0], xs.shape[1], heads, hd).transpose(1, 2)


def _steps(impl, dtype, batch=1, heads=5, hd=16, d=40, length=24, prompt=6, steps=10,
           bias=True, seed=0):
    """A dense prefill (written as an eager prefill would), then ``steps`` decode steps with
    random selections through ``impl``; returns the cache, every input, and the selections."""
    gen = torch.Generator().manual_seed(seed)
    wk, bk, wv, bv = _weights(heads, hd, d, dtype, gen, bias)
    xs = (torch.randn(batch, prompt + steps, d, generator=gen)).to(DEVICE, dtype)
    keys = torch.zeros(batch, heads, length, hd, device=DEVICE, dtype=dtype)
    values = torch.zeros_like(keys)
    keys[:, :, :prompt] = _dense(xs[:, :prompt], wk, bk, heads, hd).to(dtype)
    values[:, :, :prompt] = _dense(xs[:, :prompt], wv, bv, heads, hd).to(dtype)
    chosen = []
    for t in range(prompt, prompt + steps):
        k = 1 + t % 3  # one selected head included
        idx = torch.stack([torch.randperm(heads, generator=gen)[:k] for _ in range(batch)])
        idx = idx[:, None].to(DEVICE)
        impl(xs[:, t:t + 1], idx, wk, bk, wv, bv, keys, values,
             torch.tensor([t], device=DEVICE))
        chosen.append(idx)
    return keys, values, xs, (wk, bk, wv, bv), chosen


def _check(keys, values, xs, weights, chosen, heads, hd, prompt, tol):
    wk, bk, wv, bv = weights
    want_k, want_v = _dense(xs, wk, bk, heads, hd), _dense(xs, wv, bv, heads, hd)
    end = xs.shape[1]
    for b in range(keys.shape[0]):
        last = chosen[-1][b].flatten().tolist()
        for h in range(heads):
            if h in last:  # a head selected now holds every position up to this one
                torch.testing.assert_close(keys[b, h, :end].float(), want_k[b, h], **tol)
                torch.testing.assert_close(values[b, h, :end].float(), want_v[b, h], **tol)
            else:  # the new position of a head not selected is zero (missing)
                assert keys[b, h, end - 1].eq(0).all() and values[b, h, end - 1].eq(0).all()


def _op(*args):
    ops.lazy_kv(*args)


@pytest.mark.parametrize("batch", [1, 2])
def test_reference_fills_missing_positions_when_a_head_is_selected_again(batch):
    keys, values, xs, weights, chosen = _steps(_op if DEVICE == "cpu" else _ref_on_state,
                                               torch.float32, batch=batch)
    _check(keys, values, xs, weights, chosen, 5, 16, 6, dict(atol=1e-5, rtol=1e-5))


def _ref_on_state(x, idx, wk, bk, wv, bv, keys, values, pos):
    state = kv_state.lazy_state(keys, x.shape[-1], x.dtype)
    ref.lazy_kv(x, idx, wk, bk, wv, bv, keys, values, pos, state.inputs, state.valid)


_CONFIGS = {  # the decode step's default (d split in two), one position a tile, the
    # tensor-core form, each over the whole of d and split
    "gemv4_split2": None,
    "gemv1": {"BLOCK_P": 1, "DOT": False, "BLOCK_C": 16, "BLOCK_K": 32, "SPLIT": 1,
              "num_warps": 4},
    "dot": {"BLOCK_P": 16, "DOT": True, "BLOCK_C": 16, "BLOCK_K": 32, "SPLIT": 1,
            "num_warps": 4},
    "dot_split3": {"BLOCK_P": 16, "DOT": True, "BLOCK_C": 16, "BLOCK_K": 16, "SPLIT": 3,
                   "num_warps": 4},
}
# on a GPU also every tile the decode step's autotuner picks among (each grid ships its own)
_TILES = {} if DEVICE == "cpu" else {
    f"tile_c{t['BLOCK_C']}_k{t['BLOCK_K']}_s{t['SPLIT']}": t for t in lazy_kv.DECODE_TILES}
_CONFIGS.update(_TILES)


_SHAPES = [(torch.float16, True, 1, 16), (torch.bfloat16, False, 2, 24)]


# each form of the product with each grid; under the interpreter the two shapes take turns so
# that each form and each grid meets both (every pair of the three covered; the whole product,
# 16 cases, took 4 minutes of the suite, three of them the larger shape's); on a GPU the whole
# product (36 cases with the decode tiles)
_KERNEL_CASES = [(*shape, config, grid) for i, config in enumerate(_CONFIGS)
                 for j, grid in enumerate(lazy_kv.GRIDS)
                 for shape in (_SHAPES if DEVICE == "cuda" else [_SHAPES[(i + j) % 2]])]


def _case_id(case):
    dtype, bias, batch, hd, config, grid = case
    return f"{str(dtype)[6:]}-{'bias' if bias else 'nobias'}-b{batch}-hd{hd}-{config}-{grid}"


@pytest.mark.parametrize("dtype,bias,batch,hd,config,grid", _KERNEL_CASES,
                         ids=[_case_id(c) for c in _KERNEL_CASES])
def test_kernel_matches_the_reference(dtype, bias, batch, hd, config, grid):
    """Odd sizes (d 40, head dim 24 over tiles of 16), one to three heads selected a step,
    each form of the kernel's product, each grid (over the selection's slots, over heads),
    fp16 and bf16."""
    def kernel(*args):
        lazy_kv.lazy_kv(*args, config=_CONFIGS[config], grid=grid)

    shape = dict(batch=batch, hd=hd, bias=bias, seed=3)
    got = _steps(kernel, dtype, **shape)
    want = _steps(_ref_on_state, dtype, **shape)
    tol = dict(atol=2e-2, rtol=2e-2)
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)
    _check(*got[:4], got[4], 5, hd, 6, tol)
    # the split form's sums and tile counters are left zero for the next call
    sums, counts, _ = kv_state.split_workspace(got[0], 5 * hd)
    assert not sums.any() and not counts.any()
    assert not kv_state.lazy_state(got[0], 40, dtype).counts.any()


@pytest.mark.parametrize("grid", lazy_kv.GRIDS)
def test_kernel_takes_pads_repeats_and_a_shared_row(grid):
    """Selections as a union or a padded top-k can give them: ids of -1 and past the heads
    (ignored), a head named twice (computed once: its sums are added once), and one id row
    shared by a batch of two; the same cache and query as the reference's over 5 steps."""
    rows = [[[3, -1, 3]], [[0, 7, 2]], [[-1, -1, 1]], [[4, 4, 4]], [[2, 0, 1]]]
    gen = torch.Generator().manual_seed(13)
    dtype, batch, heads, hd, d, prompt = torch.float16, 2, 5, 16, 40, 4
    wq, bq = _weights(heads, hd, d, dtype, gen)[:2]
    wk, bk, wv, bv = _weights(heads, hd, d, dtype, gen)
    xs = torch.randn(batch, prompt + len(rows), d, generator=gen).to(DEVICE, dtype)
    caches, queries = [], []
    for impl in ("kernel", "reference"):
        keys = torch.zeros(batch, heads, 12, hd, device=DEVICE, dtype=dtype)
        values = torch.zeros_like(keys)
        keys[:, :, :prompt] = _dense(xs[:, :prompt], wk, bk, heads, hd).to(dtype)
        values[:, :, :prompt] = _dense(xs[:, :prompt], wv, bv, heads, hd).to(dtype)
        for t, row in enumerate(rows, start=prompt):
            idx = torch.tensor(row, device=DEVICE)  # [1, k]: one row for both sequences
            pos = torch.tensor([t], device=DEVICE)
            if impl == "kernel":
                out = torch.full((batch, 1, heads * hd), float("nan"), device=DEVICE,
                                 dtype=dtype)
                q = lazy_kv.lazy_qkv(xs[:, t:t + 1], idx, wq, bq, wk, bk, wv, bv, keys,
                                     values, pos, config=_CONFIGS["dot_split3"], out=out,
                                     grid=grid)
            else:
                q = _ref_qkv_on_state(xs[:, t:t + 1], idx, wq, bq, wk, bk, wv, bv, keys,
                                      values, pos)
            queries.append(q)
        caches.append((keys, values, kv_state.lazy_state(keys, d, dtype).valid.clone()))
    tol = dict(atol=2e-2, rtol=2e-2)
    for g, w in zip(caches[0], caches[1], strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)
    for g, w in zip(queries[:len(rows)], queries[len(rows):], strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)


def _with_query(impl, wq, bq, out):
    """A ``_steps`` impl that runs ``lazy_qkv`` through ``impl`` with the query weights
    ``wq``, ``bq`` and keeps each step's query in ``out``."""
    def run(x, idx, wk, bk, wv, bv, keys, values, pos):
        out.append(impl(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos))
    return run


def _ref_qkv_on_state(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos):
    state = kv_state.lazy_state(keys, x.shape[-1], x.dtype)
    return ref.lazy_qkv(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos, state.inputs,
                        state.valid)


_QUERY_CASES = [
    (torch.float16, True, 1, 16, "gemv4_split2", "heads"),
    (torch.bfloat16, False, 2, 24, "dot_split3", "selection"),
    (torch.float16, True, 2, 16, "gemv1", "heads"), (torch.float16, False, 1, 24, "dot", "selection"),
    *[(torch.float16, True, 1, 24, name, grid) for name in _TILES
      for grid in lazy_kv.GRIDS]]


@pytest.mark.parametrize("dtype,bias,batch,hd,config,grid", _QUERY_CASES,
                         ids=[_case_id(c) for c in _QUERY_CASES])
def test_fused_query_matches_the_reference(dtype, bias, batch, hd, config, grid):
    """``lazy_qkv``: the query of the selected heads (zeros for the others) from the same
    launch as their keys and values, which stay as ``lazy_kv`` leaves them. Each form and
    shape on one grid, each grid with two of them (``test_kernel_matches_the_reference`` runs
    each form on both grids)."""
    gen = torch.Generator().manual_seed(11)
    wq, bq = _weights(5, hd, 40, dtype, gen, bias)[:2]
    got_q, want_q = [], []
    shape = dict(batch=batch, hd=hd, bias=bias, seed=3)
    def kernel(x, *args):  # into rows poisoned with NaN: the kernel writes every element
        out = torch.full((x.shape[0], 1, wq.shape[0]), float("nan"), device=DEVICE, dtype=dtype)
        return lazy_kv.lazy_qkv(x, *args, config=_CONFIGS[config], out=out, grid=grid)

    got = _steps(_with_query(kernel, wq, bq, got_q), dtype, **shape)
    want = _steps(_with_query(_ref_qkv_on_state, wq, bq, want_q), dtype, **shape)
    tol = dict(atol=2e-2, rtol=2e-2)
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g.float(), w.float(), **tol)
    for g, w, idx in zip(got_q, want_q, got[4], strict=True):
        assert g.shape == (batch, 1, 5 * hd)
        torch.testing.assert_close(g.float(), w.float(), **tol)
        heads = g.view(batch, 5, hd).abs().sum(-1) > 0  # nonzero exactly where selected
        assert torch.equal(heads, ref.selected_heads(idx, batch, 1, 5).to(heads.device))
    sums, counts, _ = kv_state.split_workspace(got[0], 5 * hd, 3)
    assert not sums.any() and not counts.any()


def test_deterministic_mode_runs_the_kernel_unsplit():
    """Under ``torch.use_deterministic_algorithms`` a decode step runs a form without atomics
    (SPLIT 1; the split form's sums meet in no fixed order), a given split config is refused
    with a clear error, and the kernel still matches the reference."""
    assert lazy_kv.step_config(1) is None  # autotuned
    assert lazy_kv.step_config(4) is lazy_kv.PREFILL_FIXED
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        assert lazy_kv.step_config(1)["SPLIT"] == 1
        assert lazy_kv.step_config(1, _CONFIGS["dot"]) is _CONFIGS["dot"]
        with pytest.raises(ValueError, match="SPLIT > 1.*deterministic"):
            lazy_kv.step_config(1, _CONFIGS["dot_split3"])
        shape = dict(batch=1, hd=16, bias=True, seed=5)
        got = _steps(lazy_kv.lazy_kv, torch.float16, **shape)
    finally:
        torch.use_deterministic_algorithms(before)
    want = _steps(_ref_on_state, torch.float16, **shape)
    for g, w in zip(got[:2], want[:2], strict=True):
        torch.testing.assert_close(g.float(), w.float(), atol=2e-2, rtol=2e-2)


def test_kernel_prefill_computes_every_head():
    """Several new tokens (a prefill through the op): every head, every new position."""
    gen = torch.Generator().manual_seed(1)
    heads, hd, d = 3, 16, 40
    wk, bk, wv, bv = _weights(heads, hd, d, torch.float16, gen)
    xs = torch.randn(1, 20, d, generator=gen).to(DEVICE, torch.float16)
    keys = torch.zeros(1, heads, 32, hd, device=DEVICE, dtype=torch.float16)
    values = torch.zeros_like(keys)
    lazy_kv.lazy_kv(xs, None, wk, bk, wv, bv, keys, values, torch.arange(20, device=DEVICE))
    tol = dict(atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(keys[:, :, :20].float(), _dense(xs, wk, bk, heads, hd), **tol)
    torch.testing.assert_close(values[:, :, :20].float(), _dense(xs, wv, bv, heads, hd), **tol)
    state = kv_state.lazy_state(keys, d, torch.float16)
    assert state.valid.eq(20).all()
    # every new position's input is kept (20 rows of 40, shared out over the programs)
    assert torch.equal(state.inputs[:, :20], xs) and not state.inputs[:, 20:].any()


def test_a_new_generation_after_an_eager_prefill_keeps_its_entries():
    """The state is a hint: after a prefill that did not go through the op (eager, every head
    written), a head whose valid prefix is behind finds those positions present (non-zero) and
    does not overwrite them from inputs of an earlier generation."""
    keys, values, xs, weights, chosen = _steps(_ref_on_state, torch.float32, steps=6, seed=4)
    # a second generation on the same cache: new inputs, an eager prefill over 9 positions
    gen = torch.Generator().manual_seed(9)
    heads, hd = 5, 16
    xs2 = torch.randn(1, 11, xs.shape[2], generator=gen).to(DEVICE)
    wk, bk, wv, bv = weights
    keys.zero_()
    values.zero_()
    keys[:, :, :9] = _dense(xs2[:, :9], wk, bk, heads, hd)
    values[:, :, :9] = _dense(xs2[:, :9], wv, bv, heads, hd)
    last = []
    for t in (9, 10):
        idx = torch.tensor([[[t % heads, (t + 2) % heads]]], device=DEVICE)
        _ref_on_state(xs2[:, t:t + 1], idx, wk, bk, wv, bv, keys, values,
                      torch.tensor([t], device=DEVICE))
        last.append(idx)
    _check(keys, values, xs2, weights, last, heads, hd, 9, dict(atol=1e-5, rtol=1e-5))


def test_a_selection_needs_one_id_row_per_sequence_or_one_shared():
    """``id_rows``, the one check of a selection's rows for the reference and the kernel: one
    row per sequence or one shared row; any other count is refused, naming both counts."""
    per_row = torch.tensor([[[0, 2]], [[1, 3]]])
    assert ref.id_rows(per_row, 2).shape == (2, 2)
    assert ref.id_rows(torch.tensor([[0, 2]]), 3).shape == (1, 2)
    with pytest.raises(ValueError, match="lazy_kv: 2 id rows for a batch of 3"):
        ref.id_rows(per_row, 3)
    assert ref.selected_heads(torch.tensor([[0, -1, 9]]), 2, 1, 4).tolist() == \
        [[True, False, False, False]] * 2  # shared row; padding and ids past the heads ignored


def test_the_state_is_per_cache_and_freed_with_it():
    gc.collect()  # the caches of earlier tests
    before = kv_state.live_states()
    a = torch.zeros(1, 2, 8, 16)
    b = torch.zeros(1, 2, 8, 16)
    sa = kv_state.lazy_state(a, 12, torch.float32)
    assert kv_state.lazy_state(a, 12, torch.float32) is sa
    assert kv_state.lazy_state(b, 12, torch.float32) is not sa
    assert kv_state.live_states() == before + 2
    del a, b, sa
    gc.collect()
    assert kv_state.live_states() == before


def test_positions_must_be_consecutive():
    x = torch.zeros(1, 2, 8)
    keys = torch.zeros(1, 2, 8, 4)
    with pytest.raises(ValueError, match="consecutive"):
        ops.lazy_kv(x, None, torch.zeros(8, 8), None, torch.zeros(8, 8), None, keys,
                    torch.zeros_like(keys), torch.tensor([3, 5]))


def _decode(model, forward, ids, steps, length=24):
    cache, mask = bench._prefilled(model, ids, length)
    tok, logits = ids[:, -1:], []
    with torch.no_grad():
        for t in range(steps):
            pos = torch.tensor([ids.shape[1] + t])
            out = forward(input_ids=tok, past_key_values=cache, cache_position=pos,
                          position_ids=pos[None], attention_mask=mask, use_cache=True)
            logits.append(out.logits)
            tok = out.logits[:, -1:].argmax(-1)
    return torch.cat(logits), cache


def test_the_pass_gives_the_logits_of_dense_kv(tiny, tmp_path):
    """A tiny OPT with random attention predictors (head density 0.5, layer 0 dense): decoding
    with lazy K/V gives the logits of the same sparse heads over dense K/V; the heads the
    predictors skipped at a step hold zeros there; the report counts the rewritten blocks."""
    from dejavu_compile.backend import report

    model = tiny("opt")
    profile = bench.random_profile(model, 1.0, 0.5, 8, tmp_path / "p.yaml")
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    runs = {}
    for lazy, fuse in ((False, False), (True, False), (True, True)):
        torch._dynamo.reset()
        forward = torch.compile(model.forward, backend="dejavu",
                                options={"profile": profile, "lazy_kv": lazy, "fuse_qkv": fuse})
        runs[lazy, fuse] = _decode(model, forward, ids, 6)
        counters = [g.counters for g in report(model).graphs][-2:]
        if lazy:
            # layer 1 only (layer 0 is dense), in each decode graph
            assert [c.get("lazy_kv") for c in counters] == [1, 1]
            # with fuse_qkv its query projection joins the op (option fuse_qkv)
            assert [c.get("fuse_qkv") for c in counters] == ([1, 1] if fuse else [None, None])
    for fused in (False, True):
        torch.testing.assert_close(runs[True, fused][0], runs[False, False][0], atol=1e-5,
                                   rtol=1e-5)
        lazy_keys = runs[True, fused][1].layers[1].keys[0, :, 7:13]
        assert lazy_keys.flatten(1).eq(0).all(1).any()  # some head was skipped
        torch.testing.assert_close(runs[True, fused][1].layers[0].keys,
                                   runs[False, False][1].layers[0].keys)


def test_blocks_it_cannot_rewrite_keep_dense_kv_and_say_why(tiny, tmp_path):
    """Llama's keys go through the rotary embedding: its blocks keep dense K/V, reported."""
    from dejavu_compile.backend import report

    model = tiny("llama")
    profile = bench.random_profile(model, 1.0, 0.5, 8, tmp_path / "p.yaml")
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    forward = torch.compile(model.forward, backend="dejavu",
                            options={"profile": profile, "lazy_kv": True})
    plain = _decode(model, model.forward, ids, 2)[0]
    torch._dynamo.reset()
    got = _decode(model, forward, ids, 2)[0]
    counters = report(model).counters
    assert "lazy_kv" not in counters
    assert any(name.startswith("lazy_kv_skipped[") for name in counters)
    assert got.shape == plain.shape


def test_with_lookahead_on_a_side_stream_it_joins_the_predictor(tiny, tmp_path, monkeypatch):
    """The CUDA form of lookahead, built on CPU (ops in order): ``lazy_kv`` reads the attention
    predictor's heads, so it gets the predictor's keep and slot as the query projection does
    (it joins the side stream before reading them); the logits are those of dense K/V."""
    from dejavu_compile.passes import lookahead

    from .test_backend import _capture

    monkeypatch.setattr(lookahead, "uses_side_stream", lambda x: True)
    model = tiny("opt")
    profile = bench.random_profile(model, 1.0, 0.5, 8, tmp_path / "p.yaml", lookahead=True)
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    logits = {}
    for lazy, fuse in ((False, False), (True, False), (True, True)):
        torch._dynamo.reset()
        backend, graphs = _capture({"profile": profile, "lazy_kv": lazy, "fuse_qkv": fuse})
        logits[lazy, fuse] = _decode(model, torch.compile(model.forward, backend=backend), ids,
                                     4)[0]
        if not lazy:
            continue
        # with fuse_qkv, the one op that reads the heads joins (option fuse_qkv)
        gm, ctx = graphs[-1]
        name = "lazy_qkv" if fuse else "lazy_kv"
        lazy_nodes = [n for n in gm.graph.nodes if lookahead.is_op(n, name)]
        assert len(lazy_nodes) == 1
        ahead = lazy_nodes[0].args[1]
        assert lookahead.is_op(ahead, "predict_ahead")
        keep, slot = lazy_nodes[0].args[-2:]
        assert keep is ctx.inputs[(0, "attention")] and slot == ahead.args[-1] >= 0
        assert not any(lookahead.is_op(n, "sparse_head_proj") for n in gm.graph.nodes) == fuse
        torch.testing.assert_close(logits[lazy, fuse], logits[False, False], atol=1e-5,
                                   rtol=1e-5)


def _decode_off_and_on(tmp_path, option: str) -> dict:
    """A 4-layer OPT (random predictors at 0.5, lazy K/V) decoded 4 steps after a 7-token
    prompt with ``option`` off and on: for each (key False, True) the logits, the cache's
    lengths, and the last graph the backend compiled with its pass context."""
    import transformers as tf

    from .test_backend import _capture

    cfg = tf.OPTConfig(vocab_size=100, hidden_size=64, num_hidden_layers=4,
                       num_attention_heads=4, max_position_embeddings=256, ffn_dim=96,
                       word_embed_proj_dim=64)
    torch.manual_seed(0)
    model = tf.OPTForCausalLM(cfg).eval()
    profile = bench.random_profile(model, 0.5, 0.5, 8, tmp_path / "p.yaml")
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    runs = {}
    for on in (False, True):
        torch._dynamo.reset()
        backend, graphs = _capture({"profile": profile, "lazy_kv": True, option: on})
        logits, cache = _decode(model, torch.compile(model.forward, backend=backend), ids, 4)
        runs[on] = (logits, [layer.cumulative_length.item() for layer in cache.layers],
                    *graphs[-1])
    torch.testing.assert_close(runs[True][0], runs[False][0], atol=1e-6, rtol=1e-6)
    assert runs[True][1] == runs[False][1] == [11] * 4
    return runs


def test_batched_positions_give_the_same_steps(tmp_path):
    """Option ``batch_positions``: a 4-layer OPT's three lazy blocks take their cache positions
    from one foreach op before the first of them, and their lengths move on in one more; the
    per-layer ``arange + length`` and ``length.add_`` are gone, and the logits and the cache's
    lengths are those of the per-layer form."""
    from dejavu_compile.passes import lookahead

    for batched, (_, _, gm, ctx) in _decode_off_and_on(tmp_path, "batch_positions").items():
        nodes = list(gm.graph.nodes)
        bumps = [n for n in nodes if n.op == "call_method" and n.target == "add_"]
        foreach = [n.target for n in nodes if n.target in (torch._foreach_add,
                                                           torch._foreach_add_)]
        first_lazy = min(i for i, n in enumerate(nodes) if lookahead.is_op(n, "lazy_qkv"))
        if batched:
            assert ctx.counters.values["positions_batched"] == 3
            assert foreach == [torch._foreach_add, torch._foreach_add_]
            assert len(bumps) == 1  # layer 0's (dense K/V), which other nodes read
            assert max(i for i, n in enumerate(nodes) if n.target in (
                torch._foreach_add, torch._foreach_add_)) < first_lazy
        else:
            assert "positions_batched" not in ctx.counters.values and not foreach
            assert len(bumps) == 4


def test_positions_from_the_length_give_the_same_steps(tmp_path):
    """Option ``positions_from_length``: in a 4-layer OPT's one-token steps the three lazy
    blocks read their layers' cache lengths as their positions, and the lengths move on in one
    foreach op just before the output; no ``arange`` or per-layer ``add_`` is left for them;
    the logits and the cache's lengths are those of the per-layer form."""
    from dejavu_compile.passes import lookahead

    aranges = {}
    for on, (_, _, gm, ctx) in _decode_off_and_on(tmp_path, "positions_from_length").items():
        nodes = list(gm.graph.nodes)
        lazy = [n for n in nodes if lookahead.is_op(n, "lazy_qkv")]
        bumps = [n for n in nodes if n.op == "call_method" and n.target == "add_"]
        foreach = [n for n in nodes if n.target is torch._foreach_add_]
        assert len(lazy) == 3
        if on:
            assert ctx.counters.values["positions_from_length"] == 3
            assert len(foreach) == 1 and nodes[-2] is foreach[0]  # last before the output
            lengths = foreach[0].args[0]
            assert [n.args[10] for n in lazy] == lengths
            assert all(n.op == "placeholder" for n in lengths)
            assert len(bumps) == 1  # layer 0's (dense K/V), which other nodes read
        else:
            assert "positions_from_length" not in ctx.counters.values and not foreach
            assert len(bumps) == 4
        aranges[on] = sum(n.target is torch.arange and n.args == (1,) for n in nodes)
    assert aranges[False] - aranges[True] == 3  # the lazy layers' positions


def test_positions_from_the_length_only_for_one_new_token():
    """``positions_from_length`` rewrites a lazy op's positions ``arange(1) + length`` (the
    length then read by the op, its bump moved to the end) and leaves ``arange(2) + length``,
    whose second position the length does not hold."""
    import torch.fx as fx
    from dejavu_compile.passes import lower
    from dejavu_compile.passes.context import PassContext

    from dejavu_compile.config import DejavuOptions

    def graph(n):
        g = fx.Graph()
        x, length = g.placeholder("x"), g.placeholder("length")
        positions = g.call_function(operator.add, (g.call_function(torch.arange, (n,)), length))
        g.call_method("add_", (length, n))
        out = g.call_function(torch.ops.dejavu.lazy_kv.default,
                              (x, None, x, None, x, None, x, x, positions))
        g.output(out)
        return fx.GraphModule(torch.nn.Module(), g), out

    for n in (1, 2):
        gm, lazy = graph(n)
        ctx = PassContext(DejavuOptions(selector="oracle", mlp_density=0.5), None, {}, [])
        lower.positions_from_length(gm, ctx)
        gm.graph.lint()
        targets = [node.target for node in gm.graph.nodes]
        if n == 1:
            assert ctx.counters.values["positions_from_length"] == 1
            assert lazy.args[8].op == "placeholder" and torch.arange not in targets
            assert targets[-2:] == [torch._foreach_add_, "output"]
        else:
            assert "positions_from_length" not in ctx.counters.values
            assert lazy.args[8].target is operator.add and torch._foreach_add_ not in targets


def test_fusing_the_query_moves_only_pure_late_inputs():
    """``fuse_qkv`` puts ``lazy_qkv`` where the query projection was, so inputs computed later
    (the cache positions in Hugging Face's graphs) move before it: each once, with what they
    read, a shared input before both of its users; never an in-place op, and never past one (a
    read moved before a write would read the old value)."""
    import torch.fx as fx
    from dejavu_compile.passes.sparsify import _hoist

    def graph(mutation):
        g = fx.Graph()
        x = g.placeholder("x")
        query = g.call_function(torch.neg, (x,))
        if mutation:
            g.call_method("add_", (x, 1))
        shared = g.call_function(torch.add, (x, 1))
        pos = g.call_function(torch.mul, (shared, 2))
        other = g.call_function(torch.sub, (shared, 3))
        g.output((query, pos, other))
        return g, query, pos, other

    g, query, pos, other = graph(mutation=False)
    nodes, moved = list(g.nodes), set()
    assert _hoist(pos, query, nodes, moved) and _hoist(other, query, nodes, moved)
    g.lint()  # every node after what it reads
    order = [n.name for n in g.nodes]
    assert order.index("add") < order.index("mul") < order.index("neg")
    assert order.index("sub") < order.index("neg") and len(moved) == 3
    g, query, pos, _ = graph(mutation=True)
    assert not _hoist(pos, query, list(g.nodes), set())  # it would pass x.add_(1)
    g = fx.Graph()
    x = g.placeholder("x")
    query = g.call_function(torch.neg, (x,))
    late = g.call_method("mul_", (x, 2))
    g.output((query, late))
    assert not _hoist(late, query, list(g.nodes), set())
