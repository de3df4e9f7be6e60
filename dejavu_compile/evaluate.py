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
    """Up to ``count`` consecutive, non-overlapping windows ``[1, length]`` of ``ids`` [1, N]."""
    n = ids.shape[1] // length
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
