"""Quality of sparse decoding, measured the way it is used: token by token.

Sparsity applies to decode steps only (prefill runs dense), so perplexity is teacher-forced
decoding: each window's first ``prefix`` tokens are prefilled, then every later token is fed
alone with the KV cache and scored. The same loop runs the dense model, so the two are compared
on identical tokens.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

DEFAULT_PREFIX = 16
DEFAULT_WINDOW = 128


@dataclass
class DecodeScore:
    """Negative log-likelihoods and greedy predictions of every decoded position."""

    nll: torch.Tensor  # [positions]
    top1: torch.Tensor  # [positions] argmax token ids

    @property
    def perplexity(self) -> float:
        return math.exp(self.nll.mean().item())

    def agreement(self, other: DecodeScore) -> float:
        """Fraction of positions where both predict the same next token."""
        return (self.top1 == other.top1).float().mean().item()


def windows(ids: torch.Tensor, length: int, count: int) -> list[torch.Tensor]:
    """Up to ``count`` consecutive, non-overlapping windows ``[1, length]`` of ``ids`` [1, N]
    (at least one: ``count`` >= 1 and N >= ``length``)."""
    if count < 1:
        raise ValueError(f"the number of windows must be >= 1, got {count}")
    n = ids.shape[1] // length
    if n < 1:
        raise ValueError(f"{ids.shape[1]} tokens of text are fewer than one window of {length}")
    return [ids[:, i * length : (i + 1) * length] for i in range(min(n, count))]


@torch.no_grad()
def score_decode(model, chunks: list[torch.Tensor], prefix: int = DEFAULT_PREFIX,
                 progress: bool = False) -> DecodeScore:
    """Teacher-forced decoding of each chunk ``[1, L]`` after a dense prefill of ``prefix``."""
    from tqdm import tqdm

    nll, top1 = [], []
    for chunk in tqdm(chunks, desc="decode", disable=not progress, leave=False):
        out = model(chunk[:, :prefix], use_cache=True)
        cache, logits = out.past_key_values, out.logits[:, -1]
        for pos in range(prefix, chunk.shape[1]):
            nll.append(torch.nn.functional.cross_entropy(logits.float(), chunk[:, pos]))
            top1.append(logits.argmax(-1)[0])
            if pos + 1 < chunk.shape[1]:
                out = model(chunk[:, pos : pos + 1], past_key_values=cache, use_cache=True)
                cache, logits = out.past_key_values, out.logits[:, -1]
    return DecodeScore(torch.stack(nll), torch.stack(top1))


def _compiled_copy(model, **options):
    import copy

    import dejavu_compile

    twin = copy.deepcopy(model)
    dejavu_compile.compile(twin, inner="eager", **options)
    return twin


def mlp_byte_fraction(report) -> float:
    """MLP weight bytes read per decoded token (selectors included) over the dense MLP bytes."""
    rows = [r.mlp for r in report.layers if r.mlp is not None]
    return sum(b.total_bytes for b in rows) / sum(b.dense_bytes for b in rows)


def evaluate_profile(model, chunks: list[torch.Tensor], profile, prefix: int = DEFAULT_PREFIX,
                     progress: bool = False) -> dict:
    """Dense, oracle (at the profile's densities) and the profile's own selectors, scored by
    teacher-forced decoding of ``chunks``. Returns the JSON keys of ``dejavu eval``."""
    import dejavu_compile

    dense = score_decode(model, chunks, prefix, progress)
    # Past Dynamo's recompile limit a frame would run uncompiled, that is dense, and the scores
    # would be dense ones under the sparse names: make that an error instead.
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):
        oracle_model = _compiled_copy(model, profile=profile, selector="oracle")
        oracle = score_decode(oracle_model, chunks, prefix, progress)
        sparse_model = _compiled_copy(model, profile=profile)
        sparse = score_decode(sparse_model, chunks, prefix, progress)
    rep = dejavu_compile.report(sparse_model)
    if not any(g.decode for g in rep.graphs):
        raise RuntimeError("dejavu eval: no decode step of the profiled model was compiled, so "
                           "its scores would be dense ones")
    return {
        "tokens": int(dense.nll.numel()),
        "dense_ppl": dense.perplexity,
        "oracle_ppl": oracle.perplexity,
        "sparse_ppl": sparse.perplexity,
        "top1_agreement": sparse.agreement(dense),
        "oracle_top1_agreement": oracle.agreement(dense),
        "bytes_per_token_dense": rep.bytes_dense,
        "bytes_per_token_sparse": rep.bytes_sparse,
        "mlp_bytes_fraction": mlp_byte_fraction(rep),
        "layers": [{"layer": r.layer, "mlp_density": r.mlp.kept if r.mlp else 1.0,
                    "selector": r.mlp.selector if r.mlp else "dense",
                    "recall": profile.layer(r.layer).mlp.recall} for r in rep.layers],
    }


def plot_layers(result: dict, path) -> None:
    """PNG: per layer, the chosen MLP density and the predictor's measured recall."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    layers = [row["layer"] for row in result["layers"]]
    fig, ax = plt.subplots(figsize=(8, 3.5))
    ax.bar(layers, [row["mlp_density"] for row in result["layers"]], label="MLP density",
           color="#8ab")
    recall = [(row["layer"], row["recall"]) for row in result["layers"] if row["recall"]]
    if recall:
        ax.plot(*zip(*recall, strict=True), "o-", color="#c53", label="predictor recall")
    ax.set_xlabel("layer")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"ppl dense {result['dense_ppl']:.2f}, sparse {result['sparse_ppl']:.2f}, "
                 f"MLP bytes {result['mlp_bytes_fraction']:.2f} of dense")
    ax.legend(loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
