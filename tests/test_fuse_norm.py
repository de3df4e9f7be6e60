"""Option ``fuse_norm``: a sparse op's residual add and layer norm finished by its own reducing
kernel (``ops.sparse_mlp_norm``, ``ops.sparse_head_out_norm``, ``passes/lower.py::fuse_norms``,
``kernels/triton_common.py::finish_norm_last``), or by an add-norm launch after the op
(``triton_common.add_norm``, ``DEJAVU_NORM_FINISH``). Kernels on CPU through
TRITON_INTERPRET=1."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from dejavu_compile.kernels import ops
from dejavu_compile.kernels import reference as ref

from dejavu_compile import bench
from dejavu_compile.config import DejavuOptions

from .conftest import compile_outside_interpreter, deterministic_algorithms
from .test_backend import _capture, _dejavu_nodes
from .test_kernels import DEVICE, TOL, _mlp_case, _rand, _ref64, _selection

heads = pytest.importorskip("dejavu_compile.kernels.heads")
sparse_mlp = pytest.importorskip("dejavu_compile.kernels.sparse_mlp")
tc = pytest.importorskip("dejavu_compile.kernels.triton_common")

EPS = 1e-5


@pytest.fixture
def last_finish(monkeypatch):
    """The norm in the reducing kernel's last programs (``DEJAVU_NORM_FINISH=last``; the
    default is an add-norm launch after the op)."""
    monkeypatch.setenv(tc.NORM_FINISH_ENV, "last")


def _norm_case(batch: int, d_out: int, dtype, bias: bool):
    """A residual far from zero mean (the norm's statistics must not cancel), weight, bias."""
    residual = _rand(batch, 1, d_out, dtype=dtype, seed=11) * 6 + 3
    weight = _rand(d_out, dtype=dtype, seed=12) + 1
    return residual, weight, _rand(d_out, dtype=dtype, seed=13) if bias else None


def _check(got, y64, residual, weight, bias, dtype, rms=False):
    """The sum against the fp64 reference; the norm against the layer norm of the kernel's own
    sum (the sum is rounded to the dtype before the norm, as the graph it replaces did); with
    ``rms``, against Llama's RMS norm of that sum as ``reference.add_norm`` computes it."""
    h, normed = got
    assert h.shape == residual.shape and normed.shape == residual.shape
    want_h = residual.double() + y64.reshape(residual.shape)
    torch.testing.assert_close(h.double(), want_h, **TOL[dtype])
    if rms:
        assert bias is None
        want_n = ref.add_norm(torch.zeros_like(h), h, weight, None, EPS, rms=True)[1].double()
    else:
        want_n = torch.nn.functional.layer_norm(
            h.double(), (h.shape[-1],), weight.double(), None if bias is None else bias.double(),
            EPS)
    torch.testing.assert_close(normed.double(), want_n, **TOL[dtype])


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("density", [1 / 45, 0.3, 1.0])
@pytest.mark.parametrize("batch", [1, 3])
@pytest.mark.usefixtures("last_finish")
def test_sparse_mlp_norm_kernel(dtype, gated, density, batch):
    """The down kernel finishes the sum and its norm: on a fresh buffer, and three calls on a
    workspace (``workspace_numel`` + ``norm_numel``) with another input in between, each equal
    to the reference and the workspace left zero; a workspace without the norm's values is
    refused."""
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, gated, density, batch)
    act = "silu" if gated else "relu"
    k, d_out = idx.shape[-1], w2_t.shape[1]
    residual, weight, bias = _norm_case(batch, d_out, dtype, bias=not gated)
    norm = (residual, weight, bias, EPS)
    y64 = _ref64(ref.sparse_mlp, x, idx, w1, b1, w_up, w2_t, b2, act)
    _check(sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, norm=norm), y64,
           residual, weight, bias, dtype)
    plain = ops.workspace_numel(batch, d_out, k, gated)
    workspace = torch.zeros(plain + ops.norm_numel(batch, d_out), device=DEVICE)
    for call in range(3):
        if call == 1:
            x = _rand(batch, 1, x.shape[-1], dtype=dtype, seed=9)
            y64 = _ref64(ref.sparse_mlp, x, idx, w1, b1, w_up, w2_t, b2, act)
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, workspace=workspace,
                                    norm=norm)
        _check(got, y64, residual, weight, bias, dtype)
        assert not workspace.any(), workspace.nonzero().flatten()[:8]
    with pytest.raises(ValueError, match="norm_numel"):
        sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, workspace=workspace[:plain],
                              norm=norm)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("n_heads,head_dim,k", [(5, 8, 1), (6, 12, 3), (4, 16, 4)])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("batch", [1, 2])
@pytest.mark.usefixtures("last_finish")
def test_sparse_head_out_norm_kernel(dtype, n_heads, head_dim, k, bias, batch):
    """The output projection's kernel finishes the sum and its norm, on a fresh buffer and twice
    on a workspace it leaves zero."""
    d = 23
    attn = _rand(batch, 1, n_heads * head_dim, dtype=dtype, seed=3)
    wo_t = _rand(n_heads * head_dim, d, dtype=dtype, seed=4)
    bo = _rand(d, dtype=dtype, seed=5) if bias else None
    idx = _selection(batch, n_heads, k).view(batch, 1, k)
    residual, weight, nb = _norm_case(batch, d, dtype, bias)
    y64 = _ref64(ref.sparse_head_out, attn, idx, wo_t, bo, head_dim)
    norm = (residual, weight, nb, EPS)
    _check(heads.sparse_head_out(attn, idx, wo_t, bo, head_dim, norm=norm), y64, residual,
           weight, nb, dtype)
    workspace = torch.zeros(ops.workspace_numel(batch, d) + ops.norm_numel(batch, d),
                            device=DEVICE)
    for _ in range(2):
        got = heads.sparse_head_out(attn, idx, wo_t, bo, head_dim, workspace=workspace, norm=norm)
        _check(got, y64, residual, weight, nb, dtype)
        assert not workspace.any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.usefixtures("last_finish")
def test_norm_ops_without_the_fused_finish(dtype):
    """A batch's union selection, deterministic mode and the output projection on its original
    layout have no fused finish: the ops add and normalise after, with the same results."""
    batch = 3
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, False, 0.3, batch)
    residual, weight, bias = _norm_case(batch, w2_t.shape[1], dtype, bias=True)
    norm = (residual, weight, bias, EPS)
    y64 = _ref64(ref.sparse_mlp, x, idx, w1, b1, None, w2_t, b2, "relu", True)
    _check(sparse_mlp.sparse_mlp(x, idx, w1, b1, None, w2_t, b2, "relu", True, norm=norm), y64,
           residual, weight, bias, dtype)
    y64 = _ref64(ref.sparse_mlp, x, idx, w1, b1, None, w2_t, b2, "relu")
    with deterministic_algorithms():
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, None, w2_t, b2, "relu", norm=norm)
    _check(got, y64, residual, weight, bias, dtype)
    n_heads, head_dim, d = 6, 12, 23
    attn = _rand(batch, 1, n_heads * head_dim, dtype=dtype, seed=3)
    wo = _rand(d, n_heads * head_dim, dtype=dtype, seed=4)  # original layout: wo.t() read
    hidx = _selection(batch, n_heads, 3).view(batch, 1, 3)
    residual, weight, bias = _norm_case(batch, d, dtype, bias=True)
    assert heads.reads_columns(wo.t(), head_dim)
    _check(heads.sparse_head_out(attn, hidx, wo.t(), None, head_dim,
                                 norm=(residual, weight, bias, EPS)),
           _ref64(ref.sparse_head_out, attn, hidx, wo.t(), None, head_dim), residual, weight,
           bias, dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("d", [1, 23, 64, 300])
@pytest.mark.parametrize("rows", [1, 3])
@pytest.mark.parametrize("bias", [False, True])
def test_add_norm_kernel(dtype, d, rows, bias):
    """``triton_common.add_norm``, one program a row holding the row: the sum against the fp64
    reference, the norm against the layer norm of the kernel's own (rounded) sum, in the
    residual's shape; y may have another shape with the same values a row."""
    residual, weight, nb = _norm_case(rows, d, dtype, bias)
    y = _rand(rows, d, dtype=dtype, seed=14)  # [R, d] against the residual's [R, 1, d]
    _check(tc.add_norm(y, residual, weight, nb, EPS), y.double(), residual, weight, nb, dtype)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("clean", [False, True])
def test_add_norm_sums_kernel(dtype, bias, clean):
    """``triton_common.add_norm_sums``: a reducing kernel's fp32 sums (rows of a wider buffer)
    finished with the op's bias, rounded, added to the residual and normalised; with
    ``clean`` the sums are left zero, without it as they were."""
    rows, d = 3, 37
    residual, weight, nb = _norm_case(rows, d, dtype, bias=True)
    buf = _rand(rows, d + 5, dtype=torch.float32, seed=16)
    sums, before = buf[:, :d], buf.clone()
    yb = _rand(d, dtype=dtype, seed=17) if bias else None
    y = sums.double() + (0 if yb is None else yb.double())
    y = y.to(dtype).double()  # the op's output as its finish rounds it
    _check(tc.add_norm_sums(sums, yb, residual, weight, nb, EPS, clean=clean), y, residual,
           weight, nb, dtype)
    if clean:
        assert not sums.any() and torch.equal(buf[:, d:], before[:, d:])
    else:
        assert torch.equal(buf, before)
    with pytest.raises(ValueError, match="add_norm_sums: the sums must be fp32"):
        tc.add_norm_sums(sums.half(), yb, residual, weight, nb, EPS, clean=clean)


@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("d", [1, 23, 300])
@pytest.mark.parametrize("rows", [1, 3])
def test_add_norm_kernel_with_an_rms_norm(dtype, d, rows):
    """``rms``: the add-norm launch computes Llama's RMS norm of the rounded sum, the scaled
    row rounded before the weight as the module does, from y or from a reducing kernel's fp32
    sums (left zero with ``clean``); an RMS norm with a bias is refused."""
    residual, weight, _ = _norm_case(rows, d, dtype, bias=False)
    y = _rand(rows, d, dtype=dtype, seed=14)
    _check(tc.add_norm(y, residual, weight, None, EPS, True), y.double(), residual, weight, None,
           dtype, rms=True)
    sums = _rand(rows, d, dtype=torch.float32, seed=16)
    yb = _rand(d, dtype=dtype, seed=17)
    want = (sums.double() + yb.double()).to(dtype).double()
    _check(tc.add_norm_sums(sums, yb, residual, weight, None, EPS, True, clean=True), want,
           residual, weight, None, dtype, rms=True)
    assert not sums.any()
    with pytest.raises(ValueError, match="RMS norm takes no bias"):
        tc.add_norm(y, residual, weight, weight, EPS, True)


@pytest.mark.parametrize("finish", tc.NORM_FINISHES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_norm_ops_with_an_rms_norm(finish, dtype, monkeypatch):
    """Both ops with an RMS norm (``norm`` ending in True, as the CUDA registrations pass
    ``rms``): in every ``DEJAVU_NORM_FINISH`` the result is the reference's and the workspace
    is left zero; where the reducing kernel would finish a layer norm ("last", "mixed") it
    finishes the op and an add-norm launch follows (no ``NORM`` in the kernel). The op's CPU
    implementation computes ``reference.add_norm`` with ``rms``; a bias is refused."""
    monkeypatch.setenv(tc.NORM_FINISH_ENV, finish)
    normed = []
    for module in (sparse_mlp, heads.tc):
        real = module.launch

        def spy(kernel, grid, *args, real=real, **meta):
            normed.append(meta.get("NORM", False))
            return real(kernel, grid, *args, **meta)

        monkeypatch.setattr(module, "launch", spy)
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, True, 0.3, 1)
    k, d_out = idx.shape[-1], w2_t.shape[1]
    residual, weight, _ = _norm_case(1, d_out, dtype, bias=False)
    norm = (residual, weight, None, EPS, True)
    y64 = _ref64(ref.sparse_mlp, x, idx, w1, b1, w_up, w2_t, b2, "silu")
    space = torch.zeros(ops.workspace_numel(1, d_out, k, True) + ops.norm_numel(1, d_out),
                        device=DEVICE)
    for _ in range(2):
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, "silu", workspace=space,
                                    norm=norm)
        _check(got, y64, residual, weight, None, dtype, rms=True)
        assert not space.any()
    n_heads, head_dim = 6, 12
    attn = _rand(1, 1, n_heads * head_dim, dtype=dtype, seed=3)
    wo_t = _rand(n_heads * head_dim, d_out, dtype=dtype, seed=4)
    hidx = _selection(1, n_heads, 3).view(1, 1, 3)
    space = torch.zeros(ops.workspace_numel(1, d_out) + ops.norm_numel(1, d_out), device=DEVICE)
    for _ in range(2):
        got = heads.sparse_head_out(attn, hidx, wo_t, None, head_dim, workspace=space, norm=norm)
        _check(got, _ref64(ref.sparse_head_out, attn, hidx, wo_t, None, head_dim), residual,
               weight, None, dtype, rms=True)
        assert not space.any()
    assert normed and not any(normed)
    got = ops.sparse_mlp_norm(x, idx, w1, b1, w_up, w2_t, b2, "silu", residual, weight, None,
                              EPS, rms=True)
    _check(got, y64, residual, weight, None, dtype, rms=True)
    with pytest.raises(ValueError, match="RMS norm takes no bias"):
        sparse_mlp.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, "silu",
                              norm=(residual, weight, weight, EPS, True))


def test_add_norm_refuses_what_does_not_fit():
    """A y of another dtype or size, a dtype the kernels do not take: clear errors."""
    residual, weight, bias = _norm_case(2, 23, torch.float16, bias=True)
    for y in (_rand(2, 23, dtype=torch.float32, seed=14), _rand(2, 22, dtype=torch.float16,
                                                                   seed=14)):
        with pytest.raises(ValueError, match="add_norm: y must be torch.float16"):
            tc.add_norm(y, residual, weight, bias, EPS)
    with pytest.raises(TypeError, match="add_norm"):
        tc.add_norm(residual.double(), residual.double(), weight, bias, EPS)


@pytest.mark.parametrize("finish", ["kernel", "mixed", "sums"])
def test_norm_ops_with_the_norm_launched_after(finish, monkeypatch):
    """``DEJAVU_NORM_FINISH``: "kernel" runs both ops as without the norm, then an add-norm
    launch; "mixed" the MLP's norm in its down kernel and the output projection's in a
    launch; "sums" both reducing kernels without their finish, the add-norm launch finishing
    and zeroing their sums. The results equal the reference's, on workspaces left zero; a
    launch-after op needs no norm values in its workspace."""
    monkeypatch.setenv(tc.NORM_FINISH_ENV, finish)
    dtype, batch = torch.float16, 2
    launched, real = [], tc._add_norm_kernel

    class Spy:  # the launcher indexes the kernel by its grid: count those
        def __getitem__(self, grid):
            launched.append(grid)
            return real[grid]

    monkeypatch.setattr(tc, "_add_norm_kernel", Spy())
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, False, 0.3, batch)
    k, d_out = idx.shape[-1], w2_t.shape[1]
    residual, weight, bias = _norm_case(batch, d_out, dtype, bias=True)
    norm = (residual, weight, bias, EPS)
    in_down = finish == "mixed"
    space = torch.zeros(ops.workspace_numel(batch, d_out, k)
                        + (ops.norm_numel(batch, d_out) if in_down else 0), device=DEVICE)
    for _ in range(2):
        got = sparse_mlp.sparse_mlp(x, idx, w1, b1, None, w2_t, b2, "relu", workspace=space,
                                    norm=norm)
        _check(got, _ref64(ref.sparse_mlp, x, idx, w1, b1, None, w2_t, b2, "relu"), residual,
               weight, bias, dtype)
        assert not space.any()
    assert len(launched) == (0 if in_down else 2)
    n_heads, head_dim = 6, 12
    attn = _rand(batch, 1, n_heads * head_dim, dtype=dtype, seed=3)
    wo_t = _rand(n_heads * head_dim, d_out, dtype=dtype, seed=4)
    hidx = _selection(batch, n_heads, 3).view(batch, 1, 3)
    space = torch.zeros(ops.workspace_numel(batch, d_out), device=DEVICE)
    bo = _rand(d_out, dtype=dtype, seed=15)
    for _ in range(2):
        got = heads.sparse_head_out(attn, hidx, wo_t, bo, head_dim, workspace=space, norm=norm)
        _check(got, _ref64(ref.sparse_head_out, attn, hidx, wo_t, bo, head_dim), residual,
               weight, bias, dtype)
        assert not space.any()
    assert len(launched) == (2 if in_down else 4)


def test_norm_ops_refuse_what_does_not_fit():
    """A residual of another shape or dtype, or a norm weight of another width: clear errors,
    from the kernels and from the op's CPU implementation alike."""
    dtype = torch.float16
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, False, 0.3, 1)
    residual, weight, bias = _norm_case(1, w2_t.shape[1], dtype, bias=True)
    bad = [((residual[..., :-1], weight, bias, EPS), "residual"),
           ((residual.float(), weight, bias, EPS), "residual"),
           ((residual, weight[:-1], bias, EPS), "weight")]
    for norm, what in bad:
        with pytest.raises(ValueError, match=what):
            sparse_mlp.sparse_mlp(x, idx, w1, b1, None, w2_t, b2, "relu", norm=norm)
    with pytest.raises(ValueError, match="residual"):
        ops.sparse_mlp_norm(x, idx, w1, b1, None, w2_t, b2, "relu", residual[..., :-1], weight,
                            bias, EPS)
    with pytest.raises(ValueError, match="residual"):
        heads.sparse_head_out(_rand(1, 1, 24, dtype=dtype, seed=3), _selection(1, 2, 1).view(1, 1, 1),
                              _rand(24, 23, dtype=dtype, seed=4), None, 12,
                              norm=(_rand(1, 1, 22, dtype=dtype, seed=5),
                                    _rand(23, dtype=dtype, seed=6), None, EPS))


def _decode(model, options, ids, steps=4):
    backend, graphs = _capture(options)
    torch._dynamo.reset()
    forward = torch.compile(model.forward, backend=backend)
    with torch.no_grad():
        out = forward(input_ids=ids, use_cache=True)
        logits = [out.logits[:, -1:]]
        for _ in range(steps):
            out = forward(input_ids=logits[-1].argmax(-1), past_key_values=out.past_key_values,
                          use_cache=True)
            logits.append(out.logits)
    return torch.cat(logits, 1), graphs


def test_the_pass_fuses_opt_norms_and_keeps_the_logits(tmp_path):
    """A 3-layer OPT (layer 0 dense, random predictors, lookahead): with ``fuse_norm`` each
    sparse layer's output projection and MLP become the norm ops, their residual adds and
    layer norms gone from the decode graph (the next layer's and the final one included);
    the dense layer keeps its own; the logits are those without the option."""
    import transformers as tf

    cfg = tf.OPTConfig(vocab_size=100, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                       max_position_embeddings=256, ffn_dim=96, word_embed_proj_dim=64)
    torch.manual_seed(0)
    model = tf.OPTForCausalLM(cfg).eval()
    profile = bench.random_profile(model, 0.5, 0.5, 8, tmp_path / "p.yaml", lookahead=True)
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    runs = {}
    for fuse in (False, True):
        runs[fuse], graphs = _decode(model, {"profile": profile, "fuse_norm": fuse}, ids)
        gm, ctx = graphs[-1]
        names = _dejavu_nodes(gm)
        norms = [n for n in gm.graph.nodes if n.target is torch.nn.functional.layer_norm]
        # the blocks' discovered inputs name nodes of the graph (the fused norms' outputs)
        live = set(gm.graph.nodes)
        assert ctx.inputs and all(n in live for n in ctx.inputs.values()), ctx.inputs
        if fuse:
            assert ctx.counters.values["fuse_norm[sparse_mlp]"] == 2
            assert ctx.counters.values["fuse_norm[sparse_head_out]"] == 2
            assert names.count("dejavu::sparse_mlp_norm") == 2
            assert names.count("dejavu::sparse_head_out_norm") == 2
            assert "dejavu::sparse_mlp" not in names and "dejavu::sparse_head_out" not in names
            assert len(norms) == 3  # layer 0's two and layer 1's first, read by dense layer 0
        else:
            assert not any(k.startswith("fuse_norm") for k in ctx.counters.values)
            assert len(norms) == 7
    torch.testing.assert_close(runs[True], runs[False], atol=1e-5, rtol=1e-5)


def test_the_pass_fuses_llama_rms_norms(tiny):
    """With option ``fuse_rms_norm`` False Llama's RMS norms are left alone, each sparse op
    counted as skipped; with ``fuse_norm`` False too, but the pass does not run (nothing
    counted). By default (None: it follows ``fuse_norm``, on) the RMS norm after each sparse
    op's residual add (the next block's norm, the final one after the last MLP) is fused
    with ``rms``: none of those norms' nodes is left (one ``rsqrt``, the first layer's), the
    blocks' discovered inputs are live nodes, and the logits are those without the option."""
    model = tiny("llama")
    layers = model.config.num_hidden_layers
    options = {"selector": "oracle", "mlp_density": 0.5, "attention_density": 0.5}
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    plain, graphs = _decode(model, {**options, "fuse_rms_norm": False}, ids, 2)
    rsqrt = [n for n in graphs[-1][0].graph.nodes if n.target == torch.rsqrt]
    assert len(rsqrt) == 2 * layers + 1
    counters = graphs[-1][1].counters.values
    assert not any(k.startswith("fuse_norm[") for k in counters)
    assert counters["fuse_norm_skipped"] == 2 * layers
    off, graphs = _decode(model, {**options, "fuse_norm": False}, ids, 2)
    assert not any(k.startswith("fuse_norm") for k in graphs[-1][1].counters.values)
    assert len([n for n in graphs[-1][0].graph.nodes if n.target == torch.rsqrt]) \
        == 2 * layers + 1
    torch.testing.assert_close(off, plain, atol=0, rtol=0)
    assert DejavuOptions.from_mapping(options).rms_norms_fused
    fused, graphs = _decode(model, options, ids, 2)
    gm, ctx = graphs[-1]
    counters = ctx.counters.values
    assert counters["fuse_norm[sparse_mlp]"] == layers
    assert counters["fuse_norm[sparse_head_out]"] == layers
    assert counters["fuse_norm_rms"] == 2 * layers and "fuse_norm_skipped" not in counters
    names = _dejavu_nodes(gm)
    assert "dejavu::sparse_mlp" not in names and "dejavu::sparse_head_out" not in names
    fused_ops = [n for n in gm.graph.nodes if getattr(n.target, "name", lambda: "")().startswith(
        ("dejavu::sparse_mlp_norm", "dejavu::sparse_head_out_norm"))]
    assert fused_ops and all(n.kwargs.get("rms") is True for n in fused_ops)
    assert len([n for n in gm.graph.nodes if n.target == torch.rsqrt]) == 1  # the first
    live = set(gm.graph.nodes)
    assert ctx.inputs and all(n in live for n in ctx.inputs.values()), ctx.inputs
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)


def test_gemma_rms_norms_are_left_alone(tiny):
    """Gemma 3 normalises each sparse op's output before its residual add, and its RMS norm
    scales by ``1 + w`` in fp32: even with ``fuse_rms_norm`` nothing is fused, each sparse op
    counted as skipped; the logits are those without the options. ``fuse_rms_norm`` True
    without ``fuse_norm`` is refused."""
    model = tiny("gemma3")
    options = {"selector": "oracle", "mlp_density": 0.5, "attention_density": 0.5}
    ids = torch.randint(3, 90, (1, 7), generator=torch.Generator().manual_seed(2))
    plain, _ = _decode(model, {**options, "fuse_norm": False}, ids, 2)
    fused, graphs = _decode(model, {**options, "fuse_rms_norm": True}, ids, 2)
    counters = graphs[-1][1].counters.values
    assert not any(k.startswith("fuse_norm[") for k in counters)
    assert counters["fuse_norm_skipped"] == 2 * model.config.num_hidden_layers
    torch.testing.assert_close(fused, plain, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="'fuse_rms_norm' needs fuse_norm=True"):
        DejavuOptions.from_mapping({**options, "fuse_norm": False, "fuse_rms_norm": True})


@pytest.mark.usefixtures("last_finish")
def test_shipped_keys_match_the_fused_calls(monkeypatch):
    """The shipped H200 configs are keyed by the tuning arguments and every tensor argument's
    dtype: the down and output-projection kernels' keys must have the dtypes of an fp16 call
    with the fused finish, with or without the norm (the norm's pointers stand in for
    themselves without it), or every such call would tune again on the GPU."""
    calls = []
    for module in (sparse_mlp, heads):
        real = module.launch if module is sparse_mlp else module.tc.launch

        def spy(kernel, grid, *args, real=real, **meta):
            calls.append((kernel, args))
            return real(kernel, grid, *args, **meta)

        if module is sparse_mlp:
            monkeypatch.setattr(sparse_mlp, "launch", spy)
        else:
            monkeypatch.setattr(heads.tc, "launch", spy)
    dtype = torch.float16
    x, idx, w1, b1, w_up, w2_t, b2 = _mlp_case(dtype, False, 0.3, 1)
    d_out, k = w2_t.shape[1], idx.shape[-1]
    residual, weight, bias = _norm_case(1, d_out, dtype, bias=True)
    attn = _rand(1, 1, 24, dtype=dtype, seed=3)
    hidx, wo_t = _selection(1, 2, 1).view(1, 1, 1), _rand(24, d_out, dtype=dtype, seed=4)
    for norm in (None, (residual, weight, bias, EPS)):
        extra = ops.norm_numel(1, d_out) if norm else 0
        space = torch.zeros(ops.workspace_numel(1, d_out, k) + extra, device=DEVICE)
        sparse_mlp.sparse_mlp(x, idx, w1, b1, None, w2_t, b2, "relu", workspace=space, norm=norm)
        space = torch.zeros(ops.workspace_numel(1, d_out) + extra, device=DEVICE)
        heads.sparse_head_out(attn, hidx, wo_t, b2, 12, workspace=space, norm=norm)
    data = json.loads((Path(tc.__file__).parent / "tuned" / "NVIDIA_H200.json").read_text())
    for kernel, name in ((sparse_mlp._down_kernel, "sparse_mlp._down_kernel"),
                         (heads._head_out_kernel, "heads._head_out_kernel")):
        tails = {tuple(str(a.dtype) for a in args if hasattr(a, "dtype"))
                 for fn, args in calls if fn is kernel}
        assert len(tails) == 1, tails  # the same dtypes with and without the norm
        (tail,) = tails
        keys = [e["key"] for e in data["tuned"][name]]
        fp16 = [key for key in keys if "torch.float16" in key]
        assert fp16 and all(tuple(key[len(kernel.keys):]) == tail for key in fp16), (tail, keys)


def test_norm_finish_compiles_for_hopper(tmp_path):
    """The interpreter runs the kernels' Python, not Triton's compiler: compile the down and
    output-projection kernels with the fused norm for an sm_90 GPU (Triton's own ptxas, no GPU
    needed), at OPT-13B's row of 5120 and the shipped tiles, and the add-norm kernel for that
    row, on a row and on a reducing kernel's sums, and with an RMS norm at Llama-3-8B's row of
    4096."""
    code = """
import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource
from dejavu_compile.kernels import heads, sparse_mlp, triton_common
norm = {"res_ptr": "*fp16", "nrm_ptr": "*fp16", "nw_ptr": "*fp16", "nb_ptr": "*fp16",
        "stats_ptr": "*fp32", "rcnt_ptr": "*i32", "eps": "fp32"}
sizes = dict(NORM=True, HAS_NB=True, BLOCK_T=512, BLOCK_ROW=8192, PDL=True, CLEAN=True,
             FUSED=True, ATOMIC=True, stride_w2o=1, stride_wo=1, LATE=False)
cases = [(sparse_mlp._down_kernel.fn,
          {"pre_ptr": "*fp32", "up_ptr": "*fp32", "idx_ptr": "*i64", "b1_ptr": "*fp16",
           "w2t_ptr": "*fp16", "out_ptr": "*fp32", "fin_ptr": "*fp16", "b2_ptr": "*fp16",
           "cnt_ptr": "*i32", "clean_ptr": "*i32"},
          dict(ACT=0, HAS_B1=True, GATED=False, HAS_B2=True, BLOCK_N=16, BLOCK_D=512, TILES=4)),
         (heads._head_out_kernel.fn,
          {"a_ptr": "*fp16", "idx_ptr": "*i64", "w_ptr": "*fp16", "out_ptr": "*fp32",
           "fin_ptr": "*fp16", "b_ptr": "*fp16", "cnt_ptr": "*i32"},
          dict(HAS_B=True, EARLY=False, BLOCK_N=64, BLOCK_D=128, TILES=4)),
         (triton_common._add_norm_kernel,
          {p: "*fp16" for p in ("y_ptr", "yb_ptr", "r_ptr", "w_ptr", "b_ptr", "h_ptr", "n_ptr")},
          dict(HAS_B=True, BLOCK=8192, SUMS=False, HAS_YB=False)),
         (triton_common._add_norm_kernel,
          {"y_ptr": "*fp32", **{p: "*fp16" for p in ("yb_ptr", "r_ptr", "w_ptr", "b_ptr",
                                                     "h_ptr", "n_ptr")}},
          dict(HAS_B=True, BLOCK=8192, SUMS=True, HAS_YB=True, CLEAN=True)),
         (triton_common._add_norm_kernel,  # Llama-3-8B's RMS norm after its down kernel
          {"y_ptr": "*fp32", **{p: "*fp16" for p in ("yb_ptr", "r_ptr", "w_ptr", "b_ptr",
                                                     "h_ptr", "n_ptr")}},
          dict(HAS_B=False, BLOCK=4096, SUMS=True, HAS_YB=False, CLEAN=True, RMS=True))]
for fn, ptrs, const in cases:
    const = {k: v for k, v in {**sizes, **const}.items() if k in fn.arg_names}
    sig = {a: {**ptrs, **norm}.get(a, "constexpr" if a in const else "i32") for a in fn.arg_names}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=const),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    print(fn.__name__, ptx.count("atom.global"), ptx.count("ld.global.cg"))
"""
    stdout = compile_outside_interpreter(code, cwd=tmp_path)
    rows = [line.split() for line in stdout.splitlines()]
    assert [r[0] for r in rows] == ["_down_kernel", "_head_out_kernel", "_add_norm_kernel",
                                    "_add_norm_kernel", "_add_norm_kernel"], stdout
    # the row's statistics and values are read from L2, where the other programs stored them
    assert all(int(r[2]) > 0 for r in rows[:2]), stdout
