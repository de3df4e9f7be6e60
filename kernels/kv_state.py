"""State of ``dejavu::lazy_kv`` (the paper's "missing KV cache", section 4.2), kept per cache.

With lazy K/V, a decode step computes keys and values only for the heads its selector chose and
writes zeros for the others; it keeps every token's block input, so a head's missing positions
are computed when that head is next chosen. That needs, for each layer's cache:

- ``inputs`` [B, L, d]: the attention block's input at each position the op wrote;
- ``valid`` [B, H] int32: a prefix of positions known to hold computed keys and values per
  head (a hint: positions from it to the step's first are checked, see below);
- ``counts`` [B, H] int32: working memory of the CUDA kernel, zero between calls.

The state belongs to the cache tensor (its storage), not to the compiled graph: two caches used
in turn each keep their own inputs. It is created on the first call with a cache and dropped
when the cache's storage is freed. A position counts as missing for a head when its key is all
zero: Hugging Face's static cache starts at zero and ``reset()`` zeroes it, the op zeroes the
heads it skips, and a prefill run without the op (eagerly) writes every head, so what another
path wrote is never mistaken for missing (a key that is exactly zero would be: it is recomputed
from the kept input, which is right when the op wrote that position).
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass

import torch


@dataclass
class LazyState:
    inputs: torch.Tensor
    valid: torch.Tensor
    counts: torch.Tensor
    storage: weakref.ref


_STATES: dict[tuple, LazyState] = {}


def _key(keys: torch.Tensor) -> tuple:
    return (str(keys.device), keys.untyped_storage().data_ptr(), keys.storage_offset(),
            tuple(keys.shape))


def lazy_state(keys: torch.Tensor, d: int, dtype: torch.dtype) -> LazyState:
    """The state of the cache tensor ``keys`` [B, H, L, hd] for inputs of width ``d``, created
    (zeros) on first use. Under CUDA-graph capture it must exist already: a capture records
    kernels, and the zero-fill of a new state would run again at every replay."""
    storage = keys.untyped_storage()
    key = _key(keys)
    state = _STATES.get(key)
    if state is not None and state.storage() is storage and state.inputs.shape[2] == d \
            and state.inputs.dtype == dtype:
        return state
    _refuse_in_capture(keys, "this KV cache")
    b, h, length = keys.shape[:3]
    state = LazyState(inputs=keys.new_zeros(b, length, d, dtype=dtype),
                      valid=torch.zeros(b, h, dtype=torch.int32, device=keys.device),
                      counts=torch.zeros(b, h, dtype=torch.int32, device=keys.device),
                      storage=weakref.ref(storage))
    _STATES[key] = state
    weakref.finalize(storage, _drop, key, state)
    return state


def _refuse_in_capture(keys: torch.Tensor, what: str) -> None:
    """State created inside a CUDA-graph capture would be zero-filled again at every replay."""
    if keys.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(
            f"dejavu::lazy_kv: first call with {what} inside a CUDA-graph capture; run one decode "
            "step with the cache before capturing (CapturedStep and Inductor's CUDA graphs do)")


def _drop(key: tuple, state: LazyState) -> None:
    if _STATES.get(key) is state:
        del _STATES[key]


def live_states() -> int:
    """How many cache tensors (a layer's keys, so a cache's layers each) have lazy K/V state
    now (tests)."""
    return len(_STATES)


# the smallest column tile of the lazy K/V kernel: sizes the counters of its split form
MIN_COLUMNS = 8
_SPLIT: dict[tuple, tuple[torch.Tensor, torch.Tensor, int]] = {}


def split_workspace(keys: torch.Tensor, width: int,
                    mats: int = 2) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(fp32 sums [B, mats, L, width], tile counters, column tiles a head at most) of the lazy
    K/V kernel's split form (d over several programs; ``mats`` 2 for keys and values, 3 with
    the query of ``lazy_qkv``), zero between calls: the programs add into the sums and the last
    of a tile stores the cache rows and zeroes what it read. One per shape, shared by the
    layers and caches of that shape: the kernels that use it run one after another on one
    stream (not two lazy steps on two streams at once). Memory: ``mats`` times one layer's
    keys in fp32, per shape."""
    b, h, length, hd = keys.shape
    key = (str(keys.device), b, h, length, hd, width, mats)
    found = _SPLIT.get(key)
    if found is not None:
        return found
    _refuse_in_capture(keys, "this cache shape")
    tiles = -(-hd // MIN_COLUMNS)
    found = (torch.zeros(b, mats, length, width, dtype=torch.float32, device=keys.device),
             torch.zeros(b * h * mats * tiles * (length + 1), dtype=torch.int32,
                         device=keys.device),
             tiles)
    _SPLIT[key] = found
    return found
