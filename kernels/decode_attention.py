"""Decode attention split over the keys (flash-decoding): one new query token per sequence
against a KV cache of any length, grouped-query heads read once per KV head.

The cache of each KV head is cut into ``splits`` chunks, so ``batch * kv_heads * splits``
programs run at once (the cache of one head is too long a stream for one program):

1. ``_split_kernel``: program (batch * kv head, chunk) loads the group's query heads (padded to
   16 rows, so the products are tensor-core dots) and walks its chunk of keys and values in
   blocks with an online softmax; it writes its unnormalised output, running maximum and sum.
2. ``_combine_kernel``: program (batch * KV head, query head of its group) rescales the
   chunks to a common maximum and sums them (``_merge_chunks``).

Given ``counters`` (int32, one per batch x KV head, zero between calls: the lower pass attaches
them to each call it makes under option ``merge_attention``), the split kernel merges the
chunks itself and step 2 is not launched: each program counts itself done for its KV head, and
the last of them merges the group's chunks and sets the count back to zero. A decode step has
one launch fewer per layer.

A cache of one chunk a KV head (a short one with many KV heads or a large batch, or any with
``DEJAVU_ATTN_CHUNK=whole``) needs no merge: the split kernel stores its finished rows, the
values the merge of one chunk gives, and neither step 2 nor the counters are used.

Given ``heads`` (ids of the query heads to compute, from the output projection's selection:
the lower pass's option ``decode_selected_heads``), ``_split_heads_kernel`` and
``_combine_heads_kernel`` do the same over the KV groups of those heads only: program
(sequence x slot of the ids, chunk) attends with the query heads of its slot's KV group over
that KV head, unless an earlier slot names the same group, so the cache of a KV head that no
named head reads is not read at all and none is read twice; one more program per sequence
zeroes the output rows of the groups not named (in the combine launch, or in the split kernel
when it merges).

Without ``heads`` the cache is read exactly once. Reference:
``kernels/reference.py::decode_attention``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from .kv import check_decode
from .triton_common import INTERPRET, QUICK_TUNE, check_dtype, pdl_meta, wait_inputs

# Chunks are whole multiples of LONG_CHUNK keys, so every autotuned block size divides them;
# a cache too short to give MIN_PROGRAMS programs that way is cut into CHUNK_UNIT-key chunks
# instead (the last block of a chunk may then be partial, masked). At 128 keys a chunk, a
# Llama-3-8B step's cache of 257 positions made 24 programs on an H200's 132 SMs, and the
# kernel took 4.8 us a layer for 1 MB of keys and values (BENCHMARKS.md, eighth session).
# Each chunk writes GP x BLOCK_D fp32 partials (8 KB for 128-dim heads), so short chunks are
# kept for short caches, where latency, not bytes, sets the time.
CHUNK_UNIT = 16 if INTERPRET else 32
LONG_CHUNK = 16 if INTERPRET else 128
# ``DEJAVU_ATTN_CHUNK`` sets the long chunk's keys instead (a GPU study of shorter chunks:
# OPT-13B's step, 40 KV heads, runs 2 chunks of 128 keys a head over the bench's 129-256
# positions, 80 programs, and 3 over 257-384; 32-key chunks give 5-8 and 9-12), or "whole":
# one chunk a KV head, whatever the length (OPT-13B's step: 40 programs, no combine launch)
LONG_CHUNK_ENV = "DEJAVU_ATTN_CHUNK"
LONG_CHUNKS = (128, 64, 32)
WHOLE = "whole"
# enough programs to fill the GPU several times over; each chunk at least one unit
PROGRAMS = 4 * 132
MIN_PROGRAMS = PROGRAMS // 8  # half a wave of programs on an H200


def _configs() -> list[triton.Config]:
    """Keys per block, warps and pipeline stages; the interpreter (CPU tests) runs one."""
    if INTERPRET:
        return [triton.Config({"BLOCK_L": 16}, num_warps=1)]
    if QUICK_TUNE:
        return [triton.Config({"BLOCK_L": 64}, num_warps=4)]
    return [triton.Config({"BLOCK_L": b}, num_warps=w, num_stages=st)
            for b in (32, 64, 128) for w in (4, 8) for st in (2, 3)]


def _fp32_dots(dtype: torch.dtype) -> bool:
    """Whether the kernel's dots run in fp32 (IEEE): for fp32 caches (no TF32 rounding), and for
    bf16 under the interpreter, whose bf16 ``tl.dot`` returns garbage (Triton 3.6); compiled on
    a GPU, fp16 and bf16 dots run on tensor cores with fp32 accumulation."""
    return dtype == torch.float32 or (INTERPRET and dtype == torch.bfloat16)


def _chunk_asked() -> str | None:
    """``DEJAVU_ATTN_CHUNK``, checked: unset (None), one of ``LONG_CHUNKS`` or ``WHOLE``; any
    other value is an error naming them."""
    asked = os.environ.get(LONG_CHUNK_ENV)
    choices = (*(str(c) for c in LONG_CHUNKS), WHOLE)
    if asked is not None and asked not in choices:
        raise ValueError(f"{LONG_CHUNK_ENV}={asked!r}: set it to one of {choices}")
    return asked


def long_chunk() -> int:
    """Keys per long chunk: ``LONG_CHUNK``, or ``DEJAVU_ATTN_CHUNK``'s keys when it names some
    (with ``WHOLE``, ``LONG_CHUNK``: the unit a whole cache's chunk is rounded up to)."""
    asked = _chunk_asked()
    return LONG_CHUNK if asked in (None, WHOLE) else int(asked)


def whole_cache() -> bool:
    """Whether ``DEJAVU_ATTN_CHUNK`` asks for one chunk a KV head (``WHOLE``)."""
    return _chunk_asked() == WHOLE


def splits_for(batch_heads: int, length: int, unit: int | None = None) -> int:
    """Chunks per KV head: enough programs to fill the GPU, at least ``unit`` keys each
    (``long_chunk()`` when None)."""
    blocks = triton.cdiv(length, long_chunk() if unit is None else unit)
    return max(1, min(blocks, triton.cdiv(PROGRAMS, batch_heads)))


def chunking(batch_heads: int, length: int) -> tuple[int, int]:
    """(keys per chunk, chunks) of a cache of ``length`` keys per KV head: ``splits_for``'s
    count of ``long_chunk()``-key units, or of ``CHUNK_UNIT``-key ones when that gives fewer
    than ``MIN_PROGRAMS`` programs; chunks rounded up to whole units (to whole long chunks once
    longer than one). With ``whole_cache()``, one chunk of the whole cache, rounded up to whole
    long chunks."""
    long = unit = long_chunk()
    if whole_cache():
        return triton.cdiv(length, long) * long, 1
    if batch_heads * splits_for(batch_heads, length, long) < MIN_PROGRAMS:
        unit = CHUNK_UNIT
    chunk = triton.cdiv(triton.cdiv(length, splits_for(batch_heads, length, unit)), unit) * unit
    if chunk > long:
        chunk = triton.cdiv(chunk, long) * long
    return chunk, triton.cdiv(length, chunk)


def _fitting(configs, named_args, **kwargs):
    """The configs whose key block is no longer than a chunk: a longer one only loads masked
    keys (at a Llama-3-8B step's 32-key chunks, 64 and 128 were among the candidates)."""
    return [c for c in configs if c.kwargs["BLOCK_L"] <= named_args["CHUNK"]] or configs[:1]


@triton.jit
def _attend_chunk(q_row, k_base, v_base, mask_row, rows, mask_g, offs_d, mask_d, start, end,
                  scale, sq_h, sk_l, sv_l, HAS_MASK: tl.constexpr, GP: tl.constexpr,
                  BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr, IEEE: tl.constexpr):
    """The unnormalised output, running maximum and sum ([GP, BLOCK_D], [GP], [GP] fp32) of
    query rows ``q_row + rows * sq_h`` (those in ``mask_g``) over keys ``start .. end - 1``
    of one KV head, walked in blocks of ``BLOCK_L`` with an online softmax."""
    q = tl.load(q_row + rows[:, None] * sq_h + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0)
    q = q.to(tl.float32) * scale
    if not IEEE:
        q = q.to(k_base.dtype.element_ty)
    m = tl.full([GP], float("-inf"), tl.float32)
    s_sum = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, BLOCK_D], tl.float32)
    for lo in range(start, end, BLOCK_L):
        offs_l = lo + tl.arange(0, BLOCK_L)
        mask_l = offs_l < end
        if HAS_MASK:  # positions the sequence may not attend to (padding, unfilled cache)
            mask_l &= tl.load(mask_row + offs_l, mask=mask_l, other=0) != 0
        kv_mask = mask_l[:, None] & mask_d[None, :]
        k = tl.load(k_base + offs_l[:, None] * sk_l + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            k = k.to(tl.float32)  # fp32 caches: no TF32 rounding
            s = tl.dot(q, tl.trans(k), input_precision="ieee")
        else:
            s = tl.dot(q, tl.trans(k))  # [GP, BLOCK_L], fp32
        s = tl.where(mask_l[None, :], s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block with nothing visible
        alpha = tl.exp(m - m_safe)
        p = tl.exp(s - m_safe[:, None])
        s_sum = s_sum * alpha + tl.sum(p, 1)
        v = tl.load(v_base + offs_l[:, None] * sv_l + offs_d[None, :], mask=kv_mask, other=0.0)
        if IEEE:
            pv = tl.dot(p, v.to(tl.float32), input_precision="ieee")
        else:
            pv = tl.dot(p.to(v.dtype), v)
        acc = acc * alpha[:, None] + pv
        m = m_new
    return acc, m, s_sum


@triton.jit
def _store_partials(o_ptr, m_ptr, l_ptr, part, rows, mask_g, offs_d, mask_d, acc, m, s_sum,
                    GP: tl.constexpr, BLOCK_D: tl.constexpr):
    """Partials laid out [groups, splits, GP, BLOCK_D] and [groups, splits, GP], ``part`` the
    (group, chunk) slot: only the rows in ``mask_g`` (the padding rows are never read)."""
    tl.store(o_ptr + (part * GP + rows[:, None]) * BLOCK_D + offs_d[None, :], acc,
             mask=mask_g[:, None] & mask_d[None, :])
    tl.store(m_ptr + part * GP + rows, m, mask=mask_g)
    tl.store(l_ptr + part * GP + rows, s_sum, mask=mask_g)


# L_BUCKET (the cache length rounded up to a power of two) keys the tuning, so a cache that
# grows by one position a step does not retune every step; DIRECT does not (the shipped
# configs' keys predate it; its chunk's blocks are tuned as any chunk's)
@triton.autotune(configs=_configs(), key=["L_BUCKET", "G", "D", "KVH", "CHUNK", "MERGE"],
                 prune_configs_by={"early_config_prune": _fitting})
@triton.jit
def _split_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, o_ptr, m_ptr, l_ptr, cnt_ptr, out_ptr,
    L, L_BUCKET, G, D, KVH, CHUNK, scale,
    sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, smask_b, so_b, so_h,
    HAS_MASK: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    IEEE: tl.constexpr,  # dots in fp32 (``_fp32_dots``)
    MERGE: tl.constexpr,  # the last program of each KV head merges its chunks (``cnt_ptr``)
    GR: tl.constexpr, BLOCK_S: tl.constexpr,  # the merge's rows and chunks at once
    DIRECT: tl.constexpr,  # one chunk a KV head: the finished rows, no partials
    PDL: tl.constexpr,
):
    wait_inputs(PDL)  # the query and the cache are the kernels' before
    bh, chunk = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(1)
    b, kvh = bh // KVH, bh % KVH
    rows = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_d = rows < G, offs_d < D
    start = chunk * CHUNK
    # query heads kvh * G .. kvh * G + G - 1 share this KV head
    acc, m, s_sum = _attend_chunk(
        q_ptr + b * sq_b + kvh * G * sq_h, k_ptr + b * sk_b + kvh * sk_h,
        v_ptr + b * sv_b + kvh * sv_h, mask_ptr + b * smask_b, rows, mask_g, offs_d, mask_d,
        start, tl.minimum(start + CHUNK, L), scale, sq_h, sk_l, sv_l, HAS_MASK, GP, BLOCK_D,
        BLOCK_L, IEEE)
    if DIRECT:  # the merge of one chunk: its sums over its sum of weights
        tl.store(out_ptr + b * so_b + (kvh * G + rows[:, None]) * so_h + offs_d[None, :],
                 (acc / s_sum[:, None]).to(out_ptr.dtype.element_ty),
                 mask=mask_g[:, None] & mask_d[None, :])
    else:
        _store_partials(o_ptr, m_ptr, l_ptr, bh * splits + chunk, rows, mask_g, offs_d, mask_d,
                        acc, m, s_sum, GP, BLOCK_D)
    if MERGE:
        # every thread's stores before the count (its release); the last program's count
        # (its acquire) before its loads, which read the other programs' partials from L2
        tl.debug_barrier()
        if tl.atomic_add(cnt_ptr + bh, 1, sem="acq_rel") == splits - 1:
            _merge_chunks(o_ptr, m_ptr, l_ptr, out_ptr + b * so_b, bh, splits, G, 0, kvh * G,
                          D, so_h, GP, GR, BLOCK_D, BLOCK_S)
            tl.atomic_xchg(cnt_ptr + bh, 0)  # zero again for the next call


@triton.jit
def _selected_group(ids_ptr, b, slot, S, H, G, stride_ids, BLOCK_IDS: tl.constexpr):
    """The KV head of query head ``slot`` of sequence ``b``'s selection, and whether this slot
    computes it: its id names a head (-1 pads; ``slot`` S is the program that zeroes the rest)
    and no earlier slot names a head of the same KV group, so each KV head is read once."""
    offs = tl.arange(0, BLOCK_IDS)
    ids = tl.load(ids_ptr + b * stride_ids + offs, mask=offs < S, other=-1)
    head = tl.load(ids_ptr + b * stride_ids + slot, mask=slot < S, other=-1)
    ok = (head >= 0) & (head < H)
    kvh = tl.where(ok, head, 0).to(tl.int32) // G
    named = (ids >= 0) & (ids < H)
    earlier = tl.sum((named & (ids // G == kvh) & (offs < slot)).to(tl.int32), 0)
    return kvh, ok & (earlier == 0)


@triton.jit
def _zero_unnamed(ids_row, out_b, S, H, G, D, so_h, BLOCK_IDS: tl.constexpr,
                  BLOCK_HZ: tl.constexpr, BLOCK_D: tl.constexpr):
    """Zeros in the output rows of every query head whose KV group no id at ``ids_row``
    names, ``BLOCK_HZ`` heads a store."""
    offs_s = tl.arange(0, BLOCK_IDS)
    ids = tl.load(ids_row + offs_s, mask=offs_s < S, other=-1)
    groups = tl.where((ids >= 0) & (ids < H), ids // G, -1)
    offs_d = tl.arange(0, BLOCK_D)
    for h0 in range(0, H, BLOCK_HZ):
        offs_h = h0 + tl.arange(0, BLOCK_HZ)
        named = tl.sum((groups[None, :] == (offs_h // G)[:, None]).to(tl.int32), 1)
        rest = (offs_h < H) & (named == 0)
        tl.store(out_b + offs_h[:, None] * so_h + offs_d[None, :],
                 tl.zeros([BLOCK_HZ, BLOCK_D], dtype=out_b.dtype.element_ty),
                 mask=rest[:, None] & (offs_d < D)[None, :])


@triton.autotune(configs=_configs(), key=["L_BUCKET", "G", "D", "S", "CHUNK", "MERGE"],
                 prune_configs_by={"early_config_prune": _fitting})
@triton.jit
def _split_heads_kernel(
    q_ptr, k_ptr, v_ptr, mask_ptr, ids_ptr, o_ptr, m_ptr, l_ptr, cnt_ptr, out_ptr,
    L, L_BUCKET, G, H, D, S, SLOTS, CHUNK, scale,
    sq_b, sq_h, sk_b, sk_h, sk_l, sv_b, sv_h, sv_l, smask_b, stride_ids, so_b, so_h,
    HAS_MASK: tl.constexpr, GP: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_L: tl.constexpr,
    IEEE: tl.constexpr, MERGE: tl.constexpr, GR: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_IDS: tl.constexpr, BLOCK_HZ: tl.constexpr, PDL: tl.constexpr,
):
    """``_split_kernel`` over the KV groups of a selection's query heads (``heads``):
    program (sequence x slot of its ``S`` ids, chunk) attends with the query heads of the KV
    group its slot's head belongs to, over that KV head, when no earlier slot names the same
    group (``_selected_group``); another slot computes nothing. With ``MERGE`` each sequence
    has one slot more (``SLOTS``), whose first program zeroes the output rows of the groups
    not named, and the last program of each slot merges its chunks (``cnt_ptr``, one counter
    a slot)."""
    wait_inputs(PDL)  # the query, the ids and the cache are the kernels' before
    pid, chunk = tl.program_id(0), tl.program_id(1)
    splits = tl.num_programs(1)
    b, slot = pid // SLOTS, pid % SLOTS
    kvh, ok = _selected_group(ids_ptr, b, slot, S, H, G, stride_ids, BLOCK_IDS)
    rows = tl.arange(0, GP)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_d = (rows < G) & ok, offs_d < D
    start = chunk * CHUNK
    acc, m, s_sum = _attend_chunk(
        q_ptr + b * sq_b + kvh * G * sq_h, k_ptr + b * sk_b + kvh * sk_h,
        v_ptr + b * sv_b + kvh * sv_h, mask_ptr + b * smask_b, rows, mask_g, offs_d, mask_d,
        start, tl.where(ok, tl.minimum(start + CHUNK, L), start), scale, sq_h, sk_l, sv_l,
        HAS_MASK, GP, BLOCK_D, BLOCK_L, IEEE)
    group = b * S + slot
    _store_partials(o_ptr, m_ptr, l_ptr, group * splits + chunk, rows, mask_g, offs_d, mask_d,
                    acc, m, s_sum, GP, BLOCK_D)
    if MERGE:
        if ok:
            tl.debug_barrier()  # as _split_kernel's
            if tl.atomic_add(cnt_ptr + group, 1, sem="acq_rel") == splits - 1:
                _merge_chunks(o_ptr, m_ptr, l_ptr, out_ptr + b * so_b, group, splits, G, 0,
                              kvh * G, D, so_h, GP, GR, BLOCK_D, BLOCK_S)
                tl.atomic_xchg(cnt_ptr + group, 0)
        if (slot == S) & (chunk == 0):
            _zero_unnamed(ids_ptr + b * stride_ids, out_ptr + b * so_b, S, H, G, D, so_h,
                          BLOCK_IDS, BLOCK_HZ, BLOCK_D)


@triton.jit
def _merge_chunks(o_ptr, m_ptr, l_ptr, out_ptr, bh, splits, G, r0, h0, D, so_h,
                  GP: tl.constexpr, GR: tl.constexpr, BLOCK_D: tl.constexpr,
                  BLOCK_S: tl.constexpr):
    """Rescale the ``splits`` chunks of KV head ``bh`` to a common maximum and sum them, for
    rows ``r0 .. r0 + GR - 1`` of its group of ``G`` query heads, into the output rows of query
    heads ``h0 + r0 ..`` (``h0``: the group's first). The chunks are loaded ``BLOCK_S`` at a
    time, all ``GR`` rows at once ([BLOCK_S, GR, BLOCK_D]), so a short cache takes one round
    trip to L2: a loop over the chunks one at a time made the split kernel 3x slower on an
    H200 (104 -> 317 us a Llama-3-8B step, BENCHMARKS.md, tenth session)."""
    offs_s = tl.arange(0, BLOCK_S)
    rows = r0 + tl.arange(0, GR)
    offs_d = tl.arange(0, BLOCK_D)
    mask_g, mask_d = rows < G, offs_d < D
    m_run = tl.full([GR], float("-inf"), tl.float32)
    num = tl.zeros([GR, BLOCK_D], tl.float32)
    den = tl.zeros([GR], tl.float32)
    for s0 in range(0, splits, BLOCK_S):
        mask = ((s0 + offs_s) < splits)[:, None] & mask_g[None, :]
        part = (bh * splits + s0 + offs_s[:, None]) * GP + rows[None, :]  # [BLOCK_S, GR]
        m_s = tl.load(m_ptr + part, mask=mask, other=float("-inf"), cache_modifier=".cg")
        l_s = tl.load(l_ptr + part, mask=mask, other=0.0, cache_modifier=".cg")
        o_s = tl.load(o_ptr + part[:, :, None] * BLOCK_D + offs_d[None, None, :],
                      mask=mask[:, :, None] & mask_d[None, None, :], other=0.0,
                      cache_modifier=".cg")
        m_new = tl.maximum(m_run, tl.max(m_s, 0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)  # nothing visible yet
        alpha = tl.exp(m_run - m_safe)
        w = tl.where(m_s > float("-inf"), tl.exp(m_s - m_safe[None, :]), 0.0)
        num = num * alpha[:, None] + tl.sum(o_s * w[:, :, None], 0)
        den = den * alpha + tl.sum(l_s * w, 0)
        m_run = m_new
    tl.store(out_ptr + (h0 + rows[:, None]) * so_h + offs_d[None, :],
             (num / den[:, None]).to(out_ptr.dtype.element_ty),
             mask=mask_g[:, None] & mask_d[None, :])


@triton.jit
def _combine_kernel(
    o_ptr, m_ptr, l_ptr, out_ptr,
    G, D, KVH, SPLITS, so_b, so_h,
    GP: tl.constexpr, GR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    PDL: tl.constexpr,
):
    # program (batch x KV head, GR rows of its group): the split kernel's merge as a launch
    # of its own, one query head a program (GR = 1) as before b1dcc65, when the combine took
    # 67 us a Llama-3-8B step on an H200 (6ee37d2); one program a KV head took 114 us at
    # f3622db (BENCHMARKS.md, eleventh session, a run in which all our kernels ran slow)
    wait_inputs(PDL)  # the partials are the split kernel's, the kernel before
    bh = tl.program_id(0)
    _merge_chunks(o_ptr, m_ptr, l_ptr, out_ptr + (bh // KVH) * so_b, bh, SPLITS, G,
                  tl.program_id(1) * GR, (bh % KVH) * G, D, so_h, GP, GR, BLOCK_D, BLOCK_S)


@triton.jit
def _combine_heads_kernel(
    o_ptr, m_ptr, l_ptr, ids_ptr, out_ptr,
    H, G, D, S, SPLITS, stride_ids, so_b, so_h,
    GP: tl.constexpr, GR: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
    BLOCK_IDS: tl.constexpr, BLOCK_HZ: tl.constexpr, PDL: tl.constexpr,
):
    # program (sequence x slot of its S ids, and one more; GR rows of the group):
    # ``_split_heads_kernel``'s slot merged into its group's rows, when the slot computed
    # them; the first program of each sequence's last slot zeroes the rows of the groups not
    # named
    wait_inputs(PDL)  # the partials are the split kernel's, the kernel before
    pid, part = tl.program_id(0), tl.program_id(1)
    b, slot = pid // (S + 1), pid % (S + 1)
    kvh, ok = _selected_group(ids_ptr, b, slot, S, H, G, stride_ids, BLOCK_IDS)
    if ok:
        _merge_chunks(o_ptr, m_ptr, l_ptr, out_ptr + b * so_b, b * S + slot, SPLITS, G,
                      part * GR, kvh * G, D, so_h, GP, GR, BLOCK_D, BLOCK_S)
    if (slot == S) & (part == 0):
        _zero_unnamed(ids_ptr + b * stride_ids, out_ptr + b * so_b, S, H, G, D, so_h,
                      BLOCK_IDS, BLOCK_HZ, BLOCK_D)


# fp32 partials ``_merge_chunks`` holds at once: 64 registers a thread at 4 warps
MERGE_VALUES = 8192
# query heads per program of the combine launch
COMBINE_ROWS = 1


def merge_block(splits: int, group: int, block_d: int) -> int:
    """Chunks ``_merge_chunks`` loads at once: all of them, up to ``MERGE_VALUES`` values."""
    return max(1, min(triton.next_power_of_2(splits), MERGE_VALUES // (group * block_d)))


# the heads one store of ``_zero_unnamed`` zeroes
ZERO_HEADS = 16


def _operands(q, k, v, mask):
    """q, k and v with contiguous rows of head_dim (another layout is copied first: the lower
    pass hands the kernel the model's own tensors, whose layout the model chose), and the bool
    mask as bytes: read in place (no copy launch; a Llama-3-8B step spent 69 us in 32 such
    copies on an H200) when its keys are contiguous, as a decode step's mask is."""
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    if mask is not None:
        mask = mask.view(torch.uint8) if mask.stride(-1) == 1 else mask.to(torch.uint8).contiguous()
    return q, k, v, mask


def _targets(q: torch.Tensor, groups: int, g: int, length: int):
    """The sizes and output of a split launch over ``groups`` sets of chunks (sequence x KV
    head, or x slot of the ids) for query groups of ``g`` heads over ``length`` keys: the
    padded rows and head size (``GP``, ``BLOCK_D``), the merge's rows (``GR``), ``chunking``'s
    keys per chunk and chunks, and the output."""
    b, h, _, d = q.shape
    gr = triton.next_power_of_2(g)
    gp, block_d = max(16, gr), max(16, triton.next_power_of_2(d))
    chunk, splits = chunking(groups, length)
    out = torch.empty(b, h, 1, d, device=q.device, dtype=q.dtype)
    return gp, block_d, gr, chunk, splits, out


def _partials(q: torch.Tensor, rows: int, block_d: int):
    """The fp32 partials (output, maximum, sum) of ``rows`` padded rows of ``block_d``; with no
    rows (a launch that stores its finished rows, ``_split_kernel``'s ``DIRECT``), one element
    each, never read or written."""
    part_o = torch.empty(max(1, rows * block_d), device=q.device, dtype=torch.float32)
    part_m = torch.empty(max(1, rows), device=q.device, dtype=torch.float32)
    return part_o, part_m, torch.empty_like(part_m)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float,
                     mask: torch.Tensor | None = None,
                     counters: torch.Tensor | None = None,
                     heads: torch.Tensor | None = None) -> torch.Tensor:
    """Triton launcher of ``torch.ops.dejavu.decode_attention``.

    q: [B, H, 1, D]; k, v: [B, KVH, L, D] (the last dimension contiguous), H a multiple of KVH;
    mask: None or bool [B, L] (True: attend); counters: None, or int32 [>= B * KVH, or with
    ``heads`` >= B * S], zero, given back zero (one launch instead of two, see the module
    doc); heads: None, or int ids [..., S] (B rows or one) of the query heads whose KV groups
    to compute (``_heads``);
    returns [B, H, 1, D] in q's dtype.
    """
    check_dtype("decode_attention", q, k, v)
    # the op's checks: its CUDA kernel replaces its body
    check_decode(q, k, v, mask, counters, heads)
    if heads is not None:
        return _heads(q, k, v, scale, mask, counters, heads)
    b, h, _, d = q.shape
    kvh, length = k.shape[1], k.shape[2]
    q, k, v, mask = _operands(q, k, v, mask)
    g = h // kvh
    gp, block_d, gr, chunk, splits, out = _targets(q, b * kvh, g, length)
    block_s = merge_block(splits, gr, block_d)
    # one chunk a KV head: the split kernel stores the finished rows (the merge of one chunk,
    # the same values), with neither partials, a merge nor a combine launch
    direct = splits == 1
    part_o, part_m, part_l = _partials(q, 0 if direct else b * kvh * splits * gp, block_d)
    merge = counters is not None and not direct
    _split_kernel[(b * kvh, splits)](
        q, k, v, mask if mask is not None else q, part_o, part_m, part_l,
        counters if merge else part_m, out,
        length, triton.next_power_of_2(length), g, d, kvh, chunk, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0) if mask is not None else 0,
        out.stride(0), out.stride(1),
        HAS_MASK=mask is not None, GP=gp, BLOCK_D=block_d, IEEE=_fp32_dots(k.dtype), MERGE=merge,
        GR=gr, BLOCK_S=block_s, DIRECT=direct, **pdl_meta(),
    )
    if merge or direct:
        return out
    _combine_kernel[(b * kvh, triton.cdiv(g, COMBINE_ROWS))](
        part_o, part_m, part_l, out,
        g, d, kvh, splits, out.stride(0), out.stride(1),
        GP=gp, GR=COMBINE_ROWS, BLOCK_D=block_d,
        BLOCK_S=merge_block(splits, COMBINE_ROWS, block_d), num_warps=4, **pdl_meta(),
    )
    return out


def _heads(q, k, v, scale, mask, counters, heads):
    """``decode_attention`` over the KV groups of the query heads ``heads`` names only (option
    ``decode_selected_heads``, where the output projection reads no other head): a program
    set per slot of the ids, the first slot naming a group computing that group's query heads
    over its KV head, so the cache of a KV head that no named head reads is never read, and
    no KV head is read twice; the output rows of the groups not named are zeros."""
    b, h, _, d = q.shape
    length, g = k.shape[2], h // k.shape[1]
    q, k, v, mask = _operands(q, k, v, mask)
    ids = heads.reshape(-1, heads.shape[-1]).contiguous()
    s, stride_ids = ids.shape[1], 0 if ids.shape[0] == 1 else ids.stride(0)
    gp, block_d, gr, chunk, splits, out = _targets(q, b * s, g, length)
    part_o, part_m, part_l = _partials(q, b * s * splits * gp, block_d)
    merge = counters is not None
    slots = s + 1 if merge else s  # merging: the zeroes' slot is the split kernel's
    sizes = {"BLOCK_D": block_d, "BLOCK_IDS": triton.next_power_of_2(s),
             "BLOCK_HZ": ZERO_HEADS}
    _split_heads_kernel[(b * slots, splits)](
        q, k, v, mask if mask is not None else q, ids, part_o, part_m, part_l,
        counters if merge else part_m, out,
        length, triton.next_power_of_2(length), g, h, d, s, slots, chunk, scale,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2), mask.stride(0) if mask is not None else 0,
        stride_ids, out.stride(0), out.stride(1),
        HAS_MASK=mask is not None, GP=gp, IEEE=_fp32_dots(k.dtype), MERGE=merge, GR=gr,
        BLOCK_S=merge_block(splits, gr, block_d), **sizes, **pdl_meta(),
    )
    if merge:
        return out
    _combine_heads_kernel[(b * (s + 1), triton.cdiv(g, COMBINE_ROWS))](
        part_o, part_m, part_l, ids, out,
        h, g, d, s, splits, stride_ids, out.stride(0), out.stride(1),
        GP=gp, GR=COMBINE_ROWS, BLOCK_S=merge_block(splits, COMBINE_ROWS, block_d), **sizes,
        num_warps=4, **pdl_meta(),
    )
    return out
