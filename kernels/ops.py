"""``torch.ops.dejavu.*``: the sparse ops the passes insert.

Each op is a ``torch.library.custom_op`` whose default implementation is the reference in
``kernels/reference.py`` (used on CPU) and whose fake implementation gives shapes for Dynamo,
Inductor and export. Device kernels (Triton on CUDA) register on top with
``op.register_kernel("cuda")``; nothing else changes when they do.

Shapes: ``x`` [..., d], one decoded token per row; selections ``[..., k]`` int64, per row (see
the reference's docstring).
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch

from . import reference as ref

_LIB = "dejavu"
# the smallest output tile of a reducing kernel: sizes the counters of the programs adding into
# each output tile (``triton_common.finish_last``)
COUNT_BLOCK = 16
# ``sparse_head_out`` on the transposed view of the original ``[d_out, H * head_dim]`` weight
# (column stride 1) reads each output row's selected heads along their columns when a head is
# at least this wide (``heads.reads_columns``; the lower pass's option ``out_layout``)
COLUMN_HEAD_DIM = 8


def workspace_numel(rows: int, d_out: int, k: int = 0, gated: bool = False) -> int:
    """fp32 values of the zero-between-calls workspace of a sparse op on CUDA with ``rows``
    rows and ``d_out`` outputs each (``triton_common.workspace_targets``): for a ``sparse_mlp``
    of ``k`` selected neurons a row, the pre-activations (and up values when ``gated``), then
    for either op the output sums, the counters of the output tiles, and for the MLP the
    counters of the neuron tiles. ``sparse_head_out`` has ``k`` 0."""
    return ((2 if gated else 1) + 1) * rows * k + rows * d_out \
        + rows * -(-d_out // COUNT_BLOCK)


def norm_numel(rows: int, d_out: int) -> int:
    """fp32 values that ``sparse_mlp_norm`` and ``sparse_head_out_norm`` add after their
    op's workspace (``workspace_numel``): each output tile's two statistics (at most one tile
    per ``COUNT_BLOCK`` columns) and a counter per row (``triton_common.finish_norm_last``)."""
    return rows * (2 * -(-d_out // COUNT_BLOCK) + 1)


def _ids_like(x: torch.Tensor, n: int) -> torch.Tensor:
    return x.new_empty(*x.shape[:-1], n, dtype=torch.int64)


@torch.library.custom_op(f"{_LIB}::select_mlp_oracle", mutates_args=())
def select_mlp_oracle(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w_up: torch.Tensor | None,
    act: str,
    k: int,
) -> torch.Tensor:
    """True top-k neurons of the MLP from the dense computation (the paper's existence check)."""
    return ref.select_mlp_oracle(x, w1, b1, w_up, act, k)


@select_mlp_oracle.register_fake
def _(x, w1, b1, w_up, act, k):
    return _ids_like(x, k)


@torch.library.custom_op(f"{_LIB}::select_heads_oracle", mutates_args=())
def select_heads_oracle(
    attn: torch.Tensor, wo_t: torch.Tensor, head_dim: int, k: int, group: int
) -> torch.Tensor:
    """True top-k heads (or head groups) by the norm of their contribution to the output."""
    return ref.select_heads_oracle(attn, wo_t, head_dim, k, group)


@select_heads_oracle.register_fake
def _(attn, wo_t, head_dim, k, group):
    return _ids_like(attn, k * group)


@torch.library.custom_op(f"{_LIB}::select_predictor", mutates_args=())
def select_predictor(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    act: str,
    k: int,
    group: int,
    buckets: int = 1,
) -> torch.Tensor:
    """Learned low-rank predictor followed by a fixed top-k (static shapes), taken per bucket
    of units when ``buckets`` > 1 (``reference.bucket_topk``)."""
    return ref.select_predictor(x, w1, b1, w2, b2, act, k, group, buckets)


@select_predictor.register_fake
def _(x, w1, b1, w2, b2, act, k, group, buckets=1):
    return _ids_like(x, k * group)


@torch.library.custom_op(f"{_LIB}::select_hidden", mutates_args=())
def select_hidden(
    h: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    act: str,
    k: int,
    group: int,
    buckets: int = 1,
) -> torch.Tensor:
    """``select_predictor`` after its first GEMV, which was folded into the projections that
    read the same input (``DejavuOptions.fold_predictors``): h [..., r] -> ids [..., k * group]."""
    return ref.select_hidden(h, b1, w2, b2, act, k, group, buckets)


@select_hidden.register_fake
def _(h, b1, w2, b2, act, k, group, buckets=1):
    return _ids_like(h, k * group)


@torch.library.custom_op(f"{_LIB}::predict_ahead", mutates_args=())
def predict_ahead(
    x: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w2: torch.Tensor,
    b2: torch.Tensor | None,
    act: str,
    k: int,
    group: int,
    buckets: int,
    slot: int,
    after: torch.Tensor | None = None,
) -> torch.Tensor:
    """``select_predictor`` launched ahead (lookahead pass): on CUDA it runs on a side stream
    and records event ``slot``, which the block's first sparse op waits on; on CPU it runs in
    plain order. ``after`` is only read by the graph's order: a cut the fork must follow
    (passes/lower.py::graph_splits), so the inner compiler cannot schedule it before."""
    return ref.select_predictor(x, w1, b1, w2, b2, act, k, group, buckets)


@predict_ahead.register_fake
def _(x, w1, b1, w2, b2, act, k, group, buckets, slot, after=None):
    return _ids_like(x, k * group)


# ``keep`` and ``slot`` of the two ops below are set by the lookahead pass on the block's first
# sparse op: on CUDA the op waits for the predictor's event ``slot`` before it starts, and
# ``keep`` (the earlier layer's input the predictor read on the side stream) stays alive until
# then, so its memory is not reused while the side stream still reads it.


@torch.library.custom_op(f"{_LIB}::sparse_mlp", mutates_args=())
def sparse_mlp(
    x: torch.Tensor,
    idx: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w_up: torch.Tensor | None,
    w2_t: torch.Tensor,
    b2: torch.Tensor | None,
    act: str,
    union: bool = False,
    keep: torch.Tensor | None = None,
    slot: int = -1,
    workspace: torch.Tensor | None = None,
) -> torch.Tensor:
    """MLP over the selected neurons: act(x W1[idx]^T (+b1)) [* x W_up[idx]^T] @ W2_t[idx] (+b2);
    with ``union``, every row over the neurons any row selected (``reference.union_ids``).
    ``workspace`` (fp32 zeros, ``workspace_numel``; the lower pass attaches one on CUDA) is
    working memory the CUDA kernels leave zero again, so the op declares no mutation; the
    result is the same without it."""
    return ref.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, union)


@sparse_mlp.register_fake
def _(x, idx, w1, b1, w_up, w2_t, b2, act, union=False, keep=None, slot=-1, workspace=None):
    return x.new_empty(*x.shape[:-1], w2_t.shape[1])


def _check_norm(name, y_shape, residual, norm_w) -> None:
    if tuple(residual.shape) != tuple(y_shape) or norm_w.shape != (y_shape[-1],):
        raise ValueError(f"{name}: the residual must have the op's output shape {tuple(y_shape)} "
                         f"and the norm's weight its last dim, got {tuple(residual.shape)} and "
                         f"{tuple(norm_w.shape)}")


# The two ops below are a sparse op followed by the residual add and layer norm that read its
# output (``passes/lower.py::fuse_norms``, option ``fuse_norm``): on CUDA the reducing kernel
# that finishes the op's outputs also adds the residual and normalises the row, so no layer
# norm kernel runs after it. Returned: (residual + output, layer_norm(residual + output));
# with ``rms``, Llama's RMS norm in place of the layer norm.


@torch.library.custom_op(f"{_LIB}::sparse_mlp_norm", mutates_args=())
def sparse_mlp_norm(
    x: torch.Tensor,
    idx: torch.Tensor,
    w1: torch.Tensor,
    b1: torch.Tensor | None,
    w_up: torch.Tensor | None,
    w2_t: torch.Tensor,
    b2: torch.Tensor | None,
    act: str,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor | None,
    eps: float,
    union: bool = False,
    keep: torch.Tensor | None = None,
    slot: int = -1,
    workspace: torch.Tensor | None = None,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_mlp``, then ``h = residual + output`` and ``layer_norm(h)`` over the last dim
    with ``norm_w`` and ``norm_b`` (``rms``: Llama's RMS norm with ``norm_w``, no bias;
    ``reference.add_norm``): returns (h, the normalised h). ``workspace``: ``workspace_numel``
    plus ``norm_numel`` values."""
    y = ref.sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act, union)
    _check_norm("sparse_mlp_norm", y.shape, residual, norm_w)
    return ref.add_norm(y, residual, norm_w, norm_b, eps, rms)


@sparse_mlp_norm.register_fake
def _(x, idx, w1, b1, w_up, w2_t, b2, act, residual, norm_w, norm_b, eps, union=False,
      keep=None, slot=-1, workspace=None, rms=False):
    return torch.empty_like(residual), torch.empty_like(residual)


@torch.library.custom_op(f"{_LIB}::sparse_head_out_norm", mutates_args=())
def sparse_head_out_norm(
    attn: torch.Tensor,
    idx: torch.Tensor,
    wo_t: torch.Tensor,
    b: torch.Tensor | None,
    head_dim: int,
    residual: torch.Tensor,
    norm_w: torch.Tensor,
    norm_b: torch.Tensor | None,
    eps: float,
    union: bool = False,
    workspace: torch.Tensor | None = None,
    early: bool = False,
    rms: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``sparse_head_out``, then the residual add and layer (or RMS) norm as
    ``sparse_mlp_norm``."""
    y = ref.sparse_head_out(attn, idx, wo_t, b, head_dim, union)
    _check_norm("sparse_head_out_norm", y.shape, residual, norm_w)
    return ref.add_norm(y, residual, norm_w, norm_b, eps, rms)


@sparse_head_out_norm.register_fake
def _(attn, idx, wo_t, b, head_dim, residual, norm_w, norm_b, eps, union=False, workspace=None,
      early=False, rms=False):
    return torch.empty_like(residual), torch.empty_like(residual)


@torch.library.custom_op(f"{_LIB}::sparse_head_proj", mutates_args=())
def sparse_head_proj(
    x: torch.Tensor,
    idx: torch.Tensor,
    w: torch.Tensor,
    b: torch.Tensor | None,
    head_dim: int,
    union: bool = False,
    keep: torch.Tensor | None = None,
    slot: int = -1,
) -> torch.Tensor:
    """Query projection for the selected heads (with ``union``, those any row selected); the
    other heads' outputs are zero."""
    return ref.sparse_head_proj(x, idx, w, b, head_dim, union)


@sparse_head_proj.register_fake
def _(x, idx, w, b, head_dim, union=False, keep=None, slot=-1):
    return x.new_empty(*x.shape[:-1], w.shape[0])


@torch.library.custom_op(f"{_LIB}::sparse_head_out", mutates_args=())
def sparse_head_out(
    attn: torch.Tensor,
    idx: torch.Tensor,
    wo_t: torch.Tensor,
    b: torch.Tensor | None,
    head_dim: int,
    union: bool = False,
    workspace: torch.Tensor | None = None,
    early: bool = False,
) -> torch.Tensor:
    """Output projection over the selected heads only (``wo_t`` stored [H * head_dim, d]; with
    ``union``, the heads any row selected). ``workspace``: as ``sparse_mlp``'s
    (``workspace_numel`` with ``k`` 0). ``early``: the ids were written before the kernel
    right before this op's (an attention's heads, which its query projection read first; set
    by the sparsify pass), so the CUDA kernel may load them before it waits for that kernel
    (``DEJAVU_EARLY_IDS``); the result is the same either way."""
    return ref.sparse_head_out(attn, idx, wo_t, b, head_dim, union)


@sparse_head_out.register_fake
def _(attn, idx, wo_t, b, head_dim, union=False, workspace=None, early=False):
    return attn.new_empty(*attn.shape[:-1], wo_t.shape[1])


@torch.library.custom_op(f"{_LIB}::select_magnitude", mutates_args=())
def select_magnitude(x: torch.Tensor, k: int) -> torch.Tensor:
    """The k input activations of largest magnitude (TEAL's selector with a static count)."""
    return ref.select_magnitude(x, k)


@select_magnitude.register_fake
def _(x, k):
    return _ids_like(x, k)


@torch.library.custom_op(f"{_LIB}::select_gate", mutates_args=())
def select_gate(g: torch.Tensor, act: str, k: int) -> torch.Tensor:
    """The gate projection as selector: top-k neurons by |act(gate pre-activation)|."""
    return ref.select_gate(g, act, k)


@select_gate.register_fake
def _(g, act, k):
    return _ids_like(g, k)


@torch.library.custom_op(f"{_LIB}::sparse_mlp_gated", mutates_args=())
def sparse_mlp_gated(
    x: torch.Tensor,
    idx: torch.Tensor,
    g: torch.Tensor,
    w_up: torch.Tensor,
    w2_t: torch.Tensor,
    b2: torch.Tensor | None,
    act: str,
    union: bool = False,
) -> torch.Tensor:
    """Gated MLP over the selected neurons with the gate computed densely: reads only the
    selected rows of the up projection and of the transposed down projection (with ``union``,
    of the neurons any row selected)."""
    return ref.sparse_mlp_gated(x, idx, g, w_up, w2_t, b2, act, union)


@sparse_mlp_gated.register_fake
def _(x, idx, g, w_up, w2_t, b2, act, union=False):
    return x.new_empty(*x.shape[:-1], w2_t.shape[1])


SELECTORS = (select_mlp_oracle, select_heads_oracle, select_predictor, predict_ahead, select_gate,
             select_magnitude, select_hidden)
SPARSE_OPS = (sparse_mlp, sparse_head_proj, sparse_head_out, sparse_mlp_gated)


@torch.library.custom_op(f"{_LIB}::gemv", mutates_args=())
def gemv(x: torch.Tensor, w: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """A dense projection ``F.linear(x, w, b)`` of a decode step's few rows; on CUDA a GEMV
    kernel that reads whole weight rows in one launch (``kernels/dense.py``)."""
    return torch.nn.functional.linear(x, w, b)


@gemv.register_fake
def _(x, w, b):
    if w.dim() != 2 or w.shape[1] != x.shape[-1]:
        raise ValueError(f"gemv: weight {tuple(w.shape)} does not fit x {tuple(x.shape)}")
    return x.new_empty(*x.shape[:-1], w.shape[0])


# the tag that makes Inductor's graph partition run an op between CUDA graphs (recent torch)
CUDAGRAPH_UNSAFE = getattr(torch.Tag, "cudagraph_unsafe", None)


# what dejavu::graph_split calls after its copy, per thread: set by ``graph_cuts``
_CUT = threading.local()


@contextlib.contextmanager
def graph_cuts(cut: Callable[[], None]) -> Iterator[None]:
    """While inside, each ``dejavu::graph_split`` this thread runs calls ``cut`` after its copy:
    ``capture.CapturedStep`` ends the CUDA graph it is capturing there and begins the next."""
    previous = getattr(_CUT, "fn", None)
    _CUT.fn = cut
    try:
        yield
    finally:
        _CUT.fn = previous


@torch.library.custom_op(f"{_LIB}::graph_split", mutates_args=(),
                         tags=(CUDAGRAPH_UNSAFE,) if CUDAGRAPH_UNSAFE is not None else ())
def graph_split(x: torch.Tensor) -> torch.Tensor:
    """A copy of ``x`` where the captured decode step is cut into two CUDA graphs, launched one
    after the other: the GPU starts on the first while the host launches the second
    (``DejavuOptions.graph_splits``). With ``cudagraphs``, Inductor's graph partition runs the
    op outside its graphs (the ``cudagraph_unsafe`` tag); under ``CapturedStep``'s capture the
    op cuts that capture itself (``graph_cuts``)."""
    y = x.clone()
    cut = getattr(_CUT, "fn", None)
    if cut is not None:
        cut()
    return y


@graph_split.register_fake
def _(x):
    return torch.empty_like(x)


# The cache's kept inputs and valid prefixes (``kv_state.lazy_state``) are state of the op, like
# a kernel's tuned configs: read and written only by this op, so not declared.
@torch.library.custom_op(f"{_LIB}::lazy_kv", mutates_args=("keys", "values"))
def lazy_kv(
    x: torch.Tensor,
    idx: torch.Tensor | None,
    wk: torch.Tensor,
    bk: torch.Tensor | None,
    wv: torch.Tensor,
    bv: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    keep: torch.Tensor | None = None,
    slot: int = -1,
) -> None:
    """The K/V projections and cache write of an attention block with a head selector, lazily
    (``DejavuOptions.lazy_kv``, paper section 4.2): keys and values of the selected heads only,
    their missing earlier positions filled in from the kept inputs (``kernels/kv_state.py``).
    ``keep`` and ``slot`` join a lookahead predictor's side stream on CUDA."""
    from .kv_state import lazy_state

    state = lazy_state(keys, x.shape[-1], x.dtype)
    ref.lazy_kv(x, idx, wk, bk, wv, bv, keys, values, pos, state.inputs, state.valid)


@lazy_kv.register_fake
def _(x, idx, wk, bk, wv, bv, keys, values, pos, keep=None, slot=-1):
    return None


@torch.library.custom_op(f"{_LIB}::lazy_qkv", mutates_args=("keys", "values"))
def lazy_qkv(
    x: torch.Tensor,
    idx: torch.Tensor | None,
    wq: torch.Tensor,
    bq: torch.Tensor | None,
    wk: torch.Tensor,
    bk: torch.Tensor | None,
    wv: torch.Tensor,
    bv: torch.Tensor | None,
    keys: torch.Tensor,
    values: torch.Tensor,
    pos: torch.Tensor,
    keep: torch.Tensor | None = None,
    slot: int = -1,
) -> torch.Tensor:
    """``lazy_kv`` and the query projection of the same heads in one op (option
    ``fuse_qkv``): on CUDA one launch reads the query, key and value rows of the selected heads,
    which share its input and selection. Returns the query [B, n, H * hd], zeros in the columns
    of the heads it does not compute (``reference.lazy_qkv``)."""
    from .kv_state import lazy_state

    state = lazy_state(keys, x.shape[-1], x.dtype)
    return ref.lazy_qkv(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos, state.inputs,
                        state.valid)


@lazy_qkv.register_fake
def _(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos, keep=None, slot=-1):
    return x.new_empty(*x.shape[:-1], wq.shape[0])
