"""Every example imports: a name it takes from the package still exists (the host study once
imported a bench helper that a later change had removed). Their ``main`` is not run here: the
studies need a GPU and the demo minutes."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

EXAMPLES = sorted((Path(__file__).parents[1] / "examples").glob("*.py"))


def test_there_are_examples():
    assert {"demo.py", "quickstart.py", "host_study.py"} <= {p.name for p in EXAMPLES}


def _load(path: Path):
    """The example at ``path``, imported as a module (its ``main`` not run)."""
    spec = importlib.util.spec_from_file_location(f"example_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("path", EXAMPLES, ids=lambda p: p.stem)
def test_example_imports(path):
    module = _load(path)
    assert callable(getattr(module, "main", None)), f"{path.name} has no main()"


def test_qkv_study_stacked_selection_is_the_three_projections():
    """``examples/qkv_study.py`` times one launch over the stacked query, key and value
    weights with the selection repeated for each: that launch gives the three separate
    projections of the selected heads, side by side (the Triton kernel, under the
    interpreter)."""
    import torch
    from dejavu_compile.kernels import heads

    study = _load(Path(__file__).parents[1] / "examples" / "qkv_study.py")
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
