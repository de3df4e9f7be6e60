"""Pure-PyTorch reference of every ``dejavu`` op: the CPU implementation, and what the Triton
kernels are tested against.

Conventions shared by all ops (see ``passes/README.md``):

* ``x`` is ``[..., d]``; each of its ``R = x.numel() // d`` rows is one decoded token with its
  own selection (``idx`` is ``[..., k]``, int64): per-row selection, so a batch decodes exactly
  as each of its rows would alone. With ``union`` (the sparse ops' flag, set by the sparsify
  pass for batches), every row computes the units that any row selected (``union_ids``): the
  weights a batch reads are those of the union, read once for all rows. Prefill never reaches
  these ops: the sparsify pass rewrites only graphs that decode one token per sequence.
* Weights keep the Hugging Face layout ``[out, in]`` for the first projections (a selected
  neuron's row is contiguous); the down and output projections arrive transposed, ``[in, out]``,
  so a selected neuron's or head's weights are contiguous too (paper section 4.4).
* Arithmetic accumulates in fp32 (fp64 inputs in fp64) and the result is cast back to
  ``x.dtype``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = ("relu", "silu", "gelu", "gelu_tanh")


def activate(h: torch.Tensor, act: str) -> torch.Tensor:
    """Apply the MLP activation named ``act`` (one of ``ACTIVATIONS``)."""
    if act == "relu":
        return F.relu(h)
    if act == "silu":
        return F.silu(h)
    if act == "gelu":
        return F.gelu(h)
    if act == "gelu_tanh":
        return F.gelu(h, approximate="tanh")
    raise ValueError(f"unknown activation {act!r}; expected one of {ACTIVATIONS}")


def _acc(t: torch.Tensor) -> torch.Tensor:
    """``t`` in the accumulation dtype: fp32 for half types, else its own (fp64 stays fp64)."""
    return t.to(torch.promote_types(t.dtype, torch.float32))


def _rows(x: torch.Tensor) -> torch.Tensor:
    return _acc(x.reshape(-1, x.shape[-1]))


def mlp_hidden(x: torch.Tensor, w1, b1, w_up, act: str) -> torch.Tensor:
    """Dense MLP hidden activations ``[R, N]``: act(x W1^T + b1), times x W_up^T when gated."""
    rows = _rows(x)
    h = rows @ _acc(w1).t()
    if b1 is not None:
        h = h + _acc(b1)
    h = activate(h, act)
    if w_up is not None:
        h = h * (rows @ _acc(w_up).t())
    return h


def union_ids(idx: torch.Tensor, units: int) -> torch.Tensor:
    """The union selection of a batch: the ids (< ``units``) that any row of ``idx`` [..., k]
    selects, ascending, as one row ``[1, S]`` with ``S = min(units, rows * k)`` (the most the
    union can hold), padded at the end with -1 (no unit: ops and kernels skip it). Static
    shape and no host synchronisation, so it runs inside a captured decode step."""
    flat = idx.reshape(-1)
    size = min(units, flat.numel())
    # index_fill_ takes the value as a scalar: no host tensor to copy inside a CUDA graph capture
    chosen = torch.zeros(units, dtype=torch.bool, device=idx.device).index_fill_(0, flat, True)
    order = torch.argsort((~chosen).to(torch.uint8), stable=True)[:size]  # chosen ids first
    slots = torch.arange(size, device=idx.device)
    return torch.where(slots < chosen.sum(), order, -1).view(1, size)


def selected_rows(idx: torch.Tensor, n_rows: int, units: int, union: bool
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's ids ``[R, k']`` (-1 padding replaced by 0) and which of them are units
    ``[R, k']``: the row's own selection, or with ``union`` the batch's ``union_ids``."""
    sel = union_ids(idx, units).expand(n_rows, -1) if union else idx.reshape(n_rows, -1)
    return sel.clamp_min(0), sel >= 0


def sparse_mlp(x, idx, w1, b1, w_up, w2_t, b2, act: str, union: bool = False) -> torch.Tensor:
    """MLP over the selected neurons only (with ``union``, those any row selected).

    x: [..., d]; idx: [..., k] neuron ids; w1, w_up: [N, d]; b1: [N]; w2_t: [N, d_out].
    Returns [..., d_out].
    """
    rows = _rows(x)
    sel, valid = selected_rows(idx, rows.shape[0], w1.shape[0], union)
    h = torch.einsum("rd,rkd->rk", rows, _acc(w1[sel]))
    if b1 is not None:
        h = h + _acc(b1)[sel]
    h = activate(h, act)
    if w_up is not None:
        h = h * torch.einsum("rd,rkd->rk", rows, _acc(w_up[sel]))
    h = h * valid
    out = torch.einsum("rk,rko->ro", h, _acc(w2_t[sel]))
    if b2 is not None:
        out = out + _acc(b2)
    return out.to(x.dtype).reshape(*x.shape[:-1], w2_t.shape[1])


def select_magnitude(x: torch.Tensor, k: int) -> torch.Tensor:
    """Training-free selection on a projection's input activations (TEAL): the ``k`` entries of
    each row of ``x`` [..., n] with the largest magnitude. Returns [..., k]."""
    rows = x.reshape(-1, x.shape[-1]).abs()
    return topk_indices(rows, k).reshape(*x.shape[:-1], k)


def select_gate(g: torch.Tensor, act: str, k: int) -> torch.Tensor:
    """The gate as selector: top-``k`` neurons by |act(g)|, ``g`` [..., N] the dense gate
    pre-activations (bias included). Returns [..., k]."""
    rows = _acc(g.reshape(-1, g.shape[-1]))
    return topk_indices(activate(rows, act).abs(), k).reshape(*g.shape[:-1], k)


def sparse_mlp_gated(x, idx, g, w_up, w2_t, b2, act: str, union: bool = False) -> torch.Tensor:
    """A gated MLP over the selected neurons, the gate already computed densely: act(g[idx]) *
    (x W_up[idx]^T) @ W2_t[idx] (+b2). x: [..., d]; idx: [..., k]; g: [..., N]; w_up: [N, d];
    w2_t: [N, d_out]. Returns [..., d_out]."""
    rows = _rows(x)
    sel, valid = selected_rows(idx, rows.shape[0], w_up.shape[0], union)
    gate = activate(_acc(g.reshape(rows.shape[0], -1)).gather(1, sel), act)
    h = gate * torch.einsum("rd,rkd->rk", rows, _acc(w_up[sel])) * valid
    out = torch.einsum("rk,rko->ro", h, _acc(w2_t[sel]))
    if b2 is not None:
        out = out + _acc(b2)
    return out.to(x.dtype).reshape(*x.shape[:-1], w2_t.shape[1])


def topk_indices(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Ids of the ``k`` largest scores along the last axis, in ascending id order.

    Sorting the ids makes the weight reads of the kernels walk memory forwards.
    """
    return torch.topk(scores, k, dim=-1, sorted=False).indices.sort(dim=-1).values


def select_mlp_oracle(x, w1, b1, w_up, act: str, k: int) -> torch.Tensor:
    """The true top-``k`` neurons by |hidden activation| from the dense computation: [..., k]."""
    h = mlp_hidden(x, w1, b1, w_up, act).abs()
    return topk_indices(h, k).reshape(*x.shape[:-1], k)


def expand_groups(groups: torch.Tensor, size: int) -> torch.Tensor:
    """Turn selected group ids ``[..., g]`` into the ids of their members ``[..., g * size]``."""
    if size == 1:
        return groups
    offsets = torch.arange(size, device=groups.device)
    return (groups.unsqueeze(-1) * size + offsets).flatten(-2)


def select_heads_oracle(attn, wo_t, head_dim: int, k: int, group: int) -> torch.Tensor:
    """The true top-``k`` heads (or groups of ``group`` heads) by the norm of their output.

    attn: [..., H * head_dim] (the input of the output projection); wo_t: [H * head_dim, d].
    A head's contribution is attn_h @ wo_t[h]; a group's score is the sum of its heads' squared
    norms. Returns head ids [..., k * group].
    """
    rows = _rows(attn)
    n_heads = wo_t.shape[0] // head_dim
    per_head = rows.view(-1, n_heads, head_dim)
    contrib = torch.einsum("rhe,heo->rho", per_head, _acc(wo_t).view(n_heads, head_dim, -1))
    score = contrib.pow(2).sum(-1)
    score = score.view(rows.shape[0], n_heads // group, group).sum(-1)
    heads = expand_groups(topk_indices(score, k), group)
    return heads.reshape(*attn.shape[:-1], k * group)


def bucket_topk(scores: torch.Tensor, k: int, buckets: int = 1) -> torch.Tensor:
    """Ids of ``k`` large scores per row of ``scores`` [R, U], in ascending id order: the top
    ``k / buckets`` of each of ``buckets`` equal contiguous slices of the units (``buckets=1``
    is the plain top-k). A bucket is small enough for one GPU program to score and rank it in
    registers, so the selection is one launch however many units there are; the price is that
    a bucket holding more than its share of the true top-k gives up its weakest ones.
    """
    if buckets == 1:
        return topk_indices(scores, k)
    rows, units = scores.shape
    if units % buckets or k % buckets:
        raise ValueError(f"{buckets} buckets must divide the units ({units}) and k ({k})")
    size = units // buckets
    local = torch.topk(scores.view(rows, buckets, size), k // buckets, dim=-1, sorted=False).indices
    ids = local + torch.arange(0, units, size, device=scores.device)[:, None]
    return ids.flatten(1).sort(dim=-1).values


def select_predictor(x, w1, b1, w2, b2, act: str, k: int, group: int, buckets: int = 1
                     ) -> torch.Tensor:
    """A learned low-rank predictor: logits = act(x w1^T + b1) w2^T + b2, then top-``k``
    (per bucket, see ``bucket_topk``).

    x: [..., d]; w1: [r, d]; w2: [U, r] over U units (neurons, heads or head groups).
    ``act`` is "none" or an entry of ``ACTIVATIONS``. Returns ids [..., k * group].
    """
    return select_hidden(_rows(x) @ _acc(w1).t(), b1, w2, b2, act, k, group, buckets
                         ).reshape(*x.shape[:-1], k * group)


def select_hidden(h, b1, w2, b2, act: str, k: int, group: int, buckets: int = 1) -> torch.Tensor:
    """The predictor after its first GEMV: ``h`` [..., r] is ``x w1^T`` (computed elsewhere,
    stacked with projections that read the same input); logits = act(h + b1) w2^T + b2, then
    top-``k`` per bucket. Returns ids [..., k * group], ascending per bucket."""
    z = _acc(_rows(h))
    if b1 is not None:
        z = z + _acc(b1)
    if act != "none":
        z = activate(z, act)
    logits = z @ _acc(w2).t()
    if b2 is not None:
        logits = logits + _acc(b2)
    units = expand_groups(bucket_topk(logits, k, buckets), group)
    return units.reshape(*h.shape[:-1], k * group)


def _head_rows(idx: torch.Tensor, head_dim: int, n_rows: int, n_heads: int, union: bool
               ) -> tuple[torch.Tensor, torch.Tensor]:
    """Weight-row ids ``[R, k' * head_dim]`` covered by the selected heads ``idx`` (see
    ``selected_rows``) and which of them belong to a selected head."""
    heads, valid = selected_rows(idx, n_rows, n_heads, union)
    return expand_groups(heads, head_dim), valid.repeat_interleave(head_dim, dim=1)


def sparse_head_proj(x, idx, w, b, head_dim: int, union: bool = False) -> torch.Tensor:
    """Projection (queries) for the selected heads only; other heads' outputs are zero.

    x: [..., d]; idx: [..., k] head ids; w: [H * head_dim, d]; b: [H * head_dim].
    Returns [..., H * head_dim]: full width so the attention code around it is unchanged.
    """
    rows = _rows(x)
    sel, valid = _head_rows(idx, head_dim, rows.shape[0], w.shape[0] // head_dim, union)
    vals = torch.einsum("rd,rjd->rj", rows, _acc(w[sel]))
    if b is not None:
        vals = vals + _acc(b)[sel]
    # padding points at head 0 with a zero value: adding keeps head 0's own value
    out = rows.new_zeros(rows.shape[0], w.shape[0]).scatter_add_(1, sel, vals * valid)
    return out.to(x.dtype).reshape(*x.shape[:-1], w.shape[0])


def add_norm(y, residual, norm_w, norm_b, eps: float,
             rms: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The residual add and layer norm after a sparse op (``ops.sparse_mlp_norm``): y and
    residual [..., d] -> (h = residual + y, layer_norm(h) over d), both in residual's dtype.
    ``rms``: Llama's RMS norm instead (no bias), as its module computes it: h in fp32 times
    the reciprocal root of its mean square plus eps, rounded to h's dtype, then times the
    weight in that dtype."""
    h = residual + y.reshape(residual.shape)
    if rms:
        if norm_b is not None:
            raise ValueError("add_norm: an RMS norm takes no bias")
        hf = h.to(torch.float32)
        normed = hf * torch.rsqrt(hf.pow(2).mean(-1, keepdim=True) + eps)
        return h, norm_w * normed.to(h.dtype)
    return h, torch.nn.functional.layer_norm(h, (h.shape[-1],), norm_w, norm_b, eps)


def sparse_head_out(attn, idx, wo_t, b, head_dim: int, union: bool = False) -> torch.Tensor:
    """Output projection over the selected heads only.

    attn: [..., H * head_dim]; idx: [..., k] head ids; wo_t: [H * head_dim, d]; b: [d].
    Returns [..., d].
    """
    rows = _rows(attn)
    sel, valid = _head_rows(idx, head_dim, rows.shape[0], wo_t.shape[0] // head_dim, union)
    out = torch.einsum("rj,rjo->ro", rows.gather(1, sel) * valid, _acc(wo_t[sel]))
    out = out.reshape(*attn.shape[:-1], wo_t.shape[1])
    if b is not None:
        out = out + _acc(b)
    return out.to(attn.dtype)


def kv_scores(q: torch.Tensor, k: torch.Tensor, scale: float) -> torch.Tensor:
    """Attention mass each cached position gets from the observation queries, per KV head.

    q: [B, H, W, hd], the last W prompt tokens' queries; k: [B, KVH, T, hd], the prompt's keys
    (T >= W; query j sits at position T - W + j and sees keys up to it). Probabilities are
    summed over the W queries and over the H / KVH query heads sharing each KV head.
    Returns [B, KVH, T] in fp32. Computed one KV head at a time to bound memory.
    """
    b, h, w, _ = q.shape
    kvh, t = k.shape[1], k.shape[2]
    group = h // kvh
    pos_q = torch.arange(t - w, t, device=q.device)[:, None]
    visible = torch.arange(t, device=q.device)[None, :] <= pos_q  # [W, T]
    out = torch.empty(b, kvh, t, dtype=torch.float32, device=q.device)
    for g in range(kvh):
        qg = _acc(q[:, g * group : (g + 1) * group])  # [B, group, W, hd]
        logits = (qg @ _acc(k[:, g : g + 1]).transpose(-1, -2)) * scale  # [B, group, W, T]
        probs = logits.masked_fill(~visible, float("-inf")).softmax(-1)
        out[:, g] = probs.sum(dim=(1, 2)).float()
    return out


def kv_select(scores: torch.Tensor, budget: int, sinks: int, window: int, smooth: int) -> torch.Tensor:
    """Positions to keep per KV head: scores [B, KVH, T] smoothed by a width-``smooth`` moving
    average, the first ``sinks`` and last ``window`` positions always kept, then the highest
    scores up to ``budget`` positions. Returns [B, KVH, budget] int64, ascending."""
    b, kvh, t = scores.shape
    if budget >= t:
        return torch.arange(t, device=scores.device).expand(b, kvh, t).contiguous()
    if budget < min(t, sinks + window):
        raise ValueError(f"KV budget {budget} is below sinks + window ({sinks} + {window})")
    flat = scores.reshape(b * kvh, 1, t).float()
    if smooth > 1:
        flat = F.avg_pool1d(flat, smooth, stride=1, padding=smooth // 2, count_include_pad=False)
    ranked = flat.reshape(b, kvh, t).clone()
    ranked[..., :sinks] = float("inf")
    ranked[..., t - window :] = float("inf")
    return ranked.topk(budget, dim=-1).indices.sort(dim=-1).values


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new query token per sequence over its KV cache.

    q: [B, H, 1, D]; k, v: [B, KVH, L, D], H a multiple of KVH (grouped-query heads: query head
    h reads KV head h // (H / KVH)); mask: None or bool [B, L], True where the sequence may
    attend; heads: None, or ids [..., S] of query heads: the heads outside their KV groups
    (``named_heads``) get zero rows; softmax in fp32; returns [B, H, 1, D] in q's dtype."""
    group = q.shape[1] // k.shape[1]
    kk = k.repeat_interleave(group, 1).to(torch.promote_types(k.dtype, torch.float32))
    vv = v.repeat_interleave(group, 1).to(kk.dtype)
    s = (q.to(kk.dtype) @ kk.transpose(-1, -2)) * scale
    if mask is not None:
        s = s.masked_fill(~mask.bool()[:, None, None, :], float("-inf"))
    out = (s.softmax(-1) @ vv).to(q.dtype)
    if heads is None:
        return out
    named = named_heads(heads, q.shape[0], q.shape[1], group)
    return torch.where(named[:, :, None, None], out, torch.zeros((), dtype=out.dtype))


def named_heads(heads: torch.Tensor, batch: int, n_heads: int, group: int = 1) -> torch.Tensor:
    """[batch, n_heads] bool: the heads in a KV group of ``group`` query heads of which each
    sequence's row of ``heads`` (ids [..., S]: a row per sequence, or one for all) names one;
    -1 and ids past ``n_heads`` name none. On the ids' device, without a copy to the host."""
    ids = heads.reshape(-1, heads.shape[-1]).to(torch.int64)
    groups = n_heads // group
    ids = torch.where((ids >= 0) & (ids < n_heads), ids // group, groups)  # none: a spare column
    named = torch.zeros(ids.shape[0], groups + 1, dtype=torch.bool, device=ids.device)
    named = named.scatter_(1, ids, True)[:, :groups].repeat_interleave(group, 1)
    return named.expand(batch, n_heads)


def id_rows(idx: torch.Tensor, batch: int) -> torch.Tensor:
    """``lazy_kv``'s selection as [rows, k] ids: one row per sequence, or one shared row."""
    ids = idx.reshape(-1, idx.shape[-1])
    if ids.shape[0] not in (1, batch):
        raise ValueError(f"lazy_kv: {ids.shape[0]} id rows for a batch of {batch}")
    return ids


def selected_heads(idx: torch.Tensor | None, batch: int, tokens: int, heads: int) -> torch.Tensor:
    """[batch, heads] bool: the heads whose keys and values ``lazy_kv`` computes. All of them
    when there is no selection or several new tokens (a prefill); else those of each sequence's
    id row (``idx`` [batch, 1, k] per row or [1, k] shared; -1 pads), other ids ignored."""
    chosen = torch.zeros(batch, heads, dtype=torch.bool, device="cpu")
    if idx is None or tokens > 1:
        return chosen.fill_(True)
    ids = id_rows(idx, batch).cpu()
    for b in range(batch):
        row = ids[b if ids.shape[0] == batch else 0]
        row = row[(row >= 0) & (row < heads)]
        chosen[b, row] = True
    return chosen


def lazy_kv(x, idx, wk, bk, wv, bv, keys, values, pos, inputs, valid) -> None:
    """Keys and values of the new tokens for the selected heads, and of those heads' missing
    positions (all-zero keys after ``valid``), written into the cache; zeros for the other heads'
    new positions (``kernels/kv_state.py``).

    x [B, n, d]: the attention block's input of the ``n`` new tokens, at positions ``pos``
    (consecutive); keys, values [B, H, L, hd] (H = K/V heads, one per query head); wk, wv
    [H * hd, d]; ``inputs`` [B, L, d] and ``valid`` [B, H] the cache's state, updated."""
    batch, n, _ = x.shape
    heads, hd = keys.shape[1], keys.shape[3]
    s = int(pos.reshape(-1)[0])
    e = s + n
    if not torch.equal(pos.reshape(-1).cpu(), torch.arange(s, e)):
        raise ValueError(f"lazy_kv: positions must be consecutive, got {pos.reshape(-1).tolist()}")
    inputs[:, s:e] = x.to(inputs.dtype)
    chosen = selected_heads(idx, batch, n, heads)
    for b in range(batch):
        for h in range(heads):
            lo = min(int(valid[b, h]), s)
            if not chosen[b, h]:
                keys[b, h, s:e] = 0
                values[b, h, s:e] = 0
                valid[b, h] = lo
                continue
            cols = slice(h * hd, (h + 1) * hd)
            for cache, w, bias in ((keys, wk, bk), (values, wv, bv)):
                old = torch.arange(lo, s, device=cache.device)
                missing = old[cache[b, h, lo:s].flatten(1).eq(0).all(1)]
                rows = torch.cat([missing, torch.arange(s, e, device=cache.device)])
                out = F.linear(inputs[b, rows].to(w.dtype), w[cols],
                               None if bias is None else bias[cols])
                cache[b, h, rows] = out.to(cache.dtype)
            valid[b, h] = e


def lazy_qkv(x, idx, wq, bq, wk, bk, wv, bv, keys, values, pos, inputs, valid) -> torch.Tensor:
    """``lazy_kv`` and the query projection of the heads it computes keys and values for (the
    selected heads, or all of them in a prefill; ``selected_heads``): returns the query
    [B, n, H * hd], zeros in the other heads' columns. wq [H * hd, d] (one K/V head per query
    head)."""
    if wq.shape != wk.shape:
        raise ValueError(f"lazy_qkv: the query's weight {tuple(wq.shape)} must match the keys' "
                         f"{tuple(wk.shape)} (one K/V head per query head)")
    lazy_kv(x, idx, wk, bk, wv, bv, keys, values, pos, inputs, valid)
    batch, n, _ = x.shape
    heads, hd = keys.shape[1], keys.shape[3]
    q = F.linear(x.to(wq.dtype), wq, bq).view(batch, n, heads, hd)
    chosen = selected_heads(idx, batch, n, heads).to(q.device)
    return (q * chosen[:, None, :, None]).reshape(batch, n, heads * hd).to(x.dtype)
