"""The ``dejavu`` command line: the same API as ``dejavu_compile``, with the same defaults."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import subprocess
import sys

from .bench import BENCH_MODELS, DENSITIES, E2E_NEW, E2E_PROMPT, KV_ATTENTION, MODES, SWEEP_BLOCKS


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


def _own_error(exc: Exception) -> Exception | None:
    """The error to report in one line: one that dejavu's own code raised on what it was given
    (a profile, a model, a file, an option, the machine), taken out of the
    ``BackendCompilerFailed`` that Dynamo wraps a backend's errors in. None for anything else,
    whose traceback a bug report needs."""
    inner = getattr(exc, "inner_exception", None)
    if isinstance(inner, Exception):
        exc = inner
    tb = exc.__traceback__
    if not isinstance(exc, (ValueError, TypeError, RuntimeError, OSError)) or tb is None:
        return None
    while tb.tb_next is not None:
        tb = tb.tb_next
    module = tb.tb_frame.f_globals.get("__name__", "")
    return exc if module.split(".")[0] == "dejavu_compile" else None


def _bench(args) -> int:
    from . import bench

    if args.isolate:
        if not args.no_kernels or args.no_e2e or args.kv:
            raise SystemExit("dejavu bench: --isolate measures the end-to-end modes only; "
                             "give --no-kernels, and neither --no-e2e nor --kv")
        try:
            variants = bench.parse_variants(args.variants)
        except (ValueError, OSError) as e:
            raise SystemExit(f"dejavu bench: {e}") from None
        result = bench.isolated(args.models, args.modes, args.isolate, out_json=args.json,
                                breakdown=args.breakdown, tuned=args.tuned,
                                timeout=args.child_timeout, cpus=args.cpus,
                                prompt=args.prompt, variants=variants)
    else:
        if args.variants:
            raise SystemExit("dejavu bench: --variants needs --isolate (each variant runs in "
                             "processes of its own)")
        result = bench.run(args.models, out_json=args.json, kernels=not args.no_kernels,
                           e2e=not args.no_e2e, modes=args.modes, kv=args.kv,
                           breakdown=args.breakdown, kv_attention=args.kv_attention,
                           tuned=args.tuned, densities=args.densities, blocks=args.blocks,
                           cpus=args.cpus, prompt=args.prompt)
    command = "dejavu " + " ".join(shlex.quote(a) for a in sys.argv[1:])
    text = bench.markdown(result, command, _commit(), datetime.date.today().isoformat())
    if args.markdown:
        with open(args.markdown, "a") as f:
            f.write("\n" + text)
    print(text)
    return 0


def _text_ids(loaded, text_file: str | None, split: str, tokens: int):
    from .models import documentation_text

    if text_file:
        try:
            with open(text_file, encoding="utf-8") as f:
                text = f.read()
        except UnicodeDecodeError as e:
            raise ValueError(f"--text {text_file}: not UTF-8 text ({e})") from e
    else:
        text = documentation_text(split)
    ids = loaded.encode(text, tokens)
    if ids.shape[1] < min(tokens, 256):
        raise ValueError(f"only {ids.shape[1]} tokens of text; need at least {min(tokens, 256)}")
    return ids


def _calibrate(args) -> int:
    import logging

    from . import calibrate
    from .models import load_model

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    loaded = load_model(args.model)
    ids = _text_ids(loaded, args.text, "calibration", args.tokens)
    cal = calibrate.calibrate(loaded.model, ids, loaded.name, args.out,
                              target_density=args.target_density,
                              max_ppl_increase=args.max_ppl_increase, rank=args.rank,
                              epochs=args.epochs, cache_dir=args.cache,
                              lookahead=args.lookahead, selectors=tuple(args.selectors),
                              bucket_units=args.bucket_units, weighted_loss=args.weighted_loss)
    for layer in cal.profile.layers:
        q = cal.quality.get(layer.index, {})
        line = f"layer {layer.index:>2}: MLP {layer.mlp.selector:<9} density {layer.mlp.density:.2f}"
        if layer.mlp.recall is not None:
            line += f"  recall at that density {layer.mlp.recall:.3f}"
        if "recall" in q:
            line += f"  (predictor recall at density {calibrate.TRAIN_DENSITY}: {q['recall']:.3f})"
        print(line)
    if cal.search:
        tried = ", ".join(f"{t:.2f}: {100 * inc:+.2f}% (uniform {100 * cal.search_uniform[t]:+.2f}%)"
                          for t, inc in cal.search.items())
        print(f"held-out perplexity by byte target, the better of adaptive and uniform "
              f"({tried}); kept {cal.target_density:.2f}")
    if cal.blend:
        tried = ", ".join(f"{w:g}: {loss:.4f}" for w, loss in cal.blend.items())
        print(f"joint loss by weight of the greedy allocation against uniform ({tried}); "
              f"kept {min(cal.blend, key=cal.blend.get):g}")
    if cal.uniform_kept:
        print("the uniform spread did better than the adaptive allocation: the profile is the "
              "uniform spread (the same as its -uniform twin)")
    print(f"wrote {cal.profile.path} and {cal.uniform_profile.path}")
    return 0


def _eval(args) -> int:
    from .evaluate import DEFAULT_WINDOW, evaluate_profile, plot_layers, windows
    from .models import load_model
    from .profile import load_profile

    profile = load_profile(args.profile)  # a malformed profile stops before the model loads
    loaded = load_model(args.model)
    ids = _text_ids(loaded, args.text, "held_out", DEFAULT_WINDOW * args.windows)
    result = evaluate_profile(loaded.model, windows(ids, DEFAULT_WINDOW, args.windows), profile,
                              progress=True)
    result["profile"] = str(args.profile)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    if args.plot:
        plot_layers(result, args.plot)
    change = 100 * (result["sparse_ppl"] / result["dense_ppl"] - 1)
    oracle = 100 * (result["oracle_ppl"] / result["dense_ppl"] - 1)
    print(f"{result['tokens']} held-out tokens: perplexity dense {result['dense_ppl']:.3f}, "
          f"oracle {result['oracle_ppl']:.3f} ({oracle:+.1f}%), profile {result['sparse_ppl']:.3f} "
          f"({change:+.1f}%); top-1 agreement {100 * result['top1_agreement']:.1f}%; MLP bytes "
          f"{result['mlp_bytes_fraction']:.3f} of dense; bytes per token "
          f"{result['bytes_per_token_sparse'] / 2**20:.1f} MiB, dense "
          f"{result['bytes_per_token_dense'] / 2**20:.1f} MiB")
    return 0


def _export(args) -> int:
    from .inspection import export
    from .models import load_model
    from .profile import load_profile

    profile = load_profile(args.profile) if args.profile else None  # before the model loads
    loaded = load_model(args.model)
    options = {"profile": profile} if profile is not None else {
        "selector": "oracle", "mlp_density": args.mlp_density,
        "attention_density": args.attention_density}
    if args.lookahead is not None:
        options["lookahead"] = args.lookahead
    paths = export(loaded.model, args.out, onnx=not args.no_onnx, **options)
    for path in paths.values():
        print(f"wrote {path}")
    return 0


def _plan(args) -> int:
    from . import plan
    from .bench import shape_configs

    shapes = shape_configs()
    if args.model in shapes:
        config = shapes[args.model]
    else:
        from .models import BUILTIN_MODELS, load_model

        if args.model not in BUILTIN_MODELS and not os.path.exists(args.model):
            raise ValueError(f"model {args.model!r} is neither a shape name {tuple(shapes)}, "
                             f"a built-in model {BUILTIN_MODELS} nor an existing path")
        config = load_model(args.model).model.config
    model = plan.ModelBytes.from_config(config, args.model, args.dtype_bytes)
    costs, bandwidth = {}, None
    if args.costs:
        with open(args.costs) as f:
            measured = json.load(f)["kv"]
        costs, bandwidth = measured["costs_ms"], measured["copy_gbs"] * 1e9
    if args.profile:
        from .profile import load_predictors, load_profile

        prof = load_profile(args.profile)
        account = plan.account_from_profile(model, prof, load_predictors(prof), args.kv_keep, costs)
    else:
        account = plan.Account(model, args.projection_keep, args.kv_keep, args.scope,
                               costs_ms=costs)
    print(plan.table(account, args.context, bandwidth))
    return 0


def _retrieval(args) -> int:
    from . import retrieval
    from .models import load_model
    from .profile import load_profile

    profile = load_profile(args.profile) if args.profile else None  # before the model loads
    loaded = load_model(args.model)
    decode = None
    if profile is not None:
        from .backend import compile as dejavu_compile

        decode = dejavu_compile(loaded.model, profile=profile)
    rows = retrieval.run(loaded, args.context, args.kv_keep, policies=args.policies,
                         decode=decode, progress=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=1)
    print(retrieval.summary(rows))
    return 0


def build_parser() -> argparse.ArgumentParser:
    """The ``dejavu`` command line: every subcommand with its options and their defaults."""
    parser = argparse.ArgumentParser(prog="dejavu", description="contextual sparsity for LLMs")
    sub = parser.add_subparsers(dest="command", required=True)

    from .calibrate import (
        CALIBRATION_SELECTORS,
        DEFAULT_EPOCHS,
        DEFAULT_RANK,
        DEFAULT_SELECTORS,
        DEFAULT_TARGET_DENSITY,
        DEFAULT_TOKENS,
    )
    from .profile import BUCKET_UNITS

    p = sub.add_parser("calibrate", help="train predictors, choose densities, write a profile")
    p.add_argument("model", help="smollm2-135m, gemma3-270m, a .gguf file or a HF directory")
    p.add_argument("--out", required=True, help="profile YAML to write (predictors beside it)")
    p.add_argument("--text", help="calibration text file (default: Python docs, calibration split)")
    p.add_argument("--tokens", type=int, default=DEFAULT_TOKENS,
                   help="calibration tokens taken from the text (default %(default)s)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--target-density", type=float,
                        help="MLP bytes read per token, predictors included, as a fraction of "
                             f"dense (default {DEFAULT_TARGET_DENSITY})")
    budget.add_argument("--max-ppl-increase", type=float,
                        help="instead: the fewest bytes whose perplexity on held-out calibration "
                             "tokens stays within this increase (0.03: +3%%)")
    p.add_argument("--rank", type=int, default=DEFAULT_RANK,
                   help="rank of each low-rank predictor (default %(default)s)")
    p.add_argument("--epochs", type=int, default=DEFAULT_EPOCHS,
                   help="training epochs of each predictor (default %(default)s)")
    p.add_argument("--cache", help="folder for recorded activations (a rerun resumes from it)")
    p.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=False,
                   help="train each predictor after the first on the layer before's MLP "
                        "input (paper section 4.3)")
    p.add_argument("--selectors", nargs="+", choices=CALIBRATION_SELECTORS,
                   default=list(DEFAULT_SELECTORS),
                   help="candidate selectors per layer: the allocation picks one per layer")
    p.add_argument("--bucket-units", type=int, default=BUCKET_UNITS,
                   help="predictors take their top-k per bucket of at most this many neurons "
                        "(one GPU launch ranks them); 0 takes one top-k over all neurons")
    p.add_argument("--weighted-loss", action="store_true",
                   help="weight each neuron's term of the predictors' loss by its importance "
                        "(|h| times its down-projection column's norm)")
    p.set_defaults(fn=_calibrate)

    p = sub.add_parser("eval", help="perplexity and agreement: dense, oracle, profile")
    p.add_argument("model", help="smollm2-135m, gemma3-270m, a .gguf file or a HF directory")
    p.add_argument("--profile", required=True, help="profile YAML to evaluate")
    p.add_argument("--text", help="held-out text file (default: Python docs, held-out split)")
    p.add_argument("--windows", type=int, default=4, help="windows of 128 tokens to decode")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--plot", help="write a PNG of per-layer density and recall")
    p.set_defaults(fn=_eval)

    p = sub.add_parser("export", help="write the transformed decode graph: code, SVG, ONNX, report")
    p.add_argument("model", help="smollm2-135m, gemma3-270m, a .gguf file or a HF directory")
    p.add_argument("--profile", help="profile YAML (else the oracle at the densities below)")
    p.add_argument("--mlp-density", type=float, default=0.5,
                   help="the oracle's fraction of MLP neurons kept (default %(default)s)")
    p.add_argument("--attention-density", type=float, default=None,
                   help="the oracle's fraction of attention heads kept (default: all)")
    p.add_argument("--out", required=True, help="folder to write graph.py, graph.svg, ...")
    p.add_argument("--no-onnx", action="store_true", help="skip graph.onnx")
    p.add_argument("--lookahead", action=argparse.BooleanOptionalAction, default=None,
                   help="run the predictors one layer ahead (default: as the profile's "
                        "predictors were calibrated)")
    p.set_defaults(fn=_export)

    from .plan import DEFAULT_KV_KEEP, DEFAULT_PROJECTION_KEEP, SCOPES

    p = sub.add_parser("plan", help="byte account per decode step: projection vs KV sparsity")
    p.add_argument("model", help="a shape name (llama-3.1-8b, qwen3-8b, opt-13b, ...) or a model")
    p.add_argument("--profile", help="take the projection keep and predictor bytes from a profile")
    p.add_argument("--context", type=int, nargs="+", required=True, help="context lengths")
    p.add_argument("--projection-keep", type=float, default=DEFAULT_PROJECTION_KEEP,
                   help="fraction of the projection bytes read (without a profile)")
    p.add_argument("--kv-keep", type=float, default=DEFAULT_KV_KEEP,
                   help="fraction of the cached positions KV sparsity reads")
    p.add_argument("--scope", choices=SCOPES, default="all",
                   help="projections the projection branch sparsifies (without a profile)")
    p.add_argument("--dtype-bytes", type=int, default=2, help="bytes per weight and cache value")
    p.add_argument("--costs", help="dejavu bench --kv JSON: measured kernel costs for the gate")
    p.set_defaults(fn=_plan)

    from .kv import POLICIES

    p = sub.add_parser("retrieval", help="passkey and multi-key trials: KV policies vs dense")
    p.add_argument("model", help="smollm2-135m, gemma3-270m, a .gguf file or a HF directory")
    p.add_argument("--context", type=int, nargs="+", default=[1024, 2048], help="prompt tokens")
    p.add_argument("--kv-keep", type=float, default=DEFAULT_KV_KEEP,
                   help="fraction of the prompt's positions each KV policy keeps")
    p.add_argument("--policies", nargs="+", choices=POLICIES, default=list(POLICIES),
                   help="KV policies to try (default: all)")
    p.add_argument("--profile", help="decode through the dejavu-compiled model (composition)")
    p.add_argument("--json", help="write every trial as JSON")
    p.set_defaults(fn=_retrieval)

    p = sub.add_parser("bench", help="kernel sweep and end-to-end decode latency (CUDA GPU)")
    p.add_argument("--models", nargs="+", default=list(BENCH_MODELS),
                   help="shape names, built with random weights (default: %(default)s)")
    p.add_argument("--json", help="write all measurements to this JSON file")
    p.add_argument("--markdown", help="append a results section to this file (BENCHMARKS.md)")
    p.add_argument("--no-kernels", action="store_true", help="skip the kernel sweep")
    p.add_argument("--no-e2e", action="store_true", help="skip end-to-end decoding")
    p.add_argument("--densities", type=float, nargs="+", default=list(DENSITIES),
                   help="the kernel sweep's densities, each in (0, 1]")
    p.add_argument("--blocks", nargs="+", default=list(SWEEP_BLOCKS), choices=SWEEP_BLOCKS,
                   help="the kernel sweep's parts to run")
    p.add_argument("--modes", nargs="+", choices=MODES, metavar="MODE",
                   help="end-to-end modes to run, of: %(choices)s (default: each model's "
                        "hf_eager, hf_compiled, dejavu_dense and default step, "
                        "bench.default_modes)")
    p.add_argument("--prompt", type=int, default=E2E_PROMPT, metavar="TOKENS",
                   help=f"end-to-end: prompt tokens prefilled before the {E2E_NEW} timed "
                        "decode steps (the cache and attention grow with it)")
    p.add_argument("--kv", action="store_true",
                   help="also sweep dense / projection / KV / both from 2K to 128K context "
                        "(Llama-3-8B shape); its JSON feeds `dejavu plan --costs`")
    p.add_argument("--kv-attention", choices=KV_ATTENTION, default=KV_ATTENTION[0],
                   help="the attention every --kv mode reads its cache with: the split-K "
                        "dejavu::decode_attention kernel or PyTorch's SDPA")
    p.add_argument("--breakdown", action="store_true",
                   help="also profile each end-to-end mode: GPU time per step by kernel")
    p.add_argument("--tuned", metavar="FILE",
                   help="run the kernels with the configs an earlier bench JSON recorded "
                        "(its 'tuned') instead of tuning those keys again")
    p.add_argument("--isolate", type=int, metavar="ROUNDS",
                   help="run every end-to-end mode in a process of its own, ROUNDS times, the "
                        "modes' order reversed every other round; ratios against the same "
                        "round's hf_compiled, and their medians (needs --no-kernels)")
    p.add_argument("--variants", nargs="+", metavar="LABEL=FILE",
                   help="with --isolate: measure every dejavu mode again with each FILE's "
                        "tuned configs first (a bench JSON or its 'tuned'), in the same "
                        "alternating order, its rows marked [LABEL]: a kernel tile against "
                        "the run's own, side by side")
    p.add_argument("--child-timeout", type=float, metavar="S",
                   help="with --isolate: stop a mode's process after S seconds (listed as "
                        "failed; the run goes on)")
    p.add_argument("--cpus", type=int, nargs="+", metavar="CPU",
                   help="pin every end-to-end mode's timed steps to these CPUs (the host's "
                        "time per step depends on where it runs; warm-up, compiling and "
                        "tuning stay unpinned)")
    p.set_defaults(fn=_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.fn(args)
    except Exception as exc:
        error = _own_error(exc)
        if error is None or os.environ.get("DEJAVU_TRACEBACK") == "1":
            raise
        print(f"dejavu {args.command}: error: {error}\n(DEJAVU_TRACEBACK=1 shows where it was "
              "raised)", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
