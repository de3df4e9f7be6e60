"""Triton kernels of the bucketed learned selector (see ``kernels/predictor.py``): a hidden
GEMV with the activation fused, then one program per bucket that scores its units and keeps
their top ``k / buckets`` in registers. Reference: ``kernels/reference.py::select_predictor``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .triton_common import (
    ACT_CODES,
    INTERPRET,
    QUICK_TUNE,
    add_row_slices,
    apply_act,
    check_dtype,
    pdl_meta,
    wait_inputs,
)

# The largest bucket one program ranks (units, padded to a power of two).
MAX_BUCKET = 1024


def _hidden_configs() -> list[triton.Config]:
    if INTERPRET:
        return [triton.Config({"BLOCK_H": 4, "BLOCK_D": 16}, num_warps=1)]
    if QUICK_TUNE:
        return [triton.Config({"BLOCK_H": 2, "BLOCK_D": 512}, num_warps=4)]
    shapes = [(1, 512, 2), (1, 1024, 4), (2, 512, 4), (2, 1024, 4), (4, 512, 4), (4, 1024, 8)]
    return [triton.Config({"BLOCK_H": h, "BLOCK_D": d}, num_warps=w) for h, d, w in shapes]


@triton.autotune(configs=_hidden_configs(), key=["D", "RANK"])
@triton.jit
def _hidden_kernel(
    x_ptr, w1_ptr, b1_ptr, z_ptr,
    D, RANK,
    stride_x, stride_w1, stride_z,
    HAS_B1: tl.constexpr, ACT: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)  # x may be the previous kernel's
    pid_h, row = tl.program_id(0), tl.program_id(1)
    offs_h = pid_h * BLOCK_H + tl.arange(0, BLOCK_H)
    mask_h = offs_h < RANK
    # products kept in a 2-d accumulator over the loop and reduced once (as the down kernel's)
    acc2 = add_row_slices(tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32),
                          x_ptr + row * stride_x, w1_ptr, offs_h, mask_h, stride_w1, 0, D,
                          BLOCK_D)
    acc = tl.sum(acc2, 1)
    if HAS_B1:
        acc += tl.load(b1_ptr + offs_h, mask=mask_h, other=0.0).to(tl.float32)
    if ACT >= 0:
        acc = apply_act(acc, ACT)
    tl.store(z_ptr + row * stride_z + offs_h, acc, mask=mask_h)


def _bucket_configs() -> list[triton.Config]:
    """Rank chunks and warps of the bucket kernel, autotuned. With the 4 warps and 64-wide
    chunks it had before, it took 10 us a layer for Llama-3-8B's MLP on an H200, where reading
    its 3.7 MB of weights takes about 1 us at copy bandwidth: the time goes to scoring and
    ranking. One config for correctness runs."""
    if INTERPRET or QUICK_TUNE:
        return [triton.Config({"BLOCK_R": 16, "COUNT": 0}, num_warps=4)]
    return [triton.Config({"BLOCK_R": r, "COUNT": c}, num_warps=w) for r in (16, 32, 64, 128)
            for w in (1, 2, 4, 8) for c in (0, 1)]


COUNT_MAX = 256  # the largest bucket ranked by counting (a BLOCK_S x BLOCK_S comparison)


def _fitting(configs, named_args, **kwargs):
    """The configs whose tile (bucket x rank chunk) stays within 8192 values and whose chunk
    is no wider than the rank needs (the bound the launch used before autotuning), with at most
    128 of the tile's values per thread (the tile and its accumulator live in registers);
    ranking by counting only for buckets up to ``COUNT_MAX``."""
    size, rank = kwargs["BLOCK_S"], named_args["RANK"]
    cap = max(16, min(128, triton.next_power_of_2(rank), 8192 // size))
    return [c for c in configs if c.kwargs["BLOCK_R"] <= cap
            and size * c.kwargs["BLOCK_R"] <= 128 * 32 * c.num_warps  # values per thread
            and (not c.kwargs["COUNT"] or size <= COUNT_MAX)] or configs[:1]


@triton.autotune(configs=_bucket_configs(), key=["RANK", "SIZE", "KEEP", "BLOCK_S", "GROUP"],
                 prune_configs_by={"early_config_prune": _fitting})
@triton.jit
def _bucket_kernel(
    z_ptr, b1_ptr, w2_ptr, b2_ptr, out_ptr,
    RANK, SIZE, KEEP,
    stride_z, stride_w2, stride_out,
    HAS_B1: tl.constexpr, ACT: tl.constexpr,  # applied to z as loaded (a folded predictor)
    HAS_B2: tl.constexpr, GROUP: tl.constexpr, GROUP_P2: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_R: tl.constexpr, BLOCK_K: tl.constexpr, COUNT: tl.constexpr,
    PDL: tl.constexpr,
):
    wait_inputs(PDL)  # z is the hidden kernel's (or the folded projection's)
    bucket, row = tl.program_id(0), tl.program_id(1)
    offs_s = tl.arange(0, BLOCK_S)
    mask_s = offs_s < SIZE
    units = bucket * SIZE + offs_s
    acc2 = tl.zeros([BLOCK_S, BLOCK_R], dtype=tl.float32)
    for r0 in range(0, RANK, BLOCK_R):
        offs_r = r0 + tl.arange(0, BLOCK_R)
        mask_r = offs_r < RANK
        z = tl.load(z_ptr + row * stride_z + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        if HAS_B1:
            z += tl.load(b1_ptr + offs_r, mask=mask_r, other=0.0).to(tl.float32)
        if ACT >= 0:
            z = tl.where(mask_r, apply_act(z, ACT), 0.0)
        w = tl.load(w2_ptr + units[:, None] * stride_w2 + offs_r[None, :],
                    mask=mask_s[:, None] & mask_r[None, :], other=0.0)
        acc2 += w.to(tl.float32) * z[None, :]
    acc = tl.sum(acc2, 1)
    if HAS_B2:
        acc += tl.load(b2_ptr + units, mask=mask_s, other=0.0).to(tl.float32)
    # Order-preserving integer image of the fp32 score (negative floats have their magnitude
    # bits flipped), above the unit's position: a descending sort of the keys ranks the scores.
    bits = acc.to(tl.int32, bitcast=True)
    bits = tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits)
    keys = (bits.to(tl.int64) << 32) | offs_s.to(tl.int64)
    keys = tl.where(mask_s, keys, -9223372036854775807 - 1)
    if COUNT:
        # A unit is kept when fewer than KEEP keys are larger (keys are distinct): one
        # comparison of every pair instead of two sorting networks; a running count over the
        # kept units gives each its place, so the ids come out ascending.
        larger = tl.sum((keys[None, :] > keys[:, None]).to(tl.int32), axis=1)
        kept = mask_s & (larger < KEEP)
        place = tl.cumsum(kept.to(tl.int32), axis=0) - 1
        ids = bucket * SIZE + offs_s
        base = out_ptr + row * stride_out + (bucket * KEEP + place) * GROUP
        mask_k = kept
    else:
        top = tl.topk(keys, BLOCK_K)
        offs_k = tl.arange(0, BLOCK_K)
        mask_k = offs_k < KEEP
        # the kept ids in ascending order (the rest pushed past them): reads walk memory forwards
        local = tl.sort(tl.where(mask_k, top & 0xFFFFFFFF, 0x7FFFFFFF))
        ids = bucket * SIZE + local
        base = out_ptr + row * stride_out + (bucket * KEEP + offs_k) * GROUP
    if GROUP == 1:
        tl.store(base, ids, mask=mask_k)
    else:
        offs_g = tl.arange(0, GROUP_P2)
        tl.store(base[:, None] + offs_g[None, :], ids[:, None] * GROUP + offs_g[None, :],
                 mask=mask_k[:, None] & (offs_g < GROUP)[None, :])


def bucketed(units: int, buckets: int) -> bool:
    """Whether the Triton selector ranks these buckets (each fits one program)."""
    return units % buckets == 0 and units // buckets <= MAX_BUCKET


def _act_code(act: str) -> int:
    """The kernels' activation code; -1 for none."""
    return -1 if act == "none" else ACT_CODES[act]


def _rows(name: str, t: torch.Tensor, k: int, buckets: int) -> torch.Tensor:
    """``t`` [..., f] as rows [n, f] with contiguous features, after checking ``buckets``
    divides ``k``."""
    if k % buckets:
        raise ValueError(f"{name}: {buckets} buckets must divide k ({k})")
    rows = t.reshape(-1, t.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def select_predictor_triton(x, w1, b1, w2, b2, act: str, k: int, group: int, buckets: int,
                            out: torch.Tensor | None = None) -> torch.Tensor:
    """The two-launch selector (module doc); ids [..., k * group], ascending, written into
    ``out`` when given."""
    check_dtype("select_predictor", x, w1, w2)
    rows = _rows("select_predictor", x, k, buckets)
    (n, d), rank = rows.shape, w1.shape[0]
    w1, w2 = w1.contiguous(), w2.contiguous()
    z = torch.empty(n, rank, dtype=torch.float32, device=x.device)
    _hidden_kernel[lambda meta: (triton.cdiv(rank, meta["BLOCK_H"]), n)](
        rows, w1, b1 if b1 is not None else w1, z, d, rank,
        rows.stride(0), w1.stride(0), z.stride(0),
        HAS_B1=b1 is not None, ACT=_act_code(act), **pdl_meta(),
    )
    ids = _rank_buckets(z, None, -1, w2, b2, k, group, buckets,
                        None if out is None else out.view(n, k * group))
    return ids.reshape(*x.shape[:-1], k * group)


def _rank_buckets(z, b1, act_code: int, w2, b2, k: int, group: int, buckets: int,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """The bucket launch: z [n, rank] (act(z + b1) taken as loaded when ``b1`` / ``act_code``
    say so) -> ids [n, k * group], into ``out`` when given."""
    n, rank = z.shape
    units = w2.shape[0]
    size, keep = units // buckets, k // buckets
    if out is None:
        out = torch.empty(n, k * group, dtype=torch.int64, device=z.device)
    block_s = max(2, triton.next_power_of_2(size))  # tl.topk needs two or more
    _bucket_kernel[(buckets, n)](
        z, b1 if b1 is not None else w2, w2, b2 if b2 is not None else w2, out, rank, size, keep,
        z.stride(0), w2.stride(0), out.stride(0),
        HAS_B1=b1 is not None, ACT=act_code,
        HAS_B2=b2 is not None, GROUP=group, GROUP_P2=triton.next_power_of_2(group),
        BLOCK_S=block_s, BLOCK_K=max(2, triton.next_power_of_2(keep)), **pdl_meta(),
    )
    return out


def select_hidden_triton(h, b1, w2, b2, act: str, k: int, group: int, buckets: int
                         ) -> torch.Tensor:
    """The bucket launch alone, on the hidden pre-activations ``h`` [..., rank] of a folded
    predictor (its first GEMV ran stacked with the projections that read the same input); the
    bias and activation are applied as ``h`` is loaded. Ids [..., k * group], ascending."""
    check_dtype("select_hidden", h, w2)
    rows = _rows("select_hidden", h, k, buckets)
    out = _rank_buckets(rows, b1, _act_code(act), w2.contiguous(), b2, k, group, buckets)
    return out.reshape(*h.shape[:-1], k * group)
