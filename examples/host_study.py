"""Host time of a decode step, HF compiled against the dejavu backend, on a GPU: a model with
small matrices and the full model's layer count (``--shape llama``: hidden 1024, 32 layers as
Llama-3-8B; ``--shape opt``: hidden 1024, 40 layers as OPT-13B), so the host's work per step,
and the kernels a step launches, are those of the full size while compiling takes a minute.

For each mode of ``--modes`` (``hf_compiled``, or any dejavu mode of ``dejavu bench``, at the
bench's operating point of the shape's full-size model) it prints, per step, the medians of
the time until the step's call returns (before waiting for the GPU: the bench's host column)
and of the whole step (the call, the next token's argmax, the next position made on the GPU
and the wait for the GPU), then a cProfile of 50 steps by own time and by cumulative time. For
a ``dejavu_captured*`` mode every other timed step is done in ``CapturedStep``'s three parts,
each timed: its key, the copy of the arguments into the capture's and the graph's replay.
(The positions: the bench copied each from the host, a synchronous copy of 24-99 us, until
the thirtieth session, when this study measured it.)

With ``--cpus``, each mode is timed again pinned to each listed CPU in turn
(``bench.pinned``): in the twenty-ninth session the replay of a plain 820-kernel graph
took 6-27 us on the host depending on the device's CPU it ran on, and the OPT-13B step's host
time moved between 0.12 and 0.46 ms from one process to the next (BENCHMARKS.md).

Run on a CUDA machine: ``TRITON_INTERPRET=0 DEJAVU_QUICK_TUNE=1 python examples/host_study.py
--shape opt --modes hf_compiled dejavu_captured_qkv_pdl --cpus 0 4 5`` (one kernel config
each: the host's work does not depend on the tiles).
"""

from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dejavu_compile import CapturedStep, bench

PROMPT = 32
STEPS = 150  # the first TIMED_FROM warm up (compilation, re-layout, recording, capture)
TIMED_FROM = 20
PROFILED_FROM = 100
PINNED_STEPS = 60  # steps timed per pinned CPU, the first 10 untimed
# the full-size model whose layer count and operating point each shape takes
SHAPES = {"llama": "llama-3-8b", "opt": "opt-13b"}


def small_model(shape: str) -> torch.nn.Module:
    """A random model of ``shape`` with small matrices and the full-size model's layer count,
    fp16, on the GPU, in eval mode."""
    if shape == "llama":
        return bench.small_llama(32)
    import transformers as tf

    cfg = tf.OPTConfig(vocab_size=512, hidden_size=1024, ffn_dim=4096, num_hidden_layers=40,
                       num_attention_heads=16, max_position_embeddings=1024,
                       word_embed_proj_dim=1024)
    torch.manual_seed(0)
    return tf.OPTForCausalLM(cfg).to("cuda", torch.float16).eval()


def check_args(modes: list[str], cpus: list[int]) -> None:
    """Every mode one this study can run, every CPU one this process may run on."""
    known = {"hf_compiled", *bench._DEJAVU_MODES}
    unknown = [m for m in modes if m not in known]
    if unknown:
        raise SystemExit(f"unknown mode(s) {unknown}: hf_compiled or a dejavu mode of "
                         f"`dejavu bench` ({', '.join(sorted(bench._DEJAVU_MODES))})")
    try:
        bench.check_cpus(cpus or None, "--cpus")
    except ValueError as e:
        raise SystemExit(str(e)) from None


def build(mode: str, net: torch.nn.Module, point: dict, workdir: Path):
    """The step's forward for ``mode``, as ``dejavu bench`` builds it."""
    if mode == "hf_compiled":
        torch._dynamo.reset()
        return torch.compile(net.forward, mode="reduce-overhead", fullgraph=True)
    return bench.dejavu_forward(net, mode, point, 64, workdir / f"{mode}.yaml")


@torch.no_grad()
def steps(net, forward, ids: torch.Tensor, count: int, timed_from: int,
          profiled_from: int | None = None) -> tuple[dict[str, float], cProfile.Profile]:
    """``count`` decode steps on a fresh cache after a prefill of ``ids``, each position made
    on the GPU from the last as the bench makes it; the medians (ms) over steps ``timed_from``
    up to ``profiled_from`` of the call and the whole step, and, for a ``CapturedStep`` that
    replays, of its three parts (``parts``), and a cProfile of the steps from
    ``profiled_from`` on."""
    cache, mask = bench._prefilled(net, ids, ids.shape[1] + count + 1)
    tok = ids[:, -1:]
    pos = torch.full((1,), ids.shape[1], device=ids.device)
    times = {"call": [], "step": []}
    prof = cProfile.Profile()
    for i in range(count):
        profiled = profiled_from is not None and i >= profiled_from
        timed = timed_from <= i and not profiled
        sync(ids)
        if profiled:
            prof.enable()
        start = time.perf_counter()
        kwargs = dict(input_ids=tok, past_key_values=cache, cache_position=pos,
                      position_ids=pos[None], attention_mask=mask, use_cache=True)
        split = parts(forward, kwargs) if timed and i % 2 else None
        out = split.pop("out") if split else forward(**kwargs)
        returned = time.perf_counter()
        if profiled:
            prof.disable()
        tok = out.logits[:, -1:].argmax(-1)
        pos = pos + 1
        sync(ids)
        if timed and split:  # every other timed step, timed in parts
            for name, ms in split.items():
                times.setdefault(name, []).append(ms)
        elif timed:
            times["call"].append(1e3 * (returned - start))
            times["step"].append(1e3 * (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in times.items() if v}, prof


def parts(forward, kwargs: dict) -> dict | None:
    """A ``CapturedStep``'s call done here in its four parts, each timed (ms): its ``key``,
    the copy of the tensor arguments into the capture's, the graphs' replay and the hand-out
    of the output with the call's cache in it (``out``: the call's output). None for any other
    forward, or a call that would not replay (it runs as it is)."""
    if not isinstance(forward, CapturedStep):
        return None
    if forward._gone:  # the call's own first step: captures of freed caches go
        forward._purge()
    start = time.perf_counter()
    key = forward.key(kwargs)
    keyed = time.perf_counter()
    entry = forward._graphs.get(key)  # the call's own lookup (CapturedStep.__call__)
    if entry is None:
        return None
    tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
    graphs, out, slots = forward._load(entry, tensors)  # the call's input copy
    copied = time.perf_counter()
    for graph in graphs:
        graph.replay()
    replayed = time.perf_counter()
    out = forward._hand_out(entry, out, slots, kwargs) if slots else out
    handed = time.perf_counter()
    return {"key": 1e3 * (keyed - start), "copy": 1e3 * (copied - keyed),
            "replay": 1e3 * (replayed - copied), "hand_out": 1e3 * (handed - replayed),
            "out": out}


def sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def line(name: str, medians: dict[str, float]) -> str:
    split = ", ".join(f"{k} {medians[k]:.3f}" for k in ("key", "copy", "replay", "hand_out")
                      if k in medians)
    return (f"{name}: median ms per step: call {medians['call']:.3f}"
            + (f" (other steps, in parts: {split})" if split else "")
            + f", whole step {medians['step']:.3f}")


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--shape", choices=sorted(SHAPES), default="llama")
    p.add_argument("--modes", nargs="+", default=["hf_compiled", "dejavu_sparse"])
    p.add_argument("--cpus", nargs="*", type=int, default=[],
                   help="also time each mode pinned to each of these CPUs in turn")
    args = p.parse_args(argv)
    check_args(args.modes, args.cpus)
    if not torch.cuda.is_available():
        raise SystemExit("host_study needs a CUDA GPU")
    point = bench.OPERATING_POINTS[SHAPES[args.shape]]
    workdir = Path(tempfile.mkdtemp())
    for mode in args.modes:
        net = small_model(args.shape)  # each mode its own: dejavu re-lays out weights in place
        ids = torch.randint(0, 512, (1, PROMPT), device="cuda")
        forward = build(mode, net, point, workdir)
        with bench.kernel_switches(mode):  # the kernels' switches as the bench sets them
            medians, prof = steps(net, forward, ids, STEPS, TIMED_FROM, PROFILED_FROM)
            print(f"== {line(mode, medians)} (unpinned)", flush=True)
            for order in ("tottime", "cumulative"):
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats(order).print_stats(14)
                print(text.getvalue(), flush=True)
            for cpu in args.cpus:
                with bench.pinned([cpu]):
                    medians = steps(net, forward, ids, PINNED_STEPS, 10)[0]
                print(line(f"{mode} on CPU {cpu}", medians), flush=True)
        del net, forward
        torch.cuda.empty_cache()

if __name__ == "__main__":
    main()
