"""The ``dejavu`` torch.compile backend: run the passes on each Dynamo graph, then hand the
rewritten graph to the inner compiler (Inductor by default)."""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import threading
from pathlib import Path
from typing import Any

import torch
import torch.fx as fx
from torch.utils.weak import WeakIdKeyDictionary

from dejavu_compile.passes import PIPELINE, PassContext, lower
from dejavu_compile.profile import (
    ModelIdentity,
    Profile,
    ProfileError,
    load_predictors,
    load_profile,
)

from .config import DejavuOptions
from .report import CompileReport, GraphReport, build_graph_report

log = logging.getLogger("dejavu_compile")

_REPORTS: list[GraphReport] = []
_LOCK = threading.Lock()
# parameter -> its name in the model, filled by ``register_model`` (see PassContext.param_names)
_PARAM_NAMES = WeakIdKeyDictionary()
_DUMPED = itertools.count()  # numbers the graphs written to a dump folder
DUMP_ENV = "DEJAVU_DUMP_DIR"


def register_model(model: torch.nn.Module) -> None:
    """Remember the names of ``model``'s parameters, so that graphs Dynamo splits the model into
    still know which layer each weight belongs to."""
    with _LOCK:
        for name, param in model.named_parameters():
            _PARAM_NAMES[param] = name


def _resolve_profile(profile: Any) -> Profile | None:
    if profile is None or isinstance(profile, Profile):
        return profile
    return load_profile(profile)


def transform(gm: fx.GraphModule, example_inputs, options: DejavuOptions) -> PassContext:
    """Run ``PIPELINE`` on ``gm`` in place; returns the context (discovery, plan, counters)."""
    profile = _resolve_profile(options.profile)
    predictors = load_predictors(profile) if profile is not None else {}
    ctx = PassContext.build(gm, example_inputs, options, profile, predictors, _PARAM_NAMES)
    dump = options.dump_dir or os.environ.get(DUMP_ENV)
    number = next(_DUMPED) if dump else 0
    if dump:
        _dump(Path(dump), number, 0, "input", gm)
    for step, (name, run) in enumerate(PIPELINE, start=1):
        gm = run(gm, ctx)
        if dump:
            _dump(Path(dump), number, step, name, gm)
    return ctx


def _dump(folder: Path, number: int, step: int, name: str, gm: fx.GraphModule) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    text = gm.print_readable(print_output=False, include_stride=True, include_device=True)
    (folder / f"graph{number:03d}_{step}_{name}.py").write_text(text)


def inductor_patches(opts: DejavuOptions) -> dict[str, Any]:
    """Inductor's config for the rewritten graph: CUDA graphs when asked, multi-kernel
    reductions when asked (``DejavuOptions.multi_kernel``), programmatic launch of its own
    kernels when asked or, by default, wherever the dejavu kernels launch that way
    (``DejavuOptions.inductor_pdl``), and no
    ``reorder_for_locality`` unless asked (``DejavuOptions.reorder_for_locality``). That
    post-grad pass moves each producer right before its first consumer:
    - it put every predictor the lookahead pass moved a layer ahead back beside the sparse op
      that reads its selection, so a side stream had nothing to overlap;
    - in Inductor's code for a CPU graph of a 4-layer Llama it also split the rotary embedding
      of the query from that of the key and the cache update: 53 kernels and extern calls a
      step with the pass, 45 without (inline predictors; 55 and 45 with lookahead); on an
      H200, Llama-3-8B's step has 464 launches either way.
    With the pass off, lookahead on OPT-13B went from 15% to 0.9% over fixed indices per step
    on an H200 (BENCHMARKS.md, tenth session)."""
    patches: dict[str, Any] = {"triton.cudagraphs": True} if opts.cudagraphs else {}
    patches["reorder_for_locality"] = opts.reorder_for_locality
    if opts.graph_splits and opts.cudagraphs:  # the graphs are cut at each dejavu::graph_split
        patches["graph_partition"] = True
    if opts.multi_kernel:  # each qualifying reduction both ways, the faster kept
        patches["triton.multi_kernel"] = 1
    pdl = opts.inductor_pdl
    if pdl is None:  # the default: with the dejavu kernels' own, where this Inductor has it
        from dejavu_compile.kernels.triton_common import programmatic

        pdl = programmatic() and inductor_has("triton.enable_pdl")
    if pdl:  # Inductor's kernels launched programmatically, as ours are
        if not inductor_has("triton.enable_pdl"):
            raise ValueError(f"option 'inductor_pdl' needs an Inductor with "
                             f"triton.enable_pdl; torch {torch.__version__} has none")
        patches["triton.enable_pdl"] = True
    return patches


def inductor_has(key: str) -> bool:
    """Whether this PyTorch's Inductor has the config ``key`` (a dotted name)."""
    from torch._inductor import config as inductor_config

    return key in inductor_config.get_config_copy()


def seed_shipped_configs(example_inputs) -> None:
    """Seed the kernels' autotuners with the configs shipped for each CUDA GPU that the graph's
    inputs are on (option ``shipped_configs``; ``kernels.tuning.seed_shipped``)."""
    from dejavu_compile import kernels

    devices = {t.device for t in example_inputs
               if isinstance(t, torch.Tensor) and t.device.type == "cuda"}
    if not devices or not kernels.HAVE_TRITON:
        return
    from dejavu_compile.kernels import tuning

    for device in devices:
        gpu = torch.cuda.get_device_name(device)
        count = tuning.seed_shipped(gpu)
        if count:
            log.info("dejavu: %d kernel tuning keys from %s", count, tuning.shipped_path(gpu))


def _inner_compile(gm: fx.GraphModule, example_inputs, opts: DejavuOptions):
    if opts.inner == "eager":
        return gm.forward
    from torch._inductor.compile_fx import compile_fx

    return compile_fx(gm, example_inputs, config_patches=inductor_patches(opts))


def dejavu_backend(gm: fx.GraphModule, example_inputs, options: dict | None = None, **kwargs):
    """The torch.compile backend registered as ``"dejavu"``.

    ``options`` is the dict given to ``torch.compile(..., options=...)`` (see ``DejavuOptions``).
    ``mode`` is accepted for compatibility and ignored: the inner compiler's defaults apply.
    """
    unknown = sorted(set(kwargs) - {"mode"})
    if unknown:
        raise TypeError(f"dejavu backend got unexpected argument(s) {unknown}")
    opts = options if isinstance(options, DejavuOptions) else DejavuOptions.from_mapping(options)
    if opts.shipped_configs:
        seed_shipped_configs(example_inputs)
    ctx = transform(gm, example_inputs, opts)
    with _LOCK:
        report = build_graph_report(ctx, index=len(_REPORTS))
        _REPORTS.append(report)
    log.info("%s", CompileReport([report]))
    compiled = _inner_compile(gm, example_inputs, opts)
    if ctx.counters.values.get("relayout_pending"):
        ensure_recompile_budget()
        return _release_after(compiled)
    return compiled


# Dynamo keeps at most ``recompile_limit`` graphs per code object, for every model of the same
# class together, and past it runs the frame uncompiled: silently dense. The in-place re-layout
# recompiles each graph of a model once, and an evaluation compiles several copies of one model
# (dense twin, oracle, profile), so the backend raises the limit to at least this.
RECOMPILE_LIMIT = 64


def ensure_recompile_budget() -> None:
    """Raise Dynamo's ``recompile_limit`` to ``RECOMPILE_LIMIT`` if it is lower (logged)."""
    config = torch._dynamo.config
    if config.recompile_limit < RECOMPILE_LIMIT:
        log.info("dejavu: raising torch._dynamo.config.recompile_limit from %d to %d",
                 config.recompile_limit, RECOMPILE_LIMIT)
        config.recompile_limit = RECOMPILE_LIMIT


def _release_after(compiled):
    """``compiled``, followed on each call by the in-place re-layout of the weights the lower
    pass asked for (``passes.lower.release_pending``): Dynamo guards on the weights' strides, so
    the swap waits until the graph that read them strided has run; the next call recompiles."""

    released = []

    def run(*args):
        if released:
            raise RuntimeError(
                "dejavu: a graph compiled for the weights' layout before their in-place "
                "re-layout was called again (Dynamo did not recompile for the new strides); "
                "compile with options={'relayout': 'copy'} to keep the parameters as they are")
        out = compiled(*args)
        if lower.pending():
            count = lower.release_pending()
            log.info("dejavu: re-laid out %d weights in place; Dynamo recompiles for their "
                     "new strides on the next call", count)
        released.append(True)
        return out

    return run


def report(model: torch.nn.Module) -> CompileReport:
    """The compile report of every graph the backend compiled for ``model``'s parameters."""
    params = list(model.parameters())
    with _LOCK:
        graphs = [g for g in _REPORTS if any(p in g.params for p in params)]
    if not graphs:
        raise LookupError(
            "no dejavu compilation found for this model: run it once after "
            "torch.compile(..., backend='dejavu') (compilation happens on the first call)"
        )
    return CompileReport(graphs)


def _refuse_other_shapes(model: torch.nn.Module, profile: Profile | None) -> None:
    """Refuse, before anything is traced, a profile whose model has other shapes than a Hugging
    Face ``model``'s config says. The sparsify pass checks each layer again from the graph,
    which is all a model without such a config gets."""
    if profile is None:
        return
    try:  # the shapes the calibrator wrote into the profile, read the same way
        here = ModelIdentity.from_config(getattr(model, "config", None), profile.model.name)
    except AttributeError:  # no config, or one without those fields
        return
    wrong = profile.model.mismatch(here)
    if wrong:
        raise ProfileError(f"profile for {profile.model.name!r} does not fit this model: its "
                           f"config has {wrong}")


def _checked_options(model: torch.nn.Module, opts: DejavuOptions) -> DejavuOptions:
    """``opts`` with its profile read now, so that a missing or malformed profile is an error
    here, not at the first call (where Dynamo would wrap it in BackendCompilerFailed), and
    each traced graph uses the one read; and refused if its shapes are not ``model``'s
    (``_refuse_other_shapes``)."""
    if opts.profile is not None:
        opts = dataclasses.replace(opts, profile=_resolve_profile(opts.profile))
    _refuse_other_shapes(model, opts.profile)
    return opts


def compile(model: torch.nn.Module, *, capture: bool = False,  # noqa: A001
            **options) -> torch.nn.Module:
    """Compile ``model`` in place with the dejavu backend, so ``model.generate()`` uses it.

    ``torch.compile(model, ...)`` returns a wrapper whose ``generate`` still calls the plain
    model; ``nn.Module.compile`` compiles the module's own ``__call__`` instead. Hugging Face's
    own automatic compilation (static caches on GPU) is switched off: it would trace through
    this backend with Inductor alone.

    ``capture=True``: the compiled ``forward`` is replayed through ``CapturedStep`` instead
    (installed as the model's ``forward``, with the original's signature, which ``generate``
    reads to choose its arguments). ``model.generate(..., cache_implementation="static")``
    then replays each decode step from dejavu's own CUDA graph on a GPU: with a static cache,
    transformers 5.17 gives every decode step the same shapes (a 4-d mask of the cache's
    length), so the second step captures and the later ones replay. The prefill (its cache not
    filled yet) and calls on CPU run the compiled forward as it is. Leave ``cudagraphs`` off.
    """
    opts = _checked_options(model, DejavuOptions.from_mapping(options))
    if capture and opts.cudagraphs:
        raise ValueError("compile(capture=True) records its own CUDA graphs (CapturedStep); "
                         "leave the option 'cudagraphs' off")
    register_model(model)
    ensure_recompile_budget()
    generation_config = getattr(model, "generation_config", None)
    if generation_config is not None:
        generation_config.disable_compile = True
    if not capture:
        model.compile(backend=dejavu_backend, options=opts)
        return model
    from .capture import CapturedStep

    forward = model.forward
    step = CapturedStep(torch.compile(forward, backend=dejavu_backend, options=opts))
    functools.update_wrapper(step, forward)  # generate reads the signature through __wrapped__
    model.forward = step
    return model
