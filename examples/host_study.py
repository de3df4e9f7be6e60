"""Host time of a decode step, HF compiled against the dejavu backend, on a GPU: a Llama-shaped
model with small matrices (hidden 1024, 32 layers: the layer count of Llama-3-8B), so the
host's work per step is the same as at full size while compiling takes a minute.

For each of ``hf_compiled`` (``mode="reduce-overhead"``) and ``dejavu_sparse`` (MLP density 0.5
with random predictors, CUDA graphs; the lower pass's split-K decode attention) it prints the median time
until a step's call returns (before waiting for the GPU, as ``dejavu bench``'s host column)
and a cProfile of 50 steps, by own time and by cumulative time.

Run on a CUDA machine: ``TRITON_INTERPRET=0 DEJAVU_QUICK_TUNE=1 python examples/host_study.py``
(one kernel config each: the host's work does not depend on the tiles).
"""

from __future__ import annotations

import cProfile
import io
import pstats
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dejavu_compile.bench import _prefilled, random_profile, small_llama

PROMPT = 32
STEPS = 150  # the first TIMED_FROM warm up (compilation, re-layout, recording)
TIMED_FROM = 20
PROFILED_FROM = 100


@torch.no_grad()
def measure(name: str, net: torch.nn.Module, forward, ids: torch.Tensor) -> None:
    cache, mask = _prefilled(net, ids, PROMPT + STEPS + 1)
    tok = ids[:, -1:]
    host = []
    prof = cProfile.Profile()
    for i in range(STEPS):
        pos = torch.tensor([PROMPT + i], device="cuda")
        if i >= PROFILED_FROM:
            prof.enable()
        start = time.perf_counter()
        out = forward(input_ids=tok, past_key_values=cache, cache_position=pos,
                      position_ids=pos[None], attention_mask=mask, use_cache=True)
        host.append(1e3 * (time.perf_counter() - start))
        if i >= PROFILED_FROM:
            prof.disable()
        tok = out.logits[:, -1:].argmax(-1)
        torch.cuda.synchronize()
    print(f"== {name}: host ms per step, median {statistics.median(host[TIMED_FROM:PROFILED_FROM]):.3f}")
    for order in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(order).print_stats(14)
        print(text.getvalue(), flush=True)


def main() -> None:
    net = small_llama(32)  # Llama-3-8B's layer count
    ids = torch.randint(0, 512, (1, PROMPT), device="cuda")
    torch._dynamo.reset()
    measure("hf_compiled", net, torch.compile(net.forward, mode="reduce-overhead",
                                              fullgraph=True), ids)
    torch._dynamo.reset()
    profile = random_profile(net, 0.5, 1.0, 64, Path(tempfile.mkdtemp()) / "host.yaml")
    forward = torch.compile(net.forward, backend="dejavu", fullgraph=True,
                            options={"profile": profile, "cudagraphs": True})
    measure("dejavu_sparse", net, forward, ids)


if __name__ == "__main__":
    main()
