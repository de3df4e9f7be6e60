"""Every example imports: a name it takes from the package still exists (the host study once
imported a bench helper that a later change had removed). Their ``main`` is not run here: the
studies need a GPU and the demo minutes."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from .conftest import compile_outside_interpreter, load_example

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.py"))


def test_there_are_examples():
    assert {"demo.py", "quickstart.py", "host_study.py"} <= {p.name for p in EXAMPLES}


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_imports(path):
    module = load_example(path)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_qkv_study_stacked_selection_is_the_three_projections():
    """``examples/qkv_study.py`` times one launch over the stacked query, key and value
    weights with the selection repeated for each: that launch gives the three separate
    projections of the selected heads, side by side (the Triton kernel, under the
    interpreter)."""
    import torch
    from dejavu_compile.kernels import heads

    study = load_example(Path(__file__).parents[1] / "examples" / "qkv_study.py")
    n_heads, hd, d = 4, 8, 32
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(3 * n_heads * hd, d, generator=gen)
    b = torch.randn(3 * n_heads * hd, generator=gen)
    x = torch.randn(1, 1, d, generator=gen)
    idx = torch.tensor([[[1, 3]]])
    stacked = study.stacked_selection(idx, n_heads, 3)
    assert stacked.tolist() == [[[1, 3, 5, 7, 9, 11]]]
    got = heads.sparse_head_proj(x, stacked, w, b, hd)
    rows = n_heads * hd
    want = torch.cat([heads.sparse_head_proj(x, idx, w[m * rows:(m + 1) * rows],
                                             b[m * rows:(m + 1) * rows], hd)
                      for m in range(3)], dim=-1)
    torch.testing.assert_close(got, want)
    # --gemv: the row-storing launch gives the same rows, and dejavu::gemv over the selected
    # rows gathered beforehand gives the selected columns of that launch's output
    from dejavu_compile.kernels import dense

    torch.testing.assert_close(study.storing_rows(heads.sparse_head_proj)(x, stacked, w, b, hd),
                               want)
    rows = study.gathered_rows(stacked, hd)
    assert rows.tolist() == [r for h in (1, 3, 5, 7, 9, 11) for r in range(h * hd, (h + 1) * hd)]
    torch.testing.assert_close(dense.gemv(x, w[rows].contiguous(), b[rows]), want[..., rows])


def test_qkv_study_names_the_lazy_tiles_it_ran():
    """``examples/qkv_study.py`` prints, from the autotuner's choices, the grid and tile the
    lazy launches ran for each key: the shipped file's keys (D, HD, MATS, SEL, then dtypes)."""
    study = load_example(Path(__file__).parents[1] / "examples" / "qkv_study.py")
    shipped = json.loads((Path(__file__).parents[1] / "kernels" / "tuned" / "NVIDIA_H200.json"
                          ).read_text())["tuned"]["lazy_kv._decode_kernel"]
    lines = study.lazy_choices(shipped)
    assert "  lazy qkv (selection grid, d 5120, head dim 128): C128 K64 S4" in lines
    assert "  lazy qkv (heads grid, d 5120, head dim 128): C64 K64 S4" in lines
    assert "  lazy kv (selection grid, d 5120, head dim 128): C64 K128 S4" in lines
    assert len(lines) == len(shipped) == 4


def test_qkv_study_selectors_pick_what_their_predictors_score_highest():
    """``examples/qkv_study.py --beside``: ``Selectors`` runs a layer's two selectors as the
    step does (the bucketed Triton selector, under the interpreter here): the MLP's keeps
    ``kept_units`` of each bucket, the heads' the top heads, each the units its predictor
    scores highest (ReLU on the biased first layer)."""
    from dejavu_compile.profile import default_buckets

    study = load_example(Path(__file__).parents[1] / "examples" / "qkv_study.py")
    x = torch.randn(1, 1, 48, generator=torch.Generator().manual_seed(2))
    selectors = study.Selectors(x, 512, 0.25, 6, 0.5, rank=8,
                                generator=torch.Generator().manual_seed(3))
    assert default_buckets(512) == 4 and default_buckets(6) == 1
    mlp, heads = selectors()
    assert mlp.shape == (1, 1, 128) and heads.shape == (1, 1, 3)
    for ids, (w1, b1, w2, k, buckets) in zip((mlp, heads), selectors.parts, strict=True):
        scores = torch.relu(x.reshape(-1) @ w1.T + b1) @ w2.T
        per = w2.shape[0] // buckets
        want = torch.cat([scores[b * per:(b + 1) * per].topk(k // buckets).indices + b * per
                          for b in range(buckets)]).sort().values
        assert ids.reshape(-1).tolist() == want.tolist()


def test_qkv_study_missing_state_makes_the_lazy_launch_fill_each_call():
    """``examples/qkv_study.py --missing``: ``MissingState`` leaves the chosen selected heads
    with position ``pos - 1`` zero and their valid prefix ``pos - 1`` in every layer, so the
    lazy K/V launch at ``pos`` fills that position from the kept input (the kernel under the
    interpreter, against the projection), and puts that state back at each call."""
    import torch.nn.functional as F
    from dejavu_compile.kernels import kv_state, lazy_kv

    study = load_example(Path(__file__).parents[1] / "examples" / "qkv_study.py")
    n_layers, n_heads, length, hd, d, pos = 2, 4, 12, 8, 32, 7
    gen = torch.Generator().manual_seed(1)
    idx = torch.tensor([[[0, 2, 3]]])
    assert study.missing_heads(idx, 0.0).numel() == 0
    with pytest.raises(ValueError, match="in \\[0, 1\\], got 1.5"):
        study.missing_heads(idx, 1.5)
    missing = study.missing_heads(idx, 2 / 3)
    assert missing.numel() == 2 and set(missing.tolist()) <= {0, 2, 3}
    keys_all = torch.randn(n_layers, 1, n_heads, length, hd, generator=gen)
    values_all = torch.randn(n_layers, 1, n_heads, length, hd, generator=gen)
    states = [kv_state.lazy_state(keys_all[i], d, torch.float32) for i in range(n_layers)]
    for state in states:
        state.inputs.copy_(torch.randn(state.inputs.shape, generator=gen))
    reset = study.MissingState(keys_all, values_all, [s.valid for s in states], missing, pos)
    other = sorted(set(range(n_heads)) - set(missing.tolist()))

    def check_put_back():
        for state in states:
            assert state.valid[0, missing].tolist() == [pos - 1] * 2
            assert state.valid[0, other].tolist() == [pos] * len(other)
        for cache in (keys_all, values_all):
            assert not cache[:, 0, missing, pos - 1].any()
            assert cache[:, 0, other, pos - 1].abs().amin() > 0

    check_put_back()
    wk, wv = (torch.randn(n_heads * hd, d, generator=gen) * 0.2 for _ in range(2))
    bk, bv = (torch.randn(n_heads * hd, generator=gen) for _ in range(2))
    x = torch.randn(1, 1, d, generator=gen)
    for _ in range(2):  # the launch fills the missing position; the reset takes it away again
        lazy_kv.lazy_kv(x, idx, wk, bk, wv, bv, keys_all[0], values_all[0],
                        torch.tensor([pos]))
        kept = states[0].inputs[0, pos - 1]
        for cache, w, b in ((keys_all, wk, bk), (values_all, wv, bv)):
            want = F.linear(kept, w, b).view(n_heads, hd)[missing]
            torch.testing.assert_close(cache[0, 0, missing, pos - 1], want, atol=1e-4,
                                       rtol=1e-4)
        assert states[0].valid[0, idx.reshape(-1)].tolist() == [pos + 1] * 3
        reset()
        check_put_back()


def test_gemv_study_chain_is_the_layers_projections_in_turn():
    """``examples/gemv_study.py --chain`` times each layer's query, key and value projection
    and then its output projection of the query's part, through the GEMV as through
    ``F.linear``: the same chain (small shapes, the kernel under the interpreter)."""
    import torch.nn.functional as F
    from dejavu_compile.kernels import dense

    study = load_example(Path(__file__).parents[1] / "examples" / "gemv_study.py")
    weights = study.chain_weights(3, 24, 4, 2, 6, "cpu", dtype=torch.float32)
    assert [tuple(w.shape) for w in weights[0]] == [((4 + 2 * 2) * 6, 24), (24, 4 * 6)]
    x = torch.randn(1, 1, 24, generator=torch.Generator().manual_seed(1))
    want = x
    for w_qkv, w_o in weights:
        want = F.linear(F.linear(want, w_qkv)[..., :24], w_o)
    got = study.run_chain(x, weights, dense.gemv)
    assert got.shape == (1, 1, 24)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_tile_study_pairs_pins_both_mlp_kernels_and_ranks_the_pairs(monkeypatch):
    """``examples/tile_study.py``'s ``pairs`` runs the sparse MLP with each pair of the fastest
    up and down tiles pinned together (the Triton kernels, under the interpreter, still match
    the reference with tiles other than their own), ranks the pairs by time, and gives both
    kernels back their candidates and choices."""
    import torch
    import triton
    from dejavu_compile.kernels import reference as ref
    from dejavu_compile.kernels import sparse_mlp, tuning

    from dejavu_compile import bench

    study = load_example(Path(__file__).parents[1] / "examples" / "tile_study.py")
    up_t, down_t = sparse_mlp._up_kernel, sparse_mlp._down_kernel
    tiles = {k: [triton.Config({"BLOCK_N": n, "BLOCK_D": 16, "TILES": t}, num_warps=1)
                 for n, t in ((8, 1), (16, 2), (32, 1))] for k in ("up", "down")}
    for tuner, k in ((up_t, "up"), (down_t, "down")):
        monkeypatch.setattr(tuner, "configs", list(tiles[k]))
        monkeypatch.setattr(tuner, "cache", {})
    gen = torch.Generator().manual_seed(5)
    d, n = 24, 40
    x = torch.randn(1, 1, d, generator=gen)
    w1, w2_t = torch.randn(n, d, generator=gen), torch.randn(n, d, generator=gen)
    idx = torch.tensor([[[0, 3, 7, 11, 20, 39]]])
    want = ref.sparse_mlp(x, idx, w1, None, None, w2_t, None, "relu")
    ran = []

    def op(i):
        got = sparse_mlp.sparse_mlp(x, idx, w1, None, None, w2_t, None, "relu")
        torch.testing.assert_close(got, want)

    def time_layers(fn, layers):  # a made-up time from the pinned pair: up 8 x 16 beside
        fn(0)                     # down 16 x 16 in loops of 2 is the fastest of these
        up, down = up_t.configs, down_t.configs
        assert len(up) == len(down) == 1
        ran.append((up[0].kwargs["BLOCK_N"], down[0].kwargs["BLOCK_N"]))
        ms = {(8, 16): 1.0, (8, 8): 2.0, (16, 8): 3.0, (16, 16): 4.0}[ran[-1]]
        return ms, ms, ms

    monkeypatch.setattr(bench, "_time_layers", time_layers)
    rows = {k: [{"config": tuning.config_data(c)} for c in tiles[k][:2]] for k in tiles}
    got = study.pairs(op, rows["up"], rows["down"], top=2)
    assert sorted(ran) == [(8, 8), (8, 16), (16, 8), (16, 16)]  # the two fastest of each
    assert [r["ms"] for r in got] == [1.0, 2.0, 3.0, 4.0]
    assert got[0]["up"] == tuning.config_data(tiles["up"][0])
    assert got[0]["down"] == tuning.config_data(tiles["down"][1])
    assert up_t.configs == tiles["up"] and down_t.configs == tiles["down"]
    assert not up_t.cache and not down_t.cache


def test_tile_study_pair_study_writes_both_kernels_keys(monkeypatch):
    """``pair_study`` gives an entry for the up and the down kernel, each with the key its
    case tuned, though the up study's first call tunes both keys (so the down study finds its
    key chosen before it, as on the twenty-fifth session's GPU run, which wrote the up entry
    alone)."""
    from dejavu_compile.kernels import tuning

    study = load_example(Path(__file__).parents[1] / "examples" / "tile_study.py")
    tuners = tuning.autotuners()
    for name in study.KERNELS.values():
        monkeypatch.setattr(tuners[name], "cache", {("old", name): None})
    up_cfg, down_cfg = {"kwargs": {"BLOCK_N": 8}}, {"kwargs": {"BLOCK_N": 16}}

    def fake_study(model, kernel, density, dtype, case, step):
        for k in ("up", "down"):  # the op's first call tunes both kernels' keys
            tuners[study.KERNELS[k]].cache.setdefault((k, 5120), None)
        return {"kernel": study.KERNELS[kernel], "rows": []}, None

    monkeypatch.setattr(study, "_case",
                        lambda cfg, kernel, density, dtype, step: (None, None, 10))
    monkeypatch.setattr(study, "study", fake_study)
    monkeypatch.setattr(study, "pairs", lambda op, up, down, top: [
        {"up": up_cfg, "down": down_cfg, "ms": 1.0}])
    monkeypatch.setattr(tuning, "plain_key", lambda key: list(key))
    _, best = study.pair_study("opt-13b", 0.25, top=1)
    assert best == [{"kernel": study.KERNELS["up"], "key": ["up", 5120], "config": up_cfg},
                    {"kernel": study.KERNELS["down"], "key": ["down", 5120], "config": down_cfg}]


@pytest.mark.parametrize("gated", [False, True], ids=["opt_layer_norm", "gated_rms_norm"])
def test_tile_study_step_form_is_the_steps_mlp(monkeypatch, capsys, gated):
    """``--step``: the study's MLP as the default decode step runs it (the Triton kernels,
    under the interpreter): the same count of sorted ids from each bucket of units, as many as
    the step keeps (its tuning key), the biases of a plain MLP, and the residual add and norm
    after it, which gives the reference's; the op leaves its workspace zero (a second call
    gives the same), and its bytes are the kept rows'. Other kernels refuse the form."""
    import types

    from dejavu_compile.kernels import reference as ref
    from dejavu_compile.kernels import sparse_mlp
    from dejavu_compile.kernels.triton_common import add_norm_sums

    from dejavu_compile import bench
    from dejavu_compile.profile import default_buckets, kept_units

    study = load_example(Path(__file__).parents[1] / "examples" / "tile_study.py")
    gen = torch.Generator().manual_seed(6)
    d, n = 16, 384  # three buckets of 128 units
    sets = [tuple(torch.randn(n, d, generator=gen) * 0.3 if gated or j != 1 else None
                  for j in range(3)) for _ in range(2)]
    monkeypatch.setattr(bench, "_mlp_weights", lambda cfg, dtype: (sets, d, n, gated))
    x = torch.randn(1, 1, d, generator=gen)
    act = "silu" if gated else "relu"
    k, op, reads = study._step_mlp(sets, x, n, gated, 0.1, act)
    buckets = default_buckets(n)
    assert buckets == 3 and k == kept_units(0.1, n, buckets) == 39
    idx = reads["idx"].view(buckets, -1)
    for b, ids in enumerate(idx):
        assert (ids.diff() > 0).all() and ((ids // 128) == b).all()
    assert (reads["b1"] is None) == (reads["b2"] is None) == gated
    residual, norm_w, norm_b, eps, rms = reads["norm"]
    assert rms == gated and (norm_b is None) == gated
    w1, w_up, w2_t = sets[1]
    y = ref.sparse_mlp(x, reads["idx"], w1, reads["b1"], w_up, w2_t, reads["b2"], act)
    want = ref.add_norm(y, residual, norm_w, norm_b, eps, rms)
    finished = []  # the add-norm launch finishing the down kernel's sums, as in the step
    monkeypatch.setattr(sparse_mlp, "add_norm_sums", lambda *a, **kw: finished.append(1)
                        or add_norm_sums(*a, **kw))
    for _ in range(2):
        got = op(1)
        for g, w in zip(got, want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-4, atol=1e-4)
    _, _, nbytes = study._case(types.SimpleNamespace(), "down", 0.1, torch.float32, step=True)
    assert nbytes == 39 * (3 if gated else 2) * d * 4
    assert finished == [1, 1]
    with pytest.raises(ValueError, match="the MLP's"):
        study._case(types.SimpleNamespace(), "q", 0.5, torch.float32, step=True)
    with pytest.raises(SystemExit):  # before it needs a GPU
        study.main(["--kernel", "cols", "--step"])
    assert "--step goes with --kernel up, down or mlp, not cols" in capsys.readouterr().err


def test_tile_study_cols_pins_the_original_layout_kernel(monkeypatch):
    """``--kernel cols``: the study's op reads the Linear's own ``[d, H * head_dim]`` weight
    through its transposed view, so the column kernel runs (the one the study pins, not the
    re-laid-out layout's), and matches the reference; its dense op is that Linear."""
    import types

    import torch.nn.functional as F
    import triton
    from dejavu_compile.kernels import heads, tuning
    from dejavu_compile.kernels import reference as ref

    from dejavu_compile import bench

    study = load_example(Path(__file__).parents[1] / "examples" / "tile_study.py")
    gen = torch.Generator().manual_seed(3)
    h, hd, d = 4, 8, 24
    wo_t = [torch.randn(h * hd, d, generator=gen) for _ in range(2)]
    attn = torch.randn(1, 1, h * hd, generator=gen)
    idx = torch.tensor([[[1, 3]]])
    monkeypatch.setattr(bench, "head_weights", lambda cfg, dtype: (
        h, hd, None, attn, None, wo_t, [w.t().contiguous() for w in wo_t]))
    monkeypatch.setattr(bench, "random_ids", lambda n, density: (2, idx))
    op, dense, nbytes = study._case(types.SimpleNamespace(hidden_size=d), "cols", 0.5,
                                    torch.float32)
    assert nbytes == 2 * hd * d * 4
    torch.testing.assert_close(dense(1), F.linear(attn, wo_t[1].t()))
    tuners = tuning.autotuners()
    cols, rows = tuners[study.KERNELS["cols"]], tuners["heads._head_out_kernel"]
    tiles = [triton.Config({"BLOCK_M": m, "UNROLL": u}, num_warps=1) for m, u in ((8, 1), (16, 2))]
    monkeypatch.setattr(cols, "configs", list(tiles))
    ran = []

    def time_layers(fn, layers):  # the op (the autotuner's choice, then each pin) or dense
        if fn is not op:
            ran.append("dense")
        elif len(cols.configs) > 1:  # the autotuner's own choice: not run (no GPU to time on)
            ran.append("chosen")
        else:
            ran.append((cols.configs[0].kwargs, len(rows.configs)))
            torch.testing.assert_close(fn(1), ref.sparse_head_out(attn, idx, wo_t[1], None, hd))
        return 1.0, 1.0, 1.0

    monkeypatch.setattr(bench, "_time_layers", time_layers)
    assert heads.reads_columns(bench.head_weights(None, None)[6][1].t(), hd)
    result, _ = study.study("opt-13b", "cols", 0.5, case=(op, dense, nbytes))
    assert result["kernel"] == "heads._head_out_cols_kernel"
    assert len(result["rows"]) == 2 and cols.configs == tiles
    # each candidate of the column kernel pinned in turn, the row kernel's left as they were
    assert ran == ["chosen", "dense"] + [(t.kwargs, len(rows.configs)) for t in tiles]


def test_tile_study_check_runs_each_candidate_pinned_and_synchronised(monkeypatch, capsys):
    """``--check``: each candidate of the kernel pinned in turn (the column kernel's here,
    under the interpreter, matching the reference), run on every layer's weights and the GPU
    synchronised before the next is named, so the last tile printed before a fault is the
    faulting one; the kernel's candidates and choices are back afterwards."""
    import types

    import triton
    from dejavu_compile.kernels import reference as ref
    from dejavu_compile.kernels import tuning

    from dejavu_compile import bench

    study = load_example(Path(__file__).parents[1] / "examples" / "tile_study.py")
    gen = torch.Generator().manual_seed(4)
    h, hd, d = 4, 8, 24
    wo_t = [torch.randn(h * hd, d, generator=gen) for _ in range(bench.LAYERS)]
    attn = torch.randn(1, 1, h * hd, generator=gen)
    idx = torch.tensor([[[0, 2, 3]]])
    monkeypatch.setattr(bench, "head_weights", lambda cfg, dtype: (
        h, hd, None, attn, None, wo_t, [w.t().contiguous() for w in wo_t]))
    monkeypatch.setattr(bench, "random_ids", lambda n, density: (3, idx))
    op, _, _ = study._case(types.SimpleNamespace(hidden_size=d), "cols", 0.75, torch.float32)
    cols = tuning.autotuners()[study.KERNELS["cols"]]
    tiles = [triton.Config({"BLOCK_M": m, "UNROLL": u}, num_warps=1) for m, u in ((8, 1), (16, 2))]
    monkeypatch.setattr(cols, "configs", list(tiles))
    monkeypatch.setattr(cols, "cache", {("chosen",): tiles[1]})
    events = []

    def run(i):
        events.append((cols.configs[0].kwargs["BLOCK_M"], i))
        got = op(i)
        torch.testing.assert_close(got, ref.sparse_head_out(attn, idx, wo_t[i], None, hd))
        return got

    monkeypatch.setattr(torch.cuda, "synchronize", lambda: events.append("sync"))
    ran = study.check("opt-13b", "cols", 0.75, case=(run, None, 0))
    assert ran == 2
    layers = list(range(bench.LAYERS))
    assert events == [(8, i) for i in layers] + ["sync"] + [(16, i) for i in layers] + ["sync"]
    printed = capsys.readouterr().out.splitlines()
    assert [line for line in printed if "BLOCK_M" in line] == [
        f"opt-13b {study.KERNELS['cols']} density 0.75: {tuning.config_data(t)}" for t in tiles]
    assert printed[-1].endswith("all 2 candidates ran")
    assert cols.configs == tiles and cols.cache == {("chosen",): tiles[1]}


def test_tile_study_ship_merges_a_study_into_the_shipped_file(monkeypatch, tmp_path, capsys):
    """``--ship`` (no GPU): a study's tile for a key already shipped replaces that config, a
    new key is added, other kernels' and keys' entries and the file's ``about`` stay; a second
    merge of the same study changes nothing. No shipped file for the study's GPU, or a JSON
    that is not a study's, is an error naming it, and the shipped file is left as it was.
    The imported package's file outside the current directory (an editable install of another
    checkout) is refused unless ``--to`` names the file; ``--to`` must name that GPU's file."""
    import json

    from dejavu_compile.kernels import tuning

    study = load_example(Path(__file__).parents[1] / "examples" / "tile_study.py")
    monkeypatch.setattr(tuning, "SHIPPED_DIR", tmp_path)
    monkeypatch.chdir(tmp_path)

    def entry(key, n):
        return {"key": key, "config": {"kwargs": {"BLOCK_N": n}, "num_warps": 4}}

    about = {"gpu": "Some GPU", "source": "by hand"}
    shipped = tmp_path / "Some_GPU.json"
    shipped.write_text(json.dumps({"about": about, "tuned": {
        "sparse_mlp._up_kernel": [entry([4096, 3584], 16), entry([4096, 7168], 16)],
        "heads._head_proj_kernel": [entry([5120, 20], 8)]}}))
    run = tmp_path / "study.json"
    run.write_text(json.dumps({"gpu": "Some GPU", "results": [], "tuned": {
        "sparse_mlp._up_kernel": [entry([4096, 3584], 32)],
        "sparse_mlp._down_kernel": [entry([4096, 3584, 1], 64)]}}))
    study.main(["--ship", str(run)])
    printed = capsys.readouterr().out
    assert "sparse_mlp._up_kernel [4096, 3584]: {'BLOCK_N': 16} -> {'BLOCK_N': 32}" in printed
    assert "sparse_mlp._down_kernel [4096, 3584, 1]: added {'BLOCK_N': 64}" in printed
    data = json.loads(shipped.read_text())
    assert data["about"] == about
    assert data["tuned"] == {
        "sparse_mlp._up_kernel": [entry([4096, 3584], 32), entry([4096, 7168], 16)],
        "heads._head_proj_kernel": [entry([5120, 20], 8)],
        "sparse_mlp._down_kernel": [entry([4096, 3584, 1], 64)]}
    before = shipped.read_text()
    study.main(["--ship", str(run)])
    assert "nothing changed" in capsys.readouterr().out and shipped.read_text() == before

    run.write_text(json.dumps({"gpu": "Other GPU", "tuned": {}}))
    with pytest.raises(ValueError, match="no shipped configs for 'Other GPU'"):
        study.main(["--ship", str(run)])
    run.write_text(json.dumps({"tuned": {}}))
    with pytest.raises(SystemExit, match="not a tile study's --json"):
        study.main(["--ship", str(run)])
    run.write_text(json.dumps({"gpu": "Some GPU", "tuned": {"sparse_mlp._up_kernel": [{}]}}))
    with pytest.raises(ValueError, match="each entry needs 'key' and 'config'"):
        study.main(["--ship", str(run)])
    assert shipped.read_text() == before

    # Another checkout's package: refused without --to; --to names the file to merge into.
    run.write_text(json.dumps({"gpu": "Some GPU", "tuned": {
        "sparse_mlp._up_kernel": [entry([4096, 3584], 64)]}}))
    elsewhere = tmp_path / "here"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    with pytest.raises(SystemExit, match="outside this directory.*--to FILE"):
        study.main(["--ship", str(run)])
    assert shipped.read_text() == before
    mine = elsewhere / "Some_GPU.json"
    mine.write_text(before)
    study.main(["--ship", str(run), "--to", str(mine)])
    assert "{'BLOCK_N': 32} -> {'BLOCK_N': 64}" in capsys.readouterr().out
    assert json.loads(mine.read_text())["tuned"]["sparse_mlp._up_kernel"][0] == entry(
        [4096, 3584], 64)
    assert shipped.read_text() == before
    with pytest.raises(ValueError, match="not the shipped file of 'Some GPU'.*Some_GPU.json"):
        study.main(["--ship", str(run), "--to", str(elsewhere / "Other_GPU.json")])
    with pytest.raises(SystemExit):
        study.main(["--to", str(mine), "--kernel", "up"])


def test_down_kernel_study_reads_tiles_and_refuses_malformed_ones(capsys):
    """``--tiles``: each ``NxDxTxW`` becomes (BLOCK_N, BLOCK_D, TILES, warps); a tile that is
    not four powers of two, or ``--tiles`` without ``--flags``, is an error naming it before
    the study needs a GPU."""
    study = load_example(Path(__file__).parents[1] / "examples" / "down_kernel_study.py")
    assert study.tile("128x128x1x8") == (128, 128, 1, 8)
    assert study.tile("16X512X4X4") == (16, 512, 4, 4)
    for bad in ("128x128x1", "128x96x1x8", "axbxcxd", "0x128x1x8"):
        with pytest.raises(argparse.ArgumentTypeError, match=bad):
            study.tile(bad)
    for argv, said in ((["--flags", "--tiles", "16x512x3x4"], "'16x512x3x4'"),
                       (["--tiles", "16x512x4x4"], "--tiles goes with --flags")):
        with pytest.raises(SystemExit):
            study.main(argv)
        assert said in capsys.readouterr().err


def test_host_study_checks_its_modes_and_cpus_before_it_needs_a_gpu():
    """``host_study``: a mode that is neither HF compiled nor a bench dejavu mode, or a CPU this
    process may not run on, is refused by name before any model is built."""
    import os

    study = load_example(Path(__file__).parents[1] / "examples" / "host_study.py")
    study.check_args(["hf_compiled", "dejavu_captured_qkv_pdl"], sorted(os.sched_getaffinity(0)))
    with pytest.raises(SystemExit, match=r"unknown mode\(s\) \['dejavu_nope'\]"):
        study.main(["--modes", "hf_compiled", "dejavu_nope"])
    with pytest.raises(SystemExit, match=r"--cpus \[100000\]"):
        study.main(["--cpus", "100000"])
    with pytest.raises(SystemExit):  # an unknown shape: argparse's own error
        study.main(["--shape", "gpt"])


def test_host_study_times_a_captured_dejavu_step_on_the_cpu(tmp_path):
    """``host_study``'s step loop and its build of a bench mode, on a tiny OPT on the CPU
    (``CapturedStep`` runs the compiled step as it is there): the call's and the whole step's
    medians are measured, the call is inside the step, and the profile saw the step's calls."""
    import pstats

    import transformers as tf

    study = load_example(Path(__file__).parents[1] / "examples" / "host_study.py")
    cfg = tf.OPTConfig(vocab_size=64, hidden_size=32, ffn_dim=64, num_hidden_layers=3,
                       num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32)
    torch.manual_seed(0)
    net = tf.OPTForCausalLM(cfg).eval()
    forward = study.build("dejavu_captured_qkv_pdl", net, {"mlp": 0.5, "attention": 0.5},
                          tmp_path)
    assert type(forward).__name__ == "CapturedStep"
    ids = torch.randint(0, 64, (1, 5))
    medians, prof = study.steps(net, forward, ids, 6, 1, 4)
    assert set(medians) == {"call", "step"}  # on the CPU nothing replays: no parts
    assert 0 < medians["call"] < medians["step"]
    assert pstats.Stats(prof).total_calls > 0


def test_host_study_times_a_replay_in_its_parts():
    """``host_study.parts`` does a ``CapturedStep``'s replay as its call does (the arguments
    copied into the capture's, every graph replayed in order, the capture's output returned
    with the call's cache put back where the capture's held one), timing each part; a call
    with nothing captured is left to the step itself."""
    study = load_example(Path(__file__).parents[1] / "examples" / "host_study.py")
    from dejavu_compile import CapturedStep

    replayed = []

    class Graph:
        def __init__(self, name):
            self.name = name

        def replay(self):
            replayed.append(self.name)

    class Layer:
        def __init__(self):
            self.cumulative_length = torch.zeros(1)

    class Cache:  # what the key takes for a cache: layers that keep their counts in tensors
        def __init__(self):
            self.layers = [Layer()]

    step = CapturedStep(lambda **kw: None)
    cache = Cache()
    kwargs = {"x": torch.randn(3), "flag": True, "cache": cache}
    assert study.parts(step, kwargs) is None  # not captured: the call runs as it is
    assert study.parts(lambda **kw: None, kwargs) is None  # not a CapturedStep
    inputs = {"x": torch.full((3,), float("nan"))}
    out = {"logits": torch.zeros(1), "cache": None}
    step._graphs[step.key(kwargs)] = [inputs, [([Graph("a"), Graph("b")], out,
                                                 [("cache", "cache")])], 0]
    split = study.parts(step, kwargs)
    assert split.pop("out") is out and out["cache"] is cache and replayed == ["a", "b"]
    assert torch.equal(inputs["x"], kwargs["x"])
    assert set(split) == {"key", "copy", "replay", "hand_out"}
    assert all(v >= 0 for v in split.values())


def test_decode_attention_bench_checks_its_selection_before_it_needs_a_gpu(capsys):
    """``decode_attention_bench --heads F`` names a fraction of the shape's query heads, at
    least one; a fraction outside (0, 1] is refused by name before any GPU work."""
    bench = load_example(Path(__file__).parents[1] / "examples" / "decode_attention_bench.py")
    args = bench.parse(["1024", "4096", "--shape", "opt", "--heads", "0.5"])
    assert (args.contexts, args.shape, args.heads) == ([1024, 4096], "opt", 0.5)
    assert bench.selected_count(bench.SHAPES["opt"][0], 0.5) == 20
    assert bench.selected_count(bench.SHAPES["llama"][0], 0.01) == 1
    assert bench.parse([]).heads is None
    for bad in ("0", "1.5"):
        with pytest.raises(SystemExit):
            bench.parse(["--heads", bad])
        assert "--heads must be in (0, 1]" in capsys.readouterr().err


def test_graph_launch_study_checks_its_arguments_before_it_needs_a_gpu():
    """``graph_launch_study``: sizes below one and CPUs this process may not run on are
    refused by name; the forked graphs and the long chains hold the same kernels."""
    study = load_example(Path(__file__).parents[1] / "examples" / "graph_launch_study.py")
    with pytest.raises(SystemExit, match="--layers"):
        study.main(["--layers", "0"])
    with pytest.raises(SystemExit, match="--side"):
        study.main(["--side", "-1"])
    with pytest.raises(SystemExit, match=r"--cpus \[100000\]"):
        study.main(["--cpus", "100000"])
    kernels = {name: layers * (main + side)
               for name, (layers, main, side, _) in study.shapes(40, 18, 3).items()}
    assert kernels["forked"] == kernels["chain long"] == 840 and kernels["chain"] == 720
    assert [pdl for *_, pdl in study.shapes(2, 2, 1).values()].count(True) == 3


def test_race_study_finds_rows_written_one_position_away():
    """``race_study``'s comparison: a cache row off the reference's is found at its position and
    counted as holding the next position's row when it does; rows the run left zero (heads the
    selector skipped) are not compared; logits off name their steps, counters their layers."""
    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    gen = torch.Generator().manual_seed(0)
    ref_k, ref_v = torch.randn(1, 3, 8, 4, generator=gen), torch.randn(1, 3, 8, 4, generator=gen)
    k, v = ref_k.clone(), ref_v.clone()
    k[0, 1, 5] = ref_k[0, 1, 6]  # a step wrote the next position's key at 5
    v[0, 2, 6:] = 0  # a head the selector skipped: its new rows zero
    logits = torch.randn(4, 16, generator=gen)
    run_logits = logits.clone()
    run_logits[2, 3] += 1.0
    found = study.compare((run_logits, [(k, v)], [7]), (logits, [(ref_k, ref_v)], [8]))
    assert found["steps"] == [2] and found["counters"] == [0]
    assert found["cache"][0]["keys"] == {"positions": [5], "previous": 0, "next": 1}
    assert found["cache"][0]["values"]["positions"] == []
    assert "1 of 4 steps off (first 2)" in study.describe(found, 4)
    assert "layer 0 keys off at [5] (0 rows hold the position before's, 1 the one after's)" \
        in study.describe(found, 4)
    same = study.compare((logits, [(ref_k, ref_v)], [8]), (logits, [(ref_k, ref_v)], [8]))
    assert same == {"steps": [], "max": 0.0, "cache": {}, "counters": []}


def test_race_study_lazy_step_matches_dense_kv_on_the_cpu(tmp_path, capsys):
    """``race_study`` on a tiny OPT on the CPU (the reference ops, compiled by Inductor): the
    uncaptured lazy K/V step gives the logits, cache rows and counters of the step with dense
    K/V, and its arguments are checked before anything is built; ``main`` runs it so, and
    with ``--code`` writes Inductor's code of its compile (the wrapper and its calls)."""
    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    model = study.small_opt(2, 32, 4, "cpu")
    tokens = torch.randint(0, 512, (1, study.PROMPT + 3),
                           generator=torch.Generator().manual_seed(1))
    ref = study.decode(model, study.compiled(model, {**study.OPTIONS, "lazy_kv": False,
                                                     "fuse_qkv": False}), tokens, 3)
    run = study.decode(model, study.compiled(model, {**study.OPTIONS, "fuse_qkv": True}),
                       tokens, 3)
    assert run[2] == ref[2] == [study.PROMPT + 3] * 2
    found = study.compare(run, ref, tol=1e-4)
    assert found["steps"] == [] and found["cache"] == {} and found["counters"] == []
    assert found["max"] < 1e-4
    # the lazy op wrote zeros for the heads it skipped: half of them at each new position
    keys = run[1][0][0][0, :, study.PROMPT:study.PROMPT + 3]
    assert (keys.abs().amax(-1) == 0).sum().item() == 2 * 3
    with pytest.raises(SystemExit, match="--heads 3"):
        study.main(["--heads", "3"])
    with pytest.raises(SystemExit, match="--repeats"):
        study.main(["--repeats", "0"])
    study.main(["--layers", "1", "--hidden", "32", "--heads", "4", "--steps", "2",
                "--repeats", "1", "--code", str(tmp_path / "code")])
    out = capsys.readouterr().out
    assert "as is          run 1: 0 of 2 steps off" in out, out
    written = sorted((tmp_path / "code").iterdir())
    assert [p.name for p in written] == ["as_compiled_0.py"]
    assert "def call(" in written[0].read_text()


# two kernels as Inductor's code holds them (their source inside triple single quotes)
_KERNELS = """
x = async_compile.triton('triton_poi_early', '''
@triton.jit
def triton_poi_early(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tmp0 = tl.load(in_ptr0 + (0))
    tl.extra.cuda.gdc_wait()
    tl.store(out_ptr0 + (0), tmp0 + 1, None)
''', device_str='cuda')
y = async_compile.triton('triton_poi_late', '''
@triton.jit
def triton_poi_late(in_ptr0, out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tl.extra.cuda.gdc_wait()
    tmp0 = tl.load(in_ptr0 + (0))
    tl.store(out_ptr0 + (0), tmp0, None)
''', device_str='cuda')
"""


def test_race_study_lists_the_kernels_that_load_before_their_wait():
    """``race_study.early_loads`` names a kernel of Inductor's code whose first load comes
    before its ``gdc_wait`` and not one that waits first; the ``inductor waits`` variant's
    codegen writes the wait whatever the kernel before writes, and only while inside."""
    from types import SimpleNamespace

    from torch._inductor.codegen import triton as codegen

    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    assert study.early_loads([_KERNELS]) == ["triton_poi_early"]
    assert study.early_loads([_KERNELS.split("y = ")[1]]) == []
    lines = []
    kernel = SimpleNamespace(_enable_pdl_codegen=lambda: True, inside_reduction=False,
                             GDC_WAIT=codegen.TritonKernel.GDC_WAIT)
    before = codegen.TritonKernel._handle_pdl_before_access
    _, inside = study.COMPILED["inductor waits"]
    with inside():
        handle = codegen.TritonKernel._handle_pdl_before_access
        handle(kernel, SimpleNamespace(writeline=lines.append), "buf0")
    assert lines == [codegen.TritonKernel.GDC_WAIT]
    assert codegen.TritonKernel._handle_pdl_before_access is before


# three kernels as Inductor's code holds them with their ``triton_meta``: launched
# programmatically and never waiting, storing before their wait, and plainly with no wait
_PDL_KERNELS = """
a = async_compile.triton('triton_poi_fill', '''
@triton_heuristics.pointwise(triton_meta={'signature': {}, 'launch_pdl': True})
@triton.jit
def triton_poi_fill(out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tl.store(out_ptr0 + (0), 0.0, None)
''', device_str='cuda')
b = async_compile.triton('triton_poi_store_first', '''
@triton_heuristics.pointwise(triton_meta={'signature': {}, 'launch_pdl': True})
@triton.jit
def triton_poi_store_first(in_ptr0, out_ptr0, out_ptr1, xnumel, XBLOCK : tl.constexpr):
    tl.store(out_ptr1 + (0), 0.0, None)
    tmp0 = tl.load(in_ptr0 + (0))
    tl.extra.cuda.gdc_wait()
    tl.store(out_ptr0 + (0), tmp0, None)
''', device_str='cuda')
c = async_compile.triton('triton_poi_plain', '''
@triton_heuristics.pointwise(triton_meta={'signature': {}, 'launch_pdl': False})
@triton.jit
def triton_poi_plain(out_ptr0, xnumel, XBLOCK : tl.constexpr):
    tl.store(out_ptr0 + (0), 0.0, None)
''', device_str='cuda')
"""


def test_race_study_lists_the_kernels_that_never_wait():
    """``race_study.never_wait`` names the kernels launched programmatically that never wait,
    and neither one that waits (before its first store or after it) nor one launched
    plainly; the variants that launch the add-norm and finish kernels programmatically
    beside Inductor's kernels plain or waiting first, or with no memory they read reused,
    are compiled with those options and inside those patches (the last keeps every tensor
    the two launches are given), and leave everything as before."""
    from dejavu_compile.kernels import sparse_mlp, triton_common
    from torch._inductor.codegen import triton as codegen

    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    waits = _KERNELS.replace("'''\n@triton.jit", "'''\n@p(triton_meta={'launch_pdl': True})"
                             "\n@triton.jit")
    assert waits.count("'launch_pdl': True") == 2  # both wait
    assert study.never_wait([_PDL_KERNELS, waits]) == ["triton_poi_fill"]
    assert study.never_wait([waits]) == []
    before = (codegen.TritonKernel._handle_pdl_before_access, triton_common.ADD_NORM_PDL,
              triton_common.FINISH_PDL)
    for name, plain in (("norm programmatic inductor plain", True),
                        ("norm programmatic inductor waits", False)):
        extra, inside = study.COMPILED[name]
        assert extra == ({"inductor_pdl": False} if plain else {})
        with inside():
            assert (triton_common.ADD_NORM_PDL, triton_common.FINISH_PDL) == (True, True)
            patched = codegen.TritonKernel._handle_pdl_before_access is not before[0]
            assert patched != plain, name
        assert (codegen.TritonKernel._handle_pdl_before_access, triton_common.ADD_NORM_PDL,
                triton_common.FINISH_PDL) == before
    assert not any("," in name for name in study.COMPILED)
    # the last one: no buffer reused by Inductor, and the launches' inputs kept alive
    extra, inside = study.COMPILED["norm programmatic no reuse"]
    assert extra == {}
    reuse = (torch._inductor.config.allow_buffer_reuse, torch._inductor.config.inplace_buffers)
    finish = (triton_common.finish, sparse_mlp.finish, triton_common._launch_add_norm)
    with inside():
        assert (torch._inductor.config.allow_buffer_reuse,
                torch._inductor.config.inplace_buffers) == (False, False)
        assert (triton_common.ADD_NORM_PDL, triton_common.FINISH_PDL) == (True, True)
        assert triton_common.finish is sparse_mlp.finish and triton_common.finish is not finish[0]
    assert (torch._inductor.config.allow_buffer_reuse,
            torch._inductor.config.inplace_buffers) == reuse
    assert (triton_common.finish, sparse_mlp.finish, triton_common._launch_add_norm) == finish
    acc, res = torch.randn(1, 8), torch.randn(1, 8)
    with study._kept_inputs() as kept:
        out = triton_common.finish(acc, None, torch.float16)
        h, normed = triton_common.add_norm(res, res, torch.ones(8), None, 1e-5)
    assert kept[0] is acc and any(t.data_ptr() == res.data_ptr() for t in kept[1:])
    torch.testing.assert_close(out, acc.half())


def test_race_study_finds_a_kernel_after_a_dejavu_op_that_touches_memory_before_its_wait():
    """``race_study.after_ops``: of the launches in Inductor's code, the kernels launched
    programmatically right after a dejavu op, the one that loads before its wait marked
    (``unguarded_after_ops`` names it); one after a kernel of Inductor's or a cuBLAS call,
    and one launched plainly, are not among them."""
    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    kernels = _KERNELS.replace("'''\n@triton.jit",
                               "'''\n@p(triton_meta={'launch_pdl': True})\n@triton.jit")
    assert kernels.count("'launch_pdl': True") == 2
    call = """
    def call(self, args):
        buf1 = torch.ops.dejavu.sparse_mlp_norm.default(buf0, arg1_1)
        buf2 = buf1[0]
        del buf1
        triton_poi_early.run(buf2, buf3, 64, stream=stream0)
        triton_poi_early.run(buf3, buf4, 64, stream=stream0)
        buf5 = torch.ops.dejavu.sparse_head_proj.default(buf4, arg2_1)
        triton_poi_late.run(buf5, buf6, 64, stream=stream0)
        buf7 = torch.ops.dejavu.gemv.default(buf6, arg3_1)
        extern_kernels.mm(buf7, arg4_1, out=buf8)
        triton_poi_early.run(buf8, buf9, 64, stream=stream0)
        buf10 = torch.ops.dejavu.gemv.default(buf9, arg3_1)
        triton_poi_plain.run(buf10, 64, stream=stream0)
"""
    code = kernels + _PDL_KERNELS + call
    assert study.after_ops([code]) == {"triton_poi_early": True, "triton_poi_late": False}
    assert study.unguarded_after_ops([code]) == ["triton_poi_early"]
    first = "triton_poi_early.run(buf2"
    assert study.unguarded_after_ops([code.replace(first, "triton_poi_late.run(buf2")]) == []


def test_race_study_variants_each_take_one_suspect_away_and_put_it_back():
    """``race_study.variants``: inside each, what it names is changed (the lazy launch wrapped,
    the lazy kernel's ``pdl_meta`` or ``step_config`` replaced, the heads grid chosen, every
    dejavu module's ``pdl_meta`` plain, a group's launches plain, the add-norm or finish
    kernel programmatic, the add-norm launch wrapped, the two launched late), and on leaving
    everything is as before."""
    import os

    from dejavu_compile.kernels import bucket_select, decode_attention, lazy_kv, triton_common
    from triton.runtime.jit import JITFunction

    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    modules = (bucket_select, decode_attention, lazy_kv, triton_common)

    def norm_state():
        return (triton_common.ADD_NORM_PDL, triton_common.FINISH_PDL,
                triton_common._launch_add_norm, JITFunction.run)

    before = ([m.pdl_meta for m in modules], lazy_kv._launch, lazy_kv.step_config,
              os.environ.get(lazy_kv.GRID_ENV))
    norm_before = norm_state()
    assert norm_before[:2] == (False, False)  # the fix: both kernels launch plainly
    changed, norm, late, starts = {}, {}, {}, {}
    start_before = os.environ.get(triton_common.PDL_START_ENV)
    for name, variant in study.variants().items():
        with variant():
            changed[name] = ([m.pdl_meta for m in modules], lazy_kv._launch,
                             lazy_kv.step_config, lazy_kv.default_grid())
            norm[name] = norm_state()
            if triton_common.norm_launch() != "plain":
                late[name] = triton_common.norm_launch()
            if triton_common.pdl_start() != "wait":
                starts[name] = triton_common.pdl_start()
            if name == "dejavu plain":
                assert all(m.pdl_meta() == {"PDL": False} for m in modules)
            if name == "lazy unsplit":
                assert lazy_kv.step_config(1)["SPLIT"] == 1
                assert lazy_kv.step_config(5) == lazy_kv.PREFILL_FIXED
        assert ([m.pdl_meta for m in modules], lazy_kv._launch, lazy_kv.step_config,
                os.environ.get(lazy_kv.GRID_ENV)) == before, name
        assert norm_state() == norm_before, name
        assert os.environ.get(triton_common.PDL_START_ENV) == start_before, name
    assert norm["add_norm programmatic"][:3] == (True, False, norm_before[2])
    assert norm["finish programmatic"][:3] == (False, True, norm_before[2])
    assert norm["norm programmatic"][:3] == (True, True, norm_before[2])
    for when in ("before", "after"):
        assert norm[f"norm programmatic sync {when}"][:2] == (True, True)
        assert norm[f"norm programmatic sync {when}"][2] is not norm_before[2]
    assert late == {"norm late": "late"}  # the variable set inside that variant only
    # the exit variant: both kernels programmatic, no kernel starting its successor early
    assert norm["norm programmatic exit"][:3] == (True, True, norm_before[2])
    assert starts == {"norm programmatic exit": "exit"}
    for name in ("mlp plain", "output plain", "others plain"):
        assert norm[name][3] is not norm_before[3] and norm[name][:3] == norm_before[:3]
    for group in ("mlp", "projection", "output", "attention", "selector", "lazy"):
        name = f"add_norm programmatic {group} plain"
        assert norm[name][:3] == (True, False, norm_before[2]) and norm[name][3] is not \
            norm_before[3], name
    # ``--only`` takes the names comma-separated, and refuses a name it does not know
    assert not any("," in name for name in study.variants())
    with pytest.raises(SystemExit, match=r"--only: no variant \['norm plain'\]"):
        study.main(["--only", "as is,norm plain"])
    assert changed["as is"][:3] == before[:3] and changed["as is"][3] == lazy_kv.GRIDS[0]
    assert changed["sync before"][1] is not before[1] and changed["sync after"][1] is not before[1]
    assert changed["lazy plain"][0][2] is not before[0][2]
    assert changed["lazy plain"][0][:2] == before[0][:2]
    assert changed["heads grid"][3] == "heads"


def test_race_study_plain_launches_only_the_named_kernels():
    """``race_study._plain``: a launch of a named kernel goes through Triton's
    ``JITFunction.run`` with ``PDL`` false and no ``launch_pdl``; any other kernel's, and a
    named kernel without a ``PDL`` parameter, as asked."""
    from types import SimpleNamespace
    from unittest import mock

    from triton.runtime.jit import JITFunction

    study = load_example(Path(__file__).parents[1] / "examples" / "race_study.py")
    seen = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append((self.fn.__name__, kwargs))

    def kernel(name, params=("x", "PDL")):
        return SimpleNamespace(fn=SimpleNamespace(__name__=name), arg_names=list(params))

    asked = {"PDL": True, "launch_pdl": True, "BLOCK": 4}
    with mock.patch.object(JITFunction, "run", record), study._plain(("_finish_kernel",)):
        JITFunction.run(kernel("_finish_kernel"), 1, grid=(1,), warmup=False, **asked)
        JITFunction.run(kernel("_add_norm_kernel"), 1, grid=(1,), warmup=False, **asked)
        JITFunction.run(kernel("_finish_kernel", ("x",)), 1, grid=(1,), warmup=False, **asked)
    assert seen == [("_finish_kernel", {"PDL": False, "BLOCK": 4}),
                    ("_add_norm_kernel", asked), ("_finish_kernel", asked)]


_PROBE_PTX = """
import sys

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

sys.path.insert(0, sys.argv[1])
import pdl_probe as probe

kinds = (("griddepcontrol.wait", "wait"), ("griddepcontrol.launch_dependents", "start"),
         ("ld.volatile.global", "read"), ("ld.global", "load"), ("st.global", "store"))
flags = {"flag_ptr": "*i32", "out_ptr": "*i32", "n": "i32"}
cases = [(probe._producer, {"flag_ptr": "*i32", "sink_ptr": "*fp32", "spin": "i32"},
          {"EARLY": early}) for early in (True, False)]
cases += [(probe._reader, flags, {"PDL": pdl, "START": start, "BLOCK": 2, "CACHED": cached})
          for pdl, start, cached in ((True, False, False), (True, True, False),
                                     (False, False, False), (True, False, True))]
cases += [(probe._warm, {"flag_ptr": "*i32", "sink_ptr": "*i32", "n": "i32"}, {"BLOCK": 2})]
for fn, sig, const in cases:
    sig = {**sig, **{k: "constexpr" for k in const}}
    ptx = triton.compile(ASTSource(fn, sig, constexprs=const),
                         target=GPUTarget("cuda", 90, 32)).asm["ptx"]
    order = [name for line in ptx.splitlines() for text, name in kinds if text in line]
    print(fn.__name__, *const.values(), " ".join(order))
"""


def test_pdl_probe_kernels_read_wait_and_start_where_its_cases_need(tmp_path):
    """``examples/pdl_probe.py``'s kernels compiled for an sm_90 GPU (Triton's ptxas, no GPU
    needed): the producer waits, lets its successor start only with ``EARLY``, and sets its
    flag last; the reader reads the flags before its wait and again after it (two loads, not
    merged: volatile ones, or with ``CACHED`` plain ones), lets its successor start after its
    wait only with ``START``, and has no wait when launched plainly; the warm kernel reads
    the flags plainly."""
    stdout = compile_outside_interpreter(_PROBE_PTX, str(Path(__file__).parents[1] / "examples"),
                                         cwd=tmp_path)
    assert stdout.splitlines() == [
        "_producer True wait start load store store",
        "_producer False wait load store store",
        "_reader True False 2 False read wait read store store",
        "_reader True True 2 False read wait start read store store",
        "_reader False False 2 False read read store store",
        "_reader True False 2 True load wait load store store",
        "_warm 2 load store",
    ], stdout


def test_pdl_probe_refuses_bad_arguments_and_a_machine_without_hopper():
    """``pdl_probe.main``: ``--trials``, ``--spin``, ``--programs`` or ``--readers`` below 1 is
    an error naming it; without a CUDA GPU of compute capability 9.0 or later it stops with a
    message saying so."""
    probe = load_example(Path(__file__).parents[1] / "examples" / "pdl_probe.py")
    with pytest.raises(SystemExit, match="--trials must be at least 1, got 0"):
        probe.main(["--trials", "0"])
    with pytest.raises(SystemExit, match="--spin must be at least 1, got -3"):
        probe.main(["--spin", "-3"])
    with pytest.raises(SystemExit, match="--readers must be at least 1, got 0"):
        probe.main(["--readers", "0", "--cached"])
    if torch.cuda.is_available() and torch.cuda.get_device_capability()[0] >= 9:
        pytest.skip("this machine has a Hopper GPU: the probe runs here")
    with pytest.raises(SystemExit, match="needs a CUDA GPU of compute capability 9.0"):
        probe.main(["--trials", "1"])


def _mlp_case(gated: bool, seed: int):
    """A sparse MLP of odd sizes (37 units, d 45, d_out 29) and one row's 11 ids, unsorted:
    (x, ids, w1, b1, w_up, w2_t, act), ReLU with biases or SiLU-gated."""
    gen = torch.Generator().manual_seed(seed)
    n, d, d_out = 37, 45, 29
    w1 = torch.randn(n, d, generator=gen)
    w_up = torch.randn(n, d, generator=gen) if gated else None
    w2_t = torch.randn(n, d_out, generator=gen)
    b1 = None if gated else torch.randn(n, generator=gen)
    x = torch.randn(1, d, generator=gen)
    ids = torch.tensor([[0, 3, 4, 10, 17, 22, 30, 36, 9, 12, 25]])
    return x, ids, w1, b1, w_up, w2_t, "silu" if gated else "relu"


@pytest.mark.parametrize("gated", [False, True], ids=["relu_biases", "silu_gated"])
def test_onepass_mlp_study_kernel_is_the_sparse_mlp(gated):
    """``examples/onepass_mlp_study.py``'s one-launch MLP (the Triton kernel, under the
    interpreter) adds into zeroed sums the reference sparse MLP's output less its bias, on odd
    sizes, with a tile of neurons cut short by the selection's end."""
    from dejavu_compile.kernels import reference

    study = load_example(Path(__file__).parents[1] / "examples" / "onepass_mlp_study.py")
    x, ids, w1, b1, w_up, w2_t, act = _mlp_case(gated, 1)
    sums = torch.zeros(1, w2_t.shape[1])
    got = study.onepass_sums(x, ids, w1, b1, w_up, w2_t, act, sums, block_n=4, block_d=16,
                             block_o=16, num_warps=1)
    assert got is sums
    want = reference.sparse_mlp(x, ids, w1, b1, w_up, w2_t, None, act)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("gated", [False, True], ids=["relu_biases", "silu_gated"])
def test_persistent_mlp_study_kernel_is_the_sparse_mlp(gated):
    """``examples/onepass_mlp_study.py``'s persistent MLP (under the interpreter its two phases
    run as two launches) adds into zeroed sums the reference sparse MLP's output less its bias,
    on odd sizes, with fewer programs than items in both phases and tiles cut short by the
    selection's end; its scratch (pre-activations and the barrier's counters) is left zero,
    so a second call gives the same sums."""
    from dejavu_compile.kernels import reference

    study = load_example(Path(__file__).parents[1] / "examples" / "onepass_mlp_study.py")
    x, ids, w1, b1, w_up, w2_t, act = _mlp_case(gated, 2)
    want = reference.sparse_mlp(x, ids, w1, b1, w_up, w2_t, None, act)
    pre = torch.zeros(2, ids.shape[1])
    bar = torch.zeros(2, dtype=torch.int32)
    for _ in range(2):
        sums = torch.zeros(1, w2_t.shape[1])
        # up items: 3 neuron tiles x 3 slices of d; down items: 2 neuron blocks x 2 output slices
        got = study.persistent_sums(x, ids, w1, b1, w_up, w2_t, act, sums, pre, bar, 3,
                                    block_n=4, block_d=16, block_m=4, block_o=16, tiles=2,
                                    num_warps=1)
        assert got is sums
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert not pre.any() and not bar.any()
    with pytest.raises(ValueError, match="bar int32"):
        study.persistent_sums(x, ids, w1, b1, w_up, w2_t, act, sums, pre, bar.float(), 3)


@pytest.mark.parametrize("finish", [False, True], ids=["sums_left", "finished"])
@pytest.mark.parametrize("shape", [(4, 16, 3), (16, 32, 1)], ids=["loop", "one_tile"])
@pytest.mark.parametrize("gated", [False, True], ids=["relu_biases", "silu_gated"])
def test_down_kernel_study_step_forms_are_the_sparse_mlp(gated, shape, finish):
    """``examples/down_kernel_study.py``'s down kernel in the decode step's forms (under the
    interpreter; three neuron tiles a program, the last cut short, or one tile wider than the
    selection, as a ``--tiles`` config beyond the autotuner's may be), from the up
    projection's pre-activations: the finishing form gives the reference sparse MLP's output
    and leaves its workspace zero; the default step's (the add-norm launch after it finishes
    the sums) leaves that output less its bias as fp32 sums. Both zero the pre-activations
    they read."""
    import triton
    from dejavu_compile.kernels import ops, reference, tuning

    study = load_example(Path(__file__).parents[1] / "examples" / "down_kernel_study.py")
    x, ids, w1, b1, w_up, w2_t, act = _mlp_case(gated, 3)
    b2 = None if gated else torch.randn(w2_t.shape[1], generator=torch.Generator().manual_seed(4))
    want = reference.sparse_mlp(x, ids, w1, b1, w_up, w2_t, b2 if finish else None, act)
    pre = torch.stack([x @ w1[ids[0]].T, x @ (w_up if gated else w1)[ids[0]].T])
    space = torch.zeros(ops.workspace_numel(1, w2_t.shape[1], ids.shape[1], gated=True))
    bn, bd, tiles = shape
    tile = triton.Config({"BLOCK_N": bn, "BLOCK_D": bd, "TILES": tiles}, num_warps=1)
    with tuning.pinned("sparse_mlp._down_kernel", tile):
        got = study.down_step(pre, ids, w2_t, b1, b2, act, space, finish=finish)
    if finish:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
        assert not space.any()
    else:
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.view(-1), want.view(-1).float(), rtol=1e-4, atol=1e-4)
    assert not pre[:1 + gated].any()  # (a plain MLP reads only the first)
