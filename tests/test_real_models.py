"""The two real models that packages ship: discovery finds every layer, density 1.0 is exact."""

from __future__ import annotations

import pytest
import torch

import dejavu_compile
from dejavu_compile.models import documentation_text, load_model

from .test_backend import _decode_logits

pytestmark = pytest.mark.real_model

EXPECTED = {
    # name: (layers, query heads, MLP neurons)
    "smollm2-135m": (30, 9, 1536),
    "gemma3-270m": (18, 4, 2048),
}


@pytest.fixture(params=sorted(EXPECTED))
def real(request):
    return load_model(request.param)


def test_real_model_discovery_and_exactness(real):
    layers, heads, inter = EXPECTED[real.name]
    ids = real.encode(documentation_text("held_out"), 24)
    with torch.no_grad():
        want = _decode_logits(real.model, ids, steps=2)
        dejavu_compile.compile(real.model, selector="oracle", mlp_density=1.0,
                               attention_density=1.0, inner="eager")
        got = _decode_logits(real.model, ids, steps=2)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    rep = dejavu_compile.report(real.model)
    assert [r.layer for r in rep.layers] == list(range(layers))
    assert all(r.mlp.selector == "oracle" and r.attention.selector == "oracle" for r in rep.layers)
    assert rep.layers[0].mlp.units == inter and rep.layers[0].attention.units == heads
    graphs = [g for g in rep.graphs if g.decode]
    assert graphs and all(len(g.layers) == layers for g in graphs)
    # Every linear except the (tied) output head belongs to a block.
    assert len(rep.unmatched) == 1 and "embed_tokens.weight" in rep.unmatched[0]
