"""Every Triton kernel against the PyTorch reference, on small odd shapes, each dtype and
density: on CPU through TRITON_INTERPRET=1 (set in conftest.py), or compiled on a CUDA GPU when
run there with TRITON_INTERPRET=0."""

from __future__ import annotations

import itertools
import math
import os

import pytest
import torch
from dejavu_compile.kernels import reference as ref

from .conftest import compile_outside_interpreter, deterministic_algorithms

heads = pytest.importorskip("dejavu_compile.kernels.heads")
sparse_mlp = pytest.importorskip("dejavu_compile.kernels.sparse_mlp")
bucket_select = pytest.importorskip("dejavu_compile.kernels.bucket_select")

# Tolerances against the fp64 reference, per input dtype (kernels accumulate in fp32).
TOL = {
    torch.float32: dict(atol=1e-5, rtol=1e-4),
    torch.float16: dict(atol=2e-3, rtol=2e-3),
    torch.bfloat16: dict(atol=1.6e-2, rtol=1.6e-2),
}
DTYPES = list(TOL)
DEVICE = "cuda" if torch.cuda.is_available() and os.environ.get("TRITON_INTERPRET") != "1" else "cpu"


def _rand(*shape, dtype, seed):
    gen = torch.Generator().manual_seed(seed)
    t = torch.randn(*shape, generator=gen, dtype=torch.float64) / shape[-1] ** 0.5
    return t.to(device=DEVICE, dtype=dtype)


def _selection(rows, n, k, seed=0):
    gen = torch.Generator().manual_seed(seed)
    sel = [torch.randperm(n, generator=gen)[:k].sort().values for _ in range(rows)]
    return torch.stack(sel).to(DEVICE)


def _ref64(fn, *args, **kw):
    up = [a.double() if isinstance(a, torch.Tensor) and a.is_floating_point() else a for a in args]
    return fn(*up, **kw)


def _mlp_case(dtype, gated: bool, density: float, batch: int):
    """Odd-sized MLP inputs (d 37, 45 neurons, d_out 29) with ``density`` of the neurons
    selected per row: x, idx, w1, b1 (plain MLPs), w_up (gated), w2_t, b2."""
    d, n, d_out = 37, 45, 29
    k = max(1, round(density * n))
    x = _rand(batch, 1, d, dtype=dtype, seed=0)
    w1, w2_t = _rand(n, d, dtype=dtype, seed=1), _rand(n, d_out, dtype=dtype, seed=2)
    b1 = None if gated else _rand(n, dtype=dtype, seed=3)
    w_up = _rand(n, d, dtype=dtype, seed=4) if gated else None
    b2 = _rand(d_out, dtype=dtype, seed=5)
    return x, _selection(batch, n, k).view(batch, 1, k), w1, b1, w_up, w2_t, b2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["relu", "silu", "gelu", "gelu_tanh"])
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("density", [1 / 45, 0.3, 1.0])  # one row, a few, all
@pytest.mark.parametrize("batch", [1, 3])
def test_sparse_mlp_kernel(dtype, act, gated, density, batch):
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, gated, density, batch)
    want = _ref64(ref.sparse_mlp, x, idx, w1, b1, w_up, w2_t, b2, act)
    got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act)
    assert got.dtype == dtype and got.shape == want.shape and got.device == x.device
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("density", [1 / 45, 0.3, 1.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_sparse_mlp_fill_free_up_kernel(dtype, gated, density, batch, monkeypatch):
    """With ``DEJAVU_STORE_ROWS=1`` the up kernel stores whole rows and zeroes the down kernel's
    sums and counters itself (no fill launch): the op still equals the reference when its
    buffer starts out as garbage (NaN here), in one launch fewer."""
    from dejavu_compile.kernels import triton_common

    monkeypatch.setenv(triton_common.STORE_ROWS_ENV, "1")
    real, launched = sparse_mlp.fused_targets, []

    def garbage(*args, zeroed=True, **kw):
        earlier, sums, counters, output = real(*args, zeroed=zeroed, **kw)
        launched.append(zeroed)
        if not zeroed:  # what an unzeroed allocation may hold
            earlier.fill_(float("nan"))
            sums.fill_(float("nan"))
            counters.fill_(-7)
        return earlier, sums, counters, output

    monkeypatch.setattr(sparse_mlp, "fused_targets", garbage)
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, gated, density, batch)
    act = "silu" if gated else "relu"
    want = _ref64(ref.sparse_mlp, x, idx, w1, b1, w_up, w2_t, b2, act)
    got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act)
    assert launched == [False]
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    # a batch's union selection keeps the zeroed path
    if batch > 1:
        launched.clear()
        sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, union=True)
        assert launched == []


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("density", [1 / 45, 0.3, 1.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_sparse_mlp_workspace_is_left_zero(dtype, gated, density, batch, monkeypatch):
    """Given a zero workspace (``ops.workspace_numel``, what the lower pass attaches on
    CUDA), the op allocates and fills nothing (no zero-fill launch), equals the reference
    three calls in a row, other ids and inputs in between, and leaves the workspace zero each
    time; a batch's union and deterministic mode keep their own buffers; a workspace too
    small is refused."""
    from dejavu_compile.kernels import ops

    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, gated, density, batch)
    act = "silu" if gated else "relu"
    k, d_out = idx.shape[-1], w2_t.shape[1]
    workspace = torch.zeros(ops.workspace_numel(batch, d_out, k, gated) + 3, device=DEVICE)
    filled = []  # the op's own (zero-filled) buffers: targets outside the workspace
    real = sparse_mlp._targets

    def targets(*args, **kwargs):
        got = real(*args, **kwargs)
        if got[0].untyped_storage().data_ptr() != workspace.untyped_storage().data_ptr():
            filled.append(1)
        return got

    monkeypatch.setattr(sparse_mlp, "_targets", targets)
    for call in range(3):
        if call == 1:  # another token: other inputs, other neurons
            x = _rand(batch, 1, x.shape[-1], dtype=dtype, seed=9)
            idx = torch.flip(idx, [-1]) if k > 1 else (idx + 1) % w1.shape[0]
        want = _ref64(ref.sparse_mlp, x, idx, w1, b1, w_up, w2_t, b2, act)
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, workspace=workspace)
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
        assert not workspace.any(), workspace.nonzero().flatten()[:8]
    assert filled == []
    if batch > 1:
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, union=True,
                                    workspace=workspace)
        torch.testing.assert_close(
            got.double(), _ref64(ref.sparse_mlp, x, idx, w1, b1, w_up, w2_t, b2, act, True),
            **TOL[dtype])
        assert filled == [1] and not workspace.any()
    with deterministic_algorithms():
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, workspace=workspace)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    assert len(filled) == 1 + (batch > 1) and not workspace.any()
    with pytest.raises(ValueError, match="workspace must be"):
        sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, workspace=workspace[:-9])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("act", ["silu", "gelu_tanh"])
@pytest.mark.parametrize("density", [1 / 45, 0.3, 1.0])
@pytest.mark.parametrize("batch", [1, 3])
def test_sparse_mlp_gated_kernel(dtype, act, density, batch):
    d, n, d_out = 37, 45, 29
    k = max(1, round(density * n))
    x = _rand(batch, 1, d, dtype=dtype, seed=0)
    g = _rand(batch, 1, n, dtype=dtype, seed=1) * 4
    w_up, w2_t = _rand(n, d, dtype=dtype, seed=2), _rand(n, d_out, dtype=dtype, seed=3)
    b2 = _rand(d_out, dtype=dtype, seed=4)
    idx = _selection(batch, n, k).view(batch, 1, k)
    want = _ref64(ref.sparse_mlp_gated, x, idx, g, w_up, w2_t, b2, act)
    got = sparse_mlp.sparse_mlp_gated(x, idx, g, w_up, w2_t, b2, act)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,head_dim,k", [(5, 8, 1), (6, 12, 3), (4, 16, 4)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
def test_head_kernels(dtype, n_heads, head_dim, k, bias, batch):
    d = 23
    x = _rand(batch, 1, d, dtype=dtype, seed=0)
    w = _rand(n_heads * head_dim, d, dtype=dtype, seed=1)
    b = _rand(n_heads * head_dim, dtype=dtype, seed=2) if bias else None
    idx = _selection(batch, n_heads, k).view(batch, 1, k)
    want = _ref64(ref.sparse_head_proj, x, idx, w, b, head_dim)
    got = heads.sparse_head_proj(x, idx, w, b, head_dim)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])

    attn = _rand(batch, 1, n_heads * head_dim, dtype=dtype, seed=3)
    wo_t = _rand(n_heads * head_dim, d, dtype=dtype, seed=4)
    bo = _rand(d, dtype=dtype, seed=5) if bias else None
    want = _ref64(ref.sparse_head_out, attn, idx, wo_t, bo, head_dim)
    got = heads.sparse_head_out(attn, idx, wo_t, bo, head_dim)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    # on a workspace of zeros (what the lower pass attaches on CUDA): the same, twice, and the
    # workspace given back zero
    from dejavu_compile.kernels import ops

    workspace = torch.zeros(ops.workspace_numel(batch, d) + 2, device=DEVICE)
    for _ in range(2):
        got = heads.sparse_head_out(attn, idx, wo_t, bo, head_dim, workspace=workspace)
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
        assert not workspace.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_head_proj_row_storing_kernel(dtype, bias, batch, monkeypatch):
    """With ``DEJAVU_STORE_ROWS=1`` the query projection stores biased rows in the output's
    dtype from one kernel (no finish launch); unselected heads' rows stay zero."""
    from dejavu_compile.kernels import triton_common

    monkeypatch.setenv(triton_common.STORE_ROWS_ENV, "1")
    finishes = []
    real_finish = triton_common.finish
    monkeypatch.setattr(triton_common, "finish", lambda *a: finishes.append(1) or real_finish(*a))
    n_heads, head_dim, k, d = 5, 3, 2, 23
    x = _rand(batch, 1, d, dtype=dtype, seed=0)
    w = _rand(n_heads * head_dim, d, dtype=dtype, seed=1)
    b = _rand(n_heads * head_dim, dtype=dtype, seed=2) if bias else None
    idx = _selection(batch, n_heads, k).view(batch, 1, k)
    got = heads.sparse_head_proj(x, idx, w, b, head_dim)
    assert finishes == [] and got.dtype == dtype
    torch.testing.assert_close(got.double(), _ref64(ref.sparse_head_proj, x, idx, w, b, head_dim),
                               **TOL[dtype])
    if batch > 1:  # a batch's union selection keeps its finish
        heads.sparse_head_proj(x, idx, w, b, head_dim, union=True)
        assert finishes == [1]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
def test_transposed_views_read_as_contiguous(dtype, gated):
    """The down and output projections may arrive as ``w.t()`` views of ``[out, in]`` weights
    (the call before the in-place re-layout): same results as the contiguous layout."""
    d, n, d_out, k = 37, 45, 29, 13
    x = _rand(2, 1, d, dtype=dtype, seed=0)
    w1, w2 = _rand(n, d, dtype=dtype, seed=1), _rand(d_out, n, dtype=dtype, seed=2)
    w_up = _rand(n, d, dtype=dtype, seed=4) if gated else None
    b1 = None if gated else _rand(n, dtype=dtype, seed=3)
    idx = _selection(2, n, k).view(2, 1, k)
    view, copy = w2.t(), w2.t().contiguous()
    assert not view.is_contiguous()
    got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, view, None, "silu")
    want = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, copy, None, "silu")
    torch.testing.assert_close(got, want, **TOL[dtype])
    attn = _rand(2, 1, 6 * 8, dtype=dtype, seed=5)
    wo = _rand(d, 6 * 8, dtype=dtype, seed=6)
    hidx = _selection(2, 6, 3).view(2, 1, 3)
    torch.testing.assert_close(heads.sparse_head_out(attn, hidx, wo.t(), None, 8),
                               heads.sparse_head_out(attn, hidx, wo.t().contiguous(), None, 8),
                               **TOL[dtype])


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n_heads,head_dim,k", [(5, 8, 1), (6, 12, 3), (3, 20, 3)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 3])
def test_head_out_on_the_original_layout(dtype, n_heads, head_dim, k, bias, batch):
    """The output projection on ``W_o.t()`` (the original ``[d_out, H * head_dim]`` storage,
    option ``out_layout="original"``) runs ``_head_out_cols_kernel``: one launch, finished
    outputs, the workspace untouched; one head, several (with a partial last step of the
    unrolled loop), every head; head widths not a power of two; per-row and union ids."""
    from dejavu_compile.kernels import ops

    d = 29
    attn = _rand(batch, 1, n_heads * head_dim, dtype=dtype, seed=3)
    wo = _rand(d, n_heads * head_dim, dtype=dtype, seed=4)
    bo = _rand(d, dtype=dtype, seed=5) if bias else None
    idx = _selection(batch, n_heads, k).view(batch, 1, k)
    assert heads.reads_columns(wo.t(), head_dim)
    assert not heads.reads_columns(wo.t().contiguous(), head_dim)
    assert not heads.reads_columns(wo.t(), 1)  # one-wide units (TEAL) keep the row kernels
    workspace = torch.zeros(ops.workspace_numel(batch, d), device=DEVICE)
    for union in (False, True) if batch > 1 else (False,):
        want = _ref64(ref.sparse_head_out, attn, idx, wo.t(), bo, head_dim, union)
        got = heads.sparse_head_out(attn, idx, wo.t(), bo, head_dim, union, workspace=workspace)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
        torch.testing.assert_close(got, heads.sparse_head_out(attn, idx, wo.t().contiguous(), bo,
                                                              head_dim, union), **TOL[dtype])
    assert not workspace.any()


def _guarded(shape, dtype, fill, guard=256):
    """A tensor of ``shape`` inside a buffer with ``guard`` elements of ``fill`` on each side:
    a kernel that reads past the tensor reads ``fill``, one that writes past it changes it.
    Returns (buffer, tensor)."""
    n = math.prod(shape)
    buf = torch.full((n + 2 * guard,), fill, dtype=dtype, device=DEVICE)
    return buf, buf[guard:guard + n].view(*shape)


@pytest.mark.parametrize("block_m,unroll", [(8, 1), (8, 4), (16, 2), (64, 2)])
@pytest.mark.parametrize("head_dim", [16, 12])
def test_column_kernel_reads_and_writes_only_its_tensors(block_m, unroll, head_dim):
    """The output projection's column kernel at several of its tiles (the autotuner's
    candidates, beyond the one the interpreter runs), with fewer selected heads than a loop
    step takes and a last block of rows cut short: every tensor sits between NaN guards (the
    ids between guards of an id no head has), and the output matches the reference with its
    guards intact, so no load or store strays. The study of this kernel's tiles stopped with
    an illegal memory access in three runs (BENCHMARKS.md, sixty-fourth and sixty-sixth
    sessions), likely from its timings' stream not waiting for the ids (``bench.graph_bench``)."""
    import triton

    n_heads, k, d = 5, 3, 29
    g = torch.Generator().manual_seed(7)
    _, wo = _guarded((d, n_heads * head_dim), torch.float32, float("nan"))
    wo.copy_(torch.randn(d, n_heads * head_dim, generator=g))
    _, attn = _guarded((1, n_heads * head_dim), torch.float32, float("nan"))
    attn.copy_(torch.randn(1, n_heads * head_dim, generator=g))
    _, ids = _guarded((1, k), torch.int64, 10**12)
    ids.copy_(torch.tensor([[4, 0, 2]]))
    out_buf, out = _guarded((1, d), torch.float32, float("nan"))
    block_h = triton.next_power_of_2(head_dim)
    wt = wo.t()
    heads._head_out_cols_kernel.fn[(1, triton.cdiv(d, block_m))](
        attn, ids, wt, wt, out, d, k, head_dim, attn.stride(0), ids.stride(0), wt.stride(1),
        out.stride(0), HAS_B=False, BLOCK_M=block_m, BLOCK_H=block_h, UNROLL=unroll,
        EXACT=block_h == head_dim, PDL=False, num_warps=1)
    want = _ref64(ref.sparse_head_out, attn.view(1, 1, -1), ids.view(1, 1, k), wt, None,
                  head_dim).view(1, d)
    torch.testing.assert_close(out.double(), want, **TOL[torch.float32])
    guard = out_buf.numel() - out.numel()
    assert out_buf[: guard // 2].isnan().all() and out_buf[-(guard // 2):].isnan().all()


@pytest.mark.parametrize("dtype", DTYPES)
# k: union with padding, overlapping, all units; batch: one block of UNION_ROWS rows, two
@pytest.mark.parametrize("batch,k", [(3, 3), (3, 20), (3, 45), (18, 20)])
def test_union_selection_kernels(dtype, k, batch):
    """``union``: one id row shared by the batch (row stride 0), -1 padding skipped; against
    the reference's union."""
    d, n, d_out = 37, 45, 29
    x = _rand(batch, 1, d, dtype=dtype, seed=0)
    w1, w2_t = _rand(n, d, dtype=dtype, seed=1), _rand(n, d_out, dtype=dtype, seed=2)
    w_up, b1 = _rand(n, d, dtype=dtype, seed=4), _rand(n, dtype=dtype, seed=3)
    g = _rand(batch, 1, n, dtype=dtype, seed=6)
    idx = _selection(batch, n, k).view(batch, 1, k)
    hidx = _selection(batch, 6, 1 if k == 3 else 4).view(batch, 1, -1)
    attn, wq = _rand(batch, 1, 6 * 8, dtype=dtype, seed=5), _rand(6 * 8, d, dtype=dtype, seed=7)
    wo_t = _rand(6 * 8, d, dtype=dtype, seed=8)
    bq, bo = _rand(6 * 8, dtype=dtype, seed=9), _rand(d, dtype=dtype, seed=10)
    calls = [
        (sparse_mlp.sparse_mlp, ref.sparse_mlp, (x, idx, w1, b1, None, w2_t, None, "gelu")),
        (sparse_mlp.sparse_mlp, ref.sparse_mlp, (x, idx, w1, None, w_up, w2_t, None, "silu")),
        (sparse_mlp.sparse_mlp_gated, ref.sparse_mlp_gated, (x, idx, g, w_up, w2_t, None, "silu")),
        (heads.sparse_head_proj, ref.sparse_head_proj, (x, hidx, wq, None, 8)),
        (heads.sparse_head_proj, ref.sparse_head_proj, (x, hidx, wq, bq, 8)),
        (heads.sparse_head_out, ref.sparse_head_out, (attn, hidx, wo_t, None, 8)),
        (heads.sparse_head_out, ref.sparse_head_out, (attn, hidx, wo_t, bo, 8)),
    ]
    for kernel, reference, args in calls:
        got = kernel(*args, union=True)
        torch.testing.assert_close(got.double(), _ref64(reference, *args, union=True),
                                   **TOL[dtype])
        if k < n and batch <= 3:  # the union is not each row's own selection (the 18 rows'
            # per-row kernels, under the interpreter, would double the test's time)
            assert not torch.allclose(got, kernel(*args)), kernel.__name__


@pytest.fixture
def deterministic_mode():
    """``torch.use_deterministic_algorithms(True)`` for one test
    (``conftest.deterministic_algorithms``)."""
    with deterministic_algorithms():
        yield


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("gated", [False, True])
def test_deterministic_mode(dtype, gated, deterministic_mode):
    """In deterministic mode the projection kernels keep each program's partial sums apart and
    add them in order: same values as the reference, bitwise equal from call to call (shapes of
    several slots along each split), per-row and union selections."""
    from dejavu_compile.kernels.triton_common import deterministic

    assert deterministic()
    d, n, d_out, k = 37, 45, 29, 40
    x = _rand(2, 1, d, dtype=dtype, seed=0)
    w1, w2_t = _rand(n, d, dtype=dtype, seed=1), _rand(n, d_out, dtype=dtype, seed=2)
    w_up = _rand(n, d, dtype=dtype, seed=4) if gated else None
    b1 = None if gated else _rand(n, dtype=dtype, seed=3)
    g = _rand(2, 1, n, dtype=dtype, seed=6)
    idx = _selection(2, n, k).view(2, 1, k)
    attn, wq = _rand(2, 1, 6 * 8, dtype=dtype, seed=5), _rand(6 * 8, d, dtype=dtype, seed=7)
    wo_t = _rand(6 * 8, d, dtype=dtype, seed=8)
    hidx = _selection(2, 6, 4).view(2, 1, 4)
    calls = [
        (sparse_mlp.sparse_mlp, ref.sparse_mlp, (x, idx, w1, b1, w_up, w2_t, None, "silu")),
        (sparse_mlp.sparse_mlp_gated, ref.sparse_mlp_gated, (x, idx, g, w1, w2_t, None, "silu")),
        (heads.sparse_head_proj, ref.sparse_head_proj, (x, hidx, wq, None, 8)),
        (heads.sparse_head_out, ref.sparse_head_out, (attn, hidx, wo_t, None, 8)),
    ]
    for (kernel, reference, args), union in itertools.product(calls, (False, True)):
        first, second = kernel(*args, union=union), kernel(*args, union=union)
        assert torch.equal(first, second), kernel.__name__
        torch.testing.assert_close(first.double(), _ref64(reference, *args, union=union),
                                   **TOL[dtype])


def test_kernels_refuse_unsupported_dtype():
    x = torch.randn(1, 1, 8, dtype=torch.float64)
    with pytest.raises(TypeError, match="Triton kernel handles"):
        sparse_mlp.sparse_mlp(x, torch.zeros(1, 1, 2, dtype=torch.int64), torch.randn(4, 8),
                              None, None, torch.randn(4, 8), None, "relu")


BUCKET_SHAPES = [
    (40, 20, 1, 1),  # the heads of a layer: one bucket
    (96, 24, 1, 4),  # neurons in four buckets
    (12, 6, 3, 1),  # KV groups expanded to their heads
    (30, 3, 1, 3),  # one unit kept per bucket
    (5, 5, 1, 5),  # every unit kept
    (3, 1, 4, 1),  # a single selected group
]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("units,k,group,buckets", BUCKET_SHAPES)
@pytest.mark.parametrize("act,bias", [("relu", True), ("none", False), ("gelu", True)])
@pytest.mark.parametrize("batch", [1, 3])
def test_bucket_selector_kernel(dtype, units, k, group, buckets, act, bias, batch):
    """The two-launch Triton selector picks the same set as the reference, per row."""
    d, rank = 37, 12
    x = _rand(batch, 1, d, dtype=dtype, seed=0)
    w1, w2 = _rand(rank, d, dtype=dtype, seed=1), _rand(units, rank, dtype=dtype, seed=2)
    b1 = _rand(rank, dtype=dtype, seed=3) if bias else None
    b2 = _rand(units, dtype=dtype, seed=4) if bias else None
    want = ref.select_predictor(x, w1, b1, w2, b2, act, k, group, buckets)
    got = bucket_select.select_predictor_triton(x, w1, b1, w2, b2, act, k, group, buckets)
    assert got.shape == want.shape == (batch, 1, k * group)
    assert torch.equal(got, want)  # the same ids, in the same ascending order


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("units,k,group,buckets", [(40, 20, 1, 1), (96, 24, 1, 4), (12, 6, 3, 1)])
@pytest.mark.parametrize("act,bias", [("relu", True), ("none", False), ("silu", True)])
def test_folded_selector_kernel(dtype, units, k, group, buckets, act, bias):
    """The bucket launch alone on a folded predictor's hidden pre-activations (bias and
    activation applied as loaded) picks what the reference picks from the same hidden values,
    and what the whole predictor picks from the input."""
    d, rank = 37, 12
    x = _rand(2, 1, d, dtype=dtype, seed=0)
    w1, w2 = _rand(rank, d, dtype=dtype, seed=1), _rand(units, rank, dtype=dtype, seed=2)
    b1 = _rand(rank, dtype=dtype, seed=3) if bias else None
    b2 = _rand(units, dtype=dtype, seed=4) if bias else None
    h = (x.double() @ w1.double().t()).to(dtype)  # the stacked GEMV's output, in x's dtype
    want = ref.select_hidden(h, b1, w2, b2, act, k, group, buckets)
    got = bucket_select.select_hidden_triton(h, b1, w2, b2, act, k, group, buckets)
    assert got.shape == want.shape == (2, 1, k * group)
    assert torch.equal(got, want)
    if dtype == torch.float32:  # no rounding of h: the same as the unfolded predictor
        assert torch.equal(got, ref.select_predictor(x, w1, b1, w2, b2, act, k, group, buckets))


decode_attention = pytest.importorskip("dejavu_compile.kernels.decode_attention")


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,heads,kv_heads,length,head_dim", [
    (1, 4, 1, 1, 8),      # one cached position
    (2, 6, 3, 37, 12),    # odd length and head size, groups of 2
    (1, 8, 2, 300, 16),   # many chunks
    (1, 4, 4, 70, 24),    # no grouping
])
def test_decode_attention_kernel(dtype, batch, heads, kv_heads, length, head_dim):
    q = _rand(batch, heads, 1, head_dim, dtype=dtype, seed=0) * head_dim ** 0.5
    k = _rand(batch, kv_heads, length, head_dim, dtype=dtype, seed=1) * head_dim ** 0.5
    v = _rand(batch, kv_heads, length, head_dim, dtype=dtype, seed=2)
    scale = head_dim ** -0.5
    want = _ref64(ref.decode_attention, q, k, v, scale)
    got = decode_attention.decode_attention(q, k, v, scale)
    assert got.dtype == dtype and got.shape == want.shape
    torch.testing.assert_close(got.double(), want, **TOL[dtype])
    # a cache read through a strided view (a static buffer's first positions)
    big_k = _rand(batch, kv_heads, length + 5, head_dim, dtype=dtype, seed=1)[:, :, :length]
    big_v = _rand(batch, kv_heads, length + 5, head_dim, dtype=dtype, seed=2)[:, :, :length]
    torch.testing.assert_close(decode_attention.decode_attention(q, big_k, big_v, scale).double(),
                               _ref64(ref.decode_attention, q, big_k, big_v, scale), **TOL[dtype])
    # a key mask (padding, unfilled static cache): a masked run longer than a chunk, and the
    # last position always visible
    gen = torch.Generator().manual_seed(3)
    mask = torch.rand(batch, length, generator=gen) < 0.6
    mask[:, : length // 2] = False
    mask[:, -1] = True
    mask = mask.to(DEVICE)
    torch.testing.assert_close(decode_attention.decode_attention(q, k, v, scale, mask).double(),
                               _ref64(ref.decode_attention, q, k, v, scale, mask), **TOL[dtype])
    # one key mask shared by the batch (an expanded view, as a decode step's), and a mask whose
    # keys are strided (copied first)
    shared = mask[:1].expand(batch, length)
    torch.testing.assert_close(decode_attention.decode_attention(q, k, v, scale, shared).double(),
                               _ref64(ref.decode_attention, q, k, v, scale, shared), **TOL[dtype])
    strided = torch.stack([mask, ~mask], -1)[..., 0]
    assert strided.stride(-1) == 2
    torch.testing.assert_close(decode_attention.decode_attention(q, k, v, scale, strided).double(),
                               _ref64(ref.decode_attention, q, k, v, scale, strided), **TOL[dtype])
    # with counters the split kernel merges the chunks itself: same result, twice in a row, the
    # counters given back zero (the slot past B * KVH untouched)
    counters = torch.zeros(batch * kv_heads + 1, dtype=torch.int32, device=DEVICE)
    for m in (None, mask, None):
        got = decode_attention.decode_attention(q, k, v, scale, m, counters)
        assert got.dtype == dtype and got.shape == want.shape
        torch.testing.assert_close(got.double(), _ref64(ref.decode_attention, q, k, v, scale, m),
                                   **TOL[dtype])
        assert not counters.any()
    with pytest.raises(ValueError, match="counters must be int32"):
        decode_attention.decode_attention(q, k, v, scale, None, counters[:-2])
    # a head dimension that is not contiguous (every other value of a buffer) is read through
    # a copy
    k_t = torch.stack([k, k], -1)[..., 0]
    assert k_t.stride(-1) == 2
    torch.testing.assert_close(decode_attention.decode_attention(q, k_t, v, scale).double(),
                               _ref64(ref.decode_attention, q, k, v, scale), **TOL[dtype])


class _PoisonedEmpty:
    """``torch`` for a module under test, but ``empty`` gives floating tensors full of NaN: a
    kernel that leaves any of its output unwritten, or reads working memory it did not write,
    shows."""

    def __getattr__(self, name):
        return getattr(torch, name)

    @staticmethod
    def empty(*args, **kwargs):
        t = torch.empty(*args, **kwargs)
        return t.fill_(float("nan")) if t.is_floating_point() else t


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("batch,heads,kv_heads,length,head_dim,k", [
    (1, 4, 4, 37, 12, 2),   # one query head per KV head, odd sizes
    (2, 6, 3, 70, 16, 2),   # groups of 2: each named head reads its group's KV head
    (1, 8, 8, 300, 16, 3),  # many chunks
    (2, 5, 5, 1, 8, 1),     # one cached position, one head named
    (1, 8, 2, 45, 16, 3),   # groups of 4: two named heads share a KV head, read once
])
def test_decode_attention_kernel_over_selected_heads(monkeypatch, dtype, batch, heads, kv_heads,
                                                     length, head_dim, k):
    """With ``heads`` (option ``decode_selected_heads``) the kernels compute the KV groups of
    the named query heads only: their rows are the reference's, every other row is zero,
    though each buffer the launcher allocates starts as NaN; for ids per sequence (one of them
    -1, naming none),
    one row of ids shared by the batch (1-d too), with a key mask, and with the chunks merged
    in the split kernel on counters given back zero."""
    monkeypatch.setattr(decode_attention, "torch", _PoisonedEmpty())
    q = _rand(batch, heads, 1, head_dim, dtype=dtype, seed=0) * head_dim ** 0.5
    kk = _rand(batch, kv_heads, length, head_dim, dtype=dtype, seed=1) * head_dim ** 0.5
    v = _rand(batch, kv_heads, length, head_dim, dtype=dtype, seed=2)
    scale = head_dim ** -0.5
    ids = _selection(batch, heads, k, seed=4)
    if k > 1:
        ids[0, -1] = -1
    mask = torch.ones(batch, length, dtype=torch.bool, device=DEVICE)
    mask[:, : length // 3] = False
    counters = torch.zeros(batch * k + 1, dtype=torch.int32, device=DEVICE)
    for sel, m, c in ((ids, None, None), (ids[:1], mask, None), (ids[0], None, None),
                      (ids, mask, counters)):
        want = _ref64(ref.decode_attention, q, kk, v, scale, m, sel)
        got = decode_attention.decode_attention(q, kk, v, scale, m, c, sel)
        assert got.dtype == dtype and got.shape == want.shape
        named = ref.named_heads(sel, batch, heads, heads // kv_heads)
        assert not got[~named].any()
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
        assert not counters.any()
    with pytest.raises(ValueError, match="heads must be int64 or int32 ids"):
        decode_attention.decode_attention(q, kk, v, scale, None, None, ids.float())
    with pytest.raises(ValueError, match="heads must be"):
        decode_attention.decode_attention(q, kk, v, scale, None, None, ids[:, :0])
    with pytest.raises(ValueError, match="counters must be int32 .>= B . S"):
        decode_attention.decode_attention(q, kk, v, scale, None, counters[: batch * k - 1], ids)


def _two_kv_heads(length: int, hidden: int, seed: int):
    """fp16 q [1, 4, 1, 16] over k and v [1, 2, length, 16] (two query heads a KV head), a
    mask hiding the first ``hidden`` positions and zero counters, one per KV head."""
    f16 = torch.float16
    q = _rand(1, 4, 1, 16, dtype=f16, seed=seed) * 4
    k = _rand(1, 2, length, 16, dtype=f16, seed=seed + 1) * 4
    v = _rand(1, 2, length, 16, dtype=f16, seed=seed + 2)
    mask = torch.ones(1, length, dtype=torch.bool, device=DEVICE)
    mask[:, :hidden] = False
    return q, k, v, mask, torch.zeros(2, dtype=torch.int32, device=DEVICE)


def test_decode_attention_merges_chunks_in_blocks(monkeypatch):
    """A long cache's chunks are merged a few at a time (here 2 in the split kernel, which
    merges both rows of a group, so 300 keys take 10 rounds of the merge's loop; 4 in the
    combine launch, a row a program), with an online rescale; the first rounds see only masked
    keys."""
    monkeypatch.setattr(decode_attention, "MERGE_VALUES", 2 * 2 * 16)
    _, splits = decode_attention.chunking(2, 300)
    assert decode_attention.merge_block(splits, 2, 16) == 2 < splits
    assert decode_attention.merge_block(splits, decode_attention.COMBINE_ROWS, 16) == 4 < splits
    f16 = torch.float16
    q, k, v, mask, counters = _two_kv_heads(300, 200, seed=0)
    for m, c in itertools.product((None, mask), (None, counters)):
        torch.testing.assert_close(decode_attention.decode_attention(q, k, v, 0.25, m, c).double(),
                                   _ref64(ref.decode_attention, q, k, v, 0.25, m), **TOL[f16])
    assert not counters.any()


def test_decode_attention_splits_fill_the_gpu():
    assert decode_attention.splits_for(8, 131072) * 8 >= decode_attention.PROGRAMS
    assert decode_attention.splits_for(8, 1) == 1
    unit, long = decode_attention.CHUNK_UNIT, decode_attention.LONG_CHUNK
    for heads, length in itertools.product((1, 8, 64), (1, 17, 257, 4096, 131072)):
        chunk, splits = decode_attention.chunking(heads, length)
        # every key in exactly one chunk, none empty; whole units, long chunks whole blocks
        assert splits * chunk >= length > (splits - 1) * chunk
        assert chunk % unit == 0 and (chunk <= long or chunk % long == 0)
        assert splits <= decode_attention.splits_for(heads, length, unit)
        # long chunks whenever they give enough programs
        if heads * decode_attention.splits_for(heads, length) >= decode_attention.MIN_PROGRAMS:
            assert chunk % long == 0
    # a short cache is cut into short chunks, one program each
    assert decode_attention.chunking(8, 8 * unit + 1) == (unit, 9)
    with pytest.raises(ValueError, match="multiple of the KV heads"):
        decode_attention.decode_attention(torch.zeros(1, 3, 1, 8), torch.zeros(1, 2, 5, 8),
                                          torch.zeros(1, 2, 5, 8), 1.0)


def test_decode_attention_long_chunk_from_the_environment(monkeypatch):
    """``DEJAVU_ATTN_CHUNK`` sets the long chunk (OPT-13B's 40 KV heads over 273 positions:
    3 chunks of 128 keys, 5 of 64 or 9 of 32); the kernels give the reference's output at any
    of them; another value is an error naming the variable and its choices."""
    monkeypatch.setattr(decode_attention, "CHUNK_UNIT", 32)
    monkeypatch.setattr(decode_attention, "LONG_CHUNK", 128)
    assert decode_attention.chunking(40, 273) == (128, 3)
    for keys, splits in ((64, 5), (32, 9), (128, 3)):
        monkeypatch.setenv(decode_attention.LONG_CHUNK_ENV, str(keys))
        assert decode_attention.chunking(40, 273) == (keys, splits)
    monkeypatch.undo()
    f16 = torch.float16
    q = _rand(1, 4, 1, 16, dtype=f16, seed=3) * 4
    k, v = _rand(1, 2, 70, 16, dtype=f16, seed=4) * 4, _rand(1, 2, 70, 16, dtype=f16, seed=5)
    want = _ref64(ref.decode_attention, q, k, v, 0.25, None)
    chunks = set()
    for keys in decode_attention.LONG_CHUNKS:
        monkeypatch.setenv(decode_attention.LONG_CHUNK_ENV, str(keys))
        monkeypatch.setattr(decode_attention, "MIN_PROGRAMS", 1)  # long chunks, however few
        chunks.add(decode_attention.chunking(2, 70))
        torch.testing.assert_close(decode_attention.decode_attention(q, k, v, 0.25).double(),
                                   want, **TOL[f16])
    assert chunks == {(128, 1), (64, 2), (32, 3)}
    monkeypatch.setenv(decode_attention.LONG_CHUNK_ENV, "48")
    with pytest.raises(ValueError, match="DEJAVU_ATTN_CHUNK='48'.*'128', '64', '32', 'whole'"):
        decode_attention.chunking(40, 273)


def test_decode_attention_of_one_chunk_stores_its_rows(monkeypatch):
    """``DEJAVU_ATTN_CHUNK=whole`` cuts each KV head's cache into one chunk, whatever its length
    (rounded up to whole long chunks). One chunk needs no merge: the split kernel stores the
    finished rows, no combine is launched and the counters stay zero; the outputs are the
    reference's, with and without a mask, and with a selection of heads (whose launches still
    merge, to zero the heads no id names)."""
    monkeypatch.setattr(decode_attention, "CHUNK_UNIT", 32)
    monkeypatch.setattr(decode_attention, "LONG_CHUNK", 128)
    monkeypatch.setenv(decode_attention.LONG_CHUNK_ENV, "whole")
    assert decode_attention.whole_cache() and decode_attention.long_chunk() == 128
    assert decode_attention.chunking(40, 273) == (384, 1)
    assert decode_attention.chunking(1, 131072) == (131072, 1)
    monkeypatch.undo()
    f16 = torch.float16
    q, k, v, mask, counters = _two_kv_heads(70, 50, seed=6)
    assert decode_attention.chunking(2, 70)[1] > 1  # by default, several chunks and a merge
    monkeypatch.setenv(decode_attention.LONG_CHUNK_ENV, "whole")
    long = decode_attention.LONG_CHUNK  # 16 keys under the interpreter, 128 compiled
    assert decode_attention.chunking(2, 70) == (-(-70 // long) * long, 1)

    class NoLaunch:
        def __getitem__(self, grid):
            raise AssertionError("a combine launch for one chunk")

    plain, made, partials = decode_attention._combine_kernel, decode_attention._partials, []

    def counted(*args, **kwargs):  # the partial buffers' sizes, (output, maximum, sum)
        buffers = made(*args, **kwargs)
        partials.append(tuple(t.numel() for t in buffers))
        return buffers

    monkeypatch.setattr(decode_attention, "_partials", counted)
    monkeypatch.setattr(decode_attention, "_combine_kernel", NoLaunch())
    for m, c in itertools.product((None, mask), (None, counters)):
        got = decode_attention.decode_attention(q, k, v, 0.25, m, c)
        assert got.dtype == f16 and got.shape == q.shape
        torch.testing.assert_close(got.double(),
                                   _ref64(ref.decode_attention, q, k, v, 0.25, m), **TOL[f16])
    assert not counters.any()
    assert partials == [(1, 1, 1)] * 4  # one chunk: no partials kept, one placeholder element
    monkeypatch.setattr(decode_attention, "_combine_kernel", plain)
    ids = torch.tensor([[2]], device=DEVICE)  # KV head 1's group only
    torch.testing.assert_close(
        decode_attention.decode_attention(q, k, v, 0.25, mask, None, ids).double(),
        _ref64(ref.decode_attention, q, k, v, 0.25, mask, ids), **TOL[f16])
    assert partials[-1][1] == 16  # the selection keeps its slot's partials (16 padded rows)


def test_decode_attention_tunes_only_blocks_within_a_chunk():
    """The split kernel's autotuning tries no key block longer than a chunk (its extra keys
    would only be masked); a chunk shorter than every block keeps the first config."""
    import triton

    configs = [triton.Config({"BLOCK_L": b}, num_warps=w) for b in (32, 64, 128) for w in (4, 8)]

    def blocks(chunk):
        return sorted({c.kwargs["BLOCK_L"] for c in decode_attention._fitting(
            configs, {"CHUNK": chunk})})

    assert blocks(32) == [32]  # a Llama-3-8B step's chunks (8 KV heads, 129-256 keys)
    assert blocks(128) == [32, 64, 128]
    assert decode_attention._fitting(configs, {"CHUNK": 16}) == configs[:1]


def test_add_norm_and_finish_launch_plainly_under_programmatic_launch(monkeypatch):
    """The forty-fifth session's fix (BENCHMARKS.md): where every other kernel launches
    programmatically, the add-norm and finish kernels launch plainly (``PDL`` false, no
    ``launch_pdl``), with or without a norm bias and from unfinished sums alike; turned back
    on (``ADD_NORM_PDL``, ``FINISH_PDL``, as ``examples/race_study.py`` does) they launch as
    ``pdl_meta`` says, starting their successor right after their wait; with
    ``DEJAVU_NORM_LAUNCH=late`` programmatically, starting it after their stores (``LATE``).
    Their outputs are the reference's every way; another value of the variable is an error
    naming it."""
    from dejavu_compile.kernels import reference as ref
    from dejavu_compile.kernels import triton_common as tc

    monkeypatch.setattr(tc, "programmatic", lambda: True)
    assert tc.pdl_meta() == {"PDL": True, "launch_pdl": True}
    launches = []

    def recording(kernel):
        class Grid:
            def __getitem__(self, grid):
                def launch(*args, **meta):
                    launches.append((kernel.__name__ if hasattr(kernel, "__name__")
                                     else kernel.fn.__name__, meta.get("PDL"),
                                     "launch_pdl" in meta, meta.get("LATE")))
                    meta = {k: v for k, v in meta.items() if k not in ("PDL", "launch_pdl")}
                    return kernel[grid](*args, PDL=False, **meta)
                return launch
        return Grid()

    monkeypatch.setattr(tc, "_add_norm_kernel", recording(tc._add_norm_kernel))
    monkeypatch.setattr(tc, "_finish_kernel", recording(tc._finish_kernel))
    gen = torch.Generator().manual_seed(0)
    y, res, w, b = (torch.randn(2, 64, generator=gen) for _ in range(4))
    bias = torch.randn(64, generator=gen)
    for allowed, late in ((False, False), (True, False), (False, True)):
        monkeypatch.setattr(tc, "ADD_NORM_PDL", allowed)
        monkeypatch.setattr(tc, "FINISH_PDL", allowed)
        monkeypatch.setenv(tc.NORM_LAUNCH_ENV, "late" if late else "plain")
        launches.clear()
        h, n = tc.add_norm(y, res, w[0], b[0], 1e-5)
        want_h, want_n = ref.add_norm(y, res, w[0], b[0], 1e-5)
        torch.testing.assert_close(h, want_h)
        torch.testing.assert_close(n, want_n, atol=1e-5, rtol=1e-4)
        tc.add_norm_sums(y.clone(), bias, res, w[0], None, 1e-5, clean=False)
        out = tc.finish(y, bias, torch.float32)
        torch.testing.assert_close(out, y + bias)
        on = allowed or late
        assert launches == [("_add_norm_kernel", on, on, late)] * 2 \
            + [("_finish_kernel", on, on, late)]
    monkeypatch.setenv(tc.NORM_LAUNCH_ENV, "early")
    with pytest.raises(ValueError, match="DEJAVU_NORM_LAUNCH='early'"):
        tc.finish(y, bias, torch.float32)


def test_programmatic_launch_is_the_default_where_it_can_be(monkeypatch):
    """Programmatic launch is on by default on a Hopper-or-later GPU with compiled Triton; off
    with ``DEJAVU_PDL=0``, under the interpreter, on an older GPU and in deterministic mode;
    any other value of ``DEJAVU_PDL`` is an error naming it."""
    from dejavu_compile.kernels import triton_common as tc

    monkeypatch.delenv(tc.PDL_ENV, raising=False)
    if tc.INTERPRET or not torch.cuda.is_available():  # this machine: plain launches
        assert not tc.programmatic() and tc.pdl_meta() == {"PDL": False}
    monkeypatch.setattr(tc, "INTERPRET", False)
    monkeypatch.setattr(tc, "_GDC", True)
    monkeypatch.setattr(tc, "_hopper", lambda: True)
    assert tc.programmatic()
    assert tc.pdl_meta() == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(tc.PDL_ENV, "1")
    assert tc.programmatic()
    monkeypatch.setenv(tc.PDL_ENV, "0")
    assert not tc.programmatic() and tc.pdl_meta() == {"PDL": False}
    monkeypatch.setenv(tc.PDL_ENV, "yes")
    with pytest.raises(ValueError, match="DEJAVU_PDL='yes'"):
        tc.programmatic()
    monkeypatch.setenv(tc.PDL_ENV, "1")
    monkeypatch.setattr(tc, "_hopper", lambda: False)  # an Ampere GPU, say
    assert not tc.programmatic()
    monkeypatch.setattr(tc, "_hopper", lambda: True)
    with deterministic_algorithms():
        assert not tc.programmatic()


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
@pytest.mark.parametrize("batch", [1, 3])
def test_reducing_kernels_finish_their_outputs(dtype, batch, monkeypatch):
    """With atomics and per-row ids, the down and output-projection kernels add the bias and
    cast their outputs themselves (the last program of each output tile): no finish launch,
    and the result is the reference's over many programs per output."""
    from dejavu_compile.kernels import triton_common as tc

    def no_finish(*args, **kwargs):
        raise AssertionError("a separate finish launch")

    monkeypatch.setattr(sparse_mlp, "finish", no_finish)
    monkeypatch.setattr(tc, "finish", no_finish)
    # many programs add into each output: 19 under the interpreter's tiles, 5 on a GPU's
    d, n, d_out, k = 24, 400, 40, 300
    x = _rand(batch, 1, d, dtype=dtype, seed=0)
    w1, w2_t = _rand(n, d, dtype=dtype, seed=1), _rand(n, d_out, dtype=dtype, seed=2)
    b1, b2 = _rand(n, dtype=dtype, seed=3), _rand(d_out, dtype=dtype, seed=4)
    idx = _selection(batch, n, k).view(batch, 1, k)
    want = _ref64(ref.sparse_mlp, x, idx, w1, b1, None, w2_t, b2, "relu")
    got = sparse_mlp.sparse_mlp(x, idx, w1, b1, None, w2_t, b2, "relu")
    assert got.dtype == dtype
    torch.testing.assert_close(got.double(), want, **TOL[dtype])

    attn = _rand(batch, 1, 40 * 8, dtype=dtype, seed=5)
    wo_t = _rand(40 * 8, d_out, dtype=dtype, seed=6)
    hid = _selection(batch, 40, 33).view(batch, 1, 33)
    want = _ref64(ref.sparse_head_out, attn, hid, wo_t, b2, 8)
    got = heads.sparse_head_out(attn, hid, wo_t, b2, 8)
    torch.testing.assert_close(got.double(), want, **TOL[dtype])


def test_bucket_kernel_configs_fit_the_bucket():
    """The bucket kernel's autotuning tries only rank chunks whose tile (bucket x chunk) stays
    within 8192 values and that the rank fills, and ranks by counting only small buckets."""
    import triton

    configs = [triton.Config({"BLOCK_R": r, "COUNT": c}, num_warps=w)
               for r in (16, 32, 64, 128) for w in (4, 8) for c in (0, 1)]

    def chunks(size, rank):
        return sorted({c.kwargs["BLOCK_R"] for c in bucket_select._fitting(
            configs, {"RANK": rank}, BLOCK_S=size)})

    def counting(size):
        return {c.kwargs["COUNT"] for c in bucket_select._fitting(configs, {"RANK": 64},
                                                                   BLOCK_S=size)}

    assert chunks(128, 128) == [16, 32, 64]
    assert chunks(64, 128) == [16, 32, 64, 128]
    assert chunks(1024, 128) == [16]  # 8192 // 1024 = 8, and 16 is the smallest chunk
    assert chunks(64, 24) == [16, 32]  # a rank of 24 needs no chunk past 32
    # ranking by counting compares every pair: only for buckets up to COUNT_MAX units
    assert counting(bucket_select.COUNT_MAX) == {0, 1} and counting(512) == {0}
    # at most 128 of a tile's values per thread: one warp holds no 128 x 64 tile
    one_warp = [triton.Config({"BLOCK_R": r, "COUNT": 0}, num_warps=1) for r in (16, 32, 64)]
    assert [c.kwargs["BLOCK_R"] for c in bucket_select._fitting(
        one_warp, {"RANK": 128}, BLOCK_S=128)] == [16, 32]


@pytest.mark.parametrize("deterministic", [False, True])
def test_tile_kernels_loop_over_slices_of_d(deterministic, monkeypatch):
    """The up and query-projection kernels with ``TILES`` > 1 (each program sums several
    slices of d in a loop; the last one past d): against the reference, with atomics and with
    one slot of partial sums per program."""
    import triton
    from dejavu_compile.kernels import triton_common as tc

    loop = {**tc.TILE_FIXED, "TILES": 2}
    for kernel in (sparse_mlp._up_kernel, heads._head_proj_kernel):
        monkeypatch.setattr(kernel, "configs", [triton.Config(
            {k: v for k, v in loop.items() if k != "num_warps"}, num_warps=loop["num_warps"])])
    monkeypatch.setattr(tc, "TILE_LOOP_FIXED", loop)
    monkeypatch.setattr(sparse_mlp, "TILE_LOOP_FIXED", loop)
    before = (torch.are_deterministic_algorithms_enabled(),
              torch.is_deterministic_algorithms_warn_only_enabled())
    torch.use_deterministic_algorithms(deterministic, warn_only=True)
    try:
        d, n, d_out, k = 3 * tc.TILE_FIXED["BLOCK_D"] + 5, 45, 29, 20
        x = _rand(2, 1, d, dtype=torch.float32, seed=0)
        w1, w_up = _rand(n, d, dtype=torch.float32, seed=1), _rand(n, d, dtype=torch.float32, seed=2)
        w2_t = _rand(n, d_out, dtype=torch.float32, seed=3)
        idx = _selection(2, n, k).view(2, 1, k)
        for gate in (None, w_up):
            want = _ref64(ref.sparse_mlp, x, idx, w1, None, gate, w2_t, None, "silu")
            got = sparse_mlp.sparse_mlp(x, idx, w1, None, gate, w2_t, None, "silu")
            torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
        w = _rand(6 * 8, d, dtype=torch.float32, seed=4)
        b = _rand(6 * 8, dtype=torch.float32, seed=5)
        hid = _selection(2, 6, 3).view(2, 1, 3)
        want = _ref64(ref.sparse_head_proj, x, hid, w, b, 8)
        got = heads.sparse_head_proj(x, hid, w, b, 8)
        torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
    finally:
        torch.use_deterministic_algorithms(before[0], warn_only=before[1])


@pytest.mark.parametrize("tiles", [1, 3])
def test_down_kernel_first_tile_and_the_loop_after(tiles, monkeypatch):
    """The down kernel loads its first neuron tile before it waits for the up kernel and the
    others in its loop: with one tile a program (no loop) and three (the last past k), per-row
    ids, with and without a workspace, against the reference; the workspace left zero."""
    from dejavu_compile.kernels import ops
    from dejavu_compile.kernels import triton_common as tc

    monkeypatch.setattr(sparse_mlp._down_kernel, "configs",
                        [tc.fixed_config({**tc.TILE_FIXED, "TILES": tiles})])
    d, n, d_out, k = 37, 90, 29, 2 * tc.TILE_FIXED["BLOCK_N"] + 3  # 3 tiles, the last short
    x = _rand(2, 1, d, dtype=torch.float32, seed=0)
    w1, w_up = _rand(n, d, dtype=torch.float32, seed=1), _rand(n, d, dtype=torch.float32, seed=2)
    w2_t, b2 = _rand(n, d_out, dtype=torch.float32, seed=3), _rand(d_out, dtype=torch.float32,
                                                                   seed=4)
    idx = _selection(2, n, k).view(2, 1, k)
    for gate in (None, w_up):
        want = _ref64(ref.sparse_mlp, x, idx, w1, None, gate, w2_t, b2, "relu")
        workspace = torch.zeros(ops.workspace_numel(2, d_out, k, gate is not None),
                                device=DEVICE)
        for space in (None, workspace):
            got = sparse_mlp.sparse_mlp(x, idx, w1, None, gate, w2_t, b2, "relu",
                                        workspace=space)
            torch.testing.assert_close(got.double(), want, **TOL[torch.float32])
        assert not workspace.any()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("tiles", [1, 3])
def test_up_kernel_of_a_lookahead_block_may_load_its_ids_before_its_wait(dtype, gated, tiles,
                                                                          monkeypatch):
    """With ``DEJAVU_EARLY_IDS=1`` the up kernel of a sparse MLP whose ids a predictor wrote a
    layer ahead (``ahead``), on a workspace, runs with ``EARLY``: the ids and the first slice
    of weights load before the wait, x after, then the other slices in the loop (``tiles``
    slices a program). The output is the reference's either way, and the workspace comes back
    zero. Without the switch, without ``ahead``, or after the op's own fill, ``EARLY`` is off."""
    from dejavu_compile.kernels import ops, triton_common

    real, early = sparse_mlp.launch, []

    def spy(kernel, grid, *args, fixed=None, **meta):
        if kernel is not sparse_mlp._up_kernel:
            return real(kernel, grid, *args, fixed=fixed, **meta)
        early.append(meta["EARLY"])
        config = {**triton_common.TILE_LOOP_FIXED, "TILES": tiles}
        return real(kernel, grid, *args, fixed=config, **meta)

    monkeypatch.setattr(sparse_mlp, "launch", spy)
    d, n, d_out, k = 70, 45, 29, 13  # 70 columns: 5 slices of 16 in the interpreter's tile
    x = _rand(1, 1, d, dtype=dtype, seed=0)
    w1, w_up = _rand(n, d, dtype=dtype, seed=1), _rand(n, d, dtype=dtype, seed=2)
    w2_t, b2 = _rand(n, d_out, dtype=dtype, seed=3), _rand(d_out, dtype=dtype, seed=4)
    b1 = None if gated else _rand(n, dtype=dtype, seed=5)
    idx = _selection(1, n, k).view(1, 1, k)
    gate, act = (w_up, "silu") if gated else (None, "relu")
    want = _ref64(ref.sparse_mlp, x, idx, w1, b1, gate, w2_t, b2, act)
    space = torch.zeros(ops.workspace_numel(1, d_out, k, gated), device=DEVICE)
    for switch, ahead, workspace, on in (("1", True, space, True), ("1", False, space, False),
                                         ("0", True, space, False), ("1", True, None, False)):
        monkeypatch.setenv(triton_common.EARLY_IDS_ENV, switch)
        early.clear()
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, gate, w2_t, b2, act, workspace=workspace,
                                    ahead=ahead)
        assert early == [on], (switch, ahead, workspace is None)
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
        assert not space.any()
    monkeypatch.setenv(triton_common.EARLY_IDS_ENV, "yes")
    with pytest.raises(ValueError, match="DEJAVU_EARLY_IDS='yes'"):
        triton_common.early_ids()


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("tiles", [1, 3])
def test_output_projection_with_older_ids_may_load_them_before_its_wait(dtype, tiles,
                                                                        monkeypatch):
    """With ``DEJAVU_EARLY_IDS=1`` an output projection marked ``early`` runs its per-row
    kernel with ``EARLY``: the head ids and the first tile's weights load before the wait, the
    attention's output after, then the other tiles in the loop (``tiles`` a program). The
    output is the reference's either way, on a workspace (given back zero) and with a fill.
    Without the switch or the mark, ``EARLY`` is off."""
    from dejavu_compile.kernels import ops, triton_common

    real, early = heads.tc.launch, []

    def spy(kernel, grid, *args, fixed=None, **meta):
        if kernel is not heads._head_out_kernel:
            return real(kernel, grid, *args, fixed=fixed, **meta)
        early.append(meta["EARLY"])
        return real(kernel, grid, *args, fixed={**triton_common.REDUCE_FIXED, "TILES": tiles},
                    **meta)

    monkeypatch.setattr(heads.tc, "launch", spy)
    n_heads, head_dim, d_out, k = 11, 5, 29, 6  # 30 selected rows: 4 tiles of 8
    attn = _rand(1, 1, n_heads * head_dim, dtype=dtype, seed=0)
    wo_t, b = _rand(n_heads * head_dim, d_out, dtype=dtype, seed=1), _rand(d_out, dtype=dtype,
                                                                           seed=2)
    idx = _selection(1, n_heads, k).view(1, 1, k)
    want = _ref64(ref.sparse_head_out, attn, idx, wo_t, b, head_dim)
    space = torch.zeros(ops.workspace_numel(1, d_out, 0), device=DEVICE)
    for switch, mark, workspace, on in (("1", True, space, True), ("1", True, None, True),
                                        ("1", False, space, False), ("0", True, space, False)):
        monkeypatch.setenv(triton_common.EARLY_IDS_ENV, switch)
        early.clear()
        got = heads.sparse_head_out(attn, idx, wo_t, b, head_dim, workspace=workspace,
                                    early=mark)
        assert early == [on], (switch, mark, workspace is None)
        torch.testing.assert_close(got.double(), want, **TOL[dtype])
        assert not space.any()


def test_up_kernel_variants_compile_for_hopper(tmp_path):
    """The interpreter runs the kernels' Python, not Triton's compiler: compile the up kernel
    here for an sm_90 GPU (Triton's own ptxas, no GPU needed) with programmatic launch in each
    of its orders (waiting first; after the op's fill; with its ids and first weights before
    the wait), plain and gated, in one slice and in a loop of three, and the output
    projection's kernel in its two orders; check that each waits once, and that the early
    orders load before the wait and the waiting-first ones do not."""
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dejavu_compile.kernels import sparse_mlp
fn = sparse_mlp._up_kernel.fn
ptrs = {"x_ptr": "*fp16", "idx_ptr": "*i64", "w1_ptr": "*fp16", "wup_ptr": "*fp16",
        "pre_ptr": "*fp32", "up_out_ptr": "*fp32"}
for after, early in ((False, False), (True, False), (False, True)):
    for gated in (False, True):
        for tiles in (1, 3):
            const = dict(GATED=gated, ATOMIC=True, BLOCK_N=16, BLOCK_D=256, TILES=tiles,
                         PDL=True, AFTER=after, EARLY=early)
            sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
            ptx = triton.compile(ASTSource(fn, sig, constexprs=const),
                                 target=GPUTarget("cuda", 90, 32)).asm["ptx"]
            waits = ptx.count("griddepcontrol.wait")
            before = ptx[: ptx.index("griddepcontrol.wait")].count("ld.global")
            print(after, early, gated, tiles, waits, before > 0)
from dejavu_compile.kernels import heads
fn = heads._head_out_kernel.fn
ptrs = {"a_ptr": "*fp16", "idx_ptr": "*i64", "w_ptr": "*fp16", "out_ptr": "*fp32",
        "fin_ptr": "*fp16", "b_ptr": "*fp16", "cnt_ptr": "*i32"}
for early in (False, True):
    for tiles in (1, 3):
        const = dict(ATOMIC=True, FUSED=True, HAS_B=True, CLEAN=True, BLOCK_N=32, BLOCK_D=128,
                     TILES=tiles, PDL=True, EARLY=early, stride_wo=1, NORM=False)
        sig = {a: ptrs.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
        ptx = triton.compile(ASTSource(fn, sig, constexprs=const),
                             target=GPUTarget("cuda", 90, 32)).asm["ptx"]
        waits = ptx.count("griddepcontrol.wait")
        before = ptx[: ptx.index("griddepcontrol.wait")].count("ld.global")
        print("out", early, tiles, waits, before > 0)
"""
    stdout = compile_outside_interpreter(code, cwd=tmp_path)
    rows = [line.split() for line in stdout.splitlines()]
    up, head_out = [r for r in rows if r[0] != "out"], [r[1:] for r in rows if r[0] == "out"]
    assert len(up) == 12 and all(r[4] == "1" for r in up), stdout
    # the early order loads (ids, weights) before its wait; waiting first loads nothing before
    assert all(r[5] == "True" for r in up if r[1] == "True"), stdout
    assert all(r[5] == "False" for r in up if r[:2] == ["False", "False"]), stdout
    assert head_out == [["False", "1", "1", "False"], ["False", "3", "1", "False"],
                        ["True", "1", "1", "True"], ["True", "3", "1", "True"]], stdout


_PTX_TYPES = {torch.float16: "*fp16", torch.bfloat16: "*bf16", torch.float32: "*fp32",
              torch.int64: "*i64", torch.int32: "*i32", torch.uint8: "*u8", torch.int8: "*i8"}


def _step_launches() -> list[dict]:
    """Every Triton launch of the ops a decode step runs (fp16, batch 1, and two rows with one
    selection), as the launchers make them under the interpreter: each kernel's module and
    name, its arguments by name (a tensor as its pointer type, anything else as its value)
    and its warps and stages."""
    from unittest import mock

    from dejavu_compile.kernels import dense, lazy_kv, ops
    from dejavu_compile.kernels import triton_common as tc
    from triton.runtime.interpreter import InterpretedFunction

    seen, run = [], InterpretedFunction.run

    def record(self, *args, grid, warmup, **kwargs):
        named = {**dict(zip(self.arg_names, args, strict=False)), **kwargs}
        seen.append({"module": self.fn.__module__, "name": self.fn.__name__,
                     "args": {a: (_PTX_TYPES[v.dtype] if isinstance(v, torch.Tensor) else v)
                              for a, v in named.items() if a in self.arg_names},
                     "num_warps": kwargs.get("num_warps", 4),
                     "num_stages": kwargs.get("num_stages", 3)})
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    f16 = torch.float16
    d, n, d_out, k, heads_, hd = 32, 48, 32, 12, 4, 8

    def r(*shape, seed):
        return _rand(*shape, dtype=f16, seed=seed)

    x, res = r(1, 1, d, seed=0), r(1, 1, d_out, seed=1)
    w1, w_up, w2_t, b = r(n, d, seed=2), r(n, d, seed=3), r(n, d_out, seed=4), r(d_out, seed=5)
    nw, nb = r(d_out, seed=6), r(d_out, seed=7)
    idx = _selection(1, n, k).view(1, 1, k)
    wq, bq = r(heads_ * hd, d, seed=8), r(heads_ * hd, seed=9)
    wo_t = r(heads_ * hd, d_out, seed=10)
    head_idx = _selection(1, heads_, 2).view(1, 1, 2)
    keys = torch.zeros(1, heads_, 16, hd, dtype=f16)
    values = torch.zeros_like(keys)

    def stored(call):
        with mock.patch.dict(os.environ, {tc.STORE_ROWS_ENV: "1"}):
            call()

    def late(call):
        with mock.patch.dict(os.environ, {tc.NORM_LAUNCH_ENV: "late"}):
            call()

    def space(gated=False, norm=False):
        extra = ops.norm_numel(1, d_out) if norm else 0
        return torch.zeros(ops.workspace_numel(1, d_out, k, gated) + extra)

    calls = [
        lambda: sparse_mlp.sparse_mlp(x, idx, w1, r(n, seed=20), None, w2_t, b, "relu"),
        lambda: sparse_mlp.sparse_mlp(x, idx, w1, None, None, w2_t, b, "relu",
                                      workspace=space()),
        lambda: sparse_mlp.sparse_mlp(x, idx, w1, None, w_up, w2_t, None, "silu",
                                      workspace=space(True, True), norm=(res, nw, None, 1e-5,
                                                                         True)),
        lambda: sparse_mlp.sparse_mlp(x, idx, w1, None, None, w2_t, b, "relu",
                                      workspace=space(False, True),
                                      norm=(res, nw, nb, 1e-5)),
        lambda: sparse_mlp.sparse_mlp(r(2, 1, d, seed=11), idx[:1], w1, None, w_up, w2_t, b,
                                      "silu", union=True),
        lambda: heads.sparse_head_proj(x, head_idx, wq, bq, hd),
        lambda: heads.sparse_head_out(r(1, 1, heads_ * hd, seed=12), head_idx, wo_t, b, hd),
        lambda: heads.sparse_head_out(r(1, 1, heads_ * hd, seed=12), head_idx, wo_t, b, hd,
                                      workspace=torch.zeros(ops.workspace_numel(1, d_out)
                                                            + ops.norm_numel(1, d_out)),
                                      norm=(res, nw, nb, 1e-5)),
        lambda: heads.sparse_head_out(r(1, 1, heads_ * hd, seed=12), head_idx,
                                      r(d_out, heads_ * hd, seed=13).t(), b, hd),
        lambda: heads.sparse_head_proj(r(2, 1, d, seed=11), head_idx[:1], wq, bq, hd,
                                       union=True),
        lambda: heads.sparse_head_out(r(2, 1, heads_ * hd, seed=12), head_idx[:1], wo_t, b, hd,
                                      union=True),
        lambda: decode_attention.decode_attention(r(1, heads_, 1, hd, seed=14),
                                                  r(1, 2, 20, hd, seed=15),
                                                  r(1, 2, 20, hd, seed=16), hd ** -0.5),
        lambda: decode_attention.decode_attention(r(1, heads_, 1, hd, seed=14),
                                                  r(1, 2, 20, hd, seed=15),
                                                  r(1, 2, 20, hd, seed=16), hd ** -0.5,
                                                  counters=torch.zeros(2, dtype=torch.int32)),
        # over the selected heads (option ``decode_selected_heads``), with a combine launch and
        # merged in the split kernel
        lambda: decode_attention.decode_attention(r(1, heads_, 1, hd, seed=14),
                                                  r(1, heads_, 20, hd, seed=15),
                                                  r(1, heads_, 20, hd, seed=16), hd ** -0.5,
                                                  heads=head_idx),
        lambda: decode_attention.decode_attention(r(1, heads_, 1, hd, seed=14),
                                                  r(1, heads_, 20, hd, seed=15),
                                                  r(1, heads_, 20, hd, seed=16), hd ** -0.5,
                                                  counters=torch.zeros(2, dtype=torch.int32),
                                                  heads=head_idx),
        lambda: lazy_kv.lazy_qkv(x, head_idx, wq, bq, wq, bq, wq, bq, keys, values,
                                 torch.tensor([3])),
        lambda: lazy_kv.lazy_kv(x, head_idx, wq, bq, wq, bq, keys, values, torch.tensor([4])),
        lambda: dense.gemv(x, w1, None),
        lambda: bucket_select.select_predictor_triton(x, r(8, d, seed=17), r(8, seed=18),
                                                      r(n, 8, seed=19), None, "relu", k, 1, 1),
        lambda: tc.add_norm(res, res, nw, nb, 1e-5),
        lambda: tc.finish(torch.zeros(1, d_out), b, f16),
        # the row-storing forms (``DEJAVU_STORE_ROWS=1``)
        lambda: stored(lambda: sparse_mlp.sparse_mlp(x, idx, w1, None, None, w2_t, b, "relu")),
        lambda: stored(lambda: heads.sparse_head_proj(x, head_idx, wq, bq, hd)),
        # the add-norm and finish kernels starting their successor last
        # (``DEJAVU_NORM_LAUNCH=late``): the MLP's norm from its sums, a query projection
        lambda: late(lambda: sparse_mlp.sparse_mlp(x, idx, w1, None, None, w2_t, b, "relu",
                                                   workspace=space(False, True),
                                                   norm=(res, nw, nb, 1e-5))),
        lambda: late(lambda: heads.sparse_head_proj(x, head_idx, wq, bq, hd)),
    ]
    with mock.patch.object(InterpretedFunction, "run", record):
        for call in calls:
            call()
    return seen


_COMPILE_LAUNCHES = """
import importlib, inspect, json, re, sys
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from triton.runtime.jit import JITFunction
from triton.tools.disasm import get_sass

# the PDL meta-parameter: True (each kernel starts its successor itself), or as argv[2] says
pdl = int(sys.argv[2]) if len(sys.argv) > 2 else True
done = set()
for launch in json.load(open(sys.argv[1])):
    key = json.dumps(launch, sort_keys=True)
    if key in done:
        continue
    done.add(key)
    fn = getattr(importlib.import_module(launch["module"]), launch["name"])
    while not isinstance(fn, JITFunction):
        fn = fn.fn
    defaults = inspect.signature(fn.fn).parameters
    sig, const = {}, {}
    for p in fn.params:
        v = launch["args"].get(p.name, defaults[p.name].default)
        if p.is_constexpr:
            const[p.name] = pdl if p.name == "PDL" else v
        elif isinstance(v, str):
            sig[p.name] = v
        elif v is None:
            sig[p.name], const[p.name] = "constexpr", None
        elif isinstance(v, bool):
            sig[p.name] = "i1"
        elif isinstance(v, int):
            sig[p.name] = "i64" if abs(v) >= 2 ** 31 else "i32"
        else:
            sig[p.name] = "fp32"
    asm = triton.compile(ASTSource(fn, sig, constexprs=const), target=GPUTarget("cuda", 90, 32),
                         options={"num_warps": launch["num_warps"],
                                  "num_stages": launch["num_stages"]}).asm
    ptx = asm["ptx"]
    wait = ptx.find("griddepcontrol.wait")
    # the machine code ptxas made of it: its wait is ACQBULK, its successor's start PREEXIT
    sass = [line.split(None, 1)[-1] for line in get_sass(asm["cubin"]).splitlines()
            if line.rstrip().endswith(";")]
    ops = [re.match(r"(@!?U?P[T0-9]+ )?([A-Z]+)", line).group(2) for line in sass]
    acq = ops.index("ACQBULK") if "ACQBULK" in ops else len(ops)
    stores = [i for i, op in enumerate(ops) if op in ("STG", "ATOM", "ATOMG", "RED", "REDG")]
    writes = [(ptx.find(w), ptx.rfind(w)) for w in ("st.global", "atom.global", "red.global")
              if w in ptx]
    print(json.dumps({"name": launch["name"], "after": const.get("AFTER", False),
                      "late": const.get("LATE", False),
                      "waits": ptx.count("griddepcontrol.wait"), "wait": wait,
                      "write": min(w[0] for w in writes) if writes else -1,
                      "last_write": max(w[1] for w in writes) if writes else -1,
                      "start": ptx.find("griddepcontrol.launch_dependents"),
                      "loads": ptx[:wait].count("ld.global"),
                      "sass_waits": ops.count("ACQBULK"),
                      "sass_loads": ops[:acq].count("LDG"),
                      "sass_writes": sum(i < acq for i in stores),
                      "sass_last_write": max(stores, default=-1),
                      "sass_start": ops.index("PREEXIT") if "PREEXIT" in ops else -1,
                      "sass_wait": acq}))
"""


@pytest.mark.skipif(DEVICE != "cpu", reason="reads the launchers' launches under the interpreter")
def test_every_kernel_waits_before_it_writes_under_programmatic_launch(tmp_path):
    """Programmatic launch is right only if every kernel launched so waits for the kernel
    before it, writes nothing before that wait (the kernel before may still read or write
    there), and lets the kernel after it start only after it (that one's early loads take
    what is older than its predecessor as finished): a kernel that never waits could finish
    before the kernel before it, and the one after it, waiting for it alone, would not wait
    for that one. Every launch a decode step's ops make (``_step_launches``, the launchers'
    own arguments and tiles), compiled here for an sm_90 GPU with ``PDL`` on (Triton's own
    ptxas, no GPU needed), waits, has no global store or atomic before its first wait, and
    no start of its successor before it, but the up kernel's after the op's zero-fill
    (``AFTER``: what its successor loads early is older than that plain launch); the add-norm
    and finish kernels under ``DEJAVU_NORM_LAUNCH=late`` start it after their last store. The
    machine code ptxas makes of each keeps that order (its ``ACQBULK`` and ``PREEXIT``): the
    same global loads before the wait as the PTX, no store or atomic before it, and the late
    start after the last store."""
    import json

    launches = _step_launches()
    (tmp_path / "launches.json").write_text(json.dumps(launches))
    stdout = compile_outside_interpreter(_COMPILE_LAUNCHES, "launches.json", cwd=tmp_path,
                                         timeout=900)
    compiled = [json.loads(line) for line in stdout.splitlines()]
    names = {c["name"] for c in compiled}
    assert names >= {"_up_kernel", "_down_kernel", "_up_union_kernel", "_down_union_kernel",
                     "_head_proj_kernel", "_head_out_kernel", "_head_out_cols_kernel",
                     "_head_proj_union_kernel", "_head_out_union_kernel", "_split_kernel",
                     "_combine_kernel", "_split_heads_kernel", "_combine_heads_kernel",
                     "_lazy_kv_kernel", "_gemv_kernel", "_hidden_kernel",
                     "_bucket_kernel", "_add_norm_kernel", "_finish_kernel",
                     "_up_store_kernel", "_head_proj_store_kernel"}, names
    assert {c["name"] for c in compiled if c["after"]} == {"_up_kernel"}
    assert {c["name"] for c in compiled if c["late"]} == {"_add_norm_kernel", "_finish_kernel"}
    for c in compiled:
        assert c["waits"] >= 1, c
        assert c["write"] == -1 or c["write"] > c["wait"], c
        assert c["start"] >= 0 and (c["start"] < c["wait"]) == c["after"], c
        assert not c["late"] or c["start"] > c["last_write"] > 0, c
        # and ptxas kept that order: no load moved above the wait, no store or atomic before it
        assert c["sass_waits"] >= 1 and c["sass_writes"] == 0, c
        assert c["sass_loads"] == c["loads"], c
        assert c["sass_start"] >= 0 and (c["sass_start"] < c["sass_wait"]) == c["after"], c
        assert not c["late"] or c["sass_start"] > c["sass_last_write"] > 0, c


@pytest.mark.skipif(DEVICE != "cpu", reason="reads the launchers' launches under the interpreter")
def test_no_kernel_starts_its_successor_under_exit_start(tmp_path):
    """Under ``DEJAVU_PDL_START=exit`` (``PDL`` is ``triton_common.PDL_EXIT``) every kernel a
    decode step launches, compiled for an sm_90 GPU, still waits before it writes (the PTX and
    ptxas's machine code, as in the test above), and none starts its successor (no
    ``griddepcontrol.launch_dependents``, no ``PREEXIT``): the successor starts as its
    programs exit. One launch of each kernel (the first ``_step_launches`` makes), to keep
    the compile short."""
    import json

    from dejavu_compile.kernels import triton_common as tc

    first = {}
    for launch in _step_launches():
        key = (launch["name"], launch["args"].get("AFTER"), launch["args"].get("LATE"))
        first.setdefault(key, launch)
    (tmp_path / "launches.json").write_text(json.dumps(list(first.values())))
    stdout = compile_outside_interpreter(_COMPILE_LAUNCHES, "launches.json", str(tc.PDL_EXIT),
                                         cwd=tmp_path, timeout=900)
    compiled = [json.loads(line) for line in stdout.splitlines()]
    assert {c["name"] for c in compiled} >= {"_up_kernel", "_down_kernel", "_lazy_kv_kernel",
                                             "_add_norm_kernel", "_finish_kernel",
                                             "_split_kernel", "_combine_kernel"}
    assert any(c["after"] for c in compiled) and any(c["late"] for c in compiled)
    for c in compiled:
        assert c["waits"] >= 1 and (c["write"] == -1 or c["write"] > c["wait"]), c
        assert c["start"] == -1 and c["sass_start"] == -1, c
        assert c["sass_waits"] >= 1 and c["sass_writes"] == 0, c


def test_pdl_start_says_where_kernels_start_their_successor(monkeypatch):
    """``pdl_meta`` gives ``PDL`` True under ``DEJAVU_PDL_START=wait`` (and unset) and
    ``PDL_EXIT`` under ``exit``, with Triton's ``launch_pdl`` either way, where programmatic
    launch is on; ``PDL`` false and no ``launch_pdl`` where it is off, whatever the variable
    says; any other value is an error naming the variable."""
    from dejavu_compile.kernels import triton_common as tc

    monkeypatch.setattr(tc, "programmatic", lambda: True)
    monkeypatch.delenv(tc.PDL_START_ENV, raising=False)
    assert tc.pdl_start() == "wait" and tc.pdl_meta() == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(tc.PDL_START_ENV, "wait")
    assert tc.pdl_meta() == {"PDL": True, "launch_pdl": True}
    monkeypatch.setenv(tc.PDL_START_ENV, "exit")
    assert tc.pdl_meta() == {"PDL": tc.PDL_EXIT, "launch_pdl": True} and tc.PDL_EXIT == 2
    monkeypatch.setenv(tc.NORM_LAUNCH_ENV, "late")
    assert tc.norm_launch_meta(False) == {"PDL": tc.PDL_EXIT, "launch_pdl": True, "LATE": True}
    monkeypatch.setattr(tc, "programmatic", lambda: False)
    assert tc.pdl_meta() == {"PDL": False}
    monkeypatch.setenv(tc.PDL_START_ENV, "last")
    with pytest.raises(ValueError, match="DEJAVU_PDL_START='last'"):
        tc.pdl_start()


def test_up_kernel_loads_before_its_wait_only_after_the_ops_own_launch(monkeypatch):
    """Under programmatic launch the up kernel may load its ids and x before it waits only when
    the kernel before it is the op's own (the zero-fill, or the gated op's gather): on a
    workspace no fill runs, the kernel before is another op's (the selector, which writes the
    ids), so the up kernel is launched to wait first (``AFTER`` false)."""
    from dejavu_compile.kernels import ops

    launched = []
    monkeypatch.setattr(sparse_mlp, "launch",
                        lambda kernel, grid, *args, **meta: launched.append((kernel, meta)))
    d, n, d_out, k = 37, 90, 29, 11
    x = _rand(1, 1, d, dtype=torch.float32, seed=0)
    w1, w_up = _rand(n, d, dtype=torch.float32, seed=1), _rand(n, d, dtype=torch.float32, seed=2)
    w2_t = _rand(n, d_out, dtype=torch.float32, seed=3)
    idx = _selection(1, n, k).view(1, 1, k)

    def after(op, *args, **kwargs):
        launched.clear()
        op(*args, **kwargs)
        ups = [meta["AFTER"] for kernel, meta in launched if kernel is sparse_mlp._up_kernel]
        assert len(ups) == 1, launched
        return ups[0]

    for gate in (None, w_up):
        space = torch.zeros(ops.workspace_numel(1, d_out, k, gate is not None), device=DEVICE)
        args = (x, idx, w1, None, gate, w2_t, None, "relu")
        assert after(sparse_mlp.sparse_mlp, *args)
        assert not after(sparse_mlp.sparse_mlp, *args, workspace=space)
    g = _rand(1, 1, n, dtype=torch.float32, seed=4)
    assert after(sparse_mlp.sparse_mlp_gated, x, idx, g, w_up, w2_t, None, "silu")


# buckets one program ranks (Triton), and buckets of 1050 units, past MAX_BUCKET (PyTorch)
@pytest.mark.parametrize("units,buckets", [(96, 4), (2100, 2)])
def test_selector_writes_into_a_given_output(units, buckets):
    """``select_predictor(..., out=)`` (the lookahead side stream's call) writes the reference's
    ids into ``out`` and returns it, on the Triton and the PyTorch paths alike."""
    from dejavu_compile.kernels import predictor

    d, rank, k = 37, 12, 24
    assert bucket_select.bucketed(units, buckets) == (units == 96)
    x = _rand(2, 1, d, dtype=torch.float16, seed=0)
    w1, w2 = _rand(rank, d, dtype=torch.float16, seed=1), _rand(units, rank, dtype=torch.float16,
                                                              seed=2)
    want = ref.select_predictor(x, w1, None, w2, None, "relu", k, 1, buckets)
    out = torch.full((2, 1, k), -7, dtype=torch.int64, device=DEVICE)
    got = predictor.select_predictor(x, w1, None, w2, None, "relu", k, 1, buckets, out)
    assert got.data_ptr() == out.data_ptr() and torch.equal(out, want)


@pytest.mark.parametrize("units,k,group,buckets", BUCKET_SHAPES)
@pytest.mark.parametrize("batch", [1, 3])
def test_bucket_kernel_ranking_by_counting(units, k, group, buckets, batch, monkeypatch):
    """The bucket kernel's other ranking (config ``COUNT``: a unit is kept when fewer than
    ``keep`` scores beat it, placed by a running count) gives the reference's ids, ascending,
    as the sorting networks do; the autotuner picks whichever is faster."""
    import triton

    monkeypatch.setattr(bucket_select._bucket_kernel, "configs",
                        [triton.Config({"BLOCK_R": 16, "COUNT": 1}, num_warps=4)])
    d, rank = 37, 12
    x = _rand(batch, 1, d, dtype=torch.float16, seed=0)
    w1, w2 = _rand(rank, d, dtype=torch.float16, seed=1), _rand(units, rank, dtype=torch.float16,
                                                              seed=2)
    b1, b2 = _rand(rank, dtype=torch.float16, seed=3), _rand(units, dtype=torch.float16, seed=4)
    want = ref.select_predictor(x, w1, b1, w2, b2, "relu", k, group, buckets)
    got = bucket_select.select_predictor_triton(x, w1, b1, w2, b2, "relu", k, group, buckets)
    assert torch.equal(got, want)


@pytest.mark.parametrize("dtype", DTYPES)
# ragged row blocks and slices; d within the first slice (no loop after the wait)
@pytest.mark.parametrize("n,d", [(37, 50), (3, 16), (70, 33), (5, 7)])
@pytest.mark.parametrize("bias", [False, True])
def test_dense_gemv_kernel(dtype, n, d, bias):
    """The dense GEMV of a one-row projection equals F.linear, bias included, in x's dtype;
    more rows go to F.linear itself; a weight that does not fit is refused."""
    from dejavu_compile.kernels import dense

    x, w = _rand(1, 1, d, dtype=dtype, seed=1), _rand(n, d, dtype=dtype, seed=2)
    b = _rand(n, dtype=dtype, seed=3) if bias else None
    out = dense.gemv(x, w, b)
    assert out.shape == (1, 1, n) and out.dtype == dtype
    want = _ref64(torch.nn.functional.linear, x, w, b)
    torch.testing.assert_close(out.double(), want, **TOL[dtype])
    # every row of the weight's blocks, the last ragged one too, is computed
    assert dense.MAX_ROWS == 1
    many = _rand(3, d, dtype=dtype, seed=4)
    torch.testing.assert_close(dense.gemv(many, w, b).double(),
                               _ref64(torch.nn.functional.linear, many, w, b), **TOL[dtype])
    with pytest.raises(ValueError, match="do not fit"):
        dense.gemv(x, w[:, :-1], b)
    # deterministic mode launches the one fixed config
    before = torch.are_deterministic_algorithms_enabled()
    torch.use_deterministic_algorithms(True)
    try:
        torch.testing.assert_close(dense.gemv(x, w, b).double(), want, **TOL[dtype])
    finally:
        torch.use_deterministic_algorithms(before)
