"""Lookahead on CUDA (paper section 4.3): a predictor runs on a side stream while the current
stream computes the layer before the one it selects for.

``predict_ahead`` records an event on the current stream, makes the side stream wait on it (so
the predictor sees its input), runs the predictor there and records event ``slot``; the block's
first sparse op makes the current stream wait on that event. Fork and join are stream events,
so CUDA-graph capture records them as edges between the two streams and replays them without
the host. The output is allocated on the current stream before the fork (its memory is reused
only in that stream's order, after the waiting op); the predictor's temporaries live and die on
the side stream.
"""

from __future__ import annotations

import torch

from . import predictor

# False runs the predictor on the current stream (same graph, same ops): the GPU test compares
# the two to show that the side stream adds no race.
SIDE_STREAM = True
# The side stream's priority: the highest PyTorch's stream pools offer (a lower number is a
# higher priority; PyTorch clamps this one to its highest pool). PyTorch
# instantiates CUDA graphs with cudaGraphInstantiateFlagUseNodePriority, so the kernels captured
# on this stream keep the priority when replayed: the GPU starts the predictor's few blocks as
# soon as an SM has room, ahead of the pending blocks of the large projection kernels on the
# current stream, instead of after them. At the default priority, OPT-13B with lookahead ran no
# faster than with inline predictors on an H200 (BENCHMARKS.md, eighth session).
SIDE_PRIORITY = -100
_STREAMS: dict[int, torch.cuda.Stream] = {}
_EVENTS: dict[tuple[int, int], tuple[torch.cuda.Event, torch.cuda.Event]] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _STREAMS:
        _STREAMS[index] = torch.cuda.Stream(device=index, priority=SIDE_PRIORITY)
    return _STREAMS[index]


def _events(device: torch.device, slot: int) -> tuple[torch.cuda.Event, torch.cuda.Event]:
    index = device.index if device.index is not None else torch.cuda.current_device()
    key = (index, slot)
    if key not in _EVENTS:
        _EVENTS[key] = (torch.cuda.Event(), torch.cuda.Event())
    return _EVENTS[key]


def predict_ahead(x, w1, b1, w2, b2, act: str, k: int, group: int, buckets: int, slot: int,
                  after=None) -> torch.Tensor:
    """``select_predictor`` on the side stream; returns ids [..., k * group] (see module doc).
    ``after`` only orders the op in the graph (``dejavu::predict_ahead``)."""
    if not SIDE_STREAM:
        return predictor.select_predictor(x, w1, b1, w2, b2, act, k, group, buckets)
    out = torch.empty(*x.shape[:-1], k * group, dtype=torch.int64, device=x.device)
    main, side = torch.cuda.current_stream(x.device), _side_stream(x.device)
    fork, done = _events(x.device, slot)
    fork.record(main)
    side.wait_event(fork)
    with torch.cuda.stream(side):  # the bucket kernel writes ``out`` itself: no copy launch
        predictor.select_predictor(x, w1, b1, w2, b2, act, k, group, buckets, out)
        done.record(side)
    return out


def join(device: torch.device, slot: int) -> None:
    """Make the current stream wait for the predictor that recorded event ``slot``."""
    if slot >= 0 and SIDE_STREAM:
        torch.cuda.current_stream(device).wait_event(_events(device, slot)[1])


def waiting(impl, n_args: int, tells_ahead: bool = False):
    """Wrap a CUDA implementation of ``sparse_mlp`` / ``sparse_head_proj`` (whose own arguments
    are the first ``n_args``) so it first joins the lookahead predictor named by the op's
    trailing ``keep`` and ``slot`` arguments; a ``workspace`` after them (``sparse_mlp``) goes
    on to the implementation. With ``tells_ahead`` the implementation also hears, as
    ``ahead=True``, that its ids came from such a predictor (``slot`` set): written a layer
    earlier, never by the kernel right before its own."""

    def run(*args, keep=None, slot=-1, workspace=None):
        if len(args) > n_args:
            args, extra = args[:n_args], args[n_args:]
            slot = extra[1] if len(extra) > 1 else slot
            workspace = extra[2] if len(extra) > 2 else workspace
        join(args[0].device, slot)
        kwargs = {} if workspace is None else {"workspace": workspace}
        if tells_ahead and slot >= 0:
            kwargs["ahead"] = True
        return impl(*args, **kwargs)

    run.__doc__ = impl.__doc__
    run.__name__ = getattr(impl, "__name__", "run")
    return run
