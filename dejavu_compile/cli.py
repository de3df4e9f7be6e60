"""The ``dejavu`` command line: the same API as ``dejavu_compile``, with the same defaults."""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import subprocess
import sys

from .bench import MODES


def _commit() -> str:
    """The checkout's commit; a tree copied without .git can name it in DEJAVU_COMMIT."""
    if os.environ.get("DEJAVU_COMMIT"):
        return os.environ["DEJAVU_COMMIT"]
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                             text=True, check=True)
        return out.stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _bench(args) -> int:
    from . import bench

    result = bench.run(args.models, out_json=args.json, kernels=not args.no_kernels,
                       e2e=not args.no_e2e, modes=args.modes)
    command = "dejavu " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text = bench.markdown(result, command, _commit(), datetime.date.today().isoformat())
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + text)
    print(text)
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="dejavu", description="contextual sparsity for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("bench", help="kernel sweep and end-to-end decode latency (CUDA GPU)")
    p.add_argument("--models", nargs="+", default=["opt-13b", "llama-3-8b"])
    p.add_argument("--json", help="write all measurements to this JSON file")
    p.add_argument("--markdown", help="append a results section to this file (BENCHMARKS.md)")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel sweep")
    p.add_argument("--no-e2e", action="store_true", help="skip end-to-end decoding")
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES,
                   help="end-to-end modes to run")
    p.set_defaults(fn=_bench)

    args = parser.parse_args(argv)
    return args.fn(args)


if __name__ == "__main__":
    sys.exit(main())
