"""Where a dejavu step goes wrong when its kernels launch programmatically, on a GPU.

Found in the forty-fourth session (BENCHMARKS.md): on an H200, a small OPT (4 layers, d 2048,
16 heads, the fixed selector at MLP 0.25 and heads 0.5, option ``lazy_kv``, no CUDA graphs)
compiled by dejavu and called step by step without a capture gave logits up to 0.88 away from
the same step with dense K/V, under programmatic launch, the default on Hopper.

In the forty-fifth session this study, against a reference with nothing launched
programmatically, showed that the step with dense K/V went wrong too (4 of 8 runs), that a
captured step could (1 of 8), and that every run was right (16 of 16) with the add-norm and
finish kernels launched plainly and every other kernel programmatically, while launching any
other group of dejavu kernels plainly, or the lazy kernel plainly, unsplit or over heads, or
syncing around each lazy launch, left runs wrong. Those two kernels have launched plainly
since (``triton_common.ADD_NORM_PDL`` and ``FINISH_PDL``); what goes wrong when they launch
programmatically is not known.

The study runs the step uncaptured against the reference (the step with dense K/V compiled
from the same model, Inductor's kernels and dejavu's launched plainly), under variants:

- ``dense as is``: the step with dense K/V, as compiled;
- ``as is``: the step (lazy K/V), as compiled;
- ``sync before``: the GPU synchronised before each lazy K/V launch, so everything before it
  has finished;
- ``sync after``: synchronised after each, so nothing after it starts before it has finished;
- ``lazy plain``: the lazy K/V kernel launched without programmatic launch;
- ``lazy unsplit``: the lazy K/V kernel in one program over d per tile (no atomics, no finish
  by a tile's last program);
- ``heads grid``: the lazy K/V kernel's programs over every head, not the selection's slots;
- ``dejavu plain``: every dejavu kernel launched without programmatic launch, Inductor's
  kernels as compiled (programmatically);
- ``mlp plain``, ``projection plain``, ``output plain``, ``attention plain``,
  ``selector plain``: that group of dejavu kernels (``GROUPS``) launched plainly, every
  other as it is;
- ``others plain``: every dejavu kernel but the lazy one launched plainly;
- ``add_norm programmatic``, ``finish programmatic``, ``norm programmatic``: the add-norm
  kernel, the finish kernel or both launched programmatically again, as before the fix;
  ``norm programmatic sync before`` and ``... sync after``: both, with the GPU synchronised
  before or after each add-norm launch (whether what goes wrong is before the kernel or
  after it); ``add_norm programmatic mlp plain`` (and ``projection``, ``output``,
  ``attention``, ``selector``, ``lazy``): the add-norm kernel launched programmatically with
  that group of dejavu kernels launched plainly (the forty-ninth session found the add-norm
  kernel's early start alone wrong, and wrong without Inductor's programmatic launches: if a
  group's kernels read its output too early, runs with that group plain are right);
  ``norm late``: both launched programmatically, each starting its successor
  after its last store (``DEJAVU_NORM_LAUNCH=late``, bench modes ``*_normlate_pdl``);
  ``norm programmatic exit``: both launched programmatically as before the fix, but no
  kernel starting its successor before its programs exit (``DEJAVU_PDL_START=exit``, bench
  modes ``*_exit_pdl``): the launches of ``norm programmatic`` without any early start;
- ``captured``: the same step replayed through ``CapturedStep`` (its first step runs
  uncaptured, the others replay the capture);
- ``inductor plain`` (compiled again, after the others): Inductor's own kernels launched
  without programmatic launch (option ``inductor_pdl`` off);
- ``inductor waits`` (compiled again): Inductor's kernels launched programmatically, but each
  compiled to wait before its first load (this PyTorch's codegen patched for the compile).
  Inductor waits before a load only when the kernel it scheduled just before writes the
  buffer (``early_loads`` lists the kernels that load before their wait, for each compile;
  ``never_wait`` those launched programmatically with none, and ``unguarded_after_ops``
  those right after a dejavu op that touch memory before it);
- ``norm programmatic inductor plain`` and ``norm programmatic inductor waits`` (each
  compiled again): those two with the add-norm and finish kernels launched programmatically,
  as before the fix (whether it is Inductor's kernels those two go wrong beside);
- ``norm programmatic no reuse`` (compiled again, Inductor reusing no buffer): the add-norm
  and finish kernels launched programmatically, every tensor they are given kept alive
  (whether what goes wrong is a later kernel writing into memory they have still to read).

Each runs ``--repeats`` times (``--only`` picks variants; ``--code DIR`` writes Inductor's code
of each compile there). A line per run: the steps whose logits are off (more than ``TOL`` of
the reference's largest), the first of them, and per layer the cache positions whose keys or
values are off, and how many of those hold the reference's row of the position before or
after (a step that wrote its row one position away); and the layers whose position counter
(Hugging Face's ``cumulative_length``) is not where the run left it.

Run on a CUDA machine: ``TRITON_INTERPRET=0 python examples/race_study.py`` (``--fuse-qkv``
for the lazy op with the query, as in the default step). On CPU it makes the same comparison
through the reference ops, ``as is`` and ``captured`` only (``CapturedStep`` runs the step
as it is there).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import re
from collections.abc import Callable, Iterator
from pathlib import Path
from unittest import mock

import torch
from torch._inductor.utils import run_and_get_code

import dejavu_compile
from dejavu_compile import bench

# the failing test's step: the first k heads, a quarter of the neurons, no graphs of Inductor's
OPTIONS = {"selector": "fixed", "mlp_density": 0.25, "attention_density": 0.5,
           "lazy_kv": True, "cudagraphs": False}
PROMPT = 32
TOL = 2e-2  # of the reference's largest logit (or cache value)


def small_opt(layers: int, hidden: int, heads: int, device: str) -> torch.nn.Module:
    """A random OPT (fp16 on a GPU, fp32 on CPU) with random biases, so a dropped one shows."""
    import transformers as tf

    cfg = tf.OPTConfig(vocab_size=512, hidden_size=hidden, ffn_dim=4 * hidden,
                       num_hidden_layers=layers, num_attention_heads=heads,
                       word_embed_proj_dim=hidden, max_position_embeddings=1024)
    torch.manual_seed(0)
    dtype = torch.float16 if device == "cuda" else torch.float32
    model = tf.OPTForCausalLM(cfg).to(device, dtype).eval()
    with torch.no_grad():
        for mod in model.modules():
            if isinstance(mod, torch.nn.Linear) and mod.bias is not None:
                mod.bias.normal_(0, 0.05)
    return model


def compiled(model: torch.nn.Module, options: dict) -> Callable:
    """``model.forward`` compiled by dejavu with ``options`` (Dynamo reset first); it compiles
    at its first call, which should run inside ``no_cache()``: a patched codegen is not in the
    key of Inductor's FX graph cache."""
    torch._dynamo.reset()
    return torch.compile(model.forward, backend="dejavu", fullgraph=True, options=options)


def no_cache():
    return torch._inductor.config.patch(fx_graph_cache=False)


def decode(model: torch.nn.Module, forward: Callable, tokens: torch.Tensor, steps: int
           ) -> tuple[torch.Tensor, list, list[int]]:
    """``steps`` teacher-forced decode steps of ``forward`` after an eager prefill of the rest
    of ``tokens`` [1, P + steps], each called on its own (no capture): the logits [steps,
    vocab], each layer's (keys, values) after the last step, and each layer's position
    counter."""
    prompt = tokens.shape[1] - steps
    cache, mask = bench._prefilled(model, tokens[:, :prompt], tokens.shape[1] + 1)
    out = []
    with torch.no_grad():
        for i in range(steps):
            pos = torch.tensor([prompt + i], device=tokens.device)
            logits = forward(input_ids=tokens[:, prompt + i: prompt + i + 1],
                             past_key_values=cache, cache_position=pos, position_ids=pos[None],
                             attention_mask=mask, use_cache=True).logits
            out.append(logits[:, -1].float().clone())
    kv = [(layer.keys.float().clone(), layer.values.float().clone()) for layer in cache.layers]
    counters = [int(layer.cumulative_length) for layer in cache.layers]
    return torch.cat(out), kv, counters


def _cache_off(run: torch.Tensor, ref: torch.Tensor, tol: float) -> dict:
    """Where one layer's keys (or values) [B, H, L, hd] of a run are off the reference's:
    the positions, and how many of the rows off hold the reference's row of the position
    before or after. Rows the run left zero (heads the selector skipped) are not compared."""
    limit = tol * ref.abs().max().item()
    written = run.abs().amax(-1) > 0
    off = written & ((run - ref).abs().amax(-1) > limit)
    rows = off.nonzero().tolist()

    def holds(b: int, h: int, p: int, q: int) -> bool:
        return 0 <= q < ref.shape[2] and bool((run[b, h, p] - ref[b, h, q]).abs().max() <= limit)

    return {"positions": sorted({p for _, _, p in rows}),
            "previous": sum(holds(b, h, p, p - 1) for b, h, p in rows),
            "next": sum(holds(b, h, p, p + 1) for b, h, p in rows)}


def compare(run: tuple, ref: tuple, tol: float = TOL) -> dict:
    """A run of ``decode`` against the reference's: the steps whose logits are off and the
    largest difference, each layer's keys and values off (``_cache_off``, only layers with
    any), and the layers whose counter differs from the reference's."""
    logits, kv, counters = run
    ref_logits, ref_kv, ref_counters = ref
    err = (logits - ref_logits).abs().amax(-1)
    caches = {}
    for layer, ((k, v), (rk, rv)) in enumerate(zip(kv, ref_kv, strict=True)):
        found = {name: _cache_off(a, r, tol) for name, a, r in (("keys", k, rk),
                                                                 ("values", v, rv))}
        if any(f["positions"] for f in found.values()):
            caches[layer] = found
    return {"steps": (err > tol * ref_logits.abs().max()).nonzero().flatten().tolist(),
            "max": err.max().item(), "cache": caches,
            "counters": [layer for layer, (a, b) in enumerate(zip(counters, ref_counters,
                                                                strict=True))
                         if a != b]}


def describe(found: dict, steps: int) -> str:
    """One line for ``compare``'s result."""
    wrong = found["steps"]
    text = (f"{len(wrong)} of {steps} steps off" + (f" (first {wrong[0]})" if wrong else "")
            + f", logits max {found['max']:.4f}")
    for layer, parts in found["cache"].items():
        for name, f in parts.items():
            if f["positions"]:
                text += (f"; layer {layer} {name} off at {f['positions']} ({f['previous']} "
                         f"rows hold the position before's, {f['next']} the one after's)")
    if found["counters"]:
        text += f"; counters off in layers {found['counters']}"
    return text


def _synced(module, name: str, before: bool) -> contextlib.AbstractContextManager:
    """``module.name`` (a launcher) replaced, while inside, by one that synchronises the GPU
    before each call (``before``) or after it."""
    launch = getattr(module, name)

    def synced(*args, **kwargs):
        if before:
            torch.cuda.synchronize()
        out = launch(*args, **kwargs)
        if not before:
            torch.cuda.synchronize()
        return out

    return mock.patch.object(module, name, synced)


@contextlib.contextmanager
def _norm_programmatic(add_norm: bool, finish: bool, sync_before: bool | None = None
                       ) -> Iterator[None]:
    """The add-norm kernel (``add_norm``) and the finish kernel (``finish``) launched
    programmatically, as every kernel was before the forty-fifth session's fix
    (``triton_common.ADD_NORM_PDL`` and ``FINISH_PDL``); with ``sync_before`` true or false,
    the GPU synchronised before or after each add-norm launch
    (``triton_common._launch_add_norm``)."""
    from dejavu_compile.kernels import triton_common

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(triton_common, "ADD_NORM_PDL", add_norm))
        stack.enter_context(mock.patch.object(triton_common, "FINISH_PDL", finish))
        if sync_before is not None:
            stack.enter_context(_synced(triton_common, "_launch_add_norm", sync_before))
        yield


@contextlib.contextmanager
def _dejavu_plain() -> Iterator[None]:
    """Every dejavu kernel launched without programmatic launch (each module's ``pdl_meta``),
    Inductor's kernels as compiled (programmatically)."""
    from dejavu_compile.kernels import bucket_select, decode_attention, lazy_kv, triton_common

    with contextlib.ExitStack() as stack:
        for module in (bucket_select, decode_attention, lazy_kv, triton_common):
            stack.enter_context(mock.patch.object(module, "pdl_meta", lambda: {"PDL": False}))
        yield


# the dejavu kernels by the op they serve, for the variants that launch one group plainly
GROUPS = {"mlp": ("_up_kernel", "_down_kernel", "_up_union_kernel", "_down_union_kernel",
                  "_up_store_kernel"),
          "projection": ("_head_proj_kernel", "_head_proj_store_kernel",
                         "_head_proj_union_kernel", "_gemv_kernel"),
          "output": ("_head_out_kernel", "_head_out_cols_kernel", "_head_out_union_kernel"),
          "attention": ("_split_kernel", "_combine_kernel"),
          "norm": ("_add_norm_kernel", "_finish_kernel"),
          "selector": ("_hidden_kernel", "_bucket_kernel"),
          "lazy": ("_lazy_kv_kernel", "_decode_kernel")}


@contextlib.contextmanager
def _plain(names: tuple[str, ...]) -> Iterator[None]:
    """The Triton kernels named ``names`` launched without programmatic launch (``PDL`` false,
    no ``launch_pdl``), every other kernel as it was: Triton's ``JITFunction.run`` patched,
    which every launch of a ``triton.jit`` kernel, autotuned or not, goes through."""
    from triton.runtime.jit import JITFunction

    run = JITFunction.run

    def plain(self, *args, grid, warmup, **kwargs):
        if self.fn.__name__ in names and "PDL" in self.arg_names:
            kwargs = {**kwargs, "PDL": False}
            kwargs.pop("launch_pdl", None)
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    with mock.patch.object(JITFunction, "run", plain):
        yield


def _unsplit(n: int, config: dict | None = None) -> dict:
    from dejavu_compile.kernels import lazy_kv

    return lazy_kv.PREFILL_FIXED if n > 1 else (config or lazy_kv.DETERMINISTIC_FIXED)


def variants() -> dict[str, Callable[[], contextlib.AbstractContextManager]]:
    """The study's variants of one compiled step (see the module docstring), by name."""
    from dejavu_compile.kernels import lazy_kv, triton_common

    return {"as is": contextlib.nullcontext,
            "sync before": lambda: _synced(lazy_kv, "_launch", True),
            "sync after": lambda: _synced(lazy_kv, "_launch", False),
            "lazy plain": lambda: mock.patch.object(lazy_kv, "pdl_meta",
                                                    lambda: {"PDL": False}),
            "lazy unsplit": lambda: mock.patch.object(lazy_kv, "step_config", _unsplit),
            "heads grid": lambda: mock.patch.dict(os.environ, {lazy_kv.GRID_ENV: "heads"}),
            "dejavu plain": _dejavu_plain,
            **{f"{group} plain": (lambda names=names: _plain(names))
               for group, names in GROUPS.items() if group not in ("lazy", "norm")},
            "others plain": lambda: _plain(tuple(n for group, names in GROUPS.items()
                                                 if group != "lazy" for n in names)),
            "add_norm programmatic": lambda: _norm_programmatic(True, False),
            **{f"add_norm programmatic {group} plain": (
                lambda names=names: _both(lambda: _norm_programmatic(True, False),
                                          lambda: _plain(names)))
               for group, names in GROUPS.items() if group != "norm"},
            "finish programmatic": lambda: _norm_programmatic(False, True),
            "norm programmatic": lambda: _norm_programmatic(True, True),
            "norm programmatic sync before": lambda: _norm_programmatic(True, True, True),
            "norm programmatic sync after": lambda: _norm_programmatic(True, True, False),
            "norm late": lambda: mock.patch.dict(os.environ,
                                                 {triton_common.NORM_LAUNCH_ENV: "late"}),
            "norm programmatic exit": lambda: _both(
                lambda: _norm_programmatic(True, True),
                lambda: mock.patch.dict(os.environ, {triton_common.PDL_START_ENV: "exit"}))}


def _kernel_sources(codes: list[str]) -> list[tuple[str, str]]:
    """(name, source) of each Triton kernel in Inductor's ``codes`` (``run_and_get_code``'s):
    the source its ``async_compile.triton`` call compiles, its ``triton_meta`` included."""
    return [match.groups() for code in codes
            for match in re.finditer(r"async_compile\.triton\('(\w+)', '''(.*?)'''", code,
                                     re.S)]


def early_loads(codes: list[str]) -> list[str]:
    """The Triton kernels in Inductor's ``codes`` (``run_and_get_code``'s) that load before
    their ``gdc_wait``: under programmatic launch Inductor waits before a load only when the
    kernel it scheduled just before writes that buffer
    (``TritonKernel._handle_pdl_before_access``), so such a load may run while that kernel
    does."""
    found = []
    for name, source in _kernel_sources(codes):
        wait, load = source.find("gdc_wait"), source.find("tl.load")
        if 0 <= load < wait and name not in found:
            found.append(name)
    return found


def never_wait(codes: list[str]) -> list[str]:
    """The Triton kernels in Inductor's ``codes`` launched programmatically (``launch_pdl`` in
    their ``triton_meta``) that never wait. Inductor writes its wait after a kernel's first
    load, before anything after an extern kernel (a dejavu op: its scheduler has no node
    before then), and before a store only into what the node before reads or writes, so a
    kernel that loads nothing after one of its own may have none. Such a kernel can finish
    before the kernel before it has: the kernel after it then waits for it alone, while
    every kernel's loads before its wait (ours and Inductor's) take what is older than its
    predecessor as finished. (A store before the wait is safe: only the kernel before may
    still run then, and Inductor knows what that one touches.)"""
    found = []
    for name, source in _kernel_sources(codes):
        if "'launch_pdl': True" in source and "gdc_wait" not in source and name not in found:
            found.append(name)
    return found


def after_ops(codes: list[str]) -> dict[str, bool]:
    """Inductor's kernels launched programmatically right after a dejavu op (the next launch
    in the wrapper's code), each with whether it loads or stores anything before its wait.
    The kernels of a dejavu op let their successor start once they have waited, before they
    read their inputs and write their outputs, so the launch after the op must wait before it
    touches memory; Inductor's codegen does (its scheduler has no node before a kernel that
    follows an extern one), and this checks that it did."""
    found: dict[str, bool] = {}
    for code in codes:
        sources = dict(_kernel_sources([code]))
        after_op = False
        for line in code.splitlines():
            launch = re.search(r"\b(triton_\w+)\.run\(", line)
            if "torch.ops.dejavu." in line:
                after_op = True
            elif launch:
                source = sources.get(launch.group(1), "")
                if after_op and "'launch_pdl': True" in source:
                    first = min([i for i in (source.find("tl.load"), source.find("tl.store"))
                                 if i >= 0], default=len(source))
                    early = not 0 <= source.find("gdc_wait") < first
                    found[launch.group(1)] = found.get(launch.group(1), False) or early
                after_op = False
            elif "extern_kernels." in line or "torch.ops." in line:
                after_op = False
    return found


def unguarded_after_ops(codes: list[str]) -> list[str]:
    """The kernels of ``after_ops`` that touch memory before their wait."""
    return [name for name, early in after_ops(codes).items() if early]


@contextlib.contextmanager
def _inductor_waits_first() -> Iterator[None]:
    """Inductor's Triton kernels compiled with their ``gdc_wait`` before their first load or
    store, whatever the kernel before writes (this PyTorch's codegen, patched while inside)."""
    from torch._inductor.codegen import triton as codegen

    kernel = codegen.TritonKernel
    if not hasattr(kernel, "_handle_pdl_before_access"):
        raise RuntimeError("this PyTorch's Inductor has no "
                           "TritonKernel._handle_pdl_before_access to patch")

    def wait_first(self, wait_buffer, *dependencies, consider_reads=False):
        if not self._enable_pdl_codegen():
            return
        if self.inside_reduction and self.range_trees[-1].is_loop:
            wait_buffer = self.body  # before the loop, where Inductor puts it too
        wait_buffer.writeline(self.GDC_WAIT)

    with mock.patch.object(kernel, "_handle_pdl_before_access", wait_first):
        yield


@contextlib.contextmanager
def _kept_inputs() -> Iterator[list[torch.Tensor]]:
    """While inside, every tensor given to an add-norm or finish launch kept alive (the list
    yielded), so that the caching allocator hands none of their memory to a later tensor: a
    kernel launched programmatically starts its successor right after its wait and reads its
    inputs after that, so a successor that wrote into memory freed after the launch before
    its own wait would overwrite what the kernel has still to read."""
    from dejavu_compile.kernels import sparse_mlp, triton_common

    kept: list[torch.Tensor] = []

    def keeping(launch: Callable) -> Callable:
        def launched(*args, **kwargs):
            kept.extend(a for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor))
            return launch(*args, **kwargs)
        return launched

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(triton_common, "_launch_add_norm",
                                              keeping(triton_common._launch_add_norm)))
        finish = keeping(triton_common.finish)
        for module in (triton_common, sparse_mlp):  # sparse_mlp imports it by name
            stack.enter_context(mock.patch.object(module, "finish", finish))
        yield kept


def _no_reuse() -> contextlib.AbstractContextManager:
    """Inductor compiling with no buffer reused, in place or after its last reader."""
    return torch._inductor.config.patch(allow_buffer_reuse=False, inplace_buffers=False)


@contextlib.contextmanager
def _both(*contexts: Callable[[], contextlib.AbstractContextManager]) -> Iterator[None]:
    """Inside each of ``contexts`` (factories) at once."""
    with contextlib.ExitStack() as stack:
        for context in contexts:
            stack.enter_context(context())
        yield


# variants compiled again: their options over the study's, and what their compile and runs
# run inside. The last three launch the add-norm and finish kernels programmatically again:
# beside Inductor's kernels launched plainly or waiting first (if those two go wrong only
# through Inductor's order of waits, their runs are right), and with no memory they read
# given to a later tensor (Inductor's buffer reuse off, their inputs kept alive: if a later
# kernel overwrites what they have still to read, their runs are right).
COMPILED = {"inductor plain": ({"inductor_pdl": False}, contextlib.nullcontext),
            "inductor waits": ({}, _inductor_waits_first),
            "norm programmatic inductor plain": (
                {"inductor_pdl": False}, lambda: _norm_programmatic(True, True)),
            "norm programmatic inductor waits": (
                {}, lambda: _both(_inductor_waits_first,
                                  lambda: _norm_programmatic(True, True))),
            "norm programmatic no reuse": (
                {}, lambda: _both(_no_reuse, _kept_inputs,
                                  lambda: _norm_programmatic(True, True)))}


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--heads", type=int, default=16)
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=6)
    p.add_argument("--fuse-qkv", action="store_true",
                   help="the lazy op with the query (option fuse_qkv), as in the default step")
    p.add_argument("--code", default="",
                   help="a folder to write Inductor's code of each compile into (the wrapper "
                        "that orders the launches, and its kernels)")
    p.add_argument("--only", default="",
                   help="comma-separated names of the variants to run (default: all of them)")
    args = p.parse_args(argv)
    only = {name.strip() for name in args.only.split(",") if name.strip()}
    known = {"dense as is", "captured", *variants(), *COMPILED}
    if only - known:
        raise SystemExit(f"--only: no variant {sorted(only - known)}; the variants are "
                         f"{sorted(known)}")

    def wanted(name: str) -> bool:
        return not only or name in only
    for name in ("layers", "hidden", "heads", "steps", "repeats"):
        if getattr(args, name) < 1:
            raise SystemExit(f"--{name} must be at least 1, got {getattr(args, name)}")
    if args.hidden % args.heads:
        raise SystemExit(f"--hidden {args.hidden} must be a multiple of --heads {args.heads}")
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    model = small_opt(args.layers, args.hidden, args.heads, device)
    tokens = torch.randint(0, 512, (1, PROMPT + args.steps),
                           generator=torch.Generator().manual_seed(args.seed)).to(device)
    options = {**OPTIONS, "fuse_qkv": args.fuse_qkv}
    mode = "dejavu_captured_qkv_pdl" if args.fuse_qkv else "dejavu_captured_lazy_pdl"
    print(f"OPT {args.layers} layers, d {args.hidden}, {args.heads} heads, {args.steps} steps "
          f"uncaptured after a {PROMPT}-token prefill; lazy K/V "
          f"{'with' if args.fuse_qkv else 'without'} the query against dense K/V", flush=True)
    dense = {**options, "lazy_kv": False}
    with bench.kernel_switches(mode) if cuda else contextlib.nullcontext(), no_cache():
        # the reference: the step with dense K/V, no kernel launched programmatically
        with _dejavu_plain() if cuda else contextlib.nullcontext():
            plain = {**dense, "inductor_pdl": False} if cuda else dense
            ref = decode(model, compiled(model, plain), tokens, args.steps)
            print("reference (dense K/V, no programmatic launch) against itself, compiled "
                  "again: " + describe(compare(decode(model, compiled(model, plain), tokens,
                                                      args.steps), ref), args.steps),
                  flush=True)

        def warm(name: str, forward: Callable) -> None:
            """One run that compiles and tunes, and the kernels that load before their wait;
            Inductor's code into ``--code`` when given."""
            _, codes = run_and_get_code(decode, model, forward, tokens, args.steps)
            if args.code:
                folder = Path(args.code)
                folder.mkdir(parents=True, exist_ok=True)
                for i, code in enumerate(codes):
                    (folder / f"{name.replace(' ', '_')}_{i}.py").write_text(code)
            print(f"  {name:14s} loads before the wait: {early_loads(codes) or 'none'}; "
                  f"never waits: {never_wait(codes) or 'none'}; after a dejavu op, touches "
                  f"memory before the wait: {unguarded_after_ops(codes) or 'none'}", flush=True)

        def runs(name: str, forward: Callable) -> None:
            for r in range(args.repeats):
                found = compare(decode(model, forward, tokens, args.steps), ref)
                print(f"  {name:14s} run {r + 1}: {describe(found, args.steps)}", flush=True)

        if cuda and wanted("dense as is"):  # the step with dense K/V, as compiled
            forward = compiled(model, dense)
            warm("dense compiled", forward)
            runs("dense as is", forward)
        forward = compiled(model, options)
        warm("as compiled", forward)
        for name, variant in (variants() if cuda else {"as is": contextlib.nullcontext}).items():
            if wanted(name):
                with variant():
                    runs(name, forward)
        if wanted("captured"):
            runs("captured", dejavu_compile.CapturedStep(forward))
        for name, (extra, inside) in (COMPILED if cuda else {}).items():
            if not wanted(name):
                continue
            with contextlib.ExitStack() as stack:
                try:
                    stack.enter_context(inside())
                except RuntimeError as e:  # a codegen this PyTorch does not have
                    print(f"  {name:14s} skipped: {e}", flush=True)
                    continue
                forward = compiled(model, {**options, **extra})
                warm(name, forward)
                runs(name, forward)


if __name__ == "__main__":
    main()
