"""``CapturedStep``: the decode step replayed from dejavu's own CUDA graph. What runs on CPU:
the pass-through and the key that decides which capture a call replays, with the caches it
refuses. Capture and replay are tested on the GPU (tests/test_gpu.py)."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache, StaticCache

import dejavu_compile
from dejavu_compile import CapturedStep, bench

from .conftest import prompt


def _prefilled(model, length: int = 16):
    ids = prompt()
    with torch.no_grad():
        cache, _ = bench._prefilled(model, ids, length)
    return ids, cache


def _step_args(ids, cache, tok=None):
    pos = torch.tensor([ids.shape[1]])
    tok = ids[:, -1:].clone(memory_format=torch.contiguous_format) if tok is None else tok
    return dict(input_ids=tok, past_key_values=cache,
                cache_position=pos, position_ids=pos[None], use_cache=True)


def test_on_cpu_the_call_goes_to_the_forward(tiny):
    model = tiny("llama")
    compiled = torch.compile(model.forward, backend="dejavu",
                             options={"selector": "oracle", "mlp_density": 0.5})
    step = CapturedStep(compiled)
    ids, cache = _prefilled(model)
    _, plain = _prefilled(model)
    with torch.no_grad():
        got = step(**_step_args(ids, cache)).logits
        want = compiled(**_step_args(ids, plain)).logits
    torch.testing.assert_close(got, want)
    assert step.captured == 0


def test_the_key_follows_the_cache_tensors_and_the_input_shapes(tiny):
    """A call replays the capture of its cache (the addresses the graph reads and writes in
    place) and its tensors' shapes and strides; new token values keep the key."""
    model = tiny("llama")
    step = CapturedStep(model.forward)
    ids, cache = _prefilled(model)
    _, other = _prefilled(model)
    key = step.key(_step_args(ids, cache))
    assert step.key(_step_args(ids, cache, tok=torch.tensor([[5]]))) == key
    assert step.key(_step_args(ids, other)) != key
    assert step.key({**_step_args(ids, cache), "input_ids": ids[:, -2:]}) != key
    assert step.key({**_step_args(ids, cache), "input_ids": ids[:, -1:]}) != key  # a strided view
    assert step.key({**_step_args(ids, cache), "use_cache": False}) != key


def test_a_cache_key_is_checked_not_rebuilt_and_the_cache_is_not_kept(tiny, monkeypatch):
    """A cache's part of the key is worked out once and then checked (not walked again for an
    unfilled layer either): a layer's tensor replaced (another object, or another address) or a
    layer replaced gives a new key, and the step keeps no reference that would hold a dropped
    cache's memory."""
    import gc
    import weakref

    from dejavu_compile import capture

    walks = []
    walk = capture._unfilled_layer
    monkeypatch.setattr(capture, "_unfilled_layer", lambda v: walks.append(1) or walk(v))
    model = tiny("llama")
    step = CapturedStep(model.forward)
    ids, cache = _prefilled(model)
    key = step.key(_step_args(ids, cache))
    first = len(walks)
    assert step.key(_step_args(ids, cache)) == key
    assert first > 0 and len(walks) == first
    layer = cache.layers[1]
    old_keys = layer.keys
    layer.keys = old_keys.clone()
    assert step.key(_step_args(ids, cache)) != key
    layer.keys = old_keys
    assert step.key(_step_args(ids, cache)) == key
    cache.layers[0] = type(cache.layers[0]).__new__(type(cache.layers[0]))
    cache.layers[0].__dict__.update(vars(cache.layers[1]))
    assert step.key(_step_args(ids, cache)) != key
    alive = weakref.ref(cache)
    del cache, layer, old_keys
    gc.collect()
    assert alive() is None


def test_the_cache_memo_is_freed_with_its_cache_or_its_step(tiny):
    """The memo holds a cache's layers and tensors (checked by identity) only while both the
    cache and the step live, freed at once when either goes (no cycle left for the garbage
    collector), and it hashes into a short key: the cache's part is a number per distinct
    address set, the same for a second cache object at the same addresses."""
    import gc
    import weakref

    model = tiny("llama")
    gc.disable()
    try:
        for drop in ("cache", "step"):
            step = CapturedStep(model.forward)
            ids, cache = _prefilled(model)
            key = step.key(_step_args(ids, cache))
            part = dict((p[0], p[1:]) for p in key)["past_key_values"]
            assert part == ("cache", 0)
            tensor = weakref.ref(cache.layers[0].keys)
            if drop == "cache":
                del cache
                assert tensor() is None and not step._caches
            else:
                del step
                del cache
                assert tensor() is None
    finally:
        gc.enable()
    step = CapturedStep(model.forward)
    ids, cache = _prefilled(model)
    key = step.key(_step_args(ids, cache))
    twin = type(cache).__new__(type(cache))
    twin.__dict__.update(vars(cache))  # another object, the same layers
    assert step.key(_step_args(ids, twin)) == key and len(step._caches) == 2
    _, other = _prefilled(model)
    assert step.key(_step_args(ids, other)) != key


def test_a_captured_output_keeps_no_cache(tiny):
    """A capture's output is kept without the call's cache (``_cache_slots``, ``_placed``):
    a ``ModelOutput`` holds None there until a replay puts the call's cache back in place, a
    tuple output is made anew; a cache that takes no weak references is left in (the step
    could not see it freed)."""
    from dejavu_compile import capture

    model = tiny("llama")
    ids, cache = _prefilled(model)
    args = _step_args(ids, cache)
    with torch.no_grad():
        out = model(**args)
        plain = model(**args, return_dict=False)
    slots = capture._cache_slots(out, args)
    assert slots == [("past_key_values", "past_key_values")]
    kept = capture._placed(out, slots, None)
    assert kept is out and out.past_key_values is None and "logits" in out
    assert capture._placed(out, slots, args) is out and out.past_key_values is cache
    tuple_slots = capture._cache_slots(plain, args)
    assert tuple_slots == [(1, "past_key_values")]
    emptied = capture._placed(plain, tuple_slots, None)
    assert emptied[1] is None and emptied[0] is plain[0]
    assert capture._placed(emptied, tuple_slots, args)[1] is cache

    class Pinned:
        __slots__ = ("layers",)

    pinned = Pinned()
    pinned.layers = cache.layers
    assert capture._cache_slots({"past_key_values": pinned}, {"past_key_values": pinned}) == []


def _fake_entry(out, slots) -> list:
    """A ``_graphs`` entry with one capture of no graphs (what ``__call__`` keeps)."""
    return [{}, [([], out, slots)], 0]


def test_a_replay_lets_the_cache_of_the_capture_before_go(tiny):
    """``_hand_out``: a replay's output holds the call's cache; a replay of another key's
    capture empties the outputs of the key before, so the cache its caller dropped is freed
    (no GPU here: the entries are made by hand, as ``_capture`` would keep them)."""
    import gc
    import weakref

    from dejavu_compile import capture

    model = tiny("llama")
    step = CapturedStep(model.forward)
    entries, alive = [], []
    for _ in range(2):
        ids, cache = _prefilled(model)
        args = _step_args(ids, cache)
        with torch.no_grad():
            out = model(**args)
        slots = capture._cache_slots(out, args)
        capture._placed(out, slots, None)
        entries.append(_fake_entry(out, slots))
        got = step._hand_out(entries[-1], out, slots, args)
        assert got.past_key_values is cache and step._holding is entries[-1]
        alive.append(weakref.ref(cache))
        del cache, args
    gc.collect()
    assert alive[0]() is None and alive[1]() is not None
    assert entries[0][1][0][1].past_key_values is None


def test_the_captures_of_a_freed_cache_are_dropped(tiny):
    """A cache freed (or whose tensors were replaced) has its part of the key noted, and the
    next call drops the captures and the warm-up note of every key with that part
    (``_purge``), unless a live cache object has the same addresses; other keys stay."""
    model = tiny("llama")
    step = CapturedStep(model.forward)
    ids, cache = _prefilled(model)
    _, other = _prefilled(model)
    key, kept = step.key(_step_args(ids, cache)), step.key(_step_args(ids, other))
    twin = type(cache).__new__(type(cache))
    twin.__dict__.update(vars(cache))  # another object, the same layers: the same part
    assert step.key(_step_args(ids, twin)) == key
    for k in (key, kept):
        step._graphs[k] = _fake_entry(None, [])
        step._seen.add(k)
    step._holding = step._graphs[key]
    del twin  # its part lives on in cache
    step._purge()
    assert set(step._graphs) == {key, kept} and step._seen == {key, kept}
    del cache
    assert step._gone == [dict((p[0], p[1:]) for p in key)["past_key_values"]]
    step._purge()
    assert set(step._graphs) == {kept} and step._seen == {kept}
    assert step._holding is None and step._gone == []
    layer = other.layers[0]
    layer.keys = layer.keys.clone()  # replaced: the old addresses' captures go too
    assert step.key(_step_args(ids, other)) != kept
    step._purge()
    assert not step._graphs and not step._seen


@pytest.mark.parametrize("check", ["python", "pytorch"])
def test_the_cache_check_sees_a_tensor_moved_in_place(tiny, monkeypatch, check):
    """The per-step check of a cache (``_cache_state``) with either address comparison,
    ``data_ptr`` mapped in Python or PyTorch's C check (CUDA builds only, on a CUDA cache):
    the second call takes the memo (no walk of the layers), and a layer's tensor that stays
    the same object but moves (``set_`` onto other storage) gives a new key, as does a layer
    that loses a tensor."""
    from dejavu_compile import capture

    device = "cpu"
    if check == "pytorch":
        if capture._PTRS_EQUAL is None or not torch.cuda.is_available():
            pytest.skip("PyTorch's address check is in its CUDA builds, used on a GPU")
        device = "cuda"
    else:
        monkeypatch.setattr(capture, "_PTRS_EQUAL", None)
    model = tiny("llama").to(device)
    step = CapturedStep(model.forward)
    ids = prompt().to(device)
    with torch.no_grad():
        cache, _ = bench._prefilled(model, ids, 16)
    args = {k: v.to(device) if isinstance(v, torch.Tensor) else v
            for k, v in _step_args(ids, cache).items()}
    key = step.key(args)
    walks = []
    state = capture._state
    monkeypatch.setattr(capture, "_state",
                        lambda v: (walks.append(1) if v is cache else None) or state(v))
    assert step.key(args) == key and walks == []
    values = cache.layers[1].values
    values.set_(values.clone())  # the same tensor object at another address
    moved = step.key(args)
    assert moved != key and walks == [1]
    assert step.key(args) == moved and walks == [1]  # checked again, not walked
    del cache.layers[0].keys
    short = step.key(args)
    assert short not in (key, moved) and walks == [1, 1]
    # layers no longer alike: checked by the gatherer's Python loop, still not walked
    assert step.key(args) == short and walks == [1, 1]


def test_graph_split_calls_the_cut_of_a_capture_only_inside_one():
    """``dejavu::graph_split`` copies its input; inside ``graph_cuts`` (``CapturedStep``'s
    capture) it then calls the cut, so the capture ends one graph there and begins the next."""
    from dejavu_compile.kernels.ops import graph_cuts

    calls = []
    x = torch.randn(3, 4)
    y = torch.ops.dejavu.graph_split(x)
    assert torch.equal(y, x) and y.data_ptr() != x.data_ptr() and not calls
    with graph_cuts(lambda: calls.append(1)):
        torch.ops.dejavu.graph_split(x)
        torch.ops.dejavu.graph_split(x)
    torch.ops.dejavu.graph_split(x)
    assert calls == [1, 1]


def test_caches_a_replay_cannot_advance_are_refused(tiny):
    """A layer that counts its positions in a Python number (a sliding window of Gemma 3's
    static cache) would not advance under a replay, and a dynamic cache's tensors move every
    step: both refused with the layer named; so is an argument a graph cannot take. A cache not
    filled yet gets no key: its call (the prefill that fills it) runs as it is."""
    gemma = tiny("gemma3")
    ids, cache = _prefilled(gemma)
    step = CapturedStep(gemma.forward)
    with pytest.raises(ValueError, match=r"cache layer 0 \(StaticSlidingWindowLayer\).*Python"):
        step.key(_step_args(ids, cache))

    llama = tiny("llama")
    dynamic = DynamicCache(config=llama.config)
    with torch.no_grad():
        llama(input_ids=ids, past_key_values=dynamic, use_cache=True)
    with pytest.raises(ValueError, match=r"cache layer 0 \(DynamicLayer\).*not a static cache"):
        step.key(_step_args(ids, dynamic))
    assert step.key(_step_args(ids, StaticCache(config=llama.config, max_cache_len=16))) is None
    with pytest.raises(TypeError, match="argument of type list"):
        step.key({**_step_args(ids, cache), "extra": [1]})


def test_compile_with_capture_serves_generate(tiny):
    """``compile(model, capture=True)`` installs ``CapturedStep`` as the model's forward with
    the forward's signature, so ``generate`` passes what it passed before (the mask, the
    positions): with a static cache every decode step has the same key, so on a GPU the second
    captures and the rest replay. The prefill, its cache not filled yet, runs as it is. On CPU
    the tokens are those of the model compiled without capture, and a positional call works."""
    import inspect

    options = {"selector": "oracle", "mlp_density": 0.5}
    ids = prompt()
    settings = dict(max_new_tokens=5, do_sample=False, cache_implementation="static",
                    pad_token_id=0)
    with torch.no_grad():
        want = dejavu_compile.compile(tiny("llama"), **options).generate(ids, **settings)
    # Dynamo keeps compiled code per code object: the twin's graphs (its weights re-laid out
    # in place) must not be offered to the other model's forward
    torch._dynamo.reset()
    model = dejavu_compile.compile(tiny("llama"), capture=True, **options)
    step = model.forward
    assert isinstance(step, CapturedStep)
    assert "attention_mask" in inspect.signature(step).parameters
    keys, inner = [], step.forward

    def recording(**kwargs):
        keys.append(step.key(kwargs))
        return inner(**kwargs)

    step.forward = recording
    with torch.no_grad():
        got = model.generate(ids, **settings)
        logits = model(ids).logits
    assert torch.equal(got, want)
    # the prefill, four decode steps (five new tokens), then the positional call's
    assert keys[0] is None and len(keys) == 6
    assert keys[1] is not None and all(k == keys[1] for k in keys[2:5])
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    with pytest.raises(ValueError, match="leave the option 'cudagraphs' off"):
        dejavu_compile.compile(tiny("llama"), capture=True, cudagraphs=True, **options)


def test_a_step_is_captured_only_after_a_call_that_compiled_nothing(tiny):
    """A capture cannot hold a compile. The first decode step compiles; it re-lays out the
    weights in place, which changes what its guards check, so the second compiles again (on the
    GPU it was captured and failed, fourteenth session's test of ``generate``); only after the
    third, which compiles nothing, is the key ready to capture."""
    model = tiny("llama")
    compiled = torch.compile(model.forward, backend="dejavu",
                             options={"selector": "oracle", "mlp_density": 0.5})
    step = CapturedStep(compiled)
    ids, cache = _prefilled(model)
    args = _step_args(ids, cache)
    key = step.key(args)
    ready = []
    with torch.no_grad():
        for _ in range(3):
            step._warm(key, args)
            ready.append(key in step._seen)
    assert ready == [False, False, True]


def test_a_prefill_into_an_unfilled_cache_runs_as_it_is(tiny):
    """A cache whose layers hold no tensors yet gets no key (``key`` gives None); the call, the
    prefill that fills it, goes to the forward."""
    model = tiny("llama")
    step = CapturedStep(model.forward)
    ids = prompt()
    cache = StaticCache(config=model.config, max_cache_len=16)
    with torch.no_grad():
        out = step(input_ids=ids, past_key_values=cache, use_cache=True)
    assert out.logits.shape[1] == ids.shape[1] and step.captured == 0
    assert all(layer.is_initialized for layer in cache.layers)


def test_copies_must_be_a_count():
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match="copies must be an int >= 1"):
            CapturedStep(lambda **kw: None, copies=bad)
    assert CapturedStep(lambda **kw: None, copies=2).copies == 2


def test_it_is_part_of_the_public_api():
    assert "CapturedStep" in dejavu_compile.__all__
