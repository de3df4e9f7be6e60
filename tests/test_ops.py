"""The dejavu ops against hand-written masked dense computations, and their registration."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from dejavu_compile.kernels import reference as ref

import dejavu_compile  # noqa: F401  (registers torch.ops.dejavu)

OPS = torch.ops.dejavu
TOL = {torch.float32: dict(atol=1e-5, rtol=1e-5), torch.float64: dict(atol=1e-10, rtol=1e-10)}


def _rand(*shape, dtype=torch.float32, seed=0):
    """Fresh random values scaled like trained weights (unit-variance outputs of a matvec)."""
    t = torch.randn(*shape, generator=torch.Generator().manual_seed(seed), dtype=dtype)
    return t / shape[-1] ** 0.5


def _random_selection(rows: int, n: int, k: int, seed: int = 0) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(n, generator=gen)[:k].sort().values for _ in range(rows)])


def _mask(sel: torch.Tensor, n: int) -> torch.Tensor:
    return torch.zeros(sel.shape[0], n).scatter_(1, sel, 1.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("act", ref.ACTIVATIONS)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("batch,k", [(1, 1), (1, 20), (3, 45), (2, 7)])
def test_sparse_mlp_equals_masked_dense(dtype, act, gated, batch, k):
    d, n, d_out = 33, 45, 29
    x = _rand(batch, 1, d, dtype=dtype)
    w1, w2_t = _rand(n, d, dtype=dtype, seed=1), _rand(n, d_out, dtype=dtype, seed=2)
    b1 = None if gated else _rand(n, dtype=dtype, seed=3)
    w_up = _rand(n, d, dtype=dtype, seed=4) if gated else None
    b2 = _rand(d_out, dtype=dtype, seed=5)
    sel = _random_selection(batch, n, k)
    out = OPS.sparse_mlp(x, sel.view(batch, 1, k), w1, b1, w_up, w2_t, b2, act)
    # Masked reference written out densely, in float64.
    x64 = x.view(batch, d).double()
    h = x64 @ w1.double().t() + (0 if b1 is None else b1.double())
    h = ref.activate(h, act)
    if gated:
        h = h * (x64 @ w_up.double().t())
    want = (h * _mask(sel, n).double()) @ w2_t.double() + b2.double()
    torch.testing.assert_close(out.view(batch, d_out).double(), want, **TOL[dtype])


@pytest.mark.parametrize("gated", [False, True])
def test_mlp_oracle_picks_largest_activations(gated):
    x = _rand(3, 1, 20)
    w1, w_up = _rand(50, 20, seed=1), _rand(50, 20, seed=2) if gated else None
    idx = OPS.select_mlp_oracle(x, w1, None, w_up, "relu", 10).view(3, 10)
    h = ref.mlp_hidden(x, w1, None, w_up, "relu").abs()
    for row in range(3):
        chosen = h[row, idx[row]]
        others = h[row][~_mask(idx[row : row + 1], 50).bool()[0]]
        assert chosen.min() >= others.max()
        assert torch.equal(idx[row], idx[row].sort().values)


@pytest.mark.parametrize("heads,k,head_dim", [(4, 1, 8), (6, 3, 5), (4, 4, 8)])
def test_head_projection_and_output_equal_masked_dense(heads, k, head_dim):
    d, batch = 19, 2
    x = _rand(batch, 1, d)
    wq, bq = _rand(heads * head_dim, d, seed=1), _rand(heads * head_dim, seed=2)
    wo_t, bo = _rand(heads * head_dim, d, seed=3), _rand(d, seed=4)
    sel = _random_selection(batch, heads, k)
    head_mask = _mask(sel, heads).repeat_interleave(head_dim, dim=1)
    q = OPS.sparse_head_proj(x, sel.view(batch, 1, k), wq, bq, head_dim).view(batch, -1)
    torch.testing.assert_close(q, (x.view(batch, d) @ wq.t() + bq) * head_mask, **TOL[torch.float32])
    attn = _rand(batch, 1, heads * head_dim, seed=5)
    o = OPS.sparse_head_out(attn, sel.view(batch, 1, k), wo_t, bo, head_dim).view(batch, d)
    want = (attn.view(batch, -1) * head_mask) @ wo_t + bo
    torch.testing.assert_close(o, want, **TOL[torch.float32])


def test_union_ids_are_the_rows_union_padded():
    sel = torch.tensor([[1, 4, 7], [4, 5, 9], [1, 5, 7]])
    union = ref.union_ids(sel.view(3, 1, 3), 12)
    assert union.shape == (1, 9)  # min(12 units, 3 rows x 3)
    assert union.tolist() == [[1, 4, 5, 7, 9, -1, -1, -1, -1]]
    full = ref.union_ids(torch.tensor([[0, 1], [2, 3]]), 4)
    assert full.tolist() == [[0, 1, 2, 3]]  # no room left for padding


@pytest.mark.parametrize("gated", [False, True])
def test_union_selection_equals_dense_masked_by_the_union(gated):
    """With ``union`` every row computes the neurons (heads) any row selected: the dense
    computation masked by the union of the rows' selections, the same mask for all rows."""
    d, n, d_out, batch, k = 16, 40, 12, 3, 6
    x = _rand(batch, 1, d)
    w1, b1 = _rand(n, d, seed=1), None if gated else _rand(n, seed=2)
    w_up = _rand(n, d, seed=3) if gated else None
    w2_t, b2 = _rand(n, d_out, seed=4), _rand(d_out, seed=5)
    sel = _random_selection(batch, n, k)
    union = _mask(sel, n).amax(0, keepdim=True)
    h = ref.mlp_hidden(x, w1, b1, w_up, "silu") * union
    out = OPS.sparse_mlp(x, sel.view(batch, 1, k), w1, b1, w_up, w2_t, b2, "silu", True)
    torch.testing.assert_close(out.view(batch, d_out), h @ w2_t + b2, **TOL[torch.float32])
    if gated:
        g = (x.view(batch, d) @ w1.t()).view(batch, 1, n)
        out = OPS.sparse_mlp_gated(x, sel.view(batch, 1, k), g, w_up, w2_t, b2, "silu", True)
        torch.testing.assert_close(out.view(batch, d_out), h @ w2_t + b2, **TOL[torch.float32])
    heads, head_dim = 5, 4
    hsel = _random_selection(batch, heads, 1, seed=3)
    hmask = _mask(hsel, heads).amax(0, keepdim=True).repeat_interleave(head_dim, dim=1)
    wq, bq = _rand(heads * head_dim, d, seed=6), _rand(heads * head_dim, seed=7)
    q = OPS.sparse_head_proj(x, hsel.view(batch, 1, 1), wq, bq, head_dim, True)
    torch.testing.assert_close(q.view(batch, -1), (x.view(batch, d) @ wq.t() + bq) * hmask,
                               **TOL[torch.float32])
    attn, wo_t = _rand(batch, 1, heads * head_dim, seed=8), _rand(heads * head_dim, d, seed=9)
    o = OPS.sparse_head_out(attn, hsel.view(batch, 1, 1), wo_t, None, head_dim, True)
    torch.testing.assert_close(o.view(batch, d), (attn.view(batch, -1) * hmask) @ wo_t,
                               **TOL[torch.float32])


@pytest.mark.parametrize("group", [1, 2, 3])
def test_head_oracle_ranks_by_output_norm(group):
    heads, head_dim, d = 6, 4, 10
    attn, wo_t = _rand(1, 1, heads * head_dim), _rand(heads * head_dim, d, seed=1)
    k = 2 if group < 3 else 1
    idx = OPS.select_heads_oracle(attn, wo_t, head_dim, k, group).view(-1)
    assert idx.numel() == k * group
    contrib = torch.stack([
        attn.view(heads, head_dim)[h] @ wo_t[h * head_dim : (h + 1) * head_dim] for h in range(heads)
    ]).norm(dim=-1) ** 2
    scores = contrib.view(-1, group).sum(-1)
    chosen_groups = (idx.view(k, group)[:, 0] // group)
    assert set(chosen_groups.tolist()) == set(scores.topk(k).indices.tolist())
    if group > 1:
        assert torch.equal(idx.view(k, group), chosen_groups[:, None] * group + torch.arange(group))


def test_predictor_selection_is_top_k_of_its_logits():
    x = _rand(2, 1, 12)
    w1, b1, w2, b2 = _rand(5, 12, seed=1), _rand(5, seed=2), _rand(30, 5, seed=3), _rand(30, seed=4)
    idx = OPS.select_predictor(x, w1, b1, w2, b2, "relu", 7, 1).view(2, 7)
    logits = torch.relu(x.view(2, 12) @ w1.t() + b1) @ w2.t() + b2
    want = logits.topk(7).indices.sort().values
    assert torch.equal(idx, want)


def test_gate_selector_and_gated_mlp():
    x = _rand(2, 1, 12)
    w_g, b_g, w_up, w2_t = _rand(30, 12, seed=1), _rand(30, seed=2), _rand(30, 12, seed=3), \
        _rand(30, 9, seed=4)
    g = x @ w_g.t() + b_g
    idx = OPS.select_gate(g, "silu", 7)
    want_idx = torch.nn.functional.silu(g).abs().view(2, 30).topk(7).indices.sort().values
    assert torch.equal(idx.view(2, 7), want_idx)
    # the gated MLP over the selected neurons is the dense one with the others zeroed
    h = torch.nn.functional.silu(g) * (x @ w_up.t())
    mask = torch.zeros_like(h).scatter_(-1, idx, 1.0)
    torch.testing.assert_close(OPS.sparse_mlp_gated(x, idx, g, w_up, w2_t, None, "silu"),
                               (h * mask) @ w2_t)


@pytest.mark.parametrize(
    "name,args",
    [
        ("select_gate", lambda: (_rand(1, 1, 8), "gelu_tanh", 3)),
        ("select_magnitude", lambda: (_rand(2, 1, 8), 3)),
        ("sparse_mlp_gated", lambda: (_rand(1, 1, 8), torch.tensor([[[0, 3]]]), _rand(1, 1, 6),
                                      _rand(6, 8), _rand(6, 5), None, "silu")),
        ("sparse_mlp", lambda: (_rand(1, 1, 8), torch.tensor([[[0, 3]]]), _rand(6, 8),
                                          _rand(6), None, _rand(6, 8), None, "relu")),
        ("select_mlp_oracle", lambda: (_rand(1, 1, 8), _rand(6, 8), None, _rand(6, 8),
                                                 "silu", 3)),
        ("select_heads_oracle", lambda: (_rand(1, 1, 8), _rand(8, 5), 2, 2, 1)),
        ("select_predictor", lambda: (_rand(1, 1, 8), _rand(3, 8), None, _rand(4, 3),
                                                None, "none", 2, 2)),
        ("sparse_head_proj", lambda: (_rand(1, 1, 8), torch.tensor([[[1]]]), _rand(8, 8),
                                                None, 4)),
        ("sparse_head_out", lambda: (_rand(1, 1, 8), torch.tensor([[[0]]]), _rand(8, 5),
                                               _rand(5), 4)),
    ],
)
def test_fake_implementation_matches_real(name, args):
    # What the passes rely on: the fake implementation gives the real output's shape and dtype.
    # (torch.library.opcheck segfaults inside torch 2.13 on CPU once Inductor has compiled CPU
    # kernels earlier in the same process, so the check is written out here.)
    from torch._subclasses.fake_tensor import FakeTensorMode

    op = getattr(torch.ops.dejavu, name).default
    real_args = args()
    want = op(*real_args)
    mode = FakeTensorMode()
    fake_args = [mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in real_args]
    with mode:
        got = op(*fake_args)
    assert got.shape == want.shape and got.dtype == want.dtype and got.device == want.device


def test_bucket_topk_takes_each_buckets_share():
    scores = _rand(3, 24, seed=5)
    ids = ref.bucket_topk(scores, 8, 4)
    assert ids.shape == (3, 8)
    for row, chosen in zip(scores, ids, strict=True):
        for b in range(4):  # two per bucket of six, the bucket's two largest
            mine = chosen[(chosen >= 6 * b) & (chosen < 6 * b + 6)]
            assert torch.equal(mine, (row[6 * b:6 * b + 6].topk(2).indices + 6 * b).sort().values)
    assert torch.equal(ref.bucket_topk(scores, 8, 1), ref.topk_indices(scores, 8))
    with pytest.raises(ValueError, match="buckets must divide"):
        ref.bucket_topk(scores, 6, 4)


@pytest.mark.parametrize("max_bucket", [1024, 2])  # the Triton selector, the PyTorch fallback
@pytest.mark.parametrize("buckets", [1, 3])
def test_gpu_predictor_selects_the_same_set_with_buckets(monkeypatch, max_bucket, buckets):
    from dejavu_compile.kernels import bucket_select, predictor

    monkeypatch.setattr(bucket_select, "MAX_BUCKET", max_bucket)
    x = _rand(3, 1, 12)
    w1, b1, w2, b2 = _rand(5, 12, seed=1), _rand(5, seed=2), _rand(30, 5, seed=3), _rand(30, seed=4)
    want = OPS.select_predictor(x, w1, b1, w2, b2, "relu", 6, 2, buckets)
    got = predictor.select_predictor(x, w1, b1, w2, b2, "relu", 6, 2, buckets)
    assert got.shape == want.shape
    assert torch.equal(got.sort(dim=-1).values, want)


def test_gpu_predictor_selects_the_same_set():
    from dejavu_compile.kernels import predictor

    x = _rand(3, 1, 12)
    w1, b1, w2, b2 = _rand(5, 12, seed=1), _rand(5, seed=2), _rand(30, 5, seed=3), _rand(30, seed=4)
    want = OPS.select_predictor(x, w1, b1, w2, b2, "relu", 4, 2)
    got = predictor.select_predictor(x, w1, b1, w2, b2, "relu", 4, 2)
    assert got.shape == want.shape
    assert torch.equal(got.sort(dim=-1).values, want)


def test_the_kernels_folder_under_its_own_name_registers_nothing_again():
    """With the repository's root on sys.path (pytest, ``python -m``), transformers imports
    "kernels" while looking for Hugging Face's package of that name. That must not run a second
    copy of ``dejavu_compile.kernels`` (a copy registering the ops again would hold its own
    state: the graph cuts, the tuned configs), and transformers must take it for absent."""
    import importlib
    import sys

    import dejavu_compile.kernels as package
    import dejavu_compile.kernels.ops as ops
    from transformers.utils import import_utils

    root = str(Path(ops.__file__).parents[1])
    sys.path.insert(0, root)
    try:
        twin = importlib.import_module("kernels")
        assert twin is not package and not hasattr(twin, "ops")
        assert not any(m.startswith("kernels.") for m in sys.modules)
        assert not import_utils.is_kernels_available.__wrapped__()
    finally:
        sys.path.remove(root)
    calls = []
    with ops.graph_cuts(lambda: calls.append(1)):  # the op still runs this module's code
        torch.ops.dejavu.graph_split(torch.zeros(2))
    assert calls == [1]
