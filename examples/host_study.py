"""Host time of a decode step, HF compiled against the dejavu backend, on a GPU: a model with
small matrices and the full model's layer count (``--shape llama``: hidden 1024, 32 layers as
Llama-3-8B; ``--shape opt``: hidden 1024, 40 layers as OPT-13B), so the host's work per step,
and the kernels a step launches, are those of the full size while compiling takes a minute.

For each mode of ``--modes`` (``hf_compiled``, or any dejavu mode of ``dejavu bench``, at the
bench's operating point of the shape's full-size model) it prints, per step, the medians of
the time to make the position tensor on the GPU (as the bench's loop does), the time until
the step's call returns (before waiting for the GPU: the bench's host column) and the whole
step (the call, the next token's argmax and the wait for the GPU), then a cProfile of 50 steps
by own time and by cumulative time. For a ``dejavu_captured*`` mode the profile splits the
call into ``CapturedStep``'s key, its input copy and the graph's replay.

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

from dejavu_compile import bench

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
    """``count`` decode steps on a fresh cache after a prefill of ``ids``; the medians (ms)
    over steps ``timed_from`` up to ``profiled_from`` of the position's creation, the call
    and the whole step, and a cProfile of the steps from ``profiled_from`` on."""
    cache, mask = bench._prefilled(net, ids, ids.shape[1] + count + 1)
    tok = ids[:, -1:]
    parts = {"position": [], "call": [], "step": []}
    prof = cProfile.Profile()
    for i in range(count):
        profiled = profiled_from is not None and i >= profiled_from
        sync(ids)
        if profiled:
            prof.enable()
        start = time.perf_counter()
        pos = torch.tensor([ids.shape[1] + i], device=ids.device)
        made = time.perf_counter()
        out = forward(input_ids=tok, past_key_values=cache, cache_position=pos,
                      position_ids=pos[None], attention_mask=mask, use_cache=True)
        returned = time.perf_counter()
        if profiled:
            prof.disable()
        tok = out.logits[:, -1:].argmax(-1)
        sync(ids)
        if timed_from <= i and not profiled:
            parts["position"].append(1e3 * (made - start))
            parts["call"].append(1e3 * (returned - made))
            parts["step"].append(1e3 * (time.perf_counter() - start))
    return {k: statistics.median(v) for k, v in parts.items()}, prof


def sync(t: torch.Tensor) -> None:
    if t.device.type == "cuda":
        torch.cuda.synchronize(t.device)


def line(name: str, medians: dict[str, float]) -> str:
    return (f"{name}: median ms per step: position {medians['position']:.3f}, call "
            f"{medians['call']:.3f}, whole step {medians['step']:.3f}")


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
