"""The parts of `dejavu bench` that need no GPU: its random profiles, the analysis of a KV sweep,
the profiler breakdown and the markdown it writes into BENCHMARKS.md."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch.autograd import DeviceType

from dejavu_compile import DejavuOptions, bench, load_profile
from dejavu_compile.profile import BUCKET_UNITS, default_buckets

from .conftest import compile_outside_interpreter

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("bucket_units", [BUCKET_UNITS, 32, 0])
def test_random_profile_takes_the_bucket_size(tiny, tmp_path, bucket_units):
    model = tiny("llama")
    bench.random_profile(model, 0.5, 0.5, 8, tmp_path / "r.yaml", bucket_units=bucket_units)
    prof = load_profile(tmp_path / "r.yaml")
    assert prof.layer(0).mlp.selector == "dense"  # layer 0 stays dense
    mlp, att = prof.layer(1).mlp, prof.layer(1).attention
    assert mlp.selector == att.selector == "predictor"
    assert mlp.buckets == default_buckets(96, bucket_units)  # the tiny model's 96 neurons
    assert (mlp.buckets > 1) == (bucket_units == 32)
    assert att.buckets == 1  # four heads: one bucket


@pytest.mark.parametrize("n, density, per", [(20480, 0.1, 13), (14336, 0.5, 64), (384, 0.1, 13)],
                         ids=["opt13b_mlp", "llama8b_mlp", "three_buckets"])
def test_bucket_ids_keep_the_steps_count_from_each_bucket(n, density, per):
    """``bench.bucket_ids``: the selection of the decode step's bucketed selector, as many ids
    as its profile keeps (the step's tuning key: OPT-13B's MLP at 0.1 keeps 2080, not the
    sweep's 2048), the same count from each bucket of 128 units, sorted within it."""
    k, ids = bench.bucket_ids(n, density, "cpu")
    assert ids.shape == (1, 1, k) and k == per * default_buckets(n) == per * n // 128
    rows = ids.view(-1, per)
    assert ((rows // 128) == torch.arange(len(rows))[:, None]).all()
    assert (rows.diff(dim=1) > 0).all()


def test_analyse_kv_finds_costs_and_crossings():
    bw = 1e12  # 1 GB per ms
    weights = {"dense": 10e9, "projection": 6e9}
    kv, keep = 1e6, 0.5
    rows = []
    for n in (1000, 5000, 9000):
        for mode, w, cost, k in (("dense", 10e9, 1.0, 1.0), ("projection", 6e9, 3.0, 1.0),
                                 ("kv", 10e9, 1.0, keep), ("both", 6e9, 6.0, keep)):
            nbytes = w + k * kv * n
            noise = 0.5 if (mode, n) == ("kv", 9000) else 0.0  # one slow point
            rows.append({"mode": mode, "context": n, "bytes": nbytes,
                         "ms": nbytes / 1e9 + cost + noise})
    sweep = {"rows": rows, "kv_bytes_per_token": kv, "kv_keep": keep, "weights": weights}
    out = bench.analyse_kv(sweep, bw)
    assert out["costs_ms"]["projection"] == pytest.approx(3.0)
    assert out["costs_ms"]["kv"] == pytest.approx(1.0)  # the median, past the slow point
    assert out["byte_crossover"] == pytest.approx(8000)  # 4 GB saved / (0.5 * 1 MB)
    # projection - kv = (-4 + 0.5 n / 1000) + 2 ms: zero at n = 4000
    assert out["predicted_crossing"] == pytest.approx(4000)
    assert out["measured_crossing"] == pytest.approx(4000)
    assert out["fastest"] == {1000: "projection", 5000: "kv", 9000: "kv"}
    # the section names the attention kernel every mode read its cache with
    for attention, words in (("dejavu", "split-K `dejavu::decode_attention`"), ("sdpa", "SDPA")):
        text = "\n".join(bench._kv_markdown({**sweep, **out, "model": "m", "attention": attention,
                                             "operating_point": {"mlp": 0.5, "attention": 1.0}}))
        assert words in text and "| 5000 |" in text
    with pytest.raises(ValueError, match="attention must be one of"):
        bench.kv_sweep("llama-3-8b", None, attention="flash")


def _traced(name, start, end, stream=7, device=DeviceType.CUDA):
    return SimpleNamespace(name=name, device_type=device, device_resource_id=stream,
                           time_range=SimpleNamespace(start=start, end=end))


def test_kernel_breakdown_sums_per_step():
    def event(key, us, count, device=DeviceType.CUDA):
        return SimpleNamespace(key=key, device_type=device, self_device_time_total=us, count=count)

    prof = SimpleNamespace(key_averages=lambda: [
        event("small", 8.0, 8), event("big", 80.0, 16), event("host", 500.0, 8, DeviceType.CPU)],
        events=lambda: [_traced("big", 0, 40), _traced("small", 40, 48),
                        _traced("big", 100, 140)])
    rows = bench._kernel_breakdown(prof, steps=8)
    assert [r["kernel"] for r in rows] == ["big", "small", "(all kernels)"]
    assert rows[0]["us_per_step"] == 10.0 and rows[0]["calls_per_step"] == 2
    assert rows[0]["path_us_per_step"] == 10.0 and rows[1]["path_us_per_step"] == 1.0
    assert rows[0]["streams"] == [1] and rows[1]["streams"] == [1]
    assert rows[-1]["us_per_step"] == 11.0 and rows[-1]["calls_per_step"] == 3
    assert rows[-1]["path_us_per_step"] == 11.0
    assert rows[-1]["stream_busy_us_per_step"] == [11.0]


def test_kernel_breakdown_numbers_the_streams_by_busy_time():
    """The side stream (9) is less busy than the layers' stream (7): 2 against 1; a kernel on
    both names both; each stream's busy time per step is in the total row, busiest first."""
    def event(key, us, count):
        return SimpleNamespace(key=key, device_type=DeviceType.CUDA, self_device_time_total=us,
                               count=count)

    prof = SimpleNamespace(
        key_averages=lambda: [event("pred", 20.0, 2), event("up", 60.0, 2),
                              event("copy", 4.0, 2)],
        events=lambda: [_traced("pred", 0, 10, stream=9), _traced("up", 0, 30),
                        _traced("copy", 10, 12, stream=9), _traced("up", 50, 80),
                        _traced("copy", 80, 82)])
    rows = bench._kernel_breakdown(prof, steps=2)
    by_name = {r["kernel"]: r for r in rows}
    assert by_name["up"]["streams"] == [1] and by_name["pred"]["streams"] == [2]
    assert by_name["copy"]["streams"] == [1, 2] and by_name["copy"]["path_us_per_step"] == 2.0
    assert rows[-1]["stream_busy_us_per_step"] == [31.0, 6.0]


def test_stream_path_counts_a_kernel_from_the_end_of_the_one_before():
    """A kernel launched programmatically starts inside the one before it and waits there: it
    is counted from that kernel's end. A stream's rows add up to its busy time (its gaps left
    out); another stream's kernels do not move this stream's frontier; a kernel that ends
    inside the one before it adds nothing."""
    events = [
        _traced("norm", 0, 10), _traced("up", 4, 30),  # starts at 4, waits until 10: adds 20
        _traced("down", 25, 45),  # adds 15, from 30
        _traced("tiny", 31, 40),  # ends inside down: adds nothing
        _traced("norm", 60, 64),  # after a gap of 15: its own 4
        _traced("pred", 5, 50, stream=9),  # the side stream: its own span
        _traced("host", 0, 100, device=DeviceType.CPU),
    ]
    path = bench._stream_path(SimpleNamespace(events=lambda: events))
    assert path == {"norm": {7: 14.0}, "up": {7: 20.0}, "down": {7: 15.0}, "tiny": {7: 0.0},
                    "pred": {9: 45.0}}
    # the main stream's busy time: 0-45 and 60-64
    assert sum(v[7] for k, v in path.items() if k != "pred") == 49.0
    # and the same however the events are listed
    assert bench._stream_path(SimpleNamespace(events=lambda: events[::-1])) == path


def test_breakdown_table_shows_the_path_and_stream_columns():
    row = {"model": "m", "mode": "dejavu_x", "ms_per_token": 1.0,
           "breakdown": [{"kernel": "up", "us_per_step": 30.0, "path_us_per_step": 20.0,
                          "streams": [1], "calls_per_step": 1},
                         {"kernel": "copy", "us_per_step": 3.0, "path_us_per_step": 2.0,
                          "streams": [1, 2], "calls_per_step": 2},
                         {"kernel": "(all kernels)", "us_per_step": 33.0,
                          "path_us_per_step": 22.0, "calls_per_step": 3,
                          "stream_busy_us_per_step": [1250.0, 750.0]}]}
    text = "\n".join(bench._breakdown_markdown(row))
    assert "| `up` | 30.0 | 20.0 | 1 | 1 |" in text and "| `copy` | 3.0 | 2.0 | 1, 2 | 2 |" in text
    assert "Busy time per step of each stream, 1 the busiest: 1: 1.25 ms, 2: 0.75 ms." in text
    # an older JSON without the columns still renders, their cells empty
    for k in row["breakdown"]:
        for key in ("path_us_per_step", "streams", "stream_busy_us_per_step"):
            k.pop(key, None)
    text = "\n".join(bench._breakdown_markdown(row))
    assert "| `up` | 30.0 |  |  | 1 |" in text and "Busy time" not in text


def test_host_breakdown_sums_per_step():
    """Host events by their own time per step, largest first, GPU events left out; the last row
    totals the own times (the times with the events inside would count them twice)."""
    def event(key, own, total, count, device=DeviceType.CPU):
        return SimpleNamespace(key=key, device_type=device, self_cpu_time_total=own,
                               cpu_time_total=total, count=count)

    prof = SimpleNamespace(key_averages=lambda: [
        event("Torch-Compiled Region", 400.0, 2400.0, 8), event("cudaGraphLaunch", 2000.0,
                                                                 2000.0, 8),
        event("kernel", 900.0, 900.0, 80, DeviceType.CUDA)])
    rows = bench._host_breakdown(prof, steps=8)
    assert [r["event"] for r in rows] == ["cudaGraphLaunch", "Torch-Compiled Region",
                                          "(all events)"]
    assert rows[1] == {"event": "Torch-Compiled Region", "self_us_per_step": 50.0,
                       "total_us_per_step": 300.0, "calls_per_step": 1}
    assert rows[-1]["self_us_per_step"] == 300.0 and rows[-1]["calls_per_step"] == 2
    assert rows[-1]["total_us_per_step"] is None


def test_gpu_timeline_splits_the_profiled_steps():
    """The host's wait between steps leaves the longest gaps between kernels: each step's span
    is its first start to its last end, even when a step has a gap of its own; inside a step,
    the time with no kernel running and with two or more running at once are told apart, and
    the streams that ran kernels are counted."""
    from types import SimpleNamespace

    from torch.autograd import DeviceType

    def kernel(start, end, device=DeviceType.CUDA, name="k", stream=7):
        return SimpleNamespace(device_type=device, name=name, device_resource_id=stream,
                               time_range=SimpleNamespace(start=start, end=end))

    # the second step idles 150 us inside; its first kernel overlaps its second (20 us), which
    # ran on another stream
    steps = [[kernel(0, 10), kernel(12, 40)],
             [kernel(500, 600), kernel(510, 530, stream=9), kernel(750, 760)],
             [kernel(1300, 1340), kernel(1340, 1350)]]
    events = [k for step in steps for k in step] + [
        kernel(0, 2000, DeviceType.CPU, stream=1),
        kernel(300, 301, name="Memcpy HtoD (Pageable -> Device)", stream=3)]
    prof = SimpleNamespace(events=lambda: events)
    three = bench._gpu_timeline(prof, 3)
    assert three["span_ms"] == pytest.approx(0.05)  # median of 40, 260, 50 us
    assert three["idle_ms"] == pytest.approx(0.002)  # median of 2, 150, 0 us
    assert three["concurrent_ms"] == 0.0  # median of 0, 20, 0 us
    assert three["streams"] == 2
    # where the idle time sits, by the kernel that ended it (a mean over the three steps):
    # 2 us before the first step's second kernel, 150 us before the second step's third
    steps[1][2].name = "late"
    assert bench._gpu_timeline(prof, 3)["idle_before"] == [
        {"kernel": "late", "us_per_step": 50.0, "gaps_per_step": pytest.approx(1 / 3)},
        {"kernel": "k", "us_per_step": pytest.approx(2 / 3), "gaps_per_step": pytest.approx(1 / 3)}]
    # the first two steps alone: a median of two is the mean (idle 2 and 150 us, concurrent 0
    # and 20 us)
    prof = SimpleNamespace(events=lambda: [k for step in steps[:2] for k in step])
    two = bench._gpu_timeline(prof, 2)
    assert two["concurrent_ms"] == pytest.approx(0.010) and two["idle_ms"] == pytest.approx(0.076)
    # four steps cut the longest gap inside a step too: 40, 100, 10, 50 us
    assert bench._gpu_timeline(SimpleNamespace(events=lambda: events), 4)["span_ms"] == \
        pytest.approx(0.045)
    assert bench._gpu_timeline(prof, 7) is None  # fewer kernels than steps


def test_markdown_has_every_section():
    point = {"mlp": 0.1, "attention": 0.5}
    result = {
        "gpu": "G", "copy_gbs": 4000.0,
        "kernels": [{"model": "m", "block": "mlp", "density": 0.1, "k": 2, "sparse_ms": 0.01,
                     "sparse_p20": 0.009, "sparse_p80": 0.011, "sparse_gbs": 1000.0,
                     "pct_copy": 25.0, "dense_ms": 0.1, "naive_ms": 0.02}],
        "e2e": [{"model": "m", "mode": mode, "ms_per_token": 5.0, "p20": 4.9, "p80": 5.1,
                 "bytes_per_token": 1e9, "floor_ms": 0.25, "peak_gib": 1.0, "host_ms": 1.5,
                 "pipelined_ms": 4.5, "operating_point": point,
                 **({"breakdown": [{"kernel": "k|1", "us_per_step": 3.0, "calls_per_step": 2},
                                   {"kernel": "(all kernels)", "us_per_step": 4000.0,
                                    "calls_per_step": 2}],
                     "gpu_span_ms": 4.5, "gpu_idle_ms": 0.75, "gpu_concurrent_ms": 0.125,
                     "gpu_streams": 2,
                     "gpu_idle_before": [{"kernel": "j|2", "us_per_step": 600.0,
                                          "gaps_per_step": 40.0}],
                     "host_breakdown": [
                         {"event": "cudaGraphLaunch", "self_us_per_step": 250.0,
                          "total_us_per_step": 250.0, "calls_per_step": 1},
                         {"event": "(all events)", "self_us_per_step": 900.0,
                          "total_us_per_step": None, "calls_per_step": 40}]}
                    if mode == "dejavu_topk" else {})}
                for mode in ("hf_compiled", "dejavu_topk")],
    }
    text = bench.markdown(result, "dejavu bench", "abc1234", "2026-11-30")
    assert "commit `abc1234`" in text and "| m | mlp | 0.1 | 2 | 10.0 us" in text
    assert "| 25% |  | 100.0 us | 20.0 us |" in text  # a row measured before the copy column
    copied = {**result, "kernels": [{**result["kernels"][0], "copy_ms": 0.004}]}
    assert "| 25% | 4.0 us | 100.0 us |" in bench.markdown(copied, "dejavu bench", "abc1234",
                                                          "2026-11-30")
    assert "| m | hf_compiled |  | 5.00 (4.90-5.10) | 1.50 | 4.50 |" in text  # no operating point
    assert "| m | dejavu_topk | MLP 0.1, attention 0.5 | 5.00" in text
    assert "| 1.0 | 1.000x |  |" in text  # over the run's hf_compiled; no dense floor recorded
    result["e2e"][1]["ms_per_token"] = 2.0
    result["e2e"][1]["dense_floor_ms"] = 8.0
    assert "| 1.0 | 0.400x | 0.250x (8.00) |" in bench.markdown(result, "dejavu bench",
                                                                "abc1234", "2026-11-30")
    del result["e2e"][1]["dense_floor_ms"]
    result["e2e"][1]["ms_per_token"] = 5.0
    alone = {**result, "e2e": result["e2e"][1:]}  # no hf_compiled row: no ratio
    assert "| 1.0 |  |" in bench.markdown(alone, "dejavu bench", "abc1234", "2026-11-30")
    assert "GPU kernel time per decode step, m dejavu_topk" in text
    assert ("last kernel end 4.50 ms a step, of which 0.75 ms with no kernel running and "
            "0.12 ms with two or more at once; kernels on 2 streams") in text
    assert "| `k/1` | 3.0 |  |  | 2 |" in text  # a '|' in a kernel name would break the table
    assert ("with no kernel running, by the kernel whose start ended it (the 6 largest; us a "
            "step, stretches a step): `j/2` 600.0 (40.0).") in text
    # the JSON keeps every kernel, the table the first BREAKDOWN_ROWS and the total
    many = [{"kernel": f"k{i}", "us_per_step": 100.0 - i, "calls_per_step": 1} for i in range(20)]
    shown = bench._breakdown_markdown({**result["e2e"][1], "breakdown": many + [
        {"kernel": "(all kernels)", "us_per_step": 1.0, "calls_per_step": 20}]})
    assert "| `k11` |" in "\n".join(shown) and "| `k12` |" not in "\n".join(shown)
    assert "| `(all kernels)` | 1.0 |  |  | 20 |" in shown
    assert "Host time per decode step, m dejavu_topk" in text
    assert "| `cudaGraphLaunch` | 250.0 | 250.0 | 1 |" in text
    assert "| `(all events)` | 900.0 |  | 40 |" in text
    assert text.count("Host time per decode step") == 1  # hf_compiled has no breakdown
    assert "per step launched back to back" not in text  # a JSON without the pipelined profile
    # the steps launched back to back, each kernel beside its time one step at a time
    topk = {**result["e2e"][1], "breakdown": [
        {"kernel": "k|1", "us_per_step": 3.0, "path_us_per_step": 2.5, "calls_per_step": 2},
        {"kernel": "(all kernels)", "us_per_step": 4000.0, "path_us_per_step": 3900.0,
         "calls_per_step": 2, "stream_busy_us_per_step": [3000.0, 900.0]}]}
    topk["pipelined_breakdown"] = [
        {"kernel": "k|1", "us_per_step": 4.0, "path_us_per_step": 3.5, "calls_per_step": 2},
        {"kernel": "new", "us_per_step": 1.0, "path_us_per_step": 1.0, "calls_per_step": 1},
        {"kernel": "(all kernels)", "us_per_step": 4100.0, "path_us_per_step": 4000.0,
         "calls_per_step": 3, "stream_busy_us_per_step": [3100.0, 900.0]}]
    topk["pipelined_timeline"] = {"span_ms": 4.25, "idle_ms": 0.05, "concurrent_ms": 2.5,
                                  "streams": 2, "idle_before": [
                                      {"kernel": "j", "us_per_step": 40.0, "gaps_per_step": 2.0}]}
    piped = "\n".join(bench._breakdown_markdown(topk))
    assert ("GPU kernel time per step launched back to back, m dejavu_topk (torch.profiler over "
            "8 steps after the pipelined loop's timed ones, the window taken whole; pipelined "
            "4.50 ms a token; first kernel start to last kernel end 4.25 ms a step, of which "
            "0.05 ms with no kernel running and 2.50 ms with two or more at once):") in piped
    assert "| `k/1` | 3.5 | 2.5 | +1.0 | 2 |" in piped
    assert "| `new` | 1.0 |  |  | 1 |" in piped  # no such kernel one step at a time
    assert "| `(all kernels)` | 4000.0 | 3900.0 | +100.0 | 3 |" in piped
    assert "1: 3.10 ms, 2: 0.90 ms." in piped and "`j` 40.0 (2.0)." in piped
    # the section sits between the steps one at a time and the host's
    assert piped.index("1: 3.00 ms") < piped.index("back to back") < piped.index("Host time")


def test_fold_mode_folds_the_bench_predictors(tiny, tmp_path):
    """The profile `dejavu bench` builds has the biases of a calibrated predictor, so in mode
    dejavu_fold layer 1's predictors, which read layer 0's inputs, are folded into layer 0's
    dense projections (its biased Q, K and V; its first MLP projection: layer 0 is dense)."""
    from .conftest import prompt
    from .test_backend import _capture, _decode_logits

    model = tiny("opt")
    profile = bench.random_profile(model, 0.5, 0.5, 8, tmp_path / "r.yaml", lookahead=True)
    sparse, ahead, bucket_units, extra = bench._DEJAVU_MODES["dejavu_fold"]
    assert sparse and ahead and extra == {"fold_predictors": True}
    backend, graphs = _capture({"profile": profile, **extra})
    with torch.no_grad():
        _decode_logits(torch.compile(model, backend=backend), prompt(), steps=1)
    counters = graphs[-1][1].counters.values
    assert counters.get("folded[attention]") == 1 and counters.get("folded[mlp]") == 1


def test_only_the_sdpa_mode_turns_the_decode_attention_off():
    """Every dejavu mode's options are valid backend options; ``dejavu_sdpa`` keeps the step's
    attention on SDPA, and every other mode has the backend's default (the split-K
    ``dejavu::decode_attention`` on CUDA)."""
    from dejavu_compile.config import DEFAULT_DECODE_ATTENTION, DejavuOptions

    assert "dejavu_sdpa" in bench.MODES and "dejavu_sdpa" in bench.SPARSE_MODES
    for mode, (_, _, _, extra) in bench._DEJAVU_MODES.items():
        # as end_to_end gives them: with the step captured in CUDA graphs
        options = DejavuOptions.from_mapping({"selector": "fixed", "mlp_density": 0.5,
                                              "cudagraphs": True, **extra})
        want = "never" if mode == "dejavu_sdpa" else DEFAULT_DECODE_ATTENTION
        assert options.decode_attention == want, mode
        assert options.workspaces == (mode != "dejavu_fill"), mode
        assert options.merge_attention == ("merge" in mode), mode
        assert bool(options.graph_splits) == ("split" in mode), mode
        # the mode that captures the step itself leaves Inductor's CUDA graphs off
        assert options.cudagraphs == (not mode.startswith("dejavu_captured")), mode


def test_tuned_configs_round_trip_through_json(monkeypatch, tmp_path):
    """The configs the autotuners chose, per tuning key, come out as plain data (the bench's
    JSON keeps them) and go back into the autotuners' caches, so a later run uses those tiles
    without tuning; a kernel not tuned is left out."""

    from dejavu_compile.kernels import decode_attention, sparse_mlp, tuning

    split = decode_attention._split_kernel
    key = (256, 4, 128, 8, 32, False, "torch.float16")
    monkeypatch.setattr(split, "cache", {key: split.configs[-1]})
    monkeypatch.setattr(sparse_mlp._up_kernel, "cache", {})
    data = json.loads(json.dumps(tuning.tuned()))
    assert data["decode_attention._split_kernel"] == [
        {"key": list(key), "config": tuning.config_data(split.configs[-1])}]
    assert "sparse_mlp._up_kernel" not in data

    monkeypatch.setattr(split, "cache", {})
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"gpu": "H200", "e2e": [], "tuned": data}))
    assert tuning.seed(bench.load_tuned(str(path))) == sum(len(v) for v in data.values())
    assert split.cache == {key: split.configs[-1]}


def test_a_pinned_config_runs_and_the_tuner_is_restored(monkeypatch):
    """``tuning.pinned`` makes a kernel run the given config (here the output projection's,
    a tile other than its own, under the interpreter: the result still matches the reference)
    and gives the kernel back its candidates and earlier choices; an unknown kernel is an
    error naming it."""
    import triton
    from dejavu_compile.kernels import heads, tuning
    from dejavu_compile.kernels import reference as ref

    tuner = heads._head_out_kernel
    own, earlier = list(tuner.configs), {("k",): tuner.configs[0]}
    monkeypatch.setattr(tuner, "cache", dict(earlier))
    other = triton.Config({"BLOCK_N": 8, "BLOCK_D": 16, "TILES": 3}, num_warps=1)
    assert all(tuning.config_data(c) != tuning.config_data(other) for c in own)
    gen = torch.Generator().manual_seed(3)
    attn, wo_t = torch.randn(1, 1, 5 * 4, generator=gen), torch.randn(5 * 4, 11, generator=gen)
    idx = torch.tensor([[[0, 2, 3]]])
    with tuning.pinned("heads._head_out_kernel", other) as pinned:
        assert pinned is tuner and tuner.configs == [other] and not tuner.cache
        got = heads.sparse_head_out(attn, idx, wo_t, None, 4)
        assert tuner.best_config is other
    torch.testing.assert_close(got, ref.sparse_head_out(attn, idx, wo_t, None, 4))
    assert tuner.configs == own and tuner.cache == earlier
    with pytest.raises(ValueError, match="no autotuned kernel 'heads._nope'"):
        with tuning.pinned("heads._nope", other):
            pass


def test_tuned_configs_that_do_not_fit_are_refused(monkeypatch, tmp_path):
    """A kernel this build does not autotune, a config outside a kernel's candidates or an
    entry without its fields is an error naming it, and nothing is seeded; a bench JSON
    without tuned configs is refused as such."""

    from dejavu_compile.kernels import decode_attention, tuning

    split = decode_attention._split_kernel
    monkeypatch.setattr(split, "cache", {})
    good = {"key": [1], "config": tuning.config_data(split.configs[0])}
    other = {**good["config"], "num_warps": 64}
    with pytest.raises(ValueError, match="'heads._nope'.*does not autotune"):
        tuning.seed({"decode_attention._split_kernel": [good], "heads._nope": [good]})
    with pytest.raises(ValueError, match="_split_kernel.*not among"):
        tuning.seed({"decode_attention._split_kernel": [good, {"key": [2], "config": other}]})
    with pytest.raises(ValueError, match="needs 'key' and 'config'"):
        tuning.seed({"decode_attention._split_kernel": [{"key": [3]}]})
    assert split.cache == {}  # none of the good entries went in
    old = tmp_path / "old.json"
    old.write_text(json.dumps({"gpu": "H200", "e2e": []}))
    with pytest.raises(ValueError, match="without tuned configs"):
        bench.load_tuned(str(old))


def test_markdown_says_when_configs_were_not_tuned():
    result = {"gpu": "H200", "copy_gbs": 4200.0, "kernels": [], "e2e": [],
              "tuned_from": {"path": "run1.json", "keys": 42}}
    text = bench.markdown(result, "dejavu bench --tuned run1.json", "abc1234", "2026-12-01")
    assert "42 tuning keys taken from `run1.json` instead of tuned in this run" in text
    del result["tuned_from"]
    assert "tuning keys" not in bench.markdown(result, "dejavu bench", "abc1234", "2026-12-01")


def test_shipped_configs_are_among_the_kernels_candidates(tmp_path):
    """Every shipped file names kernels this build autotunes and configs among their candidates
    as a GPU run builds them (no interpreter, no quick tuning): seeding it is strict, so a
    config dropped from a kernel's candidates fails here and not in a user's compile. Seeding
    happens once per GPU model, and a key already chosen keeps its config. Each file in a
    process of its own, as each GPU model is seeded in a process that runs on it: two files may
    hold the same keys (the H100's holds the H200's configs), and a key seeded from one keeps
    its config when another is seeded."""
    files = sorted((ROOT / "kernels" / "tuned").glob("*.json"))
    assert files, "no shipped kernel configs"
    code = """
import json, sys
from pathlib import Path
from dejavu_compile.kernels import tuning
assert not tuning.INTERPRET and not tuning.QUICK_TUNE
path = Path(sys.argv[1])
about, data = json.loads(path.read_text())["about"], tuning.load_shipped(path.stem)
assert tuning.shipped_path(about["gpu"]) == path.resolve(), (about["gpu"], path)
name, entries = next(iter(data.items()))
tuner = tuning.autotuners()[name]
key = tuple(entries[0]["key"])
other = next(c for c in tuner.configs if tuning.config_data(c) != entries[0]["config"])
tuner.cache[key] = other  # chosen before: kept
count = tuning.seed_shipped(about["gpu"])
assert count == sum(len(v) for v in data.values()) - 1, count
assert tuner.cache[key] is other
assert tuning.seed_shipped(about["gpu"]) == 0  # once per process
assert tuning.shipped()[about["gpu"]]["keys"] == count
print("ok")
"""
    for path in files:
        out = compile_outside_interpreter(code, str(path), cwd=tmp_path, timeout=300,
                                          unset=("DEJAVU_QUICK_TUNE",))
        assert out.strip() == "ok", (path, out)


def test_shipped_keys_fit_their_kernels_arguments():
    """A shipped key is the kernel's tuning arguments then the dtype of each of its tensor
    arguments (the ``*_ptr`` ones), as Triton builds it: a key written before a kernel gained or
    lost a tensor argument would never match again, and its kernel would tune in every
    process instead of running the shipped tile."""
    from dejavu_compile.kernels import tuning

    tuners = tuning.autotuners()
    for path in sorted((ROOT / "kernels" / "tuned").glob("*.json")):
        for name, entries in tuning.load_shipped(json.loads(path.read_text())["about"]["gpu"]
                                                 ).items():
            tuner = tuners[name]
            tensors = [a for a in tuner.fn.arg_names if a.endswith("_ptr")]
            for entry in entries:
                key = entry["key"]
                assert len(key) == len(tuner.keys) + len(tensors), (path.name, name, key)
                assert all(str(k).startswith("torch.") for k in key[len(tuner.keys):]), key


def test_shipped_configs_file_names_and_absence(monkeypatch, tmp_path):
    """A GPU's file is named after its device name; a GPU without one seeds nothing and is not
    listed; under the interpreter nothing is seeded; a file without ``tuned`` is refused."""
    from dejavu_compile.kernels import tuning

    assert tuning.shipped_path("NVIDIA H200").name == "NVIDIA_H200.json"
    assert tuning.shipped_path("NVIDIA GeForce RTX 4090 (x)").name == \
        "NVIDIA_GeForce_RTX_4090_x.json"
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path)
    monkeypatch.setattr(tuning, "_SHIPPED", {})
    monkeypatch.setattr(tuning, "INTERPRET", False)
    monkeypatch.setattr(tuning, "QUICK_TUNE", False)
    assert tuning.seed_shipped("Some GPU") == 0 and tuning.shipped() == {}
    (tmp_path / "Bad_GPU.json").write_text(json.dumps({"about": {}}))
    with pytest.raises(ValueError, match="Bad_GPU.json.*'tuned'"):
        tuning.seed_shipped("Bad GPU")
    monkeypatch.setattr(tuning, "INTERPRET", True)
    assert tuning.seed_shipped("Other GPU") == 0 and "Other GPU" not in tuning._SHIPPED


def test_markdown_names_the_shipped_configs():
    result = {"gpu": "NVIDIA H200", "copy_gbs": 4200.0, "kernels": [], "e2e": [],
              "shipped": {"NVIDIA H200": {"path": "/x/kernels/tuned/NVIDIA_H200.json",
                                          "keys": 11}}}
    text = bench.markdown(result, "dejavu bench", "abc1234", "2026-12-02")
    assert ("Shipped kernel configs for the NVIDIA H200: 11 tuning keys from "
            "`kernels/tuned/NVIDIA_H200.json`") in text


def test_pipelined_timing_warms_up_on_its_own_cache(monkeypatch):
    """The pipelined loop runs its warm-up steps on the cache it then times (a new cache would
    make the CUDA-graph trees record again inside the timed steps), and times ``new`` steps
    from the prompt's end, each at the next position."""
    calls, cache, syncs = [], SimpleNamespace(layers=[]), []
    monkeypatch.setattr(bench, "_prefilled", lambda model, ids, length: (cache, "mask"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(len(calls)))

    class Out:
        logits = torch.zeros(1, 1, 5)

    def forward(input_ids, past_key_values, cache_position, position_ids, attention_mask,
                use_cache):
        calls.append((past_key_values, int(cache_position), int(position_ids)))
        return Out()

    ids = torch.zeros(1, 6, dtype=torch.int64)
    ms, each, prof = bench._pipelined(None, forward, ids, 3, 16)
    warm = bench.PIPELINE_WARMUP
    assert ms >= 0 and len(calls) == warm + 3
    assert each is None and prof is None  # no CUDA events off CUDA, no profiler unasked
    assert all(c is cache for c, _, _ in calls)
    assert [p for _, p, _ in calls] == list(range(6, 6 + warm)) + [6, 7, 8]
    assert all(p == q for _, p, q in calls)
    assert syncs == [warm, warm + 3]  # the clock starts after the warm-up has finished


def test_pipelined_steps_are_profiled_after_the_timed_ones(monkeypatch):
    """With ``profiled``, that many more steps run back to back under a CUDA profiler after the
    timed ones, going on from their last position and token, with one synchronisation before
    the profiler stops; the window is read whole (no host wait tells its steps apart)."""
    import torch.profiler
    from torch.autograd import DeviceType

    calls, cache, marks = [], SimpleNamespace(layers=[]), []
    monkeypatch.setattr(bench, "_prefilled", lambda model, ids, length: (cache, "mask"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: marks.append(("sync", len(calls))))

    class Profile:
        def __init__(self, activities):
            assert activities == [torch.profiler.ProfilerActivity.CUDA]

        def start(self):
            marks.append(("start", len(calls)))

        def stop(self):
            marks.append(("stop", len(calls)))

    monkeypatch.setattr(torch.profiler, "profile", Profile)

    def forward(input_ids, past_key_values, cache_position, position_ids, attention_mask,
                use_cache):
        calls.append((int(cache_position), int(input_ids)))
        logits = torch.zeros(1, 1, 9)
        logits[0, 0, int(cache_position)] = 1.0  # the next token is this step's position
        return SimpleNamespace(logits=logits)

    ids = torch.zeros(1, 2, dtype=torch.int64)
    ms, _, prof = bench._pipelined(None, forward, ids, 3, 16, profiled=2)
    warm = bench.PIPELINE_WARMUP
    assert isinstance(prof, Profile) and ms >= 0
    assert [p for p, _ in calls[warm:]] == [2, 3, 4, 5, 6]
    assert calls[warm + 3] == (5, 4)  # the token of the last timed step
    assert marks == [("sync", warm), ("sync", warm + 3), ("start", warm + 3),
                     ("sync", warm + 5), ("stop", warm + 5)]
    assert bench._pipelined(None, forward, ids, 3, 16)[2] is None

    # two steps back to back: 10 us idle inside the first, 4 between them, 20 with two running
    def kernel(start, end, name="k", stream=7):
        return SimpleNamespace(device_type=DeviceType.CUDA, name=name, device_resource_id=stream,
                               time_range=SimpleNamespace(start=start, end=end))

    events = [kernel(0, 50), kernel(30, 50, stream=9), kernel(60, 100, name="j"),
              kernel(104, 200, name="j")]
    window = bench._window_timeline(SimpleNamespace(events=lambda: events), 2)
    assert window["span_ms"] == pytest.approx(0.1) and window["idle_ms"] == pytest.approx(0.007)
    assert window["concurrent_ms"] == pytest.approx(0.01) and window["streams"] == 2
    assert window["idle_before"] == [{"kernel": "j", "us_per_step": pytest.approx(7.0),
                                      "gaps_per_step": pytest.approx(1.0)}]
    assert bench._window_timeline(SimpleNamespace(events=lambda: []), 2) is None


def test_pipelined_steps_are_timed_between_events(monkeypatch):
    """On CUDA the pipelined loop records an event before its first timed step and after each
    (none in the warm-up), with no synchronisation between, and gives each step's time
    between its two events; off CUDA it records none."""
    calls, cache, syncs, marks = [], SimpleNamespace(layers=[]), [], []
    monkeypatch.setattr(bench, "_prefilled", lambda model, ids, length: (cache, "mask"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: syncs.append(len(calls)))

    class Event:  # elapsed_time: the ms between two marks, 1 ms a step after the third
        def __init__(self):
            self.at = len(calls)
            marks.append(self.at)

        def elapsed_time(self, other):
            return float(sum(1 if i > warm + 2 else 0.5 for i in range(self.at, other.at)))

    warm, real = bench.PIPELINE_WARMUP, bench._step_mark
    assert real(torch.device("cpu")) is None
    monkeypatch.setattr(bench, "_step_mark", lambda device: Event)

    def forward(input_ids, past_key_values, cache_position, position_ids, attention_mask,
                use_cache):
        calls.append(int(cache_position))
        return SimpleNamespace(logits=torch.zeros(1, 1, 5))

    ids = torch.zeros(1, 6, dtype=torch.int64)
    ms, each, _ = bench._pipelined(None, forward, ids, 5, 16)
    assert marks == [warm, warm + 1, warm + 2, warm + 3, warm + 4, warm + 5]
    assert syncs == [warm, warm + 5] and each == [0.5, 0.5, 0.5, 1.0, 1.0]
    spread = bench.step_spread(each)
    assert spread["mean"] == pytest.approx(0.7) and spread["median"] == 0.5
    assert spread["max"] == 1.0 and spread["slow_steps"] == 0


def test_step_spread_counts_the_slow_steps():
    """``step_spread``: mean, median, p20/p80 and slowest of the step times, and the steps over
    twice the median with their time beyond it per step of all (what they add to the mean);
    fewer than two steps give none."""
    spread = bench.step_spread([4.0] * 8 + [20.0, 4.1])
    assert spread["median"] == pytest.approx(4.0) and spread["max"] == 20.0
    assert spread["mean"] == pytest.approx(5.61)
    assert spread["slow_steps"] == 1 and spread["slow_excess_ms"] == pytest.approx(1.6)
    assert spread["p20"] == pytest.approx(4.0)
    assert bench.step_spread([4.0]) is None and bench.step_spread(None) is None
    rows = [{"model": "opt-13b", "mode": "dejavu_captured_qkv_pdl", "round": 0,
             "step_spread": bench.step_spread([4.0, 4.0, 4.2]), "pipelined_spread": spread},
            {"model": "opt-13b", "mode": "hf_eager"}]
    text = "\n".join(bench._spread_markdown(rows))
    assert ("| opt-13b | dejavu_captured_qkv_pdl (round 0) | 4.07 / 4.00 / 4.20 | 0 | "
            "5.61 / 4.00 / 20.00 | 1 (1.60 ms a step) |") in text
    assert "hf_eager" not in text and bench._spread_markdown(rows[1:]) == []


def test_pipelined_timing_rewinds_the_static_cache(monkeypatch):
    """Transformers' static cache writes each step at its own count of filled positions, not at
    the step's ``cache_position``: the pipelined loop sets that count back to the prompt's
    length before its timed steps, so they write where they read and the cache needs no room
    beyond the prompt and the timed steps (without it, the warm-up's steps pushed the last
    timed ones past a 257-position cache: a device-side assert on the H200)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=1, vocab_size=64)
    model = LlamaForCausalLM(cfg).eval()
    prompt, new = 5, bench.PIPELINE_WARMUP + 1  # the warm-up's steps fit in the timed ones
    monkeypatch.setattr(torch.cuda, "synchronize", lambda: None)
    written = []

    def forward(**kwargs):
        cache = kwargs["past_key_values"]
        written.append(int(kwargs["cache_position"]))
        out = model(**kwargs)
        # the step's keys went where its position says: the next free position is after it
        assert int(cache.layers[0].cumulative_length) == written[-1] + 1
        return out

    ids = torch.randint(0, 64, (1, prompt))
    with torch.no_grad():
        bench._pipelined(model, forward, ids, new, prompt + new)  # no room to spare
    assert written[-new:] == list(range(prompt, prompt + new))


def test_kernel_switches_follow_the_mode(monkeypatch):
    """``dejavu_pdl`` (and every mode named ``*_pdl``) runs with programmatic launch and every
    other mode without it (``DEJAVU_PDL`` 1 or 0, whatever the environment said), and only
    ``dejavu_store`` with the row-storing kernels; the environment is restored."""
    from dejavu_compile.kernels.triton_common import PDL_ENV, STORE_ROWS_ENV, stores_rows

    monkeypatch.setenv(PDL_ENV, "1")
    monkeypatch.setenv(STORE_ROWS_ENV, "1")  # set outside: each mode still says its own
    assert {"dejavu_pdl", "dejavu_store"} <= set(bench.SPARSE_MODES)
    with bench.kernel_switches("dejavu_store"):
        assert stores_rows() and os.environ[PDL_ENV] == "0"
    for mode in ("dejavu_pdl", "dejavu_captured_lazy_pdl", "dejavu_captured_qkv_pdl"):
        assert mode in bench.SPARSE_MODES
        with bench.kernel_switches(mode):
            assert os.environ[PDL_ENV] == "1" and not stores_rows()
    assert os.environ[STORE_ROWS_ENV] == "1"
    monkeypatch.delenv(STORE_ROWS_ENV)
    monkeypatch.delenv(PDL_ENV)  # unset: the default, programmatic launch where it can be
    for mode in ("dejavu_sparse", "dejavu_captured_lazy"):
        with bench.kernel_switches(mode):
            assert os.environ[PDL_ENV] == "0" and not stores_rows()
    assert PDL_ENV not in os.environ and STORE_ROWS_ENV not in os.environ


def test_only_the_grid_modes_set_the_lazy_grid(monkeypatch):
    """``dejavu_captured_qkv_heads_pdl`` runs the lazy K/V kernel over every head
    (``DEJAVU_LAZY_GRID=heads``), ``dejavu_captured_qkv_sel_pdl`` over the selection's slots,
    every other mode over the default grid (the selection's) whatever the environment said; the
    environment is restored; an unknown grid is an error naming the variable."""
    from dejavu_compile.kernels import lazy_kv

    for mode in ("dejavu_captured_qkv_heads_pdl", "dejavu_captured_qkv_sel_pdl"):
        assert bench._DEJAVU_MODES[mode] == bench._DEJAVU_MODES["dejavu_captured_qkv_pdl"]
    monkeypatch.setenv(lazy_kv.GRID_ENV, "heads")  # set outside: the mode says its own
    for mode in ("dejavu_captured_qkv_pdl", "dejavu_captured_lazy"):
        with bench.kernel_switches(mode):
            assert lazy_kv.default_grid() == "selection"
    with bench.kernel_switches("dejavu_captured_qkv_heads_pdl"):
        assert lazy_kv.default_grid() == "heads"
    monkeypatch.setenv(lazy_kv.GRID_ENV, "selection")
    with bench.kernel_switches("dejavu_captured_qkv_sel_pdl"):
        assert lazy_kv.default_grid() == "selection"
    assert os.environ[lazy_kv.GRID_ENV] == "selection"
    monkeypatch.setenv(lazy_kv.GRID_ENV, "rows")
    with pytest.raises(ValueError, match="DEJAVU_LAZY_GRID='rows'"):
        lazy_kv.default_grid()


def test_only_the_chunk_mode_sets_the_attention_chunk(monkeypatch):
    """``dejavu_captured_qkv_chunk32_pdl`` is the default OPT step with the decode attention's
    long chunks of 32 keys (``DEJAVU_ATTN_CHUNK=32``) and ``dejavu_captured_qkv_whole_pdl``
    with one chunk a KV head (``whole``); every other mode runs the default chunk whatever the
    environment said; the environment is restored."""
    from dejavu_compile.kernels import decode_attention

    mode = "dejavu_captured_qkv_chunk32_pdl"
    assert bench._DEJAVU_MODES[mode] == bench._DEJAVU_MODES["dejavu_captured_qkv_pdl"]
    monkeypatch.setenv(decode_attention.LONG_CHUNK_ENV, "64")  # set outside: each mode says
    for other in ("dejavu_captured_qkv_pdl", "dejavu_captured_ahead_ipdl_pdl", "dejavu_sparse"):
        with bench.kernel_switches(other):
            assert decode_attention.long_chunk() == decode_attention.LONG_CHUNK
    with bench.kernel_switches(mode):
        assert decode_attention.long_chunk() == 32 and not decode_attention.whole_cache()
    whole = "dejavu_captured_qkv_whole_pdl"
    assert bench._DEJAVU_MODES[whole] == bench._DEJAVU_MODES["dejavu_captured_qkv_pdl"]
    with bench.kernel_switches(whole):
        assert decode_attention.whole_cache()
    assert os.environ[decode_attention.LONG_CHUNK_ENV] == "64"


def test_only_the_early_modes_load_the_up_kernels_ids_before_the_wait(monkeypatch):
    """The modes named ``*_early_pdl`` run with ``DEJAVU_EARLY_IDS=1``, every other mode
    without it, whatever the environment said; the environment is restored."""
    from dejavu_compile.kernels.triton_common import EARLY_IDS_ENV, early_ids

    monkeypatch.setenv(EARLY_IDS_ENV, "1")  # set outside: the mode says its own
    for mode, want in (("dejavu_captured_qkv_pdl", False), ("dejavu_captured_ahead", False),
                       ("dejavu_captured_qkv_early_pdl", True),
                       ("dejavu_captured_ahead_early_pdl", True)):
        assert mode in bench.SPARSE_MODES
        with bench.kernel_switches(mode):
            assert early_ids() is want, mode
    assert os.environ[EARLY_IDS_ENV] == "1"


def test_the_norm_modes_say_where_a_fused_norm_is_finished(monkeypatch):
    """``dejavu_captured_qkv_norm_pdl`` finishes every fused norm in the reducing kernels,
    ``dejavu_captured_qkv_normm_pdl`` the MLP's in its down kernel and the output projection's
    in an add-norm launch, ``dejavu_captured_qkv_normk_pdl`` in add-norm launches after the
    finished ops, every other mode in add-norm launches that finish the reducing kernels' sums
    (``DEJAVU_NORM_FINISH`` unset, the default; ``dejavu_captured_qkv_norms_pdl`` says it),
    whatever the environment said; the environment is restored;
    ``dejavu_captured_qkv_nonorm_pdl`` has no fused norm; an unknown value is an error naming
    the variable."""
    from dejavu_compile.kernels.triton_common import NORM_FINISH_ENV, norm_finish, norm_in_finish

    monkeypatch.setenv(NORM_FINISH_ENV, "mixed")  # set outside: the mode says its own
    for mode, want in (("dejavu_captured_qkv_norm_pdl", (True, True)),
                       ("dejavu_captured_qkv_pdl", (False, False)),
                       ("dejavu_captured_qkv_normk_pdl", (False, False)),
                       ("dejavu_captured_qkv_normm_pdl", (True, False))):
        assert mode in bench.SPARSE_MODES
        with bench.kernel_switches(mode):
            assert (norm_in_finish("mlp"), norm_in_finish("head_out")) == want, mode
    with bench.kernel_switches("dejavu_captured_qkv_norms_pdl"):
        assert norm_finish() == "sums" and not norm_in_finish("mlp")
    with bench.kernel_switches("dejavu_captured_qkv_pdl"):
        assert norm_finish() == "sums" and not norm_in_finish("head_out")
    with bench.kernel_switches("dejavu_captured_qkv_normk_pdl"):
        assert norm_finish() == "kernel"
    assert os.environ[NORM_FINISH_ENV] == "mixed"
    modes = bench._DEJAVU_MODES
    assert modes["dejavu_captured_qkv_normk_pdl"][3]["fuse_norm"] is True
    assert modes["dejavu_captured_qkv_nonorm_pdl"][3]["fuse_norm"] is False
    assert "fuse_norm" not in modes["dejavu_captured_qkv_pdl"][3]  # the default: on
    assert modes["dejavu_captured_ahead_rms_pdl"][3]["fuse_rms_norm"] is True
    assert modes["dejavu_captured_ahead_normi_pdl"][3]["fuse_rms_norm"] is False
    assert "fuse_rms_norm" not in modes["dejavu_captured_ahead_ipdl_pdl"][3]  # the default: on
    monkeypatch.setenv(NORM_FINISH_ENV, "first")
    with pytest.raises(ValueError, match="DEJAVU_NORM_FINISH='first'"):
        norm_in_finish("mlp")


@pytest.mark.parametrize("suffix,late,start", [("normlate", "late", "wait"),
                                                ("exit", "late", "exit")])
def test_the_launch_modes_are_the_default_steps_with_their_switches(monkeypatch, suffix, late,
                                                                    start):
    """``dejavu_captured_qkv_normlate_pdl`` and ``dejavu_captured_ahead_normlate_pdl`` are
    OPT-13B's and Llama-3-8B's default steps run with ``DEJAVU_NORM_LAUNCH=late``; the
    ``*_exit_pdl`` modes with ``DEJAVU_PDL_START=exit`` as well (every kernel launched
    programmatically, none starting its successor before its programs exit). Every other mode
    runs with both unset (plain and "wait", the defaults), whatever the environment said,
    which is restored afterwards."""
    from dejavu_compile.kernels.triton_common import (
        NORM_LAUNCH_ENV,
        PDL_START_ENV,
        norm_launch,
        pdl_start,
    )

    # set outside: each mode says its own
    monkeypatch.setenv(NORM_LAUNCH_ENV, "late")
    monkeypatch.setenv(PDL_START_ENV, "exit")
    modes = bench._DEJAVU_MODES
    for name, step in (("qkv", "dejavu_captured_qkv_pdl"),
                       ("ahead", "dejavu_captured_ahead_ipdl_pdl")):
        mode = f"dejavu_captured_{name}_{suffix}_pdl"
        assert mode in bench.SPARSE_MODES and modes[mode] == modes[step]
        with bench.kernel_switches(mode):
            assert (norm_launch(), pdl_start()) == (late, start)
        with bench.kernel_switches(step):
            assert NORM_LAUNCH_ENV not in os.environ and PDL_START_ENV not in os.environ
            assert (norm_launch(), pdl_start()) == ("plain", "wait")
    assert (os.environ[NORM_LAUNCH_ENV], os.environ[PDL_START_ENV]) == ("late", "exit")


def test_the_gemv_modes_pair_the_default_steps_with_and_without_dense_gemv():
    """The default steps leave ``dense_gemv`` to its default (on CUDA); the gemv modes say it
    and the nogemv modes turn it off, the rest of each step the same."""
    modes = bench._DEJAVU_MODES
    for step, name in (("dejavu_captured_qkv_pdl", "qkv"), ("dejavu_captured_ahead_ipdl_pdl", "ahead")):
        base = modes[step][3]
        assert "dense_gemv" not in base
        for suffix, value in (("gemv", True), ("nogemv", False)):
            mode = f"dejavu_captured_{name}_{suffix}_pdl"
            assert mode in bench.MODES
            assert modes[mode][:3] == modes[step][:3]
            assert modes[mode][3] == {**base, "dense_gemv": value}
    assert DejavuOptions(selector="oracle", mlp_density=0.5).dense_gemv is None


def test_readme_describes_every_bench_mode():
    from pathlib import Path

    text = (Path(__file__).parents[1] / "README.md").read_text()
    assert [m for m in bench.MODES if f"`{m}`" not in text] == []


def test_every_dejavu_mode_is_one_the_bench_can_run():
    """``--modes`` takes ``MODES``: a dejavu mode defined but left out of it could not be asked
    for (``dejavu_captured_qkv_orig_pdl`` was, until the thirtieth session)."""
    assert [m for m in bench._DEJAVU_MODES if m not in bench.MODES] == []
    assert len(set(bench.MODES)) == len(bench.MODES)


def test_a_stopped_run_keeps_what_it_measured(monkeypatch, tmp_path):
    """The JSON is rewritten after each result, marked incomplete until the run ends: a run
    that stops early (a device call's time limit) keeps the modes it finished, and the
    markdown made from it says it is partial."""

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4e12)
    llama = bench.shape_configs()["llama-3-8b"]
    monkeypatch.setattr(bench, "shape_configs", lambda: {"llama-3-8b": llama})

    def end_to_end(name, cfg, point, prompt, modes, breakdown, cpus):
        assert prompt == bench.E2E_PROMPT
        yield bench.DecodeResult("hf_compiled", 6.0, (5.9, 6.1), 15 * 10**9, 15.1, host_ms=0.6,
                                 pipelined_ms=5.6, dense_bytes=15 * 10**9)
        raise KeyboardInterrupt  # the time limit, before the second mode finished

    monkeypatch.setattr(bench, "end_to_end", end_to_end)
    out = tmp_path / "run.json"
    with pytest.raises(KeyboardInterrupt):
        bench.run(["llama-3-8b"], out_json=str(out), kernels=False)
    partial = json.loads(out.read_text())
    assert partial["complete"] is False and [r["mode"] for r in partial["e2e"]] == ["hf_compiled"]
    # the prompt and the cache each row's steps decoded into: 128 + 128 timed steps + 1
    (row,) = partial["e2e"]
    assert (row["prompt"], row["cache_positions"]) == (128, 257)
    assert row["kv_cache_bytes"] == 2 * 32 * 8 * 128 * 257 * 2
    assert row["dense_floor_ms"] == pytest.approx(3.75)  # 15 GB at 4 TB/s
    text = bench.markdown(partial, "dejavu bench", "abc1234", "2026-12-01")
    assert "Partial: the run stopped before its end" in text and "hf_compiled" in text

    monkeypatch.setattr(bench, "end_to_end", lambda *a, **k: iter(()))
    assert bench.run(["llama-3-8b"], out_json=str(out), kernels=False)["complete"] is True
    assert json.loads(out.read_text())["complete"] is True


def test_a_stopped_kernel_sweep_keeps_its_rows(monkeypatch, tmp_path):
    """The kernel sweep hands over each row as it is measured: a run stopped inside it (a
    device call's time limit) keeps the rows measured so far. The densities asked for reach
    every part of the sweep (the batch rows only at theirs), and one outside (0, 1] is
    refused before anything runs."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(bench, "shape_configs", lambda: {"opt-13b": None})
    asked = {}

    def part(block, stop=False):
        def sweep(name, cfg, *args, densities=None, **kwargs):
            asked[block] = list(densities if densities is not None else args[0])
            for density in asked[block]:
                yield {"model": name, "block": block, "density": density, "sparse_gbs": 1e3,
                       "bytes": int(density * 100)}
                if stop:
                    raise KeyboardInterrupt  # the time limit, inside the attention part
        return sweep

    copied = []  # a copy of each size, once per model
    monkeypatch.setattr(bench, "same_bytes_copy_ms", lambda n: copied.append(n) or n / 1e3)
    monkeypatch.setattr(bench, "_mlp_sweep", part("mlp"))
    monkeypatch.setattr(bench, "_attention_sweep", part("attention_out", stop=True))
    monkeypatch.setattr(bench, "_selector_sweep", part("mlp_selector"))
    monkeypatch.setattr(bench, "_mlp_batch_sweep", part("mlp batch"))
    out = tmp_path / "run.json"
    with pytest.raises(KeyboardInterrupt):
        bench.run(["opt-13b"], out_json=str(out), e2e=False, densities=(0.1, 0.8))
    partial = json.loads(out.read_text())
    assert partial["complete"] is False
    assert [(r["block"], r["density"]) for r in partial["kernels"]] == [
        ("mlp", 0.1), ("mlp", 0.8), ("attention_out", 0.1)]
    assert partial["kernels"][0]["pct_copy"] == pytest.approx(25.0)
    assert [r["copy_ms"] for r in partial["kernels"]] == [0.01, 0.08, 0.01]
    assert copied == [10, 80]

    monkeypatch.setattr(bench, "_attention_sweep", part("attention_out"))
    done = bench.run(["opt-13b"], e2e=False, densities=(0.1, 0.8))
    assert done["complete"] and asked == {"mlp": [0.1, 0.8], "attention_out": [0.1, 0.8],
                                          "mlp_selector": [0.1, 0.8], "mlp batch": [0.1]}
    asked.clear()
    bench.run(["opt-13b"], e2e=False, densities=(0.25,))
    assert "mlp batch" not in asked  # none of its densities asked
    asked.clear()  # --blocks: only the parts named, in the sweep's order
    bench.run(["opt-13b"], e2e=False, densities=(0.1,), blocks=("batch", "attention"))
    assert list(asked) == ["attention_out", "mlp batch"]
    for bad in ((), ("attention", "heads")):
        with pytest.raises(ValueError, match="blocks"):
            bench.run(["opt-13b"], e2e=False, blocks=bad)
    for bad in ((0.0, 0.5), (1.5,), ()):
        with pytest.raises(ValueError, match="densities"):
            bench.run(["opt-13b"], e2e=False, densities=bad)


def test_the_kernel_sweep_runs_the_shipped_configs_after_the_tuned_ones(monkeypatch, tmp_path):
    """The kernel sweep times the configs the backend runs: the GPU's shipped file is seeded
    before the sweep (the backend seeds it when it compiles, option ``shipped_configs``), after
    a ``--tuned`` file, whose keys it keeps. A run without the sweep leaves it to the backend."""
    from dejavu_compile.kernels import tuning

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4e12)
    monkeypatch.setattr(bench, "shape_configs", lambda: {"opt-13b": None})
    monkeypatch.setattr(bench, "kernel_sweep", lambda *a, **k: iter(()))
    monkeypatch.setattr(bench, "end_to_end", lambda *a, **k: iter(()))
    calls = []
    monkeypatch.setattr(tuning, "seed", lambda data, keep=False: calls.append(("tuned", data)) or 1)
    monkeypatch.setattr(tuning, "seed_shipped", lambda gpu: calls.append(("shipped", gpu)) or 2)
    tuned = tmp_path / "t.json"
    tuned.write_text(json.dumps({"tuned": {"k": []}}))
    bench.run(["opt-13b"], e2e=False, densities=(0.5,), tuned=str(tuned))
    assert calls == [("tuned", {"k": []}), ("shipped", "fake GPU")]
    calls.clear()
    bench.run(["opt-13b"], kernels=False)
    assert calls == []


def test_end_to_end_runs_the_dejavu_modes_in_the_order_asked(monkeypatch, tiny):
    """The HF modes run first (a dejavu compilation re-lays out the parameters in place), then
    the dejavu modes in the order given, each once: so a run can measure two modes the other
    way round. ``hf_captured`` and ``dejavu_captured`` time the step through ``CapturedStep``."""
    import dejavu_compile

    seen, captured = [], []

    def latency(model, forward, prompt, new, mode, bytes_per_token, breakdown=False, cpus=None):
        assert cpus == [0]  # every mode's timed steps pinned as asked
        seen.append(mode)
        captured.append(forward.copies if isinstance(forward, dejavu_compile.CapturedStep)
                        else 0)
        return SimpleNamespace(mode=mode, bytes_per_token=0)

    monkeypatch.setattr(bench, "random_model", lambda cfg: tiny("llama"))
    monkeypatch.setattr(bench, "random_profile", lambda *a, **k: None)
    monkeypatch.setattr(bench, "decode_latency", latency)
    monkeypatch.setattr(bench.torch.cuda, "empty_cache", lambda: None)
    monkeypatch.setattr(bench.torch, "compile", lambda fn, **kwargs: fn)  # nothing runs
    monkeypatch.setattr(bench.torch._dynamo, "reset", lambda: None)
    monkeypatch.setattr(dejavu_compile, "report",
                        lambda model: SimpleNamespace(bytes_sparse=1))
    modes = ["dejavu_split", "dejavu_captured", "hf_captured", "dejavu_sparse", "hf_compiled",
             "dejavu_split", "dejavu_captured_ahead2"]
    results = list(bench.end_to_end("llama-3-8b", None, {"mlp": 0.5, "attention": 1.0},
                                    modes=modes, cpus=[0]))
    got = [r.mode for r in results]
    assert got == seen == ["hf_compiled", "hf_captured", "dejavu_split", "dejavu_captured",
                           "dejavu_sparse", "dejavu_captured_ahead2"]
    # every mode, dense or sparse, carries the model's dense weight bytes (the dense byte
    # floor's), counted before any dejavu compilation
    assert {r.dense_bytes for r in results} == {bench.weight_bytes(tiny("llama"))}
    # the captured modes replay captures of their own: one per key, two for the "2" mode
    assert captured == [0, 1, 0, 1, 0, 2]


def test_isolated_runs_each_mode_in_its_own_process_in_alternating_order(monkeypatch, tmp_path):
    """``dejavu bench --isolate N``: one child process per mode and round, the modes' order
    reversed every other round; every child after the first runs with the configs tuned so
    far; each ratio is against the same round's hf_compiled, with medians over the rounds; a
    child that fails is listed and the run goes on, marked incomplete."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    calls, seeds = [], []
    times = {("hf_compiled", 0): 10.0, ("dejavu_sparse", 0): 4.0,
             ("dejavu_sparse", 1): 4.8, ("hf_compiled", 1): 12.0}

    def runner(cmd, timeout):
        mode, out = cmd[cmd.index("--modes") + 1], cmd[cmd.index("--json") + 1]
        r = sum(1 for c in calls if c == mode)
        calls.append(mode)
        seeds.append(json.load(open(cmd[cmd.index("--tuned") + 1])) if "--tuned" in cmd
                     else None)
        assert "--no-kernels" in cmd and "--breakdown" in cmd and timeout == 30
        if mode == "dejavu_fixed":
            return 1, "Traceback\nRuntimeError: out of memory\n"
        row = {"model": "opt-13b", "mode": mode, "ms_per_token": times[(mode, r)], "p20": 1.0,
               "p80": 2.0, "bytes_per_token": 1e9, "floor_ms": 0.2, "peak_gib": 1.0,
               "dense_floor_ms": 10.0,
               "operating_point": {"mlp": 0.1, "attention": 0.5}, "tuned": {},
               "breakdown": [{"kernel": "k", "us_per_step": 1.0, "calls_per_step": 1.0}]}
        tuned = {"k._a": [{"key": [1], "config": {"n": 1}}]} if mode == "dejavu_sparse" else {}
        json.dump({"gpu": "H", "copy_gbs": 4000.0, "e2e": [row], "tuned": tuned},
                  open(out, "w"))
        return 0, ""

    out = tmp_path / "iso.json"
    result = bench.isolated(["opt-13b"], ["hf_compiled", "dejavu_sparse", "dejavu_fixed"], 2,
                            out_json=str(out), breakdown=True, timeout=30, runner=runner)
    assert calls == ["hf_compiled", "dejavu_sparse", "dejavu_fixed",
                     "dejavu_fixed", "dejavu_sparse", "hf_compiled"]
    # the configs the first dejavu child tuned go to every child after it
    assert seeds[:2] == [None, None] and all(s == {"k._a": [{"key": [1], "config": {"n": 1}}]}
                                             for s in seeds[2:])
    assert [(f["mode"], f["round"]) for f in result["failed"]] == [("dejavu_fixed", 0),
                                                                   ("dejavu_fixed", 1)]
    assert result["complete"] is False and json.loads(out.read_text())["rounds"] == 2
    assert [r["round"] for r in result["e2e"]] == [0, 0, 1, 1]
    text = bench.markdown(result, "dejavu bench --isolate 2", "abc1234", "2026-12-01")
    rows = [line for line in text.splitlines() if "| dejavu_sparse (round" in line]
    # over the same round's hf_compiled (4/10, 4.8/12) and over the dense floor (10 ms)
    assert rows[0].endswith("| 0.400x | 0.400x (10.00) |"), rows
    assert rows[1].endswith("| 0.400x | 0.480x (10.00) |"), rows
    assert "GPU kernel time per decode step, opt-13b dejavu_sparse (round 1) (" in text
    median = [line for line in text.splitlines() if line.startswith("| opt-13b | dejavu_sparse |")]
    assert median == ["| opt-13b | dejavu_sparse | 2 | 4.00, 4.80 | 4.40 | 0.400x | 0.440x |"], \
        median
    assert "Failed: opt-13b dejavu_fixed in round 1 (return code 1): `RuntimeError: out of " \
           "memory`" in text
    with pytest.raises(ValueError, match="rounds must be at least 1"):
        bench.isolated(["opt-13b"], ["hf_compiled"], 0, runner=runner)


def test_variants_measure_each_dejavu_mode_again_with_their_configs(monkeypatch, tmp_path):
    """``dejavu bench --isolate N --variants LABEL=FILE``: each dejavu mode runs once more per
    variant in every round, in the same alternating order, its process with the file's
    configs first; those configs never reach the other processes; the rows and the medians
    carry the label, and each ratio is against the same round's hf_compiled."""
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    tile = tmp_path / "tile.json"
    tile.write_text(json.dumps({"tuned": {"k._down": [{"key": [5], "config": {"n": 64}}]}}))
    calls = []

    def runner(cmd, timeout):
        mode, out = cmd[cmd.index("--modes") + 1], cmd[cmd.index("--json") + 1]
        seeds = json.load(open(cmd[cmd.index("--tuned") + 1])) if "--tuned" in cmd else {}
        variant = seeds.get("k._down", [{}])[0].get("config") == {"n": 64}
        calls.append((mode, variant, seeds))
        row = {"model": "opt-13b", "mode": mode, "ms_per_token": 3.0 if variant else 4.0,
               "p20": 1.0, "p80": 2.0, "bytes_per_token": 1e9, "floor_ms": 0.2,
               "peak_gib": 1.0, "operating_point": {"mlp": 0.1, "attention": 0.5}}
        if mode == "hf_compiled":
            row["ms_per_token"] = 10.0
        # every dejavu process records the down key's config it ran and a key of its own
        tuned = {} if mode == "hf_compiled" else {
            "k._down": [{"key": [5], "config": {"n": 64 if variant else 16}}],
            "k._up": [{"key": [1], "config": {"n": 1}}]}
        json.dump({"gpu": "H", "copy_gbs": 4000.0, "e2e": [row], "tuned": tuned},
                  open(out, "w"))
        return 0, ""

    variants = bench.parse_variants([f"d64={tile}"])
    result = bench.isolated(["opt-13b"], ["hf_compiled", "dejavu_sparse"], 2, runner=runner,
                            variants=variants)
    assert [(m, v) for m, v, _ in calls] == [
        ("hf_compiled", False), ("dejavu_sparse", False), ("dejavu_sparse", True),
        ("dejavu_sparse", True), ("dejavu_sparse", False), ("hf_compiled", False)]
    # the plain processes after the variant's never see its tile: only what they tuned
    assert calls[3][2]["k._down"][0]["config"] == {"n": 64}
    assert calls[4][2]["k._down"] == [{"key": [5], "config": {"n": 16}}]
    assert calls[4][2]["k._up"] == [{"key": [1], "config": {"n": 1}}]
    assert [r.get("variant") for r in result["e2e"]] == [None, None, "d64", "d64", None, None]
    text = bench.markdown(result, "dejavu bench --isolate 2", "abc1234", "2026-12-07")
    assert f"Variant `d64`: each dejavu mode measured again with 1 tuning keys from `{tile}`" \
        in text
    assert "| opt-13b | dejavu_sparse [d64] (round 1) | MLP 0.1, attention 0.5 | 3.00" in text
    medians = [line for line in text.splitlines()
               if line.startswith(("| opt-13b | dejavu_sparse | 2 |",
                                   "| opt-13b | dejavu_sparse [d64] | 2 |"))]
    assert medians == ["| opt-13b | dejavu_sparse | 2 | 4.00, 4.00 | 4.00 | 0.400x |  |",
                       "| opt-13b | dejavu_sparse [d64] | 2 | 3.00, 3.00 | 3.00 | 0.300x |  |"]
    for bad, why in (("d64", "is not LABEL=FILE"), ("=x.json", "is not LABEL=FILE")):
        with pytest.raises(ValueError, match=why):
            bench.parse_variants([bad])
    with pytest.raises(ValueError, match="label 'a' is given twice"):
        bench.parse_variants([f"a={tile}", f"a={tile}"])
    with pytest.raises(FileNotFoundError):
        bench.parse_variants([f"a={tmp_path / 'missing.json'}"])


def test_isolate_builds_a_child_command_the_cli_reads(monkeypatch):
    """The child's command line is one the ``dejavu bench`` parser accepts, for one model and
    one mode, with the JSON it is read back from; ``--isolate`` refuses the kernel sweep."""
    from dejavu_compile import cli

    cmd = bench.child_command("opt-13b", "dejavu_captured_lazy", "/tmp/x.json", True, "t.json")
    assert cmd[1:4] == ["-m", "dejavu_compile.cli", "bench"]
    seen = {}
    monkeypatch.setattr(cli, "_bench", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(cmd[3:]) == 0
    assert seen["models"] == ["opt-13b"] and seen["modes"] == ["dejavu_captured_lazy"]
    assert seen["json"] == "/tmp/x.json" and seen["breakdown"] and seen["tuned"] == "t.json"
    assert seen["no_kernels"] and seen["isolate"] is None
    monkeypatch.undo()
    with pytest.raises(SystemExit, match="--isolate measures the end-to-end modes only"):
        cli.main(["bench", "--models", "opt-13b", "--isolate", "2"])
    with pytest.raises(SystemExit, match="--variants needs --isolate"):
        cli.main(["bench", "--no-kernels", "--variants", "a=t.json"])
    with pytest.raises(SystemExit, match="'a' is not LABEL=FILE"):
        cli.main(["bench", "--no-kernels", "--isolate", "1", "--variants", "a"])


def test_the_cli_passes_the_sweep_densities(monkeypatch):
    """``dejavu bench --densities`` and ``--blocks`` reach the sweep; without them, the one
    default of each."""
    from dejavu_compile import cli

    seen = []

    def run(models, **kwargs):
        seen.append(kwargs["densities"])
        return {"gpu": "fake GPU", "copy_gbs": 4000.0, "kernels": [], "e2e": [],
                "complete": True}

    monkeypatch.setattr(bench, "run", run)
    assert cli.main(["bench", "--no-e2e", "--densities", "0.1", "0.8"]) == 0
    assert cli.main(["bench", "--no-e2e"]) == 0
    assert seen == [[0.1, 0.8], list(bench.DENSITIES)]
    blocks = []
    monkeypatch.setattr(bench, "run", lambda models, **kw: blocks.append(kw["blocks"]) or run(
        models, **kw))
    assert cli.main(["bench", "--no-e2e", "--blocks", "attention"]) == 0
    assert cli.main(["bench", "--no-e2e"]) == 0
    assert blocks == [["attention"], list(bench.SWEEP_BLOCKS)]


def test_without_modes_each_model_runs_its_own_default_step(monkeypatch):
    """``dejavu bench`` with no ``--modes`` runs issue 4's rows of each model, the model's own
    default step among them, not every mode there is; named modes run for every model."""
    from dejavu_compile import cli

    assert bench.default_modes("opt-13b") == ("hf_eager", "hf_compiled", "dejavu_dense",
                                              "dejavu_captured_qkv_pdl")
    assert bench.default_modes("llama-3-8b")[-1] == "dejavu_captured_ahead_ipdl_pdl"
    configs = bench.shape_configs()
    assert all(m in bench.MODES for name in configs for m in bench.default_modes(name))
    # every OPT shape runs OPT's step
    assert {n for n in configs if configs[n].model_type == "opt"} == set(bench.DEFAULT_STEPS)
    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(bench.torch.cuda, "get_device_name", lambda: "fake GPU")
    monkeypatch.setattr(bench, "copy_bandwidth", lambda: 4e12)
    seen = []

    def end_to_end(name, cfg, point, prompt, modes, breakdown, cpus):
        seen.append((name, tuple(modes)))
        return iter(())

    monkeypatch.setattr(bench, "end_to_end", end_to_end)
    monkeypatch.setattr(bench, "markdown", lambda *a: "")
    assert cli.main(["bench", "--no-kernels", "--models", "opt-13b", "llama-3-8b"]) == 0
    assert seen == [(n, bench.default_modes(n)) for n in ("opt-13b", "llama-3-8b")]
    seen.clear()
    assert cli.main(["bench", "--no-kernels", "--models", "opt-13b", "llama-3-8b",
                     "--modes", "dejavu_sparse"]) == 0
    assert seen == [("opt-13b", ("dejavu_sparse",)), ("llama-3-8b", ("dejavu_sparse",))]

    calls = []

    def runner(cmd, timeout):
        calls.append((cmd[cmd.index("--models") + 1], cmd[cmd.index("--modes") + 1]))
        return 1, "not run"

    bench.isolated(["opt-13b", "llama-3-8b"], None, 2, runner=runner)
    opt, llama = bench.default_modes("opt-13b"), bench.default_modes("llama-3-8b")
    assert calls == ([("opt-13b", m) for m in opt] + [("llama-3-8b", m) for m in llama]
                     + [("opt-13b", m) for m in opt[::-1]]
                     + [("llama-3-8b", m) for m in llama[::-1]])


def test_a_child_process_gives_its_code_and_output_or_times_out():
    """``isolated``'s runner: a child's return code and the tail of its output; a child past
    its time limit is stopped and reported as timed out (-1)."""
    import sys

    code, tail = bench._run_child([sys.executable, "-c", "print('measured'); raise SystemExit(3)"],
                                  30)
    assert code == 3 and "measured" in tail
    code, tail = bench._run_child([sys.executable, "-c", "import time; time.sleep(30)"], 0.5)
    assert code == -1 and tail.startswith("timed out after 0.5 s")


def test_cpus_pin_the_timed_steps_and_travel_to_each_isolated_process(monkeypatch, tmp_path):
    """``dejavu bench --cpus``: checked against the CPUs this process may use (an error naming
    the others, before any child runs), passed to every ``--isolate`` child's command line,
    which the CLI reads back, recorded in the JSON and said in the markdown. ``pinned`` runs
    its block on those CPUs only and gives the process its CPUs back afterwards, after an
    error too."""
    import os

    from dejavu_compile import cli

    allowed = os.sched_getaffinity(0)
    one = min(allowed)
    with bench.pinned([one]):
        assert os.sched_getaffinity(0) == {one}
    assert os.sched_getaffinity(0) == allowed
    with pytest.raises(RuntimeError), bench.pinned([one]):
        raise RuntimeError
    assert os.sched_getaffinity(0) == allowed
    with bench.pinned(None):
        assert os.sched_getaffinity(0) == allowed
    assert bench.check_cpus(None) is None and bench.check_cpus([one, one]) == [one]
    far = max(allowed) + 1000
    with pytest.raises(ValueError, match=rf"cpus \[{far}\]: this process may run only on"):
        bench.check_cpus([one, far])
    with pytest.raises(ValueError, match="cpus"):
        bench.check_cpus([])

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    cmds = []

    def runner(cmd, timeout):
        cmds.append(cmd)
        row = {"model": "opt-13b", "mode": cmd[cmd.index("--modes") + 1], "ms_per_token": 4.0,
               "p20": 1.0, "p80": 2.0, "bytes_per_token": 1e9, "floor_ms": 0.2,
               "peak_gib": 1.0, "operating_point": {"mlp": 0.1, "attention": 0.5}}
        json.dump({"gpu": "H", "copy_gbs": 4000.0, "e2e": [row]},
                  open(cmd[cmd.index("--json") + 1], "w"))
        return 0, ""

    with pytest.raises(ValueError, match=rf"cpus \[{far}\]"):
        bench.isolated(["opt-13b"], ["hf_compiled"], 1, runner=runner, cpus=[far])
    assert cmds == []
    result = bench.isolated(["opt-13b"], ["hf_compiled", "dejavu_sparse"], 1, runner=runner,
                            cpus=[one])
    assert [c[c.index("--cpus"):] for c in cmds] == [["--cpus", str(one)]] * 2
    seen = {}
    monkeypatch.setattr(cli, "_bench", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(cmds[0][3:]) == 0 and seen["cpus"] == [one]
    assert result["cpus"] == [one]
    text = bench.markdown(result, "dejavu bench --isolate 1 --cpus 0", "abc1234", "2026-12-03")
    assert f"Timed steps pinned to CPU(s) {one} (`--cpus`" in text
    assert "pinned" not in bench.markdown({**result, "cpus": None}, "dejavu bench", "abc1234",
                                          "2026-12-03")


def test_the_end_to_end_prompt_is_checked_passed_to_each_child_and_reported(monkeypatch):
    """``dejavu bench --prompt``: a whole number of tokens whose cache fits the model's
    positions (OPT's 2048, with the timed and profiled steps), refused before any process
    starts; each isolated child gets it, and the markdown names it and what the cache holds."""
    from dejavu_compile import cli

    configs = bench.shape_configs()
    assert bench.cache_positions(1919, False) == 1919 + 128 + 1 == 2048
    bench.check_prompt(1919, ["opt-13b"], configs, False)
    bench.check_prompt(4096, ["llama-3-8b"], configs, True)
    with pytest.raises(ValueError, match=r"--prompt 1920: opt-13b has 2048 positions.*2049.*"
                                         r"give --prompt 1919 or less"):
        bench.check_prompt(1920, ["llama-3-8b", "opt-13b"], configs, False)
    with pytest.raises(ValueError, match=r"16 profiled.*--prompt 1903 or less"):
        bench.check_prompt(1919, ["opt-13b"], configs, True)
    for bad in (0, -5, True, 12.0, "64"):
        with pytest.raises(ValueError, match="whole number of tokens"):
            bench.check_prompt(bad, ["opt-13b"], configs, False)
    # keys and values of every layer and KV head: OPT's 40 heads, Llama's 8 KV heads of 32
    assert bench.kv_cache_bytes(configs["opt-13b"], 100) == 2 * 40 * 40 * 128 * 100 * 2
    assert bench.kv_cache_bytes(configs["llama-3-8b"], 100) == 2 * 32 * 8 * 128 * 100 * 2

    monkeypatch.setattr(bench.torch.cuda, "is_available", lambda: True)
    cmds = []

    def runner(cmd, timeout):
        cmds.append(cmd)
        prompt = int(cmd[cmd.index("--prompt") + 1])
        positions = bench.cache_positions(prompt, False)
        row = {"model": "opt-13b", "mode": cmd[cmd.index("--modes") + 1], "ms_per_token": 4.0,
               "p20": 1.0, "p80": 2.0, "bytes_per_token": 1e9, "floor_ms": 0.2,
               "peak_gib": 1.0, "operating_point": {"mlp": 0.1, "attention": 0.5},
               "prompt": prompt, "cache_positions": positions,
               "kv_cache_bytes": bench.kv_cache_bytes(configs["opt-13b"], positions)}
        json.dump({"gpu": "H", "copy_gbs": 4000.0, "e2e": [row]},
                  open(cmd[cmd.index("--json") + 1], "w"))
        return 0, ""

    with pytest.raises(ValueError, match="--prompt 4096: opt-13b has 2048 positions"):
        bench.isolated(["opt-13b"], ["hf_compiled"], 1, runner=runner, prompt=4096)
    assert cmds == []
    result = bench.isolated(["opt-13b"], ["hf_compiled", "dejavu_sparse"], 1, runner=runner,
                            prompt=1024)
    assert [c[c.index("--prompt"):c.index("--prompt") + 2] for c in cmds] == \
        [["--prompt", "1024"]] * 2
    seen = {}
    monkeypatch.setattr(cli, "_bench", lambda args: seen.update(vars(args)) or 0)
    assert cli.main(cmds[0][3:]) == 0 and seen["prompt"] == 1024
    assert cli.main(["bench", "--models", "opt-13b"]) == 0 and seen["prompt"] == bench.E2E_PROMPT
    text = bench.markdown(result, "dejavu bench --isolate 1 --prompt 1024", "abc1234",
                          "2026-12-05")
    assert "### End to end (fp16, batch 1, 1024-token prompt, 128 new tokens, static cache)" \
        in text
    # 2 x 40 layers x 40 heads x 128 x 1153 positions x 2 bytes
    assert "holds opt-13b, 1153 positions: 0.94 GB; each step's attention reads all" in text
    # a result from before --prompt: the prompt it ran, and no cache line
    for row in result["e2e"]:
        for key in ("prompt", "cache_positions", "kv_cache_bytes"):
            del row[key]
    text = bench.markdown(result, "dejavu bench --isolate 1", "abc1234", "2026-12-05")
    assert "(fp16, batch 1, 128-token prompt, 128 new tokens" in text
    assert "static K/V cache" not in text


def test_graph_bench_waits_for_the_queued_work_first(monkeypatch):
    """``bench.graph_bench`` synchronises before ``triton.testing.do_bench_cudagraph``, which
    runs its function on a new stream that waits for no other, and passes its arguments and
    result through; ``_time_layers`` times through it."""
    import triton.testing

    calls = []
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: calls.append("synchronize"))

    def do_bench_cudagraph(fn, **kwargs):
        calls.append(("bench", kwargs))
        fn()
        return [8.0, 4.0, 16.0] if "quantiles" in kwargs else 3.0

    monkeypatch.setattr(triton.testing, "do_bench_cudagraph", do_bench_cudagraph)
    ran = []
    assert bench.graph_bench(lambda: ran.append(1), rep=7, return_mode="median") == 3.0
    assert calls == ["synchronize", ("bench", {"rep": 7, "return_mode": "median"})]
    assert ran == [1]
    calls.clear()
    assert bench._time_layers(ran.append, 4) == (2.0, 1.0, 4.0)  # a layer's share
    assert calls[0] == "synchronize" and calls[1][0] == "bench"
    assert ran == [1, 0, 1, 2, 3]


def test_only_graph_bench_calls_do_bench_cudagraph():
    """Every CUDA-graph timing in the package and its examples goes through
    ``bench.graph_bench``: a direct ``do_bench_cudagraph`` call would time from a stream that
    does not wait for its inputs."""
    direct = [str(p.relative_to(ROOT)) for d in ("dejavu_compile", "kernels", "passes", "examples")
              for p in sorted((ROOT / d).rglob("*.py"))
              if "do_bench_cudagraph" in p.read_text()
              and p != ROOT / "dejavu_compile" / "bench.py"]
    assert direct == []
