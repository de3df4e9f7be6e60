"""Whether the GPU orders launches as dejavu's kernels assume when a kernel lets its successor
start early (programmatic dependent launch), on a Hopper or later GPU.

``race_study.py`` found the add-norm kernel's early start wrong (forty-fifth to fifty-first
sessions, BENCHMARKS.md) even with the kernels after it launched plainly, while no read before a
wait explains it. The kernels rest on three assumptions, which this probes one by one, with no
model: a kernel launched with the programmatic attribute may start once the kernel before it
has let it (so what it loads before its wait may be older); a plain launch starts only once
everything before it in the stream has finished; and so a zero-fill launched plainly (the op's
``torch.zeros``) is a barrier, after which a kernel launched programmatically may load, before
its wait, what was written before the fill (``_head_proj_kernel`` loads its input so, and
``sparse_mlp._up_kernel`` with ``AFTER``).

Each trial zeroes a flag, then launches a producer (one program, launched programmatically):
it waits, lets its successor start right away (start ``early``) or not at all (``exit``: the
successor starts as it exits), spins for ``--spin`` dependent steps (about 2 ns each) and
only then sets the flag. Then, by case:

- ``pdl``: a reader launched programmatically reads the flag before its wait and after it;
- ``plain``: the same reader launched plainly;
- ``fill then pdl``: ``torch.zeros`` (PyTorch's fill kernel, launched plainly), then the
  reader launched programmatically;
- ``copy``: PyTorch's copy of the flag (launched plainly);
- ``pdl chain``: a first reader launched programmatically that waits and then lets its own
  successor start, then the reader launched programmatically: what every kernel here assumes
  is that the second one's read before its wait, older than the first reader, sees the flag.

A line per case and start: in how many trials the flag was still unset where it was read.
Only ``pdl``'s read before its wait may see it unset (under ``early``, that is the overlap
itself). Anywhere else an unset flag is a read the ordering does not protect.

Run on the GPU: ``TRITON_INTERPRET=0 python examples/pdl_probe.py`` (seconds).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

CASES = ("pdl", "plain", "fill then pdl", "copy", "pdl chain")
STARTS = ("early", "exit")


@triton.jit
def _producer(flag_ptr, sink_ptr, spin, EARLY: tl.constexpr):
    gdc_wait()
    if EARLY:
        gdc_launch_dependents()
    acc = tl.load(sink_ptr)
    for _ in range(spin):
        acc = acc * 0.999999 + 1.0
    tl.store(sink_ptr + 1, acc)
    tl.store(flag_ptr, 1)


@triton.jit
def _reader(flag_ptr, out_ptr, PDL: tl.constexpr, START: tl.constexpr):
    before = tl.load(flag_ptr, volatile=True)
    if PDL:
        gdc_wait()
        if START:
            gdc_launch_dependents()
    after = tl.load(flag_ptr, volatile=True)
    tl.store(out_ptr, before)
    tl.store(out_ptr + 1, after)


def trial(case: str, start: str, spin: int, flag: torch.Tensor, sink: torch.Tensor,
          out: torch.Tensor) -> tuple[int, int]:
    """One trial of ``case`` after a producer with ``start``: the flag where it was read (before
    and after the (last) reader's wait; for ``copy``, the copy's value twice), each 0 or 1.
    ``out`` holds 4 int32: the reader's 2, the first reader's of ``pdl chain`` after them."""
    flag.zero_()
    out.fill_(-1)
    torch.cuda.synchronize()
    _producer[(1,)](flag, sink, spin, EARLY=start == "early", launch_pdl=True)
    if case == "fill then pdl":
        torch.zeros(4, device=flag.device)
    if case == "pdl chain":
        _reader[(1,)](flag, out[2:], PDL=True, START=True, launch_pdl=True)
    if case == "copy":
        out[:1].copy_(flag)
        out[1:2].copy_(out[:1])
    else:
        programmatic = case != "plain"
        _reader[(1,)](flag, out, PDL=programmatic, START=False, launch_pdl=programmatic)
    torch.cuda.synchronize()
    before, after = out[:2].tolist()
    return before, after


def probe(trials: int, spin: int) -> dict[tuple[str, str], tuple[int, int]]:
    """For each (case, start): in how many of ``trials`` the flag was unset (before, after
    the reader's wait)."""
    flag = torch.zeros(1, dtype=torch.int32, device="cuda")
    sink = torch.ones(2, dtype=torch.float32, device="cuda")
    out = torch.zeros(4, dtype=torch.int32, device="cuda")
    found = {}
    for case in CASES:
        for start in STARTS:
            trial(case, start, spin, flag, sink, out)  # compiles
            unset = [0, 0]
            for _ in range(trials):
                for i, seen in enumerate(trial(case, start, spin, flag, sink, out)):
                    if seen not in (0, 1):
                        raise RuntimeError(f"{case}, {start}: the reader wrote {seen}, not the "
                                           "flag")
                    unset[i] += seen == 0
            found[(case, start)] = (unset[0], unset[1])
    return found


def describe(case: str, start: str, unset: tuple[int, int], trials: int) -> str:
    before, after = unset
    if case == "copy":
        return f"{case:14s} {start:5s}: flag unset in {before} of {trials} trials"
    where = "before its wait" if case != "plain" else "first read"
    return (f"{case:14s} {start:5s}: flag unset {where} in {before} of {trials} trials, "
            f"after it in {after}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--spin", type=int, default=100_000,
                   help="the producer's dependent steps before it sets the flag")
    args = p.parse_args(argv)
    for name in ("trials", "spin"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("pdl_probe needs a CUDA GPU of compute capability 9.0 or later "
                         "(programmatic dependent launch); none is here")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}: {args.trials} trials a line, producer spin {args.spin}",
          flush=True)
    for (case, start), unset in probe(args.trials, args.spin).items():
        print(describe(case, start, unset, args.trials), flush=True)


if __name__ == "__main__":
    main()
