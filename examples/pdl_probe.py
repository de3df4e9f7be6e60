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

Each trial zeroes the flags, then launches a producer (``--programs`` programs, launched
programmatically): each program waits, lets the successor start right away (start ``early``)
or not at all (``exit``: the successor starts as the programs exit), spins for ``--spin``
dependent floating-point steps and only then sets its flag. Then, by case:

- ``pdl``: a reader (``--readers`` programs, each reading every flag) launched
  programmatically reads the flags before its wait and after it;
- ``plain``: the same reader launched plainly;
- ``fill then pdl``: ``torch.zeros`` (PyTorch's fill kernel, launched plainly), then the
  reader launched programmatically;
- ``torch``: a PyTorch kernel (launched plainly) reading the flags (``flag == 0``);
- ``pdl chain``: a first reader launched programmatically that waits and then lets its own
  successor start, then the reader launched programmatically: what every kernel here assumes
  is that the second one's read before its wait, older than the first reader, sees the flags.

The readers read with volatile loads, from L2. With ``--cached`` they use plain loads, which
may be served from an SM's L1, and before the producer a kernel of ``--readers`` programs
reads the unset flags the same way, so that an L1 not emptied between kernels would hand a
reader the old value.

A line per case and start: in how many trials a flag was still unset where it was read (by
any reader program). Only ``pdl``'s read before its wait may see one unset (under ``early``,
that is the overlap itself). Anywhere else an unset flag is a read the ordering does not
protect.

Run on the GPU: ``TRITON_INTERPRET=0 python examples/pdl_probe.py`` (seconds).
"""

from __future__ import annotations

import argparse

import torch
import triton
import triton.language as tl
from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

CASES = ("pdl", "plain", "fill then pdl", "torch", "pdl chain")
STARTS = ("early", "exit")


@triton.jit
def _producer(flag_ptr, sink_ptr, spin, EARLY: tl.constexpr):
    pid = tl.program_id(0)
    gdc_wait()
    if EARLY:
        gdc_launch_dependents()
    acc = tl.load(sink_ptr)
    for _ in range(spin):
        acc = acc * 0.999999 + 1.0
    tl.store(sink_ptr + 1 + pid, acc)
    tl.store(flag_ptr + pid, 1)


@triton.jit
def _count(flag_ptr, n, BLOCK: tl.constexpr, CACHED: tl.constexpr):
    """How many of the ``n`` flags are unset, read volatile (L2) or, ``CACHED``, plainly."""
    offs = tl.arange(0, BLOCK)
    if CACHED:
        flags = tl.load(flag_ptr + offs, mask=offs < n, other=1)
    else:
        flags = tl.load(flag_ptr + offs, mask=offs < n, other=1, volatile=True)
    return tl.sum((flags == 0).to(tl.int32), 0)


@triton.jit
def _reader(flag_ptr, out_ptr, n, PDL: tl.constexpr, START: tl.constexpr,
            BLOCK: tl.constexpr, CACHED: tl.constexpr):
    pid = tl.program_id(0)
    before = _count(flag_ptr, n, BLOCK, CACHED)
    if PDL:
        gdc_wait()
        if START:
            gdc_launch_dependents()
    after = _count(flag_ptr, n, BLOCK, CACHED)
    tl.store(out_ptr + 2 * pid, before)
    tl.store(out_ptr + 2 * pid + 1, after)


@triton.jit
def _warm(flag_ptr, sink_ptr, n, BLOCK: tl.constexpr):
    """Each program reads the flags plainly (into its SM's L1) and stores what it saw."""
    tl.store(sink_ptr + tl.program_id(0), _count(flag_ptr, n, BLOCK, True))


class Buffers:
    """The flags (one per producer program), the producer's sink, the readers' counts (two per
    reader program) and the first reader's of ``pdl chain``, and the warm kernel's sink."""

    def __init__(self, programs: int, readers: int):
        self.programs, self.readers = programs, readers
        self.block = triton.next_power_of_2(programs)
        self.flag = torch.zeros(programs, dtype=torch.int32, device="cuda")
        self.sink = torch.ones(programs + 1, dtype=torch.float32, device="cuda")
        self.out = torch.zeros(2, 2 * readers, dtype=torch.int32, device="cuda")
        self.warm = torch.zeros(readers, dtype=torch.int32, device="cuda")


def trial(case: str, start: str, spin: int, buf: Buffers, cached: bool) -> tuple[int, int]:
    """One trial of ``case`` after a producer with ``start``: whether any flag was unset where
    the (last) reader read it, before and after its wait (for ``torch``, what it read, twice),
    each 0 or 1."""
    buf.flag.zero_()
    buf.out.fill_(-1)
    torch.cuda.synchronize()
    n, block = buf.programs, buf.block
    if cached:
        _warm[(buf.readers,)](buf.flag, buf.warm, n, BLOCK=block)
    _producer[(n,)](buf.flag, buf.sink, spin, EARLY=start == "early", launch_pdl=True)
    if case == "fill then pdl":
        torch.zeros(4, device=buf.flag.device)
    if case == "pdl chain":
        _reader[(buf.readers,)](buf.flag, buf.out[1], n, PDL=True, START=True, BLOCK=block,
                                CACHED=cached, launch_pdl=True)
    if case == "torch":
        unset = (buf.flag == 0).any()
        torch.cuda.synchronize()
        return int(unset), int(unset)
    programmatic = case != "plain"
    _reader[(buf.readers,)](buf.flag, buf.out[0], n, PDL=programmatic, START=False,
                            BLOCK=block, CACHED=cached, launch_pdl=programmatic)
    torch.cuda.synchronize()
    counts = buf.out[0].view(buf.readers, 2)
    if (counts < 0).any() or (counts > n).any():
        raise RuntimeError(f"{case}, {start}: a reader program wrote {counts.tolist()}, not "
                           "a count of flags")
    before, after = (counts > 0).any(0).tolist()
    return int(before), int(after)


def probe(trials: int, spin: int, programs: int = 1, readers: int = 1,
          cached: bool = False) -> dict[tuple[str, str], tuple[int, int]]:
    """For each (case, start): in how many of ``trials`` a flag was unset where a reader read
    it (before, after the reader's wait)."""
    buf = Buffers(programs, readers)
    found = {}
    for case in CASES:
        for start in STARTS:
            trial(case, start, spin, buf, cached)  # compiles
            unset = [0, 0]
            for _ in range(trials):
                for i, seen in enumerate(trial(case, start, spin, buf, cached)):
                    unset[i] += seen
            found[(case, start)] = (unset[0], unset[1])
    return found


def describe(case: str, start: str, unset: tuple[int, int], trials: int) -> str:
    before, after = unset
    if case == "torch":
        return f"{case:14s} {start:5s}: a flag unset in {before} of {trials} trials"
    where = "before its wait" if case != "plain" else "first read"
    return (f"{case:14s} {start:5s}: a flag unset {where} in {before} of {trials} trials, "
            f"after it in {after}")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=50)
    p.add_argument("--spin", type=int, default=100_000,
                   help="the producer's dependent steps before it sets the flag")
    p.add_argument("--programs", type=int, default=1, help="the producer's programs")
    p.add_argument("--readers", type=int, default=1, help="each reader's programs")
    p.add_argument("--cached", action="store_true",
                   help="plain loads (through L1), after a kernel that reads the unset flags")
    args = p.parse_args(argv)
    for name in ("trials", "spin", "programs", "readers"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9:
        raise SystemExit("pdl_probe needs a CUDA GPU of compute capability 9.0 or later "
                         "(programmatic dependent launch); none is here")
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton "
          f"{triton.__version__}: {args.trials} trials a line, producer spin {args.spin}, "
          f"{args.programs} producer programs, {args.readers} reader programs, "
          + ("plain loads after a kernel that read the flags" if args.cached
             else "volatile loads"), flush=True)
    found = probe(args.trials, args.spin, args.programs, args.readers, args.cached)
    for (case, start), unset in found.items():
        print(describe(case, start, unset, args.trials), flush=True)


if __name__ == "__main__":
    main()
