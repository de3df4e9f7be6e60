"""The decode step captured in one CUDA graph by dejavu itself, for decode loops that call the
model with a static cache.

    step = dejavu_compile.CapturedStep(torch.compile(model.forward, backend="dejavu",
                                                     options={"profile": ...}))
    out = step(input_ids=tok, past_key_values=cache, cache_position=pos, ...)  # a static cache

Why: Inductor's CUDA graphs (option ``cudagraphs``) replay the step's kernels, but each step
still pays on the host for Dynamo's guards, the AOT and CUDA-graph-tree wrappers and then the
graph's launch, and on an H200 a step took about the host's time plus the GPU's (BENCHMARKS.md,
twelfth and thirteenth sessions). Replaying a graph captured around
the whole compiled call leaves only the copies of the new inputs and the launch.

How: the first calls with a given cache (its tensors' addresses) and input shapes and strides
run the forward as it is (it compiles and autotunes there, which a capture cannot hold), until
one compiles nothing. The next captures it into ``torch.cuda.CUDAGraph``s reading copies of the
tensor arguments, then replays them; every later call copies its tensors into those copies (one
launch) and replays. The returned output is the captured one: its tensors are overwritten by
the next call, as with Inductor's CUDA graphs. Arguments that are not tensors (the cache,
flags) are part of the key: other values make another capture. A cache's part of the key is
worked out in full once per cache object and then only checked (its layers' tensors are still
the same objects at the same addresses): the full walk over the layers took 443 us a call for a
40-layer cache on a CPU core of the development machine, against 77 us for the check (an H200
decode step takes about 5 ms). The cache must be one that keeps all its state in tensors
updated in place (Hugging Face's ``StaticCache`` with full attention layers does; a
sliding-window layer keeps a Python count, which a replay would not advance, and is refused).
On CPU, with no tensor argument, or with a cache not filled yet (a prefill), the call goes
straight to the forward.

Caches in the output: a step's output holds the cache it was given (Hugging Face's
``past_key_values``), and a capture's output is kept to be returned by every replay, so until
the fifty-fourth session every cache a step was captured with stayed alive for as long as the
step, with its lazy K/V state (``kernels/kv_state.py``): on an H100, ``dejavu bench
--prompt 1919`` (three decode loops and a pipelined one, each on a new cache of 2048
positions) peaked at 33.9 GiB against HF compiled's 27.3, and 25.6 against 24.4 at the
default prompt: four caches held, each 1.68 GB of keys and values and 0.84 GB of lazy
inputs at 2048 positions (0.21 and 0.11 GB at 257), where HF compiled's loop holds two at
most, account for all but about 0.4 GiB of each difference, the same at both prompts
(dejavu's predictors and the like). Since this change that bench peaks at 29.2 GiB at
``--prompt 1919`` and 25.0 at the default prompt (H100, fifty-fifth session). A capture's output
now keeps no cache: each replay puts the call's own caches where the capture's output held
one (a dict output, such as a ``ModelOutput``, in place; a tuple anew), and a call that
replays another key's capture empties the dict outputs of the key before, so a cache the
caller drops is freed once a call has replayed a capture made with another. The captures
made with a freed cache are dropped at the next call (``_purge``): their graphs would read
and write its freed memory, and a new cache at the same addresses is run as it is and
captured anew. A cache object that takes no weak references is held as before.

With ``generate``: ``dejavu_compile.compile(model, capture=True)`` installs this class as the
model's forward (see there).

Copies: ``CapturedStep(forward, copies=2)`` captures the step twice per key and replays the
captures in turn (each with its own output, which the call after next overwrites). CUDA runs
one launch of a graph at a time; with two, a step's launch need not wait for the one before.
Measured on an H200 (BENCHMARKS.md, fifteenth session), it does not pay: the same time step by
step, slower back to back (OPT-13B 5.54 against 5.06 ms, Llama-3-8B 4.38 against 4.13).

Segments: a forward compiled with ``graph_splits`` (and without ``cudagraphs``) runs a
``dejavu::graph_split`` op at each cut; while this class captures, that op ends the CUDA graph
being captured and begins the next, so the step becomes one graph per segment, replayed in
order. A graph's launch costs the host time in proportion to its kernels and the GPU starts a
graph only once its launch returns, so with segments the GPU starts on the first while the host
launches the rest (``segments``: the graphs per capture). Measured on OPT-13B with lookahead
(BENCHMARKS.md, fourteenth session, one run) three segments gained nothing: three launches
cost the host more than one, so a launch has a large fixed part.

Compile the forward without ``cudagraphs``: its kernels are to be recorded in this graph, not
in Inductor's.
"""

from __future__ import annotations

import inspect
import operator
import weakref
from collections.abc import Callable
from functools import partial
from typing import Any

import torch


def _state(value: Any) -> tuple:
    """What a non-tensor argument contributes to the capture's key: a filled cache's tensors'
    addresses (the graph reads and writes them in place; ``CapturedStep._cache_state`` gives
    an unfilled one no key), else the value itself."""
    layers = getattr(value, "layers", None)
    if layers is None:
        try:
            hash(value)
        except TypeError:
            raise TypeError(f"CapturedStep: argument of type {type(value).__name__} is neither a "
                            "tensor, a cache nor a plain value; a captured graph cannot take it"
                            ) from None
        return ("value", value)
    ptrs = []
    for i, layer in enumerate(layers):
        if not isinstance(getattr(layer, "cumulative_length", None), torch.Tensor):
            raise ValueError(
                f"CapturedStep: cache layer {i} ({type(layer).__name__}) keeps no count of its "
                "positions in a tensor: not a static cache (a dynamic cache's tensors grow and "
                "move every step, which a captured graph cannot follow); use a StaticCache")
        counts = [name for name, attr in vars(layer).items() if "length" in name
                  and isinstance(attr, int) and not isinstance(attr, bool)]
        if counts or getattr(layer, "is_sliding", False):
            raise ValueError(
                f"CapturedStep: cache layer {i} ({type(layer).__name__}) keeps a count of its "
                f"positions as a Python number ({', '.join(counts) or 'a sliding window'}), "
                "which a replayed graph would not advance; use a cache whose layers keep their "
                "state in tensors (a StaticCache of full-attention layers), or Inductor's CUDA "
                "graphs (option cudagraphs)")
        ptrs.extend((i, name, attr.data_ptr()) for name, attr in sorted(vars(layer).items())
                    if isinstance(attr, torch.Tensor))
    if not ptrs:
        raise ValueError("CapturedStep: the cache has no layers yet (run the prefill first)")
    return ("cache", type(value).__name__, tuple(ptrs))


def _cache_slots(out: Any, kwargs: dict[str, Any]) -> list[tuple[Any, str]]:
    """Where the step's output ``out`` holds a cache argument of the call (``kwargs``): (its
    key or index in ``out``, the argument's name) for each; searched in a dict (a
    ``ModelOutput``) and in a plain tuple (``return_dict=False``), no deeper."""
    caches = [(name, v) for name, v in kwargs.items() if getattr(v, "layers", None) is not None
              and type(v).__weakrefoffset__]  # a cache the step cannot see freed stays held
    if isinstance(out, dict):
        items = out.items()
    elif type(out) is tuple:
        items = enumerate(out)
    else:
        return []
    return [(at, name) for at, v in items for name, c in caches if v is c]


def _placed(out: Any, slots: list[tuple[Any, str]], kwargs: dict[str, Any] | None) -> Any:
    """``out`` with each of ``slots`` (``_cache_slots``) holding the argument of ``kwargs``
    that it names, or None without ``kwargs``: a dict changed in place, a tuple made anew."""
    if type(out) is tuple:
        items = list(out)
        for at, name in slots:
            items[at] = None if kwargs is None else kwargs[name]
        return tuple(items)
    for at, name in slots:
        out[at] = None if kwargs is None else kwargs[name]
    return out


def _unfilled_layer(value: Any) -> int | None:
    """The first layer of the cache ``value`` that holds no tensors yet (None when every layer
    does, or ``value`` is no cache): such a cache gets no key, and a call with one (the prefill
    that fills it, ``generate``'s first call) runs as it is."""
    for i, layer in enumerate(getattr(value, "layers", None) or ()):
        if getattr(layer, "is_initialized", True) is False:
            return i
    return None


def _gatherer(names: list[tuple[str, ...]]) -> Callable[[Any], list]:
    """A function of a cache's layers that returns, in one list, the attributes ``names[i]``
    of each layer ``i`` (a layer short of one raises ``AttributeError``). When every layer has
    the same names (a cache of one kind of layer), one C-level ``map`` of
    ``operator.attrgetter`` per name, the list ordered by name and then by layer; else a
    Python loop, ordered by layer."""
    if len(set(names)) == 1:
        gets = [operator.attrgetter(name) for name in names[0]]

        def alike(layers) -> list:
            out = []
            for get in gets:
                out.extend(map(get, layers))
            return out

        return alike
    return lambda layers: [getattr(layer, name) for layer, n in zip(layers, names, strict=True)
                           for name in n]


def _same_addresses(tensors: list[torch.Tensor], ptrs: tuple[list[int], list[int]]) -> bool:
    """Whether ``tensors`` start at the addresses ``ptrs[0]`` (``ptrs[1]``: their indices,
    ``0 .. n-1``): PyTorch's own check in C where the build has it (the CUDA builds;
    Inductor's CUDA graphs check their static inputs with it), else ``data_ptr`` mapped over
    them."""
    if len(tensors) != len(ptrs[0]):
        return False
    if _PTRS_EQUAL is not None:
        return _PTRS_EQUAL(tensors, *ptrs)
    return list(map(torch.Tensor.data_ptr, tensors)) == ptrs[0]


_PTRS_EQUAL = getattr(torch._C, "_tensors_data_ptrs_at_indices_equal", None)


def _forget(step: weakref.ref, key: int, _dead: weakref.ref) -> None:
    """A cache's memo dropped from ``step`` (if it still lives) when the cache is freed, and its
    part of the key noted for ``CapturedStep._purge``. The step is reached through a weak
    reference: a callback that held its memo dictionary would make a cycle that kept the memo,
    with the cache's tensors, until the garbage collector ran."""
    live = step()
    if live is not None:
        memo = live._caches.pop(key, None)
        if memo is not None:
            live._gone.append(memo[5])


class CapturedStep:
    """``forward`` (a compiled decode step) replayed from CUDA graphs captured per cache and
    input shapes; see the module docstring."""

    def __init__(self, forward: Callable[..., Any], copies: int = 1):
        if not isinstance(copies, int) or isinstance(copies, bool) or copies < 1:
            raise ValueError(f"CapturedStep: copies must be an int >= 1, got {copies!r}")
        self.forward = forward
        self.copies = copies
        # key -> [the tensor arguments' copies, [(graphs in replay order, output, where the
        # output holds a cache argument) per capture of the step], the capture the next call
        # replays]
        self._graphs: dict[tuple, list] = {}
        self._holding = None  # the _graphs entry whose dict outputs hold its call's caches
        self._gone: list[tuple] = []  # the key parts of caches freed since the last call
        self._seen: set[tuple] = set()
        self._pool = None  # one memory pool for every graph this step captures
        # id(cache) -> (weak reference to it, its layers, their tensors' gatherer, the tensors,
        # (their addresses, their indices), its part of the key); see _cache_state
        self._caches: dict[int, tuple] = {}
        self._states: dict[tuple, int] = {}  # a cache's _state -> its number in the key

    def _cache_state(self, value: Any) -> tuple | None:
        """``_state(value)``'s part of the key, worked out once per cache object and then only
        checked: the same layer objects holding the same tensor objects at the same addresses.
        None for a cache with a layer that holds no tensors yet (only looked for when the check
        fails: a checked cache's layers are the ones that held tensors).
        The part is ``("cache", n)``, ``n`` this step's number for the cache's addresses (one
        number per distinct ``_state``), so that the key hashes a few values, not 3 per tensor.
        The memo keeps the cache's layers and tensors (to check them by identity) only while the
        cache object lives: a weak reference's callback drops it with the cache, so a cache the
        caller drops is freed; a layer's tensor replaced stays alive until the next call with
        that cache, which works the memo out again (and notes the old part for ``_purge``).
        The check runs on every replayed step, before the launch, so it is kept to loops in C
        (``map``; the addresses compared by PyTorch's own check where it has one): on the
        H200's host the key took 0.18 ms a step with the check written as a Python loop, 0.13
        ms with these loops but checking ids (thirtieth session, ``examples/host_study.py``)."""
        layers = value.layers
        memo = self._caches.get(id(value))
        if memo is not None and memo[0]() is value and len(layers) == len(memo[1]) \
                and all(map(operator.is_, layers, memo[1])):
            _, _, gather, kept, ptrs, part = memo
            try:
                tensors = gather(layers)
            except AttributeError:  # a layer lost an attribute: worked out in full below
                tensors = None
            if tensors is not None and len(tensors) == len(kept) \
                    and all(map(operator.is_, tensors, kept)) and _same_addresses(tensors, ptrs):
                return part
        if memo is not None:  # tensors replaced or moved: their captures go (``_purge``)
            self._gone.append(memo[5])
        if _unfilled_layer(value) is not None:
            return None
        state = _state(value)  # ("cache", type name, ((layer index, name, address), ...))
        part = ("cache", self._states.setdefault(state, len(self._states)))
        try:
            ref = weakref.ref(value, partial(_forget, weakref.ref(self), id(value)))
        except TypeError:  # no weak references to it: worked out in full on every call
            return part
        names = [[] for _ in layers]
        for i, name, _ in state[2]:
            names[i].append(name)
        gather = _gatherer([tuple(n) for n in names])
        tensors = gather(layers)
        self._caches[id(value)] = (ref, list(layers), gather, tensors,
                                   ([t.data_ptr() for t in tensors], list(range(len(tensors)))),
                                   part)
        return part

    def key(self, kwargs: dict[str, Any]) -> tuple | None:
        """The capture a call replays: each tensor argument's shape, strides, dtype and device
        (what Dynamo's guards check), each other argument's ``_state``. None when a cache
        argument has a layer that holds no tensors yet (such a call runs as it is)."""
        parts = []
        for name in sorted(kwargs):
            value = kwargs[name]
            if isinstance(value, torch.Tensor):
                parts.append((name, "tensor", value.shape, value.stride(), value.dtype,
                              value.device))
            elif getattr(value, "layers", None) is not None:
                state = self._cache_state(value)
                if state is None:
                    return None
                parts.append((name, *state))
            else:
                parts.append((name, *_state(value)))
        return tuple(parts)

    @property
    def captured(self) -> int:
        """How many captures this step holds (one per cache and input shapes)."""
        return len(self._graphs)

    @property
    def segments(self) -> list[int]:
        """The CUDA graphs of each capture, in capture order: 1 unless the forward was compiled
        with ``graph_splits``."""
        return [len(captures[0][0]) for _, captures, _ in self._graphs.values()]

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if args:  # by name, as the key reads them (``model(ids)`` once installed as forward)
            signature = inspect.signature(getattr(self, "__wrapped__", self.forward))
            kwargs = {**signature.bind_partial(*args).arguments, **kwargs}
        tensors = {k: v for k, v in kwargs.items() if isinstance(v, torch.Tensor)}
        if not tensors or any(t.device.type != "cuda" for t in tensors.values()):
            return self.forward(**kwargs)
        if self._gone:
            self._purge()
        key = self.key(kwargs)
        if key is None:  # the prefill that fills the cache, generate()'s first call
            return self.forward(**kwargs)
        entry = self._graphs.get(key)
        if entry is None:
            if key not in self._seen:  # compile and autotune outside a capture
                return self._warm(key, kwargs)
            # same strides as the call's tensors, so the guards of the compiled forward hold
            inputs = {name: torch.empty_strided(t.shape, t.stride(), dtype=t.dtype,
                                                device=t.device).copy_(t)
                      for name, t in tensors.items()}
            captures = [self._capture(kwargs, inputs) for _ in range(self.copies)]
            entry = self._graphs[key] = [inputs, captures, 0]
        graphs, out, slots = self._load(entry, tensors)
        for graph in graphs:
            graph.replay()
        return self._hand_out(entry, out, slots, kwargs) if slots else out

    def _purge(self) -> None:
        """Drop the captures (and the note that their key compiled nothing) made with a cache
        that has been freed since, unless a live cache object has the same addresses: such a
        capture's graphs read and write the freed cache's memory and its lazy K/V state, freed
        with it (``kernels/kv_state.py``), and a new cache that the allocator puts at the same
        addresses has the same key, so it must be run as it is first (that makes its state)
        and captured anew."""
        live = {memo[5] for memo in self._caches.values()}
        gone = {part for part in self._gone if part not in live}
        self._gone.clear()
        if not gone:
            return

        def stale(key: tuple) -> bool:
            return any(part[1:] in gone for part in key)

        for key in [k for k in self._graphs if stale(k)]:
            if self._graphs.pop(key) is self._holding:
                self._holding = None
        self._seen = {k for k in self._seen if not stale(k)}

    def _hand_out(self, entry: list, out: Any, slots: list[tuple[Any, str]],
                  kwargs: dict[str, Any]) -> Any:
        """The output ``out`` of a capture of ``entry``, holding the call's caches in its
        ``slots``; first the dict outputs of the entry that held caches before, if another,
        let theirs go (see the module docstring)."""
        held = self._holding
        if held is not entry:
            if held is not None:
                for _, before, where in held[1]:
                    _placed(before, where, None)
            self._holding = entry
        return _placed(out, slots, kwargs)

    @staticmethod
    def _load(entry: list, tensors: dict[str, torch.Tensor]) -> tuple[list, Any, list]:
        """The capture of ``entry`` (a key's ``_graphs`` entry) that this call replays, its
        graphs, output and the output's cache slots (the next call takes the next capture),
        with the call's ``tensors`` copied into the capture's inputs (one launch)."""
        inputs, captures, turn = entry
        entry[2] = (turn + 1) % len(captures)
        torch._foreach_copy_([inputs[name] for name in tensors], list(tensors.values()))
        return captures[turn]

    def _warm(self, key: tuple, kwargs: dict[str, Any]) -> Any:
        """A call of ``key`` not captured yet runs as it is; the next one captures only if this
        one compiled nothing. A forward whose call changes what its own guards check compiles
        again on the next call (dejavu's in-place re-layout of the weights changes their
        strides: ``generate``'s first two decode steps both compile), and a compile cannot run
        inside a capture."""
        from torch._dynamo.utils import counters

        def compiles() -> int:
            return counters["frames"]["total"] + counters["stats"]["unique_graphs"]

        before = compiles()
        out = self.forward(**kwargs)
        if compiles() == before:
            self._seen.add(key)
        return out

    def _capture(self, kwargs: dict[str, Any], inputs: dict[str, torch.Tensor]):
        from dejavu_compile.kernels.ops import graph_cuts

        graphs = [torch.cuda.CUDAGraph()]

        def cut() -> None:  # at each dejavu::graph_split: the next segment shares the pool
            graphs[-1].capture_end()
            graphs.append(torch.cuda.CUDAGraph())
            graphs[-1].capture_begin(graphs[-2].pool())

        torch.cuda.synchronize()
        stream = torch.cuda.Stream()  # a capture cannot run on the default stream
        stream.wait_stream(torch.cuda.current_stream())
        try:
            with torch.cuda.stream(stream), graph_cuts(cut):
                graphs[0].capture_begin(*(() if self._pool is None else (self._pool,)))
                try:
                    out = self.forward(**{**kwargs, **inputs})
                finally:
                    graphs[-1].capture_end()
        except Exception as e:
            raise RuntimeError(
                "CapturedStep: the decode step could not be captured in CUDA graphs (it "
                "synchronises with the host, allocates outside the graph's pool, or a side "
                f"stream crosses a graph_splits cut?): {e}") from e
        torch.cuda.current_stream().wait_stream(stream)
        self._pool = graphs[-1].pool()
        slots = _cache_slots(out, kwargs)  # kept without the caches: _hand_out
        return graphs, _placed(out, slots, None), slots
