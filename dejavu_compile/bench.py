"""``dejavu bench``: kernel sweep and end-to-end decode latency on a CUDA GPU.

Shapes come from the model configs below (the published dimensions of each model; weights are
random: speed does not depend on their values). Every timing of one table is taken in the same
process, side by side, with the measured copy bandwidth of this GPU as the ceiling.

(a) kernels: the fused sparse MLP and the head-gathered output projection at several densities,
    against cuBLAS dense and PyTorch's naive index-then-multiply. Each timing runs the op over
    ``LAYERS`` distinct weight sets inside one CUDA graph (as decoding reads each layer once per
    token, so nothing is served from L2) and divides by ``LAYERS``.
(b) end to end: per-token decode latency (batch 1, fp16, static KV cache) for HF eager, HF +
    torch.compile (Inductor, CUDA graphs), dejavu dense, and dejavu at the operating point, with
    the byte floor of each and (c) the peak GPU memory of each.
"""

from __future__ import annotations

import contextlib
import functools
import gc
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from unittest import mock

import torch
import torch.nn.functional as F

from .kernels import tuning
from .profile import BUCKET_UNITS

DENSITIES = (0.05, 0.1, 0.25, 0.5, 0.8, 1.0)
# the shapes the issue's targets name: what `dejavu bench` measures without --models
BENCH_MODELS = ("opt-13b", "llama-3-8b")
LAYERS = 8


def shape_configs():
    """Hugging Face configs with the published shapes of the benchmarked models."""
    import transformers as tf

    return {
        "opt-13b": tf.OPTConfig(hidden_size=5120, ffn_dim=20480, num_hidden_layers=40,
                                num_attention_heads=40, word_embed_proj_dim=5120,
                                vocab_size=50272, max_position_embeddings=2048),
        "opt-6.7b": tf.OPTConfig(hidden_size=4096, ffn_dim=16384, num_hidden_layers=32,
                                 num_attention_heads=32, word_embed_proj_dim=4096,
                                 vocab_size=50272, max_position_embeddings=2048),
        "llama-3-8b": tf.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                     num_hidden_layers=32, num_attention_heads=32,
                                     num_key_value_heads=8, vocab_size=128256,
                                     max_position_embeddings=8192, rope_theta=500000.0),
        # same layer shapes as Llama-3-8B, with the 128K context of Llama 3.1
        "llama-3.1-8b": tf.LlamaConfig(hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32,
                                       num_key_value_heads=8, vocab_size=128256,
                                       max_position_embeddings=131072, rope_theta=500000.0),
        "qwen3-8b": tf.Qwen3Config(hidden_size=4096, intermediate_size=12288,
                                   num_hidden_layers=36, num_attention_heads=32,
                                   num_key_value_heads=8, head_dim=128, vocab_size=151936,
                                   max_position_embeddings=40960),
        "mistral-7b": tf.MistralConfig(hidden_size=4096, intermediate_size=14336,
                                       num_hidden_layers=32, num_attention_heads=32,
                                       num_key_value_heads=8, vocab_size=32768,
                                       max_position_embeddings=32768, sliding_window=None),
    }


def copy_bandwidth(nbytes: int = 2 << 30) -> float:
    """Device-to-device copy bandwidth in bytes/s (read + write counted)."""
    import triton.testing

    src = torch.empty(nbytes // 2, dtype=torch.float16, device="cuda")
    dst = torch.empty_like(src)
    ms = triton.testing.do_bench(lambda: dst.copy_(src), return_mode="median")
    return 2 * nbytes / (ms * 1e-3)


def graph_bench(fn, **kwargs):
    """``triton.testing.do_bench_cudagraph(fn, **kwargs)`` once the GPU has finished the work
    already queued. That function runs ``fn`` on a new stream that waits for no other, so
    without the wait its first calls (the autotuner's trials among them) can run before the
    current stream has written their inputs. The likely cause of the illegal memory access in
    ``examples/tile_study.py --kernel cols`` (at Llama-3-8B's first key after OPT-13B's, in
    each of three runs, never with ``CUDA_LAUNCH_BLOCKING=1``): its head ids not yet written,
    in memory that OPT-13B's study had used (BENCHMARKS.md, sixty-sixth session)."""
    import triton.testing

    torch.cuda.synchronize()
    return triton.testing.do_bench_cudagraph(fn, **kwargs)


def _time_layers(fn, layers: int) -> tuple[float, float, float]:
    """Median and 20/80 percentiles (ms) of one call of ``fn(i)``, run for each of ``layers``
    weight sets inside one CUDA graph (``graph_bench``)."""

    def body():
        for i in range(layers):
            fn(i)

    q = graph_bench(body, rep=200, quantiles=[0.5, 0.2, 0.8])
    return tuple(t / layers for t in q)


def same_bytes_copy_ms(nbytes: int) -> float:
    """A device copy that moves ``nbytes`` (half read, half written, as ``copy_bandwidth``
    counts them) timed as the kernels are (``_time_layers``, a buffer pair per weight set):
    what copy bandwidth is at a kernel's own size, launch and ramp included."""
    n = max(1, nbytes // 4)  # fp16 values: nbytes / 2 bytes on each side
    src = [torch.zeros(n, dtype=torch.float16, device="cuda") for _ in range(LAYERS)]
    dst = [torch.empty_like(t) for t in src]
    return _time_layers(lambda i: dst[i].copy_(src[i]), LAYERS)[0]


def _mlp_weights(cfg, dtype):
    d = cfg.hidden_size
    n = getattr(cfg, "intermediate_size", None) or cfg.ffn_dim
    gated = cfg.model_type != "opt"
    gen = torch.Generator(device="cuda").manual_seed(0)

    def rand(*shape):
        return (torch.randn(*shape, device="cuda", generator=gen) * shape[-1] ** -0.5).to(dtype)

    sets = []
    for _ in range(LAYERS):
        w1 = rand(n, d)
        w_up = rand(n, d) if gated else None
        w2_t = rand(n, d)
        sets.append((w1, w_up, w2_t))
    return sets, d, n, gated


def _dense_mlp(sets, gated: bool, x):
    """``i -> `` the dense MLP of weight set ``i`` on ``x`` through cuBLAS (the down projection
    copied to the [d, n] row-major layout cuBLAS reads)."""
    dense_w2 = [w2_t.t().contiguous() for _, _, w2_t in sets]

    def run(i):
        w1, w_up, _ = sets[i]
        h = F.silu(F.linear(x, w1)) * F.linear(x, w_up) if gated else F.relu(F.linear(x, w1))
        return F.linear(h, dense_w2[i])

    return run


def _mlp_sweep(name: str, cfg, densities, dtype):
    """The sparse MLP against cuBLAS dense and PyTorch's index-then-multiply, on a workspace
    kept zero as in the decode step (two launches, no zero-fill)."""
    from dejavu_compile.kernels import ops, sparse_mlp

    act = "relu" if cfg.model_type == "opt" else "silu"
    sets, d, n, gated = _mlp_weights(cfg, dtype)
    x = torch.randn(1, 1, d, device="cuda", dtype=dtype)
    esize = torch.finfo(dtype).bits // 8
    dense_ms = _time_layers(_dense_mlp(sets, gated, x), LAYERS)
    dense_bytes = (3 if gated else 2) * n * d * esize
    for density in densities:
        k, idx = random_ids(n, density)
        sparse_bytes = k * (3 if gated else 2) * d * esize
        workspace = torch.zeros(ops.workspace_numel(1, d, k, gated), device="cuda")

        def sparse(i, idx=idx, workspace=workspace):
            w1, w_up, w2_t = sets[i]
            return sparse_mlp.sparse_mlp(x, idx, w1, None, w_up, w2_t, None, act,
                                         workspace=workspace)

        def naive(i, idx=idx):
            w1, w_up, w2_t = sets[i]
            sel = idx.view(-1)
            h = x.view(1, d) @ w1[sel].t()
            h = F.silu(h) * (x.view(1, d) @ w_up[sel].t()) if gated else F.relu(h)
            return h @ w2_t[sel]

        ours, naive_ms = _time_layers(sparse, LAYERS), _time_layers(naive, LAYERS)
        yield {
            "model": name, "block": "mlp", "density": density, "k": k,
            "sparse_ms": ours[0], "sparse_p20": ours[1], "sparse_p80": ours[2],
            "naive_ms": naive_ms[0], "dense_ms": dense_ms[0],
            "bytes": sparse_bytes, "dense_bytes": dense_bytes,
            "sparse_gbs": sparse_bytes / (ours[0] * 1e-3) / 1e9,
            "dense_gbs": dense_bytes / (dense_ms[0] * 1e-3) / 1e9,
        }


BATCH = 8  # the batch of the union-selection rows of the kernel sweep
BATCH_DENSITIES = (0.1, 0.5)
# the kernel sweep's parts, in the order it runs them (``kernel_sweep``, ``--blocks``)
SWEEP_BLOCKS = ("mlp", "attention", "selectors", "batch")


def check_blocks(blocks) -> None:
    """Refuse an empty or unknown choice of the kernel sweep's parts."""
    unknown = [b for b in blocks if b not in SWEEP_BLOCKS]
    if not blocks or unknown:
        raise ValueError(f"kernel sweep blocks must be some of {SWEEP_BLOCKS}, got {list(blocks)}")


def _mlp_batch_sweep(name: str, cfg, dtype, batch: int = BATCH,
                     densities=BATCH_DENSITIES):
    """The sparse MLP for ``batch`` rows, each with its own random selection: union selection
    (one id list read for all rows) against per-row selection, and cuBLAS dense on the batch.
    Bytes: the union's rows once (union), each row's own rows (per row)."""
    from dejavu_compile.kernels import sparse_mlp
    from dejavu_compile.kernels.reference import union_ids

    act = "relu" if cfg.model_type == "opt" else "silu"
    sets, d, n, gated = _mlp_weights(cfg, dtype)
    x = torch.randn(batch, 1, d, device="cuda", dtype=dtype)
    per_row = (3 if gated else 2) * d * (torch.finfo(dtype).bits // 8)  # bytes of one neuron
    dense_ms = _time_layers(_dense_mlp(sets, gated, x), LAYERS)
    for density in densities:
        k = max(1, round(density * n))
        idx = torch.stack([torch.randperm(n, device="cuda")[:k].sort().values
                           for _ in range(batch)]).view(batch, 1, k)
        united = int((union_ids(idx, n) >= 0).sum())
        for mode, union, nbytes in (("union", True, united * per_row),
                                    ("row", False, batch * k * per_row)):
            def sparse(i, idx=idx, union=union):
                w1, w_up, w2_t = sets[i]
                return sparse_mlp.sparse_mlp(x, idx, w1, None, w_up, w2_t, None, act, union)

            ours = _time_layers(sparse, LAYERS)
            yield {
                "model": name, "block": f"mlp batch {batch} {mode}", "density": density,
                "k": k, "sparse_ms": ours[0], "sparse_p20": ours[1], "sparse_p80": ours[2],
                "naive_ms": float("nan"), "dense_ms": dense_ms[0],
                "bytes": nbytes, "dense_bytes": n * per_row,
                "sparse_gbs": nbytes / (ours[0] * 1e-3) / 1e9,
                "dense_gbs": n * per_row / (dense_ms[0] * 1e-3) / 1e9,
            }


def random_ids(n: int, density: float) -> tuple[int, torch.Tensor]:
    """``k = max(1, round(density * n))`` and k sorted random ids of ``n`` units, [1, 1, k] on
    the GPU: the kernel sweep's selection."""
    k = max(1, round(density * n))
    return k, torch.randperm(n, device="cuda")[:k].sort().values.view(1, 1, k)


def bucket_ids(n: int, density: float, device="cuda") -> tuple[int, torch.Tensor]:
    """The selection a decode step's bucketed selector makes at ``density`` of ``n`` units:
    ``k`` (``profile.kept_units`` of ``profile.default_buckets(n)`` buckets, as the step's
    profile keeps) and k random ids, the same count from each bucket, sorted within it, [1,
    1, k] on ``device``. OPT-13B's MLP at 0.1 keeps 2080 of 20480 (13 of each 128), where
    ``random_ids`` keeps 2048: the step's tuning keys, not the sweep's."""
    from .profile import default_buckets, kept_units

    buckets = default_buckets(n)
    k, size = kept_units(density, n, buckets), n // buckets
    ids = torch.cat([b * size + torch.randperm(size, device=device)[:k // buckets].sort().values
                     for b in range(buckets)])
    return k, ids.view(1, 1, k)


def head_weights(cfg, dtype):
    """``(H, hd, x, attn, wq, wo_t, wo)`` for ``LAYERS`` layers of ``cfg``'s attention: an
    input [1, 1, d] and an attention output [1, 1, H * hd]; [H * hd, d] weights, the query's as
    Hugging Face stores them and the output projection's as the lower pass re-lays them out (a
    head's rows contiguous); ``wo`` the [d, H * hd] layout of the output projection's Linear,
    which cuBLAS gets."""
    d = cfg.hidden_size
    heads_n, hd = cfg.num_attention_heads, cfg.hidden_size // cfg.num_attention_heads
    x = torch.randn(1, 1, d, device="cuda", dtype=dtype)
    attn = torch.randn(1, 1, heads_n * hd, device="cuda", dtype=dtype)
    wq = [(torch.randn(heads_n * hd, d, device="cuda") * d**-0.5).to(dtype)
          for _ in range(LAYERS)]
    wo_t = [(torch.randn(heads_n * hd, d, device="cuda") * d**-0.5).to(dtype)
            for _ in range(LAYERS)]
    return heads_n, hd, x, attn, wq, wo_t, [w.t().contiguous() for w in wo_t]


def _attention_sweep(name, cfg, densities, dtype):
    """The head-gathered query projection (``attention_q``) and output projection
    (``attention_out``) over selected heads, each against cuBLAS dense and PyTorch's
    index-then-multiply (the selected heads' weight rows copied out, then one matmul). The
    output projection runs on a workspace kept zero, as in the decode step (no zero-fill);
    ``attention_out_original`` is the same op on the original layout (option ``out_layout``)."""
    from dejavu_compile.kernels import heads, ops

    d = cfg.hidden_size
    esize = torch.finfo(dtype).bits // 8
    heads_n, hd, x, attn, wq, wo_t, wo = head_weights(cfg, dtype)
    full = heads_n * hd * d * esize
    workspace = torch.zeros(ops.workspace_numel(1, d), device="cuda")
    dense = {"attention_q": _time_layers(lambda i: F.linear(x, wq[i]), LAYERS),
             "attention_out": _time_layers(lambda i: F.linear(attn, wo[i]), LAYERS)}
    dense["attention_out_original"] = dense["attention_out"]  # the same dense op
    for density in densities:
        k, idx = random_ids(heads_n, density)
        nbytes = k * hd * d * esize
        sel = idx.view(-1)
        runs = {"attention_q": (
                    lambda i, idx=idx: heads.sparse_head_proj(x, idx, wq[i], None, hd),
                    lambda i, sel=sel: x.view(1, d) @ wq[i].view(heads_n, hd, d)[sel]
                    .reshape(-1, d).t()),
                "attention_out": (
                    lambda i, idx=idx: heads.sparse_head_out(attn, idx, wo_t[i], None, hd,
                                                             workspace=workspace),
                    lambda i, sel=sel: attn.view(heads_n, hd)[sel].reshape(1, -1)
                    @ wo_t[i].view(heads_n, hd, d)[sel].reshape(-1, d)),
                # option out_layout="original": the Linear's own [d, H * hd] weight, read
                # along its columns (heads._head_out_cols_kernel); the naive row as above
                "attention_out_original": (
                    lambda i, idx=idx: heads.sparse_head_out(attn, idx, wo[i].t(), None, hd),
                    None)}
        naive_ms = None
        for block, (fn, naive) in runs.items():
            ours = _time_layers(fn, LAYERS)
            naive_ms = naive_ms if naive is None else _time_layers(naive, LAYERS)
            yield {
                "model": name, "block": block, "density": density, "k": k,
                "sparse_ms": ours[0], "sparse_p20": ours[1], "sparse_p80": ours[2],
                "naive_ms": naive_ms[0], "dense_ms": dense[block][0],
                "bytes": nbytes, "dense_bytes": full,
                "sparse_gbs": nbytes / (ours[0] * 1e-3) / 1e9,
                "dense_gbs": full / (dense[block][0] * 1e-3) / 1e9,
            }


def _selector_sweep(name, cfg, densities, dtype, rank: int = 128):
    """The learned selector (rank-``rank`` predictor and top-k) of the MLP and of the heads:
    the bucketed Triton selector in the "dejavu" column, the cuBLAS + ``torch.topk`` path over
    all units (one global top-k) in the "naive" column; bytes are the predictor's."""
    from dejavu_compile.kernels import predictor
    from dejavu_compile.profile import default_buckets, kept_units

    d = cfg.hidden_size
    esize = torch.finfo(dtype).bits // 8
    x = torch.randn(1, 1, d, device="cuda", dtype=dtype)
    n_mlp = getattr(cfg, "intermediate_size", None) or cfg.ffn_dim
    for block, units in (("mlp_selector", n_mlp), ("heads_selector", cfg.num_attention_heads)):
        sets = [((torch.randn(rank, d, device="cuda") * d**-0.5).to(dtype),
                 (torch.randn(units, rank, device="cuda") * rank**-0.5).to(dtype))
                for _ in range(LAYERS)]
        buckets = default_buckets(units)
        nbytes = (rank * d + units * rank) * esize
        for density in densities:
            if density >= 1.0:
                continue
            k = kept_units(density, units, buckets)
            def select(i, k=k, sets=sets, buckets=buckets):
                w1, w2 = sets[i]
                return predictor.select_predictor(x, w1, None, w2, None, "relu", k, 1, buckets)

            ours = _time_layers(select, LAYERS)
            flat = _time_layers(functools.partial(select, buckets=1), LAYERS)
            yield {
                "model": name, "block": f"{block} ({buckets} buckets)", "density": density,
                "k": k, "sparse_ms": ours[0], "sparse_p20": ours[1], "sparse_p80": ours[2],
                "naive_ms": flat[0], "dense_ms": float("nan"),
                "bytes": nbytes, "dense_bytes": nbytes,
                "sparse_gbs": nbytes / (ours[0] * 1e-3) / 1e9, "dense_gbs": float("nan"),
            }


@torch.no_grad()
def kernel_sweep(name: str, cfg, densities=DENSITIES, dtype=torch.float16,
                 blocks=SWEEP_BLOCKS):
    """Rows of the kernel table for one model shape, each as soon as it is measured (a run
    stopped by a time limit keeps them), of the parts named in ``blocks``: ``mlp``, the
    ``attention``'s query and output projections, the learned ``selectors``, and the MLP of a
    ``batch`` with union and per-row selection (at the ``BATCH_DENSITIES`` among
    ``densities``)."""
    check_blocks(blocks)
    batch = [x for x in BATCH_DENSITIES if x in densities]
    parts = {"mlp": lambda: _mlp_sweep(name, cfg, densities, dtype),
             "attention": lambda: _attention_sweep(name, cfg, densities, dtype),
             "selectors": lambda: _selector_sweep(name, cfg, densities, dtype),
             "batch": lambda: _mlp_batch_sweep(name, cfg, dtype, densities=batch)}
    sweeps = [parts[b]() for b in SWEEP_BLOCKS if b in blocks and (b != "batch" or batch)]
    for sweep in sweeps:  # generators: each allocates its weights when it starts
        yield from sweep
        gc.collect()
        torch.cuda.empty_cache()


@dataclass
class DecodeResult:
    mode: str
    ms_per_token: float
    spread: tuple[float, float]
    bytes_per_token: int
    peak_gib: float
    breakdown: list[dict] | None = None  # GPU kernel time per step, by kernel name
    # host time per step until the call returns (launch, guards, CUDA-graph replay), median:
    # near ms_per_token, the GPU waits for the host
    host_ms: float | None = None
    # ms per token over the same steps launched back to back (tokens and positions stay on the
    # GPU, one synchronisation at the end), as a generation loop that does not wait for each
    # token runs: the host's work overlaps the GPU's
    pipelined_ms: float | None = None
    # with --breakdown: ``_gpu_timeline`` of the profiled steps (a step's span from its first
    # kernel start to its last kernel end, the time in it with no kernel running and with two
    # or more at once, the streams that ran kernels)
    gpu_timeline: dict | None = None
    # with --breakdown: ``_host_breakdown`` of as many steps again, profiled on the host
    host_breakdown: list[dict] | None = None
    # with --breakdown: ``_kernel_breakdown`` and ``_window_timeline`` of as many steps again
    # launched back to back, after the pipelined loop's timed ones
    pipelined_breakdown: list[dict] | None = None
    pipelined_timeline: dict | None = None
    # the spread of each timed step (``step_spread``): one at a time (host clock, the times
    # ``ms_per_token`` is the median of) and back to back (CUDA events between the pipelined
    # loop's steps; CUDA only; its mean is ``pipelined_ms`` less the host's time before the
    # first step's launch): a gap between the two medians is every step's, one between a
    # mean and its median a few slow steps'
    step_spread: dict | None = None
    pipelined_spread: dict | None = None
    # the bytes of the model's weights read densely (``weight_bytes``), whatever the mode
    # reads: their floor is the dense byte floor, half of which is issue 4's stretch target
    dense_bytes: int | None = None


PROFILED_STEPS = 8  # decode steps --breakdown profiles, after the timed ones
E2E_PROMPT = 128  # end-to-end: prompt tokens prefilled before the timed steps (--prompt)
E2E_NEW = 128  # end-to-end: decode steps timed
BREAKDOWN_ROWS = 12  # kernels and host events a breakdown's table shows (the JSON has them all)
IDLE_ROWS = 6  # kernels a breakdown names for the idle time before them (the JSON has them all)


def _gpu_timeline(prof, steps: int) -> dict | None:
    """How a profiled decode step spends its GPU time, medians over the ``steps`` profiled
    steps: ``span_ms``, first kernel start to last kernel end; ``idle_ms``, the part of it with
    no kernel running; ``concurrent_ms``, the part with two or more kernels running at once
    (what a side stream overlaps); ``streams``, how many streams ran kernels; and
    ``idle_before``, where that idle time sits: for each kernel name that ended a stretch with
    no kernel running (the kernel whose start ended it), the stretches' time per step (us, the
    mean over the steps) and their number per step, largest first. The steps are told apart by
    the host's wait between them: the ``steps - 1`` longest gaps between kernels are the
    boundaries. None when fewer than ``steps`` kernels were recorded."""
    from torch.autograd import DeviceType

    # kernels only: copies and fills (a captured step's input copy) are left out
    kernels = [ev for ev in prof.events()
               if ev.device_type == DeviceType.CUDA
               and not ev.name.startswith(("Memcpy", "Memset"))]
    timed = sorted((ev.time_range.start, ev.time_range.end, ev.name) for ev in kernels)
    spans = [(t0, t1) for t0, t1, _ in timed]
    if len(spans) < steps:
        return None
    ends = [spans[0][1]]
    for _, end in spans[1:]:
        ends.append(max(ends[-1], end))  # the latest end so far: kernels may overlap
    gaps = sorted(range(1, len(spans)), key=lambda i: spans[i][0] - ends[i - 1])
    cuts = sorted(gaps[len(gaps) - (steps - 1):]) if steps > 1 else []
    bounds = [0, *cuts, len(spans)]
    span, idle, concurrent = [], [], []
    before: dict[str, list] = {}  # kernel name -> [idle us before it, stretches], all steps
    for a, b in itertools.pairwise(bounds):
        # sweep the step's starts (+1) and ends (-1) in time order, ends first at a tie
        marks = sorted([(t0, 1, name) for t0, _, name in timed[a:b]]
                       + [(t1, -1, name) for _, t1, name in timed[a:b]])
        running, last, alone, both = 0, marks[0][0], 0.0, 0.0
        for t, step, name in marks:
            if running == 0:
                alone += t - last
                if t > last:  # a start after a stretch with nothing running
                    mine = before.setdefault(name, [0.0, 0])
                    mine[0] += t - last
                    mine[1] += 1
            elif running >= 2:
                both += t - last
            running, last = running + step, t
        span.append(ends[b - 1] - spans[a][0])
        idle.append(alone)
        concurrent.append(both)
    streams = {getattr(ev, "device_resource_id", None) for ev in kernels}
    idle_before = [{"kernel": name[:90], "us_per_step": us / steps, "gaps_per_step": n / steps}
                   for name, (us, n) in before.items()]
    idle_before.sort(key=lambda r: -r["us_per_step"])
    return {"span_ms": statistics.median(span) / 1e3, "idle_ms": statistics.median(idle) / 1e3,
            "concurrent_ms": statistics.median(concurrent) / 1e3, "streams": len(streams),
            "idle_before": idle_before}


def _window_timeline(prof, steps: int) -> dict | None:
    """``_gpu_timeline``'s figures for ``steps`` decode steps launched back to back, per step.
    No host wait tells such steps apart, so the profiled window is taken whole and each figure
    (its span, the time with no kernel running and with two or more, each kernel's idle time
    before it and its stretches) is divided by ``steps``. None when no kernel was recorded."""
    whole = _gpu_timeline(prof, 1)
    if whole is None:
        return None
    for k in ("span_ms", "idle_ms", "concurrent_ms"):
        whole[k] /= steps
    for g in whole["idle_before"]:
        g["us_per_step"] /= steps
        g["gaps_per_step"] /= steps
    return whole


def _host_breakdown(prof, steps: int) -> list[dict]:
    """The host's time per decode step in a finished profiler run (CPU activity) over ``steps``
    steps, by event, every one (the markdown shows the first ``BREAKDOWN_ROWS``): its own time
    (``self``, not counting the events inside it; a compiled region's own time is its Python,
    guards and wrappers) and its time with the events inside it (``total``), by own time,
    largest first; a last row totals the own times. Where the time of dejavu's host goes at
    Llama-3-8B's shapes, which the Python path at small shapes does not
    explain (BENCHMARKS.md, ninth and tenth sessions)."""
    from torch.autograd import DeviceType

    rows = [{"event": ev.key[:90], "self_us_per_step": ev.self_cpu_time_total / steps,
             "total_us_per_step": ev.cpu_time_total / steps, "calls_per_step": ev.count / steps}
            for ev in prof.key_averages() if ev.device_type == DeviceType.CPU]
    rows.sort(key=lambda r: -r["self_us_per_step"])
    total = {"event": "(all events)",
             "self_us_per_step": sum(r["self_us_per_step"] for r in rows),
             "total_us_per_step": None,
             "calls_per_step": sum(r["calls_per_step"] for r in rows)}
    return rows + [total]


def _stream_path(prof) -> dict[str, dict]:
    """For each GPU event name of a finished profiler run, the time (us, summed over the run)
    that its events added to their stream's busy time, by stream: from the later of its start
    and the end of the stream's events before it, to its end. Under programmatic dependent
    launch a kernel starts while the kernel before it on its stream still runs and waits inside
    for its outputs, so its own span counts that wait (the thirty-fourth session's OPT-13B
    profile: the layer norms 259-286 us a step against 72-83 without); this counts only what
    comes after the kernel before has ended. A stream's events add up to its busy time."""
    from torch.autograd import DeviceType

    by_stream: dict = {}
    for ev in prof.events():
        if ev.device_type == DeviceType.CUDA:
            by_stream.setdefault(getattr(ev, "device_resource_id", None), []).append(ev)
    path: dict[str, dict] = {}
    for stream, events in by_stream.items():
        events.sort(key=lambda ev: (ev.time_range.start, ev.time_range.end))
        frontier = float("-inf")  # the latest end on the stream so far
        for ev in events:
            start, end = ev.time_range.start, ev.time_range.end
            mine = path.setdefault(ev.name, {})
            mine[stream] = mine.get(stream, 0.0) + max(0.0, end - max(start, frontier))
            frontier = max(frontier, end)
    return path


def _kernel_breakdown(prof, steps: int) -> list[dict]:
    """GPU time per decode step of each kernel name in a finished profiler run over ``steps``
    decode steps: ``us_per_step`` from each call's start, its wait under programmatic launch
    included; ``path_us_per_step``, what its calls added to their stream's busy time
    (``_stream_path``); and ``streams``, the streams it ran on, numbered by their busy time (1
    the busiest). These are the streams the profiler saw: a CUDA graph's replay runs its
    branches on streams the driver picks, so in a captured step the selectors' stream also
    showed the step's tail (the LM head) and some up and down calls (thirty-fifth session,
    BENCHMARKS.md). Ordered by ``path_us_per_step``, largest first (every one: the markdown shows the
    first ``BREAKDOWN_ROWS``); a last row totals every kernel, with each stream's busy time per
    step in that order (``stream_busy_us_per_step``)."""
    from torch.autograd import DeviceType

    path = _stream_path(prof)
    busy: dict = {}
    for by_stream in path.values():
        for stream, us in by_stream.items():
            busy[stream] = busy.get(stream, 0.0) + us
    order = sorted(busy, key=lambda s: -busy[s])
    rank = {s: i + 1 for i, s in enumerate(order)}
    rows = []
    for ev in prof.key_averages():
        if ev.device_type != DeviceType.CUDA:
            continue
        us = getattr(ev, "self_device_time_total", None)
        us = ev.self_cuda_time_total if us is None else us
        mine = path.get(ev.key, {})
        rows.append({"kernel": ev.key[:90], "us_per_step": us / steps,
                     "path_us_per_step": sum(mine.values()) / steps,
                     "streams": sorted(rank[s] for s in mine),
                     "calls_per_step": ev.count / steps})
    rows.sort(key=lambda r: (-r["path_us_per_step"], -r["us_per_step"]))
    total = {"kernel": "(all kernels)"}
    total.update({k: sum(r[k] for r in rows)
                  for k in ("us_per_step", "path_us_per_step", "calls_per_step")})
    total["stream_busy_us_per_step"] = [busy[s] / steps for s in order]
    return rows + [total]


def random_model(cfg, dtype=torch.float16):
    """A randomly initialised causal LM of ``cfg``'s shape on the GPU, in eval mode."""
    import transformers as tf

    cfg = cfg.__class__.from_dict(cfg.to_dict())
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = tf.AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    return model.eval()


def small_llama(layers: int, device: str = "cuda") -> torch.nn.Module:
    """A random Llama of small matrices (hidden 1024, 16 query heads over 4 KV heads, vocabulary
    512) with ``layers`` layers, fp16, in eval mode: a decode step's structure at a size that
    compiles in a minute (``tests/test_gpu.py``, ``examples/host_study.py``)."""
    import transformers as tf

    cfg = tf.LlamaConfig(vocab_size=512, hidden_size=1024, intermediate_size=4096,
                         num_hidden_layers=layers, num_attention_heads=16, num_key_value_heads=4,
                         max_position_embeddings=1024)
    torch.manual_seed(0)
    return tf.LlamaForCausalLM(cfg).to(device, torch.float16).eval()


def random_profile(model, mlp_density: float, attention_density: float, rank: int, path,
                   lookahead: bool = False, bucket_units: int = BUCKET_UNITS):
    """A profile with random predictors (speed does not depend on their values); layer 0 dense.

    Densities of 1.0 leave that block dense (no selector): the dense pipeline. With
    ``lookahead``, each predictor reads the previous layer's input."""
    from dejavu_compile.profile import (
        BlockProfile,
        LayerProfile,
        ModelIdentity,
        Profile,
        default_buckets,
        save_profile,
    )

    ident = ModelIdentity.from_config(model.config, f"random-{model.config.model_type}")
    tensors, layers = {}, []
    gen = torch.Generator().manual_seed(0)
    for i in range(ident.num_layers):
        blocks = {}
        for kind, units, density in (("mlp", ident.intermediate_size, mlp_density),
                                     ("attention", ident.num_heads, attention_density)):
            if i == 0 or density >= 1.0:
                blocks[kind] = BlockProfile()
                continue
            # the tensors of a calibrated predictor (calibrate.Predictor): both layers with biases
            tensors[f"layers.{i}.{kind}.w1"] = torch.randn(rank, ident.hidden_size, generator=gen)
            tensors[f"layers.{i}.{kind}.b1"] = torch.randn(rank, generator=gen)
            tensors[f"layers.{i}.{kind}.w2"] = torch.randn(units, rank, generator=gen)
            tensors[f"layers.{i}.{kind}.b2"] = torch.randn(units, generator=gen)
            blocks[kind] = BlockProfile(selector="predictor", density=density, units=units,
                                        rank=rank, activation="relu",
                                        input="previous" if lookahead else "same",
                                        buckets=default_buckets(units, bucket_units))
        layers.append(LayerProfile(index=i, **blocks))
    profile = Profile(model=ident, layers=tuple(layers),
                      predictor_file=f"{path.stem}.safetensors" if tensors else None)
    return save_profile(profile, path, tensors or None)


def _mark_cache_static(cache) -> None:
    """Mark the (initialised) cache tensors as static addresses, so CUDA graphs read and write
    them in place: Inductor skips CUDA graphs for a graph that mutates other inputs."""
    for layer in cache.layers:
        for value in vars(layer).values():
            if isinstance(value, torch.Tensor):
                torch._dynamo.mark_static_address(value)


def _prefilled(model, ids: torch.Tensor, length: int):
    """A static cache of ``length`` positions after an eager prefill of ``ids`` [1, P], its
    tensors marked static, and an all-ones attention mask over it."""
    from transformers import StaticCache

    cache = StaticCache(config=model.config, max_cache_len=length)
    model(input_ids=ids, past_key_values=cache,
          cache_position=torch.arange(ids.shape[1], device=ids.device), use_cache=True)
    _mark_cache_static(cache)
    # A mask over the whole static cache and explicit positions keep the decode step free of
    # data-dependent shapes (OPT otherwise sizes its mask by the cache's filled length).
    return cache, torch.ones(1, length, dtype=torch.long, device=ids.device)


def check_cpus(cpus, what: str = "cpus") -> list[int] | None:
    """``cpus`` (CPU numbers to pin the timed steps to) sorted, or None for none; each must be
    one this process may run on (an error names the others, as ``what``)."""
    if cpus is None:
        return None
    cpus = sorted(set(cpus))
    allowed = os.sched_getaffinity(0)
    outside = [c for c in cpus if c not in allowed]
    if not cpus or outside:
        raise ValueError(f"{what} {outside or cpus}: this process may run only on CPUs "
                         f"{sorted(allowed)}")
    return cpus


@contextlib.contextmanager
def pinned(cpus: list[int] | None):
    """The calling thread, the one that launches the steps, on ``cpus`` only while the block
    runs (``os.sched_setaffinity``: threads started inside it inherit that, threads started
    before keep theirs), its CPUs as before afterwards; nothing for None.
    In the twenty-ninth session the host time of one CUDA-graph replay differed up to 4.5
    times between the device's CPUs, and the decode step's host time per process moved
    between 0.12 and 0.46 ms (BENCHMARKS.md): pinning every mode's timed steps to the same
    CPUs takes the placement out of a side-by-side ratio."""
    if cpus is None:
        yield
        return
    before = os.sched_getaffinity(0)
    os.sched_setaffinity(0, cpus)
    try:
        yield
    finally:
        os.sched_setaffinity(0, before)


@torch.no_grad()
def decode_latency(model, forward, prompt: int, new: int, mode: str, bytes_per_token: int,
                   warmup: int = 2, breakdown: bool = False,
                   cpus: list[int] | None = None) -> DecodeResult:
    """Per-token latency of ``new`` decode steps after a ``prompt``-token prefill (run eagerly:
    only the decode step is compiled), with a static cache; ``forward`` is the (compiled or
    plain) forward to call for decode steps. With ``cpus``, the timed steps and the pipelined
    ones run pinned to those CPUs (``pinned``); the warm-up steps, which compile and tune, do
    not."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, model.config.vocab_size, (1, prompt), device="cuda")
    times, host, prof, host_prof = [], [], None, None
    # the profiled steps follow the timed ones: PROFILED_STEPS for the GPU's kernels, then as
    # many for the host's events (profiling the host slows it, so not in the same steps)
    extra = 2 * PROFILED_STEPS if breakdown else 0
    length = cache_positions(prompt, breakdown, new)
    for rep in range(warmup + 1):
        # the last repetition is the timed one: pinned, if asked (compiling and tuning are
        # done by then)
        with pinned(cpus if rep == warmup else None):
            cache, mask = _prefilled(model, ids, length)
            tok = ids[:, -1:]
            pos = torch.full((1,), prompt, device="cuda")
            torch.cuda.synchronize()
            steps, calls = [], []
            for i in range(new + extra if rep == warmup else 4):
                if rep == warmup and i == new and breakdown:
                    prof = profile(activities=[ProfilerActivity.CUDA])
                    prof.start()
                if rep == warmup and i == new + PROFILED_STEPS and breakdown:
                    prof.stop()
                    # CUDA too: the runtime's calls (graph and kernel launches, copies) are recorded
                    # with it
                    host_prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
                    host_prof.start()
                start = time.perf_counter()
                out = forward(input_ids=tok, past_key_values=cache, cache_position=pos,
                              position_ids=pos[None], attention_mask=mask, use_cache=True)
                launched = time.perf_counter()
                tok = out.logits[:, -1:].argmax(-1)
                # the next position made on the GPU from this one, as generate() makes it (a
                # fresh tensor: a view would recompile), behind the argmax; until the thirtieth
                # session each step began with a copy of it from the host, synchronous, 24-99
                # us on the H200's host (examples/host_study.py)
                pos = pos + 1
                torch.cuda.synchronize()
                steps.append(1e3 * (time.perf_counter() - start))
                calls.append(1e3 * (launched - start))
        times, host = steps[:new], calls[:new]
    if host_prof is not None:
        host_prof.stop()
    with pinned(cpus):
        pipelined, piped_steps, piped_prof = _pipelined(model, forward, ids, new, length,
                                                        PROFILED_STEPS if breakdown else 0)
    spread = step_spread(times)
    peak = torch.cuda.max_memory_allocated() / 2**30
    kernels = _kernel_breakdown(prof, PROFILED_STEPS) if prof is not None else None
    timeline = _gpu_timeline(prof, PROFILED_STEPS) if prof is not None else None
    host_events = _host_breakdown(host_prof, PROFILED_STEPS) if host_prof is not None else None
    piped = {}
    if piped_prof is not None:
        piped = {"pipelined_breakdown": _kernel_breakdown(piped_prof, PROFILED_STEPS),
                 "pipelined_timeline": _window_timeline(piped_prof, PROFILED_STEPS)}
    return DecodeResult(mode, spread["median"], (spread["p20"], spread["p80"]), bytes_per_token,
                        peak, kernels, statistics.median(host), pipelined, timeline, host_events,
                        **piped, step_spread=spread, pipelined_spread=step_spread(piped_steps))


def step_spread(ms: list[float] | None) -> dict | None:
    """The spread of step times ``ms``: mean, median, p20, p80, the slowest, and the steps over
    twice the median with their time beyond it in ms per step of all (what they add to the
    mean); None without at least two steps."""
    if not ms or len(ms) < 2:
        return None
    med = statistics.median(ms)
    qs = statistics.quantiles(ms, n=10)
    slow = [t for t in ms if t > 2 * med]
    return {"mean": statistics.fmean(ms), "median": med, "p20": qs[1], "p80": qs[7],
            "max": max(ms), "slow_steps": len(slow),
            "slow_excess_ms": sum(t - med for t in slow) / len(ms)}


def _step_mark(device: torch.device):
    """A function recording a timed CUDA event on the current stream and returning it, on a
    CUDA device (no synchronisation: the pipelined loop's steps stay back to back); None on
    another device."""
    if device.type != "cuda":
        return None

    def mark():
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    return mark


# untimed steps of the pipelined loop on its cache before the timed ones: a cache at new
# addresses makes Inductor's CUDA-graph trees record the step again (its tensors are static
# inputs), and one recording inside the timed steps would add tens of us to their mean
PIPELINE_WARMUP = 4


def _rewind(cache, length: int) -> None:
    """Set a static cache back to ``length`` filled positions, in place (its tensors keep their
    addresses). Transformers' ``StaticLayer`` writes each step's keys and values at its own
    count of filled positions (``cumulative_length``), not at the ``cache_position`` it is
    given: steps that start again from the prompt's end without this wrote past it, and past
    the cache's end when it had no room to spare (a device-side assert, eleventh session)."""
    for layer in cache.layers:
        count = getattr(layer, "cumulative_length", None)
        if isinstance(count, torch.Tensor):
            count.fill_(length)


def _pipelined(model, forward, ids: torch.Tensor, new: int, length: int,
               profiled: int = 0) -> tuple[float, list[float] | None, object | None]:
    """ms per token of ``new`` decode steps after a prefill of ``ids`` into a static cache of
    ``length`` positions (the timed steps' length: another would recompile), launched without
    waiting for each other: the next token and its position never leave the GPU, and the one
    synchronisation is after the last step. ``PIPELINE_WARMUP`` steps on the same cache come
    first, untimed; the timed steps then start again from the prompt's end (``_rewind``).
    Also each timed step's ms between CUDA events recorded before the first and after each
    (``_step_mark``; None off CUDA), and, with ``profiled``, the finished CUDA profiler of
    that many more steps launched back to back after the timed ones, from where they stopped
    (the cache needs room for them); else None."""
    prompt = ids.shape[1]
    cache, mask = _prefilled(model, ids, length)
    mark = _step_mark(ids.device)

    def steps(count: int, pos: torch.Tensor, tok: torch.Tensor, marks: list | None = None):
        for _ in range(count):
            out = forward(input_ids=tok, past_key_values=cache, cache_position=pos,
                          position_ids=pos[None], attention_mask=mask, use_cache=True)
            tok = out.logits[:, -1:].argmax(-1)
            pos = pos + 1  # a fresh tensor, like the timed loop's (a view would recompile)
            if marks is not None:
                marks.append(mark())
        return pos, tok

    def first():
        return torch.full((1,), prompt, device=ids.device), ids[:, -1:]

    steps(PIPELINE_WARMUP, *first())
    _rewind(cache, prompt)
    torch.cuda.synchronize()
    start = time.perf_counter()
    marks = None if mark is None else [mark()]
    pos, tok = steps(new, *first(), marks)
    torch.cuda.synchronize()
    ms = 1e3 * (time.perf_counter() - start) / new
    each = None if marks is None else [a.elapsed_time(b) for a, b in itertools.pairwise(marks)]
    if not profiled:
        return ms, each, None
    from torch.profiler import ProfilerActivity, profile

    prof = profile(activities=[ProfilerActivity.CUDA])
    prof.start()
    steps(profiled, pos, tok)
    torch.cuda.synchronize()
    prof.stop()
    return ms, each, prof


def weight_bytes(model) -> int:
    """Bytes of the weights one decoded token reads densely (the embedding row aside)."""
    seen = {}
    for name, p in model.named_parameters():
        seen[p.data_ptr()] = (name, p.numel() * p.element_size())
    emb = model.get_input_embeddings().weight
    tied = model.get_output_embeddings().weight.data_ptr() == emb.data_ptr()
    total = sum(b for _, b in seen.values())
    return total if tied else total - emb.numel() * emb.element_size()


MODES = ("hf_eager", "hf_compiled", "hf_captured", "dejavu_dense", "dejavu_sparse", "dejavu_lookahead",
         "dejavu_fold", "dejavu_fixed", "dejavu_topk", "dejavu_pdl", "dejavu_sdpa", "dejavu_gemv",
         "dejavu_store", "dejavu_reorder", "dejavu_fill", "dejavu_merge", "dejavu_split",
         "dejavu_split6", "dejavu_split_ahead", "dejavu_captured", "dejavu_captured_ahead",
         "dejavu_captured_split", "dejavu_captured_split_ahead", "dejavu_captured2",
         "dejavu_captured_ahead2", "dejavu_lazy", "dejavu_captured_lazy",
         "dejavu_captured_lazy_pdl", "dejavu_captured_lazy_mk_pdl", "dejavu_captured_qkv",
         "dejavu_captured_qkv_pdl", "dejavu_captured_qkv_orig_pdl",
         "dejavu_captured_qkv_trans_pdl", "dejavu_captured_qkv_bp_pdl",
         "dejavu_captured_qkv_sel_pdl", "dejavu_captured_qkv_heads_pdl",
         "dejavu_captured_qkv_ipdl_pdl",
         "dejavu_captured_ahead_ipdl_pdl", "dejavu_captured_qkv_noipdl_pdl",
         "dejavu_captured_qkv_early_pdl", "dejavu_captured_ahead_early_pdl",
         "dejavu_captured_qkv_norm_pdl", "dejavu_captured_qkv_normk_pdl",
         "dejavu_captured_qkv_normm_pdl", "dejavu_captured_qkv_norms_pdl",
         "dejavu_captured_qkv_nonorm_pdl", "dejavu_captured_ahead_rms_pdl",
         "dejavu_captured_ahead_normi_pdl", "dejavu_captured_ahead_gemv_pdl",
         "dejavu_captured_qkv_gemv_pdl", "dejavu_captured_ahead_nogemv_pdl",
         "dejavu_captured_qkv_nogemv_pdl", "dejavu_captured_qkv_normlate_pdl",
         "dejavu_captured_ahead_normlate_pdl", "dejavu_captured_qkv_exit_pdl",
         "dejavu_captured_ahead_exit_pdl",
         "dejavu_captured_qkv_merge_pdl", "dejavu_captured_ahead_merge_pdl",
         "dejavu_captured_qkv_selattn_pdl", "dejavu_captured_qkv_selattn_merge_pdl",
         "dejavu_captured_qkv_allattn_pdl", "dejavu_captured_qkv_chunk32_pdl",
         "dejavu_captured_qkv_lenpos_pdl", "dejavu_captured_qkv_whole_pdl")
SPARSE_MODES = MODES[4:]
# each bench shape's default decode step (the backend's default options, replayed through
# CapturedStep): OPT's with the query, key and value in the lazy K/V launch; the other shapes'
# (Llama's family) the lookahead step with Inductor's kernels launched programmatically too
DEFAULT_STEPS = {"opt-13b": "dejavu_captured_qkv_pdl", "opt-6.7b": "dejavu_captured_qkv_pdl"}
DEFAULT_STEP = "dejavu_captured_ahead_ipdl_pdl"


def default_modes(name: str) -> tuple[str, ...]:
    """The end-to-end modes run when none are named: issue 4's rows for the shape ``name`` (HF
    eager, HF static cache + ``torch.compile``, dejavu at density 1.0, and the model's default
    step at its operating point). ``MODES`` has every other mode, each run only when named."""
    return ("hf_eager", "hf_compiled", "dejavu_dense", DEFAULT_STEPS.get(name, DEFAULT_STEP))


# the options of the lookahead steps replayed through CapturedStep with lazy K/V (option
# lazy_kv), the query projection in a launch of its own or in the lazy K/V launch (fuse_qkv):
# the base of OPT-13B's modes below, which the bench reads and never changes
_CAPTURED_LAZY = {"cudagraphs": False, "lazy_kv": True, "fuse_qkv": False}
_CAPTURED_QKV = {**_CAPTURED_LAZY, "fuse_qkv": True}
# Llama-3-8B's lookahead step replayed through CapturedStep with every kernel launched
# programmatically (but the add-norm and finish kernels, ``triton_common.ADD_NORM_PDL``),
# Inductor's own too: the base of its modes below
_CAPTURED_AHEAD_IPDL = {"cudagraphs": False, "inductor_pdl": True}
# dejavu modes: (MLP density, attention density) from the operating point or dense, the
# predictors' input (lookahead or not), the predictors' bucket size and other backend options
_DEJAVU_MODES = {
    "dejavu_dense": (False, False, BUCKET_UNITS, {}),
    "dejavu_sparse": (True, False, BUCKET_UNITS, {}),  # predictors inline, on their own input
    # predictors one layer ahead, on a side stream
    "dejavu_lookahead": (True, True, BUCKET_UNITS, {}),
    # predictors one layer ahead, each attention predictor's first layer stacked with the K and
    # V projections that read the same input (issue 5's folding alternative)
    "dejavu_fold": (True, True, BUCKET_UNITS, {"fold_predictors": True}),
    "dejavu_fixed": (True, False, BUCKET_UNITS, {"selector": "fixed"}),  # no predictor at all
    "dejavu_topk": (True, False, 0, {}),  # one top-k over all units (cuBLAS + torch.topk)
    # dejavu_sparse with the kernels launched programmatically (triton_common.PDL_ENV)
    "dejavu_pdl": (True, False, BUCKET_UNITS, {}),
    # dejavu_sparse with the step's attention left to SDPA: every other mode's runs through
    # dejavu::decode_attention, the split-K Triton kernel (option decode_attention)
    "dejavu_sdpa": (True, False, BUCKET_UNITS, {"decode_attention": "never"}),
    # dejavu_sparse with the blocks' remaining dense projections (Q, K, V and the output of a
    # dense attention, layer 0's MLP) through dejavu::gemv instead of cuBLAS
    "dejavu_gemv": (True, False, BUCKET_UNITS, {"dense_gemv": True}),
    # dejavu_sparse with the row-storing up and query-projection kernels
    # (triton_common.STORE_ROWS_ENV)
    "dejavu_store": (True, False, BUCKET_UNITS, {}),
    # dejavu_sparse with Inductor's reorder_for_locality on (its default; the backend's is off)
    "dejavu_reorder": (True, False, BUCKET_UNITS, {"reorder_for_locality": True}),
    # dejavu_sparse with a zero-fill launch per sparse op instead of workspaces kept zero
    "dejavu_fill": (True, False, BUCKET_UNITS, {"workspaces": False}),
    # dejavu_sparse with the decode attention's chunks merged by its split kernel's last
    # programs instead of a combine launch of their own
    "dejavu_merge": (True, False, BUCKET_UNITS, {"merge_attention": True}),
    # dejavu_sparse with the step cut into three CUDA graphs (layers 0-1, 2-7, the rest), so
    # the GPU starts on the first while the host launches the others (option graph_splits)
    "dejavu_split": (True, False, BUCKET_UNITS, {"graph_splits": (2, 8)}),
    # the same cut into seven graphs, the first of one layer
    "dejavu_split6": (True, False, BUCKET_UNITS, {"graph_splits": (1, 2, 4, 8, 16, 24)}),
    # dejavu_lookahead cut as dejavu_split: the predictors of layers 2 and 8 fork after the cut
    "dejavu_split_ahead": (True, True, BUCKET_UNITS, {"graph_splits": (2, 8)}),
    # dejavu_sparse compiled without Inductor's CUDA graphs and replayed from one CUDA graph
    # captured around the whole compiled call (capture.CapturedStep): no guards or wrappers
    # on the host per step
    "dejavu_captured": (True, False, BUCKET_UNITS, {"cudagraphs": False}),
    # dejavu_lookahead replayed the same way (its side stream's fork and join in the capture)
    "dejavu_captured_ahead": (True, True, BUCKET_UNITS, {"cudagraphs": False}),
    # the two above with their capture cut before layers 2 and 8 (three graphs launched in
    # turn: the GPU starts on the first while the host launches the others)
    "dejavu_captured_split": (True, False, BUCKET_UNITS, {"cudagraphs": False,
                                                          "graph_splits": (2, 8)}),
    "dejavu_captured_split_ahead": (True, True, BUCKET_UNITS, {"cudagraphs": False,
                                                               "graph_splits": (2, 8)}),
    # dejavu_captured and dejavu_captured_ahead with two captures replayed in turn
    # (CapturedStep's copies): a step's graph launch need not wait for the step before's
    "dejavu_captured2": (True, False, BUCKET_UNITS, {"cudagraphs": False}),
    "dejavu_captured_ahead2": (True, True, BUCKET_UNITS, {"cudagraphs": False}),
    # dejavu_lookahead and dejavu_captured_ahead with lazy K/V: the K and V projections of the
    # selected heads only, missing positions filled in later (option lazy_kv)
    # (the query in a launch of its own: fuse_qkv off, as before it existed)
    "dejavu_lazy": (True, True, BUCKET_UNITS, {"lazy_kv": True, "fuse_qkv": False}),
    "dejavu_captured_lazy": (True, True, BUCKET_UNITS, _CAPTURED_LAZY),
    # dejavu_captured_lazy with the kernels launched programmatically, as dejavu_pdl
    "dejavu_captured_lazy_pdl": (True, True, BUCKET_UNITS, _CAPTURED_LAZY),
    # dejavu_captured_lazy with the query projection in the lazy K/V launch (fuse_qkv), and
    # that with programmatic launch
    "dejavu_captured_qkv": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    "dejavu_captured_qkv_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    # dejavu_captured_qkv_pdl with the output projections left in their original layout and
    # read along its columns (option out_layout; since the sixty-first session "auto", the
    # default, does so at head density 0.5 on CUDA, so the same step), and with them re-laid
    # out (the default step before)
    "dejavu_captured_qkv_orig_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                "out_layout": "original"}),
    "dejavu_captured_qkv_trans_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                 "out_layout": "transposed"}),
    # dejavu_captured_qkv_pdl with every lazy block's cache positions in two foreach ops
    # (option batch_positions)
    "dejavu_captured_qkv_bp_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                              "batch_positions": True}),
    # and with each lazy block reading its cache length as its position, every length moved
    # on in one foreach op at the end (option positions_from_length)
    "dejavu_captured_qkv_lenpos_pdl": (True, True, BUCKET_UNITS, {
        **_CAPTURED_QKV, "positions_from_length": True}),
    # dejavu_captured_qkv_pdl with the lazy K/V kernel's programs over the selection's slots
    # (lazy_kv.GRID_ENV set to "selection"; kernel_switches): since the forty-third session
    # the default, so the same step; and with them over every head ("heads")
    "dejavu_captured_qkv_sel_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    "dejavu_captured_qkv_heads_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    # dejavu_captured_qkv_pdl with Inductor's own kernels launched programmatically too
    # (option inductor_pdl; since it became the default, with every *_pdl mode, the two are
    # the same step, and dejavu_captured_qkv_noipdl_pdl is the one without)
    "dejavu_captured_qkv_ipdl_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                "inductor_pdl": True}),
    # dejavu_captured_ahead (Llama-3-8B's step) with every kernel launched programmatically
    # (as above), Inductor's own too
    "dejavu_captured_ahead_ipdl_pdl": (True, True, BUCKET_UNITS, _CAPTURED_AHEAD_IPDL),
    # dejavu_captured_qkv_pdl with Inductor's kernels launched plainly (option inductor_pdl
    # off; on by default wherever the dejavu kernels launch programmatically)
    "dejavu_captured_qkv_noipdl_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                  "inductor_pdl": False}),
    # dejavu_captured_qkv_pdl and dejavu_captured_ahead_ipdl_pdl (OPT-13B's and Llama-3-8B's
    # default steps) with the up kernel of each lookahead MLP and each attention's output
    # projection loading their ids and first weights before their wait
    # (triton_common.EARLY_IDS_ENV set to 1; kernel_switches)
    "dejavu_captured_qkv_early_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    "dejavu_captured_ahead_early_pdl": (True, True, BUCKET_UNITS, {"cudagraphs": False}),
    # dejavu_captured_qkv_pdl with each residual add and layer norm after a sparse MLP or
    # output projection (option fuse_norm, on by default since the thirty-seventh session)
    # done by that op's reducing kernel (triton_common.NORM_FINISH_ENV "last"), in an add-norm
    # launch of its own after the op ("kernel", the default of the thirty-seventh session),
    # the MLP's in its down kernel and the output projection's in such a launch ("mixed"),
    # and in such launches that also finish the reducing kernels' sums ("sums", the default
    # since the thirty-eighth: the same step as dejavu_captured_qkv_pdl; kernel_switches)
    "dejavu_captured_qkv_norm_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                "fuse_norm": True}),
    "dejavu_captured_qkv_normk_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                 "fuse_norm": True}),
    "dejavu_captured_qkv_normm_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                 "fuse_norm": True}),
    "dejavu_captured_qkv_norms_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                 "fuse_norm": True}),
    # dejavu_captured_qkv_pdl without option fuse_norm: Inductor's fused residual adds and
    # layer norms, the default step until the thirty-seventh session
    "dejavu_captured_qkv_nonorm_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                  "fuse_norm": False}),
    # dejavu_captured_ahead_ipdl_pdl (Llama-3-8B's step) with option fuse_rms_norm said
    # (on by default since the thirty-ninth session: the same step): each residual add and
    # RMS norm after a sparse MLP in an add-norm launch of ours that finishes the down
    # kernel's sums, in place of its finish and of Inductor's fused add and norm; and with it
    # off (normi: Inductor's add and RMS norm), the default step until then
    "dejavu_captured_ahead_rms_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_AHEAD_IPDL,
                                                                 "fuse_rms_norm": True}),
    "dejavu_captured_ahead_normi_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_AHEAD_IPDL,
                                                                   "fuse_rms_norm": False}),
    # Llama-3-8B's step with its dense attention's fused query, key and value projection and
    # its output projection through dejavu::gemv (option dense_gemv) in place of cuBLAS's
    # split-K GEMMs (in the thirty-ninth session's breakdown 15.4 us a call for the 48 MB of
    # the first, 10.9 us and a 1.9 us reduction for the 32 MB of the second: 2.5-3.1 TB/s),
    # and OPT-13B's default step with its dense first layer's projections so; dense_gemv is
    # on for CUDA by default since the fortieth session (the same steps as the default ones),
    # and the nogemv modes are those steps with it off (cuBLAS), the default steps before
    "dejavu_captured_ahead_gemv_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_AHEAD_IPDL,
                                                                  "dense_gemv": True}),
    "dejavu_captured_qkv_gemv_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                "dense_gemv": True}),
    "dejavu_captured_ahead_nogemv_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_AHEAD_IPDL,
                                                                    "dense_gemv": False}),
    "dejavu_captured_qkv_nogemv_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                  "dense_gemv": False}),
    # OPT-13B's and Llama-3-8B's default steps with the decode attention's chunks merged by
    # the split kernel's last program of each KV head (option merge_attention) instead of a
    # combine launch (thirty-eighth and thirty-ninth sessions' breakdowns: 88 and 52 us a
    # step after the kernel before); slower in the eleventh session's step, before
    # programmatic launch
    "dejavu_captured_qkv_merge_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                 "merge_attention": True}),
    "dejavu_captured_ahead_merge_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_AHEAD_IPDL,
                                                                   "merge_attention": True}),
    # OPT-13B's default step with each decode attention computing only the heads its output
    # projection selects (option decode_selected_heads) at any cache length: at head density
    # 0.5 half the KV cache is read by the split and combine kernels; in the forty-ninth
    # session's breakdown they took 219 and 78 us a step after the kernel before, against 211
    # and 86 for every head (a cache of 129-256 positions). By default the option is on from
    # a cache of config.SELECTED_HEADS_MIN_POSITIONS, so at a long --prompt this is the
    # default step; allattn is the step with it off, every head's cache read at any length
    "dejavu_captured_qkv_selattn_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_QKV,
                                                                   "decode_selected_heads": True}),
    "dejavu_captured_qkv_allattn_pdl": (True, True, BUCKET_UNITS, {
        **_CAPTURED_QKV, "decode_selected_heads": False}),
    # dejavu_captured_qkv_pdl with the decode attention's long chunks of 32 keys instead of
    # 128 (decode_attention.LONG_CHUNK_ENV "32"; kernel_switches): OPT-13B's 40 KV heads over
    # the bench's 129-256 positions in 5-8 chunks a head instead of 2
    "dejavu_captured_qkv_chunk32_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    # and with one chunk a KV head ("whole"): 40 programs over the whole cache, each storing
    # its finished rows, no combine launch
    "dejavu_captured_qkv_whole_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    # and with each selected head's chunks merged by its last program in the split kernel
    # (option merge_attention): no combine launch
    "dejavu_captured_qkv_selattn_merge_pdl": (True, True, BUCKET_UNITS, {
        **_CAPTURED_QKV, "decode_selected_heads": True, "merge_attention": True}),
    # OPT-13B's and Llama-3-8B's default steps with the add-norm and finish kernels launched
    # programmatically, each starting its successor after its last store
    # (triton_common.NORM_LAUNCH_ENV "late"; kernel_switches): plain since the forty-fifth
    # session, when with the successor started right after the wait some steps went wrong
    "dejavu_captured_qkv_normlate_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    "dejavu_captured_ahead_normlate_pdl": (True, True, BUCKET_UNITS, _CAPTURED_AHEAD_IPDL),
    # and with no kernel starting its successor before its programs exit
    # (triton_common.PDL_START_ENV "exit"), the add-norm and finish kernels launched
    # programmatically too: every kernel still launched so, none overlapping the next
    "dejavu_captured_qkv_exit_pdl": (True, True, BUCKET_UNITS, _CAPTURED_QKV),
    "dejavu_captured_ahead_exit_pdl": (True, True, BUCKET_UNITS, _CAPTURED_AHEAD_IPDL),
    # dejavu_captured_lazy_pdl with Inductor's reductions (the layer norms) compiled both as
    # loops and in one pass, the faster kept (option multi_kernel)
    "dejavu_captured_lazy_mk_pdl": (True, True, BUCKET_UNITS, {**_CAPTURED_LAZY,
                                                               "multi_kernel": True}),
}
# the captures per key of the modes that replay through CapturedStep with more than one
_CAPTURE_COPIES = {"dejavu_captured2": 2, "dejavu_captured_ahead2": 2}


@contextlib.contextmanager
def kernel_switches(mode: str):
    """The kernels' environment switches as ``mode`` needs them while the block runs:
    ``DEJAVU_PDL`` (programmatic launch, on by default where it can be) 1 for the modes named
    ``*_pdl`` and 0 for every other mode, so that each pair compares it,
    ``DEJAVU_STORE_ROWS`` (the row-storing kernels) set for ``dejavu_store`` and
    ``DEJAVU_LAZY_GRID`` (the lazy K/V kernel's grid) "selection" for
    ``dejavu_captured_qkv_sel_pdl`` and "heads" for ``dejavu_captured_qkv_heads_pdl``,
    ``DEJAVU_EARLY_IDS`` (a lookahead MLP's up kernel and an
    attention's output projection load their ids and first weights before their wait) 1 for
    the modes named ``*_early_pdl``, ``DEJAVU_NORM_FINISH`` (where a fused norm is computed)
    "last" for ``dejavu_captured_qkv_norm_pdl``, "kernel" for
    ``dejavu_captured_qkv_normk_pdl``, "mixed" for ``dejavu_captured_qkv_normm_pdl`` and
    "sums" for ``dejavu_captured_qkv_norms_pdl``, ``DEJAVU_NORM_LAUNCH`` (how the add-norm
    and finish kernels launch) "late" for the modes named ``*_normlate_pdl`` and
    ``*_exit_pdl``, ``DEJAVU_PDL_START`` (where a kernel starts its successor) "exit" for
    the modes named ``*_exit_pdl``, ``DEJAVU_ATTN_CHUNK`` (the decode attention's long
    chunk) "32" for ``dejavu_captured_qkv_chunk32_pdl`` and "whole" for
    ``dejavu_captured_qkv_whole_pdl``, each unset otherwise; restored afterwards."""
    from dejavu_compile.kernels.decode_attention import LONG_CHUNK_ENV
    from dejavu_compile.kernels.lazy_kv import GRID_ENV
    from dejavu_compile.kernels.triton_common import (
        EARLY_IDS_ENV,
        NORM_FINISH_ENV,
        NORM_LAUNCH_ENV,
        PDL_ENV,
        PDL_START_ENV,
        STORE_ROWS_ENV,
    )

    with mock.patch.dict(os.environ):  # the whole environment restored afterwards
        os.environ[PDL_ENV] = "1" if mode.endswith("_pdl") else "0"
        os.environ.pop(STORE_ROWS_ENV, None)
        os.environ.pop(GRID_ENV, None)
        os.environ.pop(EARLY_IDS_ENV, None)
        os.environ.pop(NORM_FINISH_ENV, None)
        os.environ.pop(NORM_LAUNCH_ENV, None)
        os.environ.pop(PDL_START_ENV, None)
        os.environ.pop(LONG_CHUNK_ENV, None)
        chunks = {"dejavu_captured_qkv_chunk32_pdl": "32",
                  "dejavu_captured_qkv_whole_pdl": "whole"}
        if mode in chunks:
            os.environ[LONG_CHUNK_ENV] = chunks[mode]
        if mode.endswith(("_normlate_pdl", "_exit_pdl")):
            os.environ[NORM_LAUNCH_ENV] = "late"
        if mode.endswith("_exit_pdl"):
            os.environ[PDL_START_ENV] = "exit"
        finishes = {"dejavu_captured_qkv_norm_pdl": "last",
                    "dejavu_captured_qkv_normk_pdl": "kernel",
                    "dejavu_captured_qkv_normm_pdl": "mixed",
                    "dejavu_captured_qkv_norms_pdl": "sums"}
        if mode in finishes:
            os.environ[NORM_FINISH_ENV] = finishes[mode]
        if mode.endswith("_early_pdl"):
            os.environ[EARLY_IDS_ENV] = "1"
        if mode == "dejavu_store":
            os.environ[STORE_ROWS_ENV] = "1"
        grids = {"dejavu_captured_qkv_sel_pdl": "selection",
                 "dejavu_captured_qkv_heads_pdl": "heads"}
        if mode in grids:
            os.environ[GRID_ENV] = grids[mode]
        yield


def dejavu_forward(model, mode: str, operating_point: dict, rank: int, path):
    """The decode step's forward for the dejavu ``mode`` of ``_DEJAVU_MODES`` as the bench
    measures it: random predictors of ``rank`` at ``operating_point`` (dense for a dense mode)
    in a profile written to ``path``, compiled with the mode's options, replayed through
    ``CapturedStep`` for a ``dejavu_captured*`` mode. Compiled lazily: the first call
    compiles (inside ``kernel_switches(mode)``, as the bench calls it)."""
    import dejavu_compile

    sparse, ahead, bucket_units, extra = _DEJAVU_MODES[mode]
    mlp, att = (operating_point["mlp"], operating_point["attention"]) if sparse else (1.0, 1.0)
    torch._dynamo.reset()
    profile = random_profile(model, mlp, att, rank, path, lookahead=ahead,
                             bucket_units=bucket_units)
    options = {"profile": profile, "cudagraphs": True, **extra}
    fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True, options=options)
    if mode.startswith("dejavu_captured"):
        fwd = dejavu_compile.CapturedStep(fwd, copies=_CAPTURE_COPIES.get(mode, 1))
    return fwd


@torch.no_grad()
def end_to_end(name: str, cfg, operating_point: dict, prompt: int = E2E_PROMPT,
               new: int = E2E_NEW,
               rank: int = 128, workdir=None, modes=MODES, breakdown: bool = False,
               cpus: list[int] | None = None):
    """Per-token decode latency of each mode on a random model of ``cfg``'s shape; yields one
    ``DecodeResult`` per mode as soon as it is measured: the HF modes first, then the dejavu
    modes in the order of ``modes``. ``cpus``: each mode's timed steps pinned to these CPUs
    (``decode_latency``)."""
    import tempfile
    from pathlib import Path

    import dejavu_compile

    workdir = Path(workdir or tempfile.mkdtemp())
    model = random_model(cfg)
    dejavu_compile.backend.register_model(model)
    dense_bytes = weight_bytes(model)

    def dense(res: DecodeResult) -> DecodeResult:
        res.dense_bytes = dense_bytes
        return res

    if "hf_eager" in modes:
        yield dense(decode_latency(model, model.forward, prompt, new, "hf_eager", dense_bytes,
                                   breakdown=breakdown, cpus=cpus))
    if "hf_compiled" in modes:
        torch._dynamo.reset()
        compiled = torch.compile(model.forward, mode="reduce-overhead", fullgraph=True)
        yield dense(decode_latency(model, compiled, prompt, new, "hf_compiled", dense_bytes,
                                   breakdown=breakdown, cpus=cpus))
    if "hf_captured" in modes:  # dense, replayed from one graph as dejavu_captured is
        torch._dynamo.reset()
        compiled = dejavu_compile.CapturedStep(torch.compile(model.forward, fullgraph=True))
        yield dense(decode_latency(model, compiled, prompt, new, "hf_captured", dense_bytes,
                                   breakdown=breakdown, cpus=cpus))

    # in the order asked, after the HF modes: the first dejavu compilation re-lays out the
    # model's parameters in place, which would change what an HF mode after it reads
    for mode in dict.fromkeys(m for m in modes if m in _DEJAVU_MODES):
        fwd = dejavu_forward(model, mode, operating_point, rank,
                             workdir / f"{name}-{mode}.yaml")
        # the step is compiled and its kernels captured in here
        with kernel_switches(mode):
            res = decode_latency(model, fwd, prompt, new, mode, 0, breakdown=breakdown, cpus=cpus)
        res.bytes_per_token = dejavu_compile.report(model).bytes_sparse
        yield dense(res)
    del model
    gc.collect()
    torch.cuda.empty_cache()


KV_CONTEXTS = (2048, 8192, 16384, 32768, 65536, 131072)
KV_MODEL = "llama-3-8b"
KV_ROUNDS = 3  # each mode's step measured this many times per context, in turn with the others


@functools.cache
def fixed_length_layer():
    """A timing cache layer (a transformers ``DynamicLayer``) of exactly ``L`` positions: each
    decode step writes its token into the last slot, in place, and attention reads all ``L``
    (the step of an ``L``-token context with static storage, so CUDA graphs replay it; values
    do not change the time)."""
    from transformers.cache_utils import DynamicLayer

    class FixedLengthLayer(DynamicLayer):
        # not "compileable" in transformers' sense, so its mask code may drop the all-visible
        # mask of a one-token query: SDPA then runs without a mask (flash, GQA without copies)
        is_compileable = False

        def __init__(self, keys: torch.Tensor, values: torch.Tensor):
            super().__init__()
            self.keys, self.values = keys, values
            self.is_initialized = True
            self.dtype, self.device = keys.dtype, keys.device

        def update(self, key_states, value_states, *args, **kwargs):
            self.keys[:, :, -1:].copy_(key_states)
            self.values[:, :, -1:].copy_(value_states)
            return self.keys, self.values

        def get_seq_length(self) -> int:
            return self.keys.shape[-2] - 1

        def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
            return self.keys.shape[-2], 0

    return FixedLengthLayer


def _fixed_cache(model, length: int):
    from transformers import DynamicCache

    cfg = model.config
    heads = cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    cache = DynamicCache(config=cfg)
    layers = []
    for _ in range(cfg.num_hidden_layers):
        k = torch.randn(1, heads, length, hd, device="cuda", dtype=torch.float16)
        v = torch.randn_like(k)
        for t in (k, v):
            torch._dynamo.mark_static_address(t, guard=False)
            torch._dynamo.mark_dynamic(t, 2)
        layers.append(fixed_length_layer()(k, v))
    cache.layers = layers
    return cache


@torch.no_grad()
def _step_ms(model, forward, length: int, steps: int) -> float:
    cache = _fixed_cache(model, length)
    tok = torch.randint(0, model.config.vocab_size, (1, 1), device="cuda")
    pos = torch.tensor([length - 1], device="cuda")
    times = []
    for i in range(steps + 3):
        torch.cuda.synchronize()
        start = time.perf_counter()
        forward(input_ids=tok, past_key_values=cache, cache_position=pos, position_ids=pos[None],
                use_cache=True)
        torch.cuda.synchronize()
        if i >= 3:
            times.append(1e3 * (time.perf_counter() - start))
    del cache
    torch.cuda.empty_cache()
    return statistics.median(times)


KV_ATTENTION = ("dejavu", "sdpa")


@torch.no_grad()
def kv_sweep(name: str, cfg, contexts=KV_CONTEXTS, kv_keep: float = 0.3, steps: int = 20,
             rank: int = 128, workdir=None, attention: str = KV_ATTENTION[0],
             rounds: int = KV_ROUNDS) -> dict:
    """Decode-step latency from 2K to 128K context for dense, projection sparsity (the
    operating point), KV selection (``kv_keep`` of the context) and both; every mode reads its
    cache through the same attention kernel: ``attention="dejavu"`` the split-K
    ``dejavu::decode_attention`` (``kv.use_decode_attention``), ``"sdpa"`` PyTorch's SDPA (no
    mask: its flash kernel, one program per head). The dense and projection pipelines are two
    compiled copies of one random model (the projection pipeline re-lays out its weights in
    place), so at each context the four modes are measured in turn, ``rounds`` times, and each
    keeps its median: drift of the GPU over the sweep does not land on one mode. Returns the
    times, the bytes of each mode and the fixed cost of each (see ``analyse_kv``)."""
    import tempfile
    from pathlib import Path

    import dejavu_compile

    from .plan import ModelBytes

    workdir = Path(workdir or tempfile.mkdtemp())
    point = OPERATING_POINTS[name]
    if attention not in KV_ATTENTION:
        raise ValueError(f"attention must be one of {KV_ATTENTION}, got {attention!r}")
    torch._dynamo.reset()
    shape = ModelBytes.from_config(cfg, name)  # fp16, as random_model builds it
    kv_per_token = shape.kv_bytes_per_token * shape.num_layers
    pipelines = {}
    for pipeline, (mlp, att) in (("dense", (1.0, 1.0)), ("projection", (point["mlp"],
                                                                          point["attention"]))):
        model = random_model(cfg)
        dejavu_compile.backend.register_model(model)
        if attention == "dejavu":
            from .kv import use_decode_attention

            use_decode_attention(model)
        profile = random_profile(model, mlp, att, rank, workdir / f"{name}-kv-{pipeline}.yaml")
        # SDPA stays SDPA for attention="sdpa" (the backend's pass would otherwise take it)
        keep_sdpa = {} if attention == "dejavu" else {"decode_attention": "never"}
        fwd = torch.compile(model.forward, backend="dejavu", fullgraph=True,
                            options={"profile": profile, "cudagraphs": True, **keep_sdpa})
        pipelines[pipeline] = (model, fwd)
    # (mode, pipeline, cache tokens at context n)
    modes = (("dense", "dense", lambda n: n), ("kv", "dense", lambda n: max(2, round(kv_keep * n))),
             ("projection", "projection", lambda n: n),
             ("both", "projection", lambda n: max(2, round(kv_keep * n))))
    rows, weights, out_of_memory = [], {}, set()
    for n in contexts:
        times = {}
        for _ in range(rounds):
            for mode, pipeline, length in modes:
                if (mode, n) in out_of_memory:
                    continue
                model, fwd = pipelines[pipeline]
                try:
                    times.setdefault(mode, []).append(_step_ms(model, fwd, length(n), steps))
                except torch.cuda.OutOfMemoryError:
                    torch.cuda.empty_cache()
                    out_of_memory.add((mode, n))
                    times.pop(mode, None)
                    continue
                if pipeline not in weights:
                    weights[pipeline] = dejavu_compile.report(model).bytes_sparse
        for mode, pipeline, length in modes:
            if mode in times:
                rows.append({"context": n, "mode": mode, "cache_tokens": length(n),
                             "ms": statistics.median(times[mode]), "rounds": times[mode],
                             "bytes": weights[pipeline] + kv_per_token * length(n)})
                print(json.dumps({"model": name, **rows[-1]}), flush=True)
    del pipelines, model, fwd
    gc.collect()
    torch.cuda.empty_cache()
    return {"model": name, "kv_keep": kv_keep, "operating_point": point, "rows": rows,
            "weights": weights, "kv_bytes_per_token": kv_per_token, "attention": attention}


def analyse_kv(sweep: dict, bandwidth: float) -> dict:
    """Fixed costs per mode (time minus bytes at ``bandwidth``: the median over the contexts, so
    one noisy point does not set it; the cost of a compiled step does not grow with its cache
    when attention reads at copy bandwidth), the byte crossover of projection and KV, the
    crossing the account predicts with those costs, and the measured crossing (linear
    interpolation of the time difference)."""
    rows = sweep["rows"]
    ms = {(r["mode"], r["context"]): r["ms"] for r in rows}
    contexts = sorted({r["context"] for r in rows})
    residuals = {}
    for r in rows:
        residuals.setdefault(r["mode"], []).append(r["ms"] - r["bytes"] / bandwidth * 1e3)
    costs = {mode: statistics.median(v) for mode, v in residuals.items()}
    kv, keep, w = sweep["kv_bytes_per_token"], sweep["kv_keep"], sweep["weights"]
    saved = w.get("dense", 0) - w.get("projection", 0)
    byte_cross = saved / ((1 - keep) * kv) if kv else None
    # projection(n) = (Wp + kv n)/bw + c_p ; kv(n) = (Wd + keep kv n)/bw + c_k
    predicted = None
    if {"projection", "kv"} <= set(costs):
        num = (w["projection"] - w["dense"]) / bandwidth * 1e3 + costs["projection"] - costs["kv"]
        den = -(1 - keep) * kv / bandwidth * 1e3
        predicted = num / den
    measured = None
    diffs = [(n, ms[("projection", n)] - ms[("kv", n)]) for n in contexts
             if ("projection", n) in ms and ("kv", n) in ms]
    for (n0, d0), (n1, d1) in zip(diffs, diffs[1:], strict=False):
        if d0 < 0 <= d1:
            measured = n0 + (n1 - n0) * (-d0) / (d1 - d0)
            break
    if measured is None and diffs and diffs[0][1] >= 0:
        measured = 0.0  # KV already ahead at the shortest context
    fastest = {n: min((m for m in ("dense", "projection", "kv", "both") if (m, n) in ms),
                      key=lambda m, n=n: ms[(m, n)]) for n in contexts}
    return {"costs_ms": costs, "byte_crossover": byte_cross, "predicted_crossing": predicted,
            "measured_crossing": measured, "fastest": fastest, "copy_gbs": bandwidth / 1e9}


def load_tuned(path: str) -> dict:
    """The tuned configs in ``path``: a ``dejavu bench`` JSON (its ``tuned``) or a mapping of
    kernel to entries as ``kernels.tuning.tuned()`` gives it."""
    with open(path) as f:
        data = json.load(f)
    if isinstance(data, dict) and "tuned" in data:
        return data["tuned"]
    if isinstance(data, dict) and {"gpu", "e2e"} & set(data):
        raise ValueError(f"{path} is a dejavu bench JSON without tuned configs (bench runs "
                         "record them since 34a7fe3)")
    return data


def _checked(models: list[str]) -> dict:
    """The shape configs, after checking that a CUDA GPU is here and every model is known."""
    if not torch.cuda.is_available():
        raise RuntimeError("dejavu bench needs a CUDA GPU")
    configs = shape_configs()
    unknown = [m for m in models if m not in configs]
    if unknown:
        raise ValueError(f"unknown model shape(s) {unknown}; known: {sorted(configs)}")
    return configs


def cache_positions(prompt: int, breakdown: bool, new: int = E2E_NEW) -> int:
    """Positions of the static cache an end-to-end mode decodes into (``decode_latency``): the
    prompt, the ``new`` timed steps, the profiled ones with ``breakdown``, and one to spare."""
    return prompt + new + (2 * PROFILED_STEPS if breakdown else 0) + 1


def check_prompt(prompt: int, models: list[str], configs: dict, breakdown: bool) -> None:
    """Refuse an end-to-end prompt that is not a positive whole number of tokens, or whose
    cache would pass a model's positions (OPT's learned position embeddings stop at 2048)."""
    if isinstance(prompt, bool) or not isinstance(prompt, int) or prompt < 1:
        raise ValueError(f"the end-to-end prompt must be a whole number of tokens >= 1, "
                         f"got {prompt!r}")
    need = cache_positions(prompt, breakdown)
    for name in models:
        limit = getattr(configs[name], "max_position_embeddings", None)
        if limit is not None and need > limit:
            raise ValueError(
                f"--prompt {prompt}: {name} has {limit} positions, and its decode steps need "
                f"{need} (the prompt, {E2E_NEW} timed steps"
                f"{f', {2 * PROFILED_STEPS} profiled' if breakdown else ''} and one); give "
                f"--prompt {limit - need + prompt} or less")


def kv_cache_bytes(cfg, positions: int, dtype_bytes: int = 2) -> int:
    """Bytes of a static K/V cache of ``positions`` for ``cfg``'s shape: keys and values of
    every layer and KV head (the byte account's ``kv_bytes_per_token``, every layer)."""
    from .plan import ModelBytes

    shape = ModelBytes.from_config(cfg, cfg.model_type, dtype_bytes)
    return shape.kv_bytes_per_token * shape.num_layers * positions


def check_densities(densities) -> None:
    """Refuse kernel-sweep densities that are none, or not each in (0, 1]."""
    if not densities or any(not 0.0 < x <= 1.0 for x in densities):
        raise ValueError(f"kernel sweep densities must be in (0, 1], got {list(densities)}")


def run(models: list[str], out_json: str | None = None, kernels: bool = True,
        e2e: bool = True, modes=None, kv: bool = False, breakdown: bool = False,
        kv_attention: str = KV_ATTENTION[0], tuned: str | None = None,
        densities=DENSITIES, blocks=SWEEP_BLOCKS, cpus: list[int] | None = None,
        prompt: int = E2E_PROMPT) -> dict:
    """The whole benchmark; returns (and optionally writes) a JSON-able dict. ``tuned``: a
    file of tuned configs (``load_tuned``) that the kernels run with instead of tuning those
    keys; the result's ``tuned`` holds every config used, ``tuned_from`` that file, and
    ``shipped`` the shipped file seeded (by the kernel sweep, or by the backend's option
    ``shipped_configs``) if any.
    ``densities``: the kernel sweep's, each in (0, 1]; ``blocks``: its parts (``SWEEP_BLOCKS``).
    ``cpus``: the end-to-end modes' timed steps pinned to these CPUs (``decode_latency``).
    ``prompt``: the end-to-end modes' prompt tokens (``check_prompt``). ``modes``: the
    end-to-end modes of every model; None: each model's ``default_modes``."""
    cpus = check_cpus(cpus)
    if kernels:
        check_densities(densities)
        check_blocks(blocks)
    configs = _checked(models)
    if e2e:
        check_prompt(prompt, models, configs, breakdown)
    seeded = tuning.seed(load_tuned(tuned)) if tuned else 0
    gpu = torch.cuda.get_device_name()
    if kernels:
        # the sweep runs the configs the backend would (its option shipped_configs): this GPU's
        # shipped ones for their keys, after those of ``tuned``; other keys tune
        tuning.seed_shipped(gpu)
    bw = copy_bandwidth()
    result = {"gpu": gpu, "copy_gbs": bw / 1e9, "kernels": [], "e2e": [], "complete": False}
    if cpus is not None:
        result["cpus"] = cpus
    if tuned:
        result["tuned_from"] = {"path": tuned, "keys": seeded}
    print(f"GPU {result['gpu']}: copy bandwidth {bw / 1e9:.0f} GB/s", flush=True)

    def save() -> None:
        """The JSON as measured so far, rewritten after each result: a run stopped by a time
        limit keeps what it measured (``complete`` false)."""
        result["tuned"] = tuning.tuned()
        shipped = tuning.shipped()
        if shipped:
            result["shipped"] = shipped
        if out_json:
            with open(out_json, "w") as f:
                json.dump(result, f, indent=1)

    if kv:
        sweep = kv_sweep(KV_MODEL, configs[KV_MODEL], attention=kv_attention)
        result["kv"] = {**sweep, **analyse_kv(sweep, bw)}
        save()
    for name in models:
        if kernels:
            copies = {}  # a copy of each size once
            for row in kernel_sweep(name, configs[name], densities, blocks=blocks):
                row["pct_copy"] = 100 * row["sparse_gbs"] * 1e9 / bw
                if row["bytes"] not in copies:
                    copies[row["bytes"]] = same_bytes_copy_ms(row["bytes"])
                row["copy_ms"] = copies[row["bytes"]]
                result["kernels"].append(row)
                print(json.dumps(row), flush=True)
                save()
        if e2e:
            point = OPERATING_POINTS[name]
            positions = cache_positions(prompt, breakdown)
            for res in end_to_end(name, configs[name], point, prompt=prompt,
                                  modes=modes or default_modes(name),
                                  breakdown=breakdown, cpus=cpus):
                row = {"model": name, "mode": res.mode, "ms_per_token": res.ms_per_token,
                       "p20": res.spread[0], "p80": res.spread[1],
                       "bytes_per_token": res.bytes_per_token,
                       "floor_ms": res.bytes_per_token / bw * 1e3, "peak_gib": res.peak_gib,
                       "dense_floor_ms": (None if res.dense_bytes is None
                                          else res.dense_bytes / bw * 1e3),
                       "host_ms": res.host_ms, "pipelined_ms": res.pipelined_ms,
                       "step_spread": res.step_spread, "pipelined_spread": res.pipelined_spread,
                       "operating_point": point, "prompt": prompt,
                       "cache_positions": positions,
                       "kv_cache_bytes": kv_cache_bytes(configs[name], positions)}
                if res.breakdown is not None:
                    row["breakdown"] = res.breakdown
                    if res.gpu_timeline is not None:
                        row.update({f"gpu_{k}": v for k, v in res.gpu_timeline.items()})
                if res.host_breakdown is not None:
                    row["host_breakdown"] = res.host_breakdown
                if res.pipelined_breakdown is not None:
                    row["pipelined_breakdown"] = res.pipelined_breakdown
                    row["pipelined_timeline"] = res.pipelined_timeline
                row["tuned"] = tuning.tuned()  # the configs so far: the modes share them
                result["e2e"].append(row)
                print(json.dumps(row), flush=True)
                save()
    result["complete"] = True
    save()
    return result


def merge_tuned(into: dict, more: dict) -> dict:
    """``into`` with ``more``'s entries added (``kernels.tuning.tuned()``'s form): a key
    already in ``into`` keeps its config."""
    for kernel, entries in more.items():
        have = into.setdefault(kernel, [])
        keys = [e["key"] for e in have]
        have += [e for e in entries if e["key"] not in keys]
    return into


def child_command(model: str, mode: str, out_json: str, breakdown: bool,
                  tuned: str | None, cpus: list[int] | None = None,
                  prompt: int = E2E_PROMPT) -> list[str]:
    """The ``dejavu bench`` command line that measures one end-to-end mode in a process of its
    own (``isolated``)."""
    cmd = [sys.executable, "-m", "dejavu_compile.cli", "bench", "--models", model,
           "--no-kernels", "--modes", mode, "--json", out_json]
    cmd += ["--breakdown"] if breakdown else []
    cmd += ["--tuned", tuned] if tuned else []
    cmd += ["--prompt", str(prompt)]
    return cmd + (["--cpus", *map(str, cpus)] if cpus is not None else [])


def _run_child(cmd: list[str], timeout: float | None) -> tuple[int, str]:
    """Run a child bench; its return code and the tail of what it wrote."""
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired as e:
        tail = e.stderr if isinstance(e.stderr, str) else (e.stderr or b"").decode(errors="replace")
        return -1, f"timed out after {timeout} s\n{tail[-2000:]}"
    return out.returncode, (out.stdout + out.stderr)[-2000:]


def parse_variants(specs: list[str] | None) -> dict[str, str]:
    """``--variants``' ``LABEL=FILE`` items as {label: file}, in the order given; a malformed
    item, an empty or repeated label, or a file ``load_tuned`` cannot read is an error naming
    it."""
    variants: dict[str, str] = {}
    for spec in specs or []:
        label, sep, path = spec.partition("=")
        if not sep or not label or not path:
            raise ValueError(f"--variants: {spec!r} is not LABEL=FILE")
        if label in variants:
            raise ValueError(f"--variants: label {label!r} is given twice")
        load_tuned(path)  # read now: a bad file fails the run before any process starts
        variants[label] = path
    return variants


def _variant_runs(modes: list[str], variants: dict[str, str]) -> list[tuple[str, str | None]]:
    """(mode, variant label or None) for every process of a round: each mode as it is, then
    each dejavu mode once more per variant."""
    return [(m, None) for m in modes] + [(m, label) for label in variants for m in modes
                                         if m.startswith("dejavu")]


def isolated(models: list[str], modes, rounds: int, out_json: str | None = None,
             breakdown: bool = False, tuned: str | None = None, timeout: float | None = None,
             runner=_run_child, cpus: list[int] | None = None,
             prompt: int = E2E_PROMPT, variants: dict[str, str] | None = None) -> dict:
    """End-to-end decode latency with every mode in a process of its own, ``rounds`` times,
    the modes' order reversed every other round: a mode's time then owes nothing to the modes
    measured before it in the same process, and a drift of the machine over the run falls on
    every mode alike. Each row gains its ``round``; ``markdown`` takes each ratio against the
    same round's ``hf_compiled`` and adds the medians over the rounds.

    The first process to tune a kernel's key records its config; every later process runs
    with all configs recorded so far (and those of ``tuned``, which come first), so every
    round runs the same tiles. A process that fails or passes ``timeout`` seconds is listed
    under ``failed`` with the tail of its output; the run goes on. ``cpus``: every process's
    timed steps pinned to these CPUs (``decode_latency``); ``prompt``: its prompt tokens.
    ``variants``: {label: tuned-configs file}; each dejavu mode is also measured once per
    label in each round, in the same alternating order, its process running that file's
    configs first (a kernel tile against the run's own, side by side); its rows carry the
    label (``variant``), and the configs of its file's keys are never passed to the other
    processes. ``modes`` None: each model's ``default_modes``."""
    check_prompt(prompt, models, _checked(models), breakdown)
    cpus = check_cpus(cpus)
    if rounds < 1:
        raise ValueError(f"rounds must be at least 1, got {rounds}")
    configs = load_tuned(tuned) if tuned else {}
    result = {"gpu": None, "copy_gbs": None, "kernels": [], "e2e": [], "failed": [],
              "rounds": rounds, "complete": False}
    if cpus is not None:
        result["cpus"] = cpus
    if tuned:
        result["tuned_from"] = {"path": tuned, "keys": sum(len(v) for v in configs.values())}
    variants = variants or {}
    own = {label: load_tuned(path) for label, path in variants.items()}
    if variants:
        result["variants"] = {label: {"path": path, "keys": sum(map(len, own[label].values()))}
                              for label, path in variants.items()}

    def save() -> None:
        result["tuned"] = configs
        if out_json:
            with open(out_json, "w") as f:
                json.dump(result, f, indent=1)

    runs = {name: _variant_runs(list(dict.fromkeys(modes or default_modes(name))), variants)
            for name in models}
    with tempfile.TemporaryDirectory(prefix="dejavu-bench-") as workdir:
        for r, name in itertools.product(range(rounds), models):
            for mode, label in (runs[name] if r % 2 == 0 else runs[name][::-1]):
                tag = mode if label is None else f"{mode}-v{list(variants).index(label)}"
                child_json = os.path.join(workdir, f"{name}-{tag}-{r}.json")
                # the variant's configs first, then those recorded so far
                known = merge_tuned({k: list(v) for k, v in own[label].items()} if label else {},
                                    configs)
                seeds = os.path.join(workdir, "tuned.json") if known else None
                if seeds:
                    with open(seeds, "w") as f:
                        json.dump(known, f)
                code, tail = runner(child_command(name, mode, child_json, breakdown, seeds,
                                                  cpus, prompt), timeout)
                child = None
                if os.path.exists(child_json):
                    with open(child_json) as f:
                        child = json.load(f)
                rows = child["e2e"] if child else []
                if code != 0 or not rows:
                    result["failed"].append({"model": name, "mode": mode, "round": r,
                                             "returncode": code, "output": tail,
                                             **({"variant": label} if label else {})})
                if child:
                    result["gpu"], result["copy_gbs"] = child["gpu"], child["copy_gbs"]
                    recorded = child.get("tuned") or {}
                    if label:  # the variant's own keys stay its own
                        recorded = {k: [e for e in v if e["key"] not in
                                        [x["key"] for x in own[label].get(k, [])]]
                                    for k, v in recorded.items()}
                    merge_tuned(configs, recorded)
                    if child.get("shipped"):
                        result.setdefault("shipped", child["shipped"])
                for row in rows:
                    row["round"] = r
                    if label:
                        row["variant"] = label
                    row.pop("tuned", None)  # the run's configs are kept once, in "tuned"
                    result["e2e"].append(row)
                    print(json.dumps({k: v for k, v in row.items()
                                      if k not in ("breakdown", "host_breakdown",
                                                   "pipelined_breakdown")}), flush=True)
                save()
    result["complete"] = not result["failed"]
    save()
    return result


# Issue 4's operating points: the paper's for OPT (MLP 0.1, heads 0.5, first layer dense) and
# MLP 0.5 with dense attention for Llama-3-8B.
OPERATING_POINTS = {
    "opt-13b": {"mlp": 0.1, "attention": 0.5},
    "opt-6.7b": {"mlp": 0.1, "attention": 0.5},
    "llama-3-8b": {"mlp": 0.5, "attention": 1.0},
}


def _ms(value: float | None) -> str:
    return "" if value is None else f"{value:.2f}"


def markdown(result: dict, command: str, commit: str, date: str) -> str:
    """A BENCHMARKS.md section for ``result``."""
    bw = "" if result["copy_gbs"] is None else \
        f", measured copy bandwidth {result['copy_gbs']:.0f} GB/s (read + write)"
    lines = [f"## {date}: `{command}`", "", f"GPU {result['gpu']}, commit `{commit}`{bw}.", ""]
    if result.get("rounds"):
        lines += [f"Every mode measured in a process of its own, {result['rounds']} round(s), "
                  "the modes' order reversed every other round; each ratio is against the same "
                  "round's hf_compiled.", ""]
    if result.get("cpus"):
        lines += [f"Timed steps pinned to CPU(s) {', '.join(map(str, result['cpus']))} "
                  "(`--cpus`; warm-up, compiling and tuning unpinned).", ""]
    if result.get("complete") is False:
        lines += ["Partial: the run stopped before its end; these are the results it wrote.", ""]
    for label, src in (result.get("variants") or {}).items():
        lines += [f"Variant `{label}`: each dejavu mode measured again with {src['keys']} "
                  f"tuning keys from `{src['path']}` first (rows marked [{label}]).", ""]
    for f in result.get("failed", []):
        lines += [f"Failed: {f['model']} {_variant_mode(f)} in round {f['round']} (return code "
                  f"{f['returncode']}): `{(f['output'].strip().splitlines() or [''])[-1]}`",
                  ""]
    if result.get("tuned_from"):
        src = result["tuned_from"]
        lines += [f"Kernel configs: {src['keys']} tuning keys taken from `{src['path']}` instead "
                  "of tuned in this run.", ""]
    for gpu, src in (result.get("shipped") or {}).items():
        lines += [f"Shipped kernel configs for the {gpu}: {src['keys']} tuning keys from "
                  f"`kernels/tuned/{os.path.basename(src['path'])}` "
                  "(option shipped_configs) instead of tuned in this run.", ""]
    if result["kernels"]:
        lines += ["### Kernels (fp16, batch 1; ms per call, median of CUDA-graph replays over "
                  f"{LAYERS} weight sets)", "",
                  "| model | block | density | k | dejavu ms (p20-p80) | GB/s | % of copy | "
                  "copy of the same bytes | cuBLAS dense ms | naive gather ms |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        for r in result["kernels"]:
            copy = f"{r['copy_ms'] * 1e3:.1f} us" if "copy_ms" in r else ""
            lines.append(
                f"| {r['model']} | {r['block']} | {r['density']} | {r['k']} | "
                f"{r['sparse_ms'] * 1e3:.1f} us ({r['sparse_p20'] * 1e3:.1f}-"
                f"{r['sparse_p80'] * 1e3:.1f}) | {r['sparse_gbs']:.0f} | {r['pct_copy']:.0f}% | "
                f"{copy} | {r['dense_ms'] * 1e3:.1f} us | {r['naive_ms'] * 1e3:.1f} us |")
        lines.append("")
    if result["e2e"]:
        prompts = sorted({r.get("prompt", E2E_PROMPT) for r in result["e2e"]})
        lines += [f"### End to end (fp16, batch 1, {', '.join(map(str, prompts))}-token prompt, "
                  f"{E2E_NEW} new tokens, static cache)",
                  "", "| model | mode | operating point | ms/token (p20-p80) | host ms | "
                  "pipelined ms/token | bytes/token | byte floor ms | peak GiB | "
                  "ms/token over HF compiled | ms/token over the dense byte floor (ms) |",
                  "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
        # each mode's per-step time over its model's hf_compiled in the same run (issue 4's
        # ratios are against that step)
        # (the same round's, with isolated processes: ``isolated``)
        hf = {(r["model"], r.get("round")): r["ms_per_token"] for r in result["e2e"]
              if r["mode"] == "hf_compiled"}
        for r in result["e2e"]:
            at = (r["model"], r.get("round"))
            ratio = f"{r['ms_per_token'] / hf[at]:.3f}x" if at in hf else ""
            point = (f"MLP {r['operating_point']['mlp']}, attention "
                     f"{r['operating_point']['attention']}"
                     if r["mode"] in SPARSE_MODES else "")
            lines.append(
                f"| {r['model']} | {_mode_label(r)} | {point} | {r['ms_per_token']:.2f} "
                f"({r['p20']:.2f}-{r['p80']:.2f}) | {_ms(r.get('host_ms'))} | "
                f"{_ms(r.get('pipelined_ms'))} | {r['bytes_per_token'] / 1e9:.2f} GB | "
                f"{r['floor_ms']:.2f} | {r['peak_gib']:.1f} | {ratio} | "
                f"{_over_dense_floor(r)} |")
        lines += ["", "host ms: median time until a step's call returned, before waiting for the "
                  "GPU (guards, launches, CUDA-graph replay); near ms/token, the host sets the "
                  "pace. pipelined: the same steps launched back to back, the next token and "
                  "its position kept on the GPU and one synchronisation at the end, so the "
                  "host's work overlaps the GPU's.", ""]
        caches = {(r["model"], r["cache_positions"]): r["kv_cache_bytes"] for r in result["e2e"]
                  if "kv_cache_bytes" in r}
        if caches:
            held = "; ".join(f"{m}, {n} positions: {b / 1e9:.2f} GB"
                             for (m, n), b in sorted(caches.items()))
            lines += ["bytes/token and the byte floor count weights only. The static K/V cache "
                      f"(every layer and KV head) holds {held}; each step's attention reads all of "
                      "it (with option decode_selected_heads, the selected heads' part).", ""]
        lines += _spread_markdown(result["e2e"])
        lines += _rounds_markdown(result["e2e"], hf)
        for r in result["e2e"]:
            if r.get("breakdown"):
                lines += _breakdown_markdown(r)
    if result.get("kv"):
        lines += _kv_markdown(result["kv"])
    return "\n".join(lines)


def _spread_markdown(rows: list[dict]) -> list[str]:
    """Each row's step times one at a time and back to back (``step_spread``), mean beside
    median: ms/token is a median of steps one at a time, pipelined ms/token a mean of steps
    back to back; rows without either spread are left out."""
    def cell(spread: dict | None) -> str:
        if not spread:
            return " | "
        slow = (f"{spread['slow_steps']} ({spread['slow_excess_ms']:.2f} ms a step)"
                if spread["slow_steps"] else "0")
        return (f"{spread['mean']:.2f} / {spread['median']:.2f} / {spread['max']:.2f} | "
                f"{slow}")

    shown = [r for r in rows if r.get("step_spread") or r.get("pipelined_spread")]
    if not shown:
        return []
    lines = ["Step times, ms (mean / median / slowest), and the steps over twice the median "
             "with what they add to the mean: one at a time (the host's clock) and back to "
             "back (CUDA events between the pipelined loop's steps).", "",
             "| model | mode | one at a time | over twice the median | back to back | "
             "over twice the median |", "| --- | --- | --- | --- | --- | --- |"]
    for r in shown:
        lines.append(f"| {r['model']} | {_mode_label(r)} | {cell(r.get('step_spread'))} | "
                     f"{cell(r.get('pipelined_spread'))} |")
    return lines + [""]


def _mode_label(row: dict) -> str:
    """A result row's mode, with its variant's label and its round when an isolated run
    measured it."""
    mode = _variant_mode(row)
    return mode if row.get("round") is None else f"{mode} (round {row['round']})"


def _variant_mode(row: dict) -> str:
    """A row's mode, with the label of the ``--variants`` file it ran with."""
    return row["mode"] + (f" [{row['variant']}]" if row.get("variant") else "")


def _over_dense_floor(row: dict) -> str:
    """A row's ms/token over its model's dense byte floor, and that floor: issue 4's stretch
    target is under half of it (0.500x). Blank for a row measured before the sixtieth
    session, which has no ``dense_floor_ms``."""
    floor = row.get("dense_floor_ms")
    return "" if floor is None else f"{row['ms_per_token'] / floor:.3f}x ({floor:.2f})"


def _rounds_markdown(rows: list[dict], hf: dict) -> list[str]:
    """Per model and mode, the median over the rounds of ms/token and of the ratios to the same
    round's ``hf_compiled`` and to the dense byte floor (rows of ``isolated``; nothing for rows
    without rounds)."""
    rounds = [r for r in rows if r.get("round") is not None]
    if not rounds:
        return []
    lines = ["Medians over the rounds:", "",
             "| model | mode | rounds | ms/token, each round | median ms/token | "
             "median over HF compiled | median over the dense byte floor |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for (model, mode), group in itertools.groupby(
            sorted(rounds, key=lambda r: (r["model"], _variant_mode(r), r["round"])),
            key=lambda r: (r["model"], _variant_mode(r))):
        group = list(group)
        ratios = [r["ms_per_token"] / hf[(model, r["round"])] for r in group
                  if (model, r["round"]) in hf]
        each = ", ".join(f"{r['ms_per_token']:.2f}" for r in group)
        ratio = f"{statistics.median(ratios):.3f}x" if ratios else ""
        floors = [r["ms_per_token"] / r["dense_floor_ms"] for r in group
                  if r.get("dense_floor_ms")]
        floor = f"{statistics.median(floors):.3f}x" if floors else ""
        lines.append(f"| {model} | {mode} | {len(group)} | {each} | "
                     f"{statistics.median(r['ms_per_token'] for r in group):.2f} | {ratio} | "
                     f"{floor} |")
    return lines + [""]


def _shown(rows: list[dict]) -> list[dict]:
    """A breakdown's first ``BREAKDOWN_ROWS`` rows and its total (the last row)."""
    return rows[:-1][:BREAKDOWN_ROWS] + rows[-1:]


def _breakdown_markdown(r: dict) -> list[str]:
    span = r.get("gpu_span_ms")
    idle = ""
    if span is not None:
        idle = (f"; first kernel start to last kernel end {span:.2f} ms a step, of which "
                f"{r['gpu_idle_ms']:.2f} ms with no kernel running and "
                f"{r['gpu_concurrent_ms']:.2f} ms with two or more at once; kernels on "
                f"{r['gpu_streams']} stream{'s' if r['gpu_streams'] != 1 else ''}")
    mode = _mode_label(r)
    lines = [f"GPU kernel time per decode step, {r['model']} {mode} (torch.profiler over 8 "
             f"steps; wall time {r['ms_per_token']:.2f} ms{idle}):", "",
             "| kernel | us per step | us per step after its stream's kernel before | "
             "stream | calls per step |", "| --- | --- | --- | --- | --- |"]
    for k in _shown(r["breakdown"]):
        name = k["kernel"].replace("|", "/")
        # a JSON written before the thirty-fourth session has no path column, and before the
        # thirty-fifth no stream column
        after = k.get("path_us_per_step")
        streams = ", ".join(str(s) for s in k.get("streams", []))
        lines.append(f"| `{name}` | {k['us_per_step']:.1f} | "
                     f"{'' if after is None else f'{after:.1f}'} | {streams} | "
                     f"{k['calls_per_step']:.0f} |")
    lines += ["", "us per step: from each call's start, which under programmatic launch "
              "includes its wait for the kernel before; after its stream's kernel before: "
              "only the time from that kernel's end (or the call's start, if later) to the "
              "call's end, so that each stream's rows add up to its busy time. stream: the "
              "streams a kernel ran on, 1 the busiest (in a CUDA graph's replay, the streams the "
              "driver ran the graph's branches on)."]
    lines += _busy_idle_markdown(r["breakdown"], r.get("gpu_idle_before"))
    lines.append("")
    if r.get("pipelined_breakdown"):
        lines += _pipelined_markdown(r)
    if r.get("host_breakdown"):
        lines += [f"Host time per decode step, {r['model']} {mode} (torch.profiler with CPU "
                  f"activity, over {PROFILED_STEPS} more steps; the profiler slows the host):",
                  "", "| event | own us per step | us per step with the events inside | "
                  "calls per step |", "| --- | --- | --- | --- |"]
        for e in _shown(r["host_breakdown"]):
            name = e["event"].replace("|", "/")
            total = e["total_us_per_step"]
            lines.append(f"| `{name}` | {e['self_us_per_step']:.1f} | "
                         f"{'' if total is None else f'{total:.1f}'} | "
                         f"{e['calls_per_step']:.0f} |")
        lines.append("")
    return lines


def _busy_idle_markdown(breakdown: list[dict], before: list[dict] | None) -> list[str]:
    """A breakdown's busy time per stream and where its idle time sits, as lines."""
    lines = []
    busy = breakdown[-1].get("stream_busy_us_per_step")
    if busy:
        lines += ["", "Busy time per step of each stream, 1 the busiest: "
                  + ", ".join(f"{i + 1}: {us / 1e3:.2f} ms" for i, us in enumerate(busy)) + "."]
    if before:  # (a JSON written before the seventy-fifth session: none)
        lines += ["", "Time a step with no kernel running, by the kernel whose start ended it "
                  f"(the {IDLE_ROWS} largest; us a step, stretches a step): "
                  + "; ".join(f"`{g['kernel'].replace('|', '/')}` {g['us_per_step']:.1f} "
                              f"({g['gaps_per_step']:.1f})" for g in before[:IDLE_ROWS]) + "."]
    return lines


def _pipelined_markdown(r: dict) -> list[str]:
    """The breakdown of the steps launched back to back beside that of the steps one at a
    time: which kernels take longer when no host wait separates the steps."""
    piped, timeline = r["pipelined_breakdown"], r.get("pipelined_timeline") or {}
    alone = {k["kernel"]: k.get("path_us_per_step") for k in r["breakdown"]}
    window = ""
    if timeline:
        window = (f"; first kernel start to last kernel end {timeline['span_ms']:.2f} ms a "
                  f"step, of which {timeline['idle_ms']:.2f} ms with no kernel running and "
                  f"{timeline['concurrent_ms']:.2f} ms with two or more at once")
    pipelined = r.get("pipelined_ms")
    lines = [f"GPU kernel time per step launched back to back, {r['model']} {_mode_label(r)} "
             f"(torch.profiler over {PROFILED_STEPS} steps after the pipelined loop's timed "
             f"ones, the window taken whole"
             + ("" if pipelined is None else f"; pipelined {pipelined:.2f} ms a token")
             + f"{window}):", "",
             "| kernel | us per step after its stream's kernel before, back to back | the same, "
             "one step at a time | back to back less one at a time | calls per step |",
             "| --- | --- | --- | --- | --- |"]
    for k in _shown(piped):
        mine, other = k["path_us_per_step"], alone.get(k["kernel"])
        diff = "" if other is None else f"{mine - other:+.1f}"
        lines.append(f"| `{k['kernel'].replace('|', '/')}` | {mine:.1f} | "
                     f"{'' if other is None else f'{other:.1f}'} | {diff} | "
                     f"{k['calls_per_step']:.0f} |")
    lines += _busy_idle_markdown(piped, timeline.get("idle_before"))
    return lines + [""]


_KV_KERNEL = {"dejavu": "split-K `dejavu::decode_attention` kernel", "sdpa": "SDPA call"}


def _kv_markdown(kv: dict) -> list[str]:
    point = kv["operating_point"]
    lines = [f"### Projection vs KV sparsity ({kv['model']}, fp16, batch 1; projection: MLP "
             f"{point['mlp']}, attention {point['attention']}; KV keep {kv['kv_keep']}; every "
             f"mode reads its cache through the same {_KV_KERNEL[kv.get('attention', 'sdpa')]})",
             "",
             "| context | dense ms | projection ms | KV ms | both ms | fastest |",
             "| --- | --- | --- | --- | --- | --- |"]
    ms = {(r["mode"], r["context"]): r["ms"] for r in kv["rows"]}
    for n in sorted({r["context"] for r in kv["rows"]}):
        cells = [f"{ms[(m, n)]:.2f}" if (m, n) in ms else "-"
                 for m in ("dense", "projection", "kv", "both")]
        lines.append(f"| {n} | " + " | ".join(cells) + f" | {kv['fastest'][n]} |")

    def tokens(v):
        return "none" if v is None else f"{v:,.0f}"

    costs = ", ".join(f"{m} {c:.2f} ms" for m, c in kv["costs_ms"].items())
    lines += ["", f"Fixed costs (time minus bytes at copy bandwidth, median over the contexts): "
              f"{costs}. Byte crossover {tokens(kv['byte_crossover'])} tokens; predicted with "
              f"costs {tokens(kv['predicted_crossing'])}; measured "
              f"{tokens(kv['measured_crossing'])}.", ""]
    return lines
