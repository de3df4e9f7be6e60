"""KV-cache sparsity (second paper): after a dense prefill, keep a fraction of each layer's
cached positions per KV head, gathered into a contiguous cache that decoding reads and appends
to. Composes with projection sparsity: the decode step can be the dejavu-compiled model.

Policies:
- ``scored``: attention-scored selection (appendix A): the last ``window`` prompt tokens'
  attention (``dejavu::kv_scores``), pooled over the query heads of each KV head, smoothed with
  a width-7 average; the first ``sinks`` tokens and the observation window are always kept; then
  the top positions per KV head within the budget (``dejavu::kv_select``).
- ``shared``: ``scored`` with one selection per layer: the scores of the layer's KV heads are
  summed, smoothed over 15 positions, and every KV head keeps the same positions. On
  SmolLM2-135M's passkey trials the per-head selection kept some of the key's digits in one
  head and others in another, and the answer lost digits; the shared one keeps them together,
  and the wider smoothing keeps the whole key where width 7 kept its first digits at 4K and 8K
  (README, retrieval).
- ``window``: the ``sinks`` first tokens and the most recent ones, the same budget (the plain
  recent-token window the paper compares against).
- ``dense``: the whole cache.

The scores come from an attention function registered with transformers' ``AttentionInterface``
(``dejavu_kv_scored``), which runs SDPA and, during the prefill only, scores the cache; it sees
the post-RoPE queries and keys, so no model class is patched.
"""

from __future__ import annotations

import contextlib
import copy
from dataclasses import dataclass, field

import torch

POLICIES = ("dense", "scored", "shared", "window")
SCORED = ("scored", "shared")  # the policies that need the prefill's attention scores
DEFAULT_KEEP = 0.3
SINKS, WINDOW, SMOOTH = 4, 64, 7
SHARED_SMOOTH = 15  # the ``shared`` policy's smoothing width
# the default policy: the one that answered as dense on every passkey and multi-key trial on
# SmolLM2-135M up to its context (README), where ``scored`` lost digits of the passkey
DEFAULT_POLICY = "shared"
ATTENTION_NAME = "dejavu_kv_scored"

_COLLECTOR: dict | None = None  # layer -> scores [B, KVH, T], filled during a scored prefill


def _scored_attention(module, query, key, value, attention_mask, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    out = sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if _COLLECTOR is not None and query.shape[2] > 1:
        w = min(WINDOW, query.shape[2])
        scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
        _COLLECTOR[module.layer_idx] = torch.ops.dejavu.kv_scores(
            query[:, :, -w:].contiguous(), key.contiguous(), float(scale))
    return out


def _register() -> None:
    from transformers import AttentionInterface

    AttentionInterface.register(ATTENTION_NAME, _scored_attention)


DECODE_ATTENTION = "dejavu_decode"


def _decode_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0,
                      **kwargs):
    """Hugging Face attention function ``dejavu_decode``: a decode step (one query token) with
    no mask or a boolean key mask shared by the heads runs ``torch.ops.dejavu.decode_attention``
    (split over the keys on CUDA); anything else (prefill, a float or per-head mask, a sliding
    window, soft-capping, dropout) runs SDPA as before."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    mask = attention_mask
    keys = key.shape[2]
    if mask is not None and mask.dtype == torch.bool and mask.dim() == 4 \
            and mask.shape[1] == 1 and mask.shape[2] == 1 and mask.shape[3] == keys:
        mask = mask[:, 0, 0, :].expand(query.shape[0], keys)
    plain = (query.shape[2] == 1 and (mask is None or mask.dim() == 2) and not dropout
             and kwargs.get("sliding_window") is None and kwargs.get("softcap") is None
             and query.shape[1] % key.shape[1] == 0)
    if not plain:
        return sdpa_attention_forward(module, query, key, value, attention_mask,
                                      scaling=scaling, dropout=dropout, **kwargs)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = torch.ops.dejavu.decode_attention(query, key, value, float(scale), mask)
    return out.transpose(1, 2).contiguous(), None


def use_decode_attention(model) -> None:
    """Run ``model``'s decode-step attention through ``dejavu::decode_attention`` (masks are
    built as for SDPA, which drops an all-visible one)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    AttentionInterface.register(DECODE_ATTENTION, _decode_attention)
    AttentionMaskInterface.register(DECODE_ATTENTION, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(DECODE_ATTENTION)


@contextlib.contextmanager
def _scoring(model):
    """Run the model's attention through the scoring function; yields the score dict."""
    global _COLLECTOR
    _register()
    before = model.config._attn_implementation
    model.set_attn_implementation(ATTENTION_NAME)
    _COLLECTOR = {}
    try:
        yield _COLLECTOR
    finally:
        _COLLECTOR = None
        model.set_attn_implementation(before)


@dataclass
class Selection:
    """What a policy kept: per layer, the kept positions [B, KVH, b] (None: all)."""

    policy: str
    prompt_tokens: int
    kept: dict[int, torch.Tensor | None] = field(default_factory=dict)

    @property
    def kept_tokens(self) -> int:
        sizes = [t.shape[-1] for t in self.kept.values() if t is not None]
        return max(sizes) if sizes else self.prompt_tokens


def budget_for(prompt_tokens: int, keep: float) -> int:
    """Positions kept per KV head: ``keep`` of the prompt, never below sinks + window."""
    if not 0.0 < keep <= 1.0:
        raise ValueError(f"KV keep must be in (0, 1], got {keep}")
    return min(prompt_tokens, max(round(keep * prompt_tokens), SINKS + WINDOW))


def _check_layers(cache) -> None:
    for i, layer in enumerate(cache.layers):
        if getattr(layer, "is_sliding", False):
            raise NotImplementedError(
                f"KV selection needs full-attention layers; layer {i} is a sliding-window "
                "layer (its cache is already bounded)")


def select(cache, policy: str, keep: float, scores: dict | None = None) -> Selection:
    """Gather each layer's kept positions of ``cache`` (a DynamicCache after prefill) into a
    contiguous cache, in place."""
    if policy not in POLICIES:
        raise ValueError(f"KV policy must be one of {POLICIES}, got {policy!r}")
    _check_layers(cache)
    t = cache.layers[0].keys.shape[2]
    sel = Selection(policy, t)
    b = budget_for(t, keep)
    for i, layer in enumerate(cache.layers):
        if policy == "dense" or b >= t:
            sel.kept[i] = None
            continue
        keys, values = layer.keys, layer.values
        batch, kvh, _, hd = keys.shape
        if policy in SCORED:
            if scores is None or i not in scores:
                raise ValueError(f"{policy} KV selection has no scores for layer {i}")
            layer_scores, smooth = ((scores[i].sum(1, keepdim=True), SHARED_SMOOTH)
                                    if policy == "shared" else (scores[i], SMOOTH))
            idx = torch.ops.dejavu.kv_select(layer_scores, b, SINKS, WINDOW, smooth)
            idx = idx.expand(batch, kvh, idx.shape[-1])
        else:
            recent = torch.arange(t - (b - SINKS), t, device=keys.device)
            idx = torch.cat([torch.arange(SINKS, device=keys.device), recent])
            idx = idx.expand(batch, kvh, b)
        gather = idx.unsqueeze(-1).expand(batch, kvh, idx.shape[-1], hd)
        layer.keys = keys.gather(2, gather).contiguous()
        layer.values = values.gather(2, gather).contiguous()
        sel.kept[i] = idx
    return sel


@torch.no_grad()
def generate_policies(model, ids: torch.Tensor, max_new_tokens: int, policies=POLICIES,
                      keep: float = DEFAULT_KEEP, decode=None
                      ) -> dict[str, tuple[torch.Tensor, Selection]]:
    """Greedy decoding of ``ids`` [1, T] under each KV policy, from one dense prefill: each
    policy selects from its own copy of the prefilled cache. ``decode`` runs the decode steps
    (default: ``model``; pass the dejavu-compiled model to compose with projection sparsity).
    The prefill runs the model's eager forward (recording attention scores when a policy
    needs them). Returns per policy the new tokens [1, max_new_tokens] and the selection."""
    from transformers import DynamicCache

    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"KV policy must be one of {POLICIES}, got {policy!r}")
    prefilled = DynamicCache(config=model.config)
    scoring = _scoring(model) if set(SCORED) & set(policies) else contextlib.nullcontext()
    with scoring as scores:
        out = model.forward(input_ids=ids, past_key_values=prefilled, use_cache=True)
    first = out.logits[:, -1:].argmax(-1)
    decode = decode if decode is not None else model
    t, results = ids.shape[1], {}
    for n, policy in enumerate(policies):
        cache = prefilled if n == len(policies) - 1 else copy.deepcopy(prefilled)
        sel = select(cache, policy, keep, scores)
        tok, new = first, []
        for i in range(max_new_tokens):
            new.append(tok)
            if i == max_new_tokens - 1:
                break
            length = cache.get_seq_length()
            out = decode(input_ids=tok, past_key_values=cache, use_cache=True,
                         position_ids=torch.tensor([[t + i]], device=ids.device),
                         cache_position=torch.tensor([length], device=ids.device),
                         attention_mask=torch.ones(1, length + 1, dtype=torch.long,
                                                   device=ids.device))
            tok = out.logits[:, -1:].argmax(-1)
        results[policy] = (torch.cat(new, dim=1), sel)
    return results


def generate(model, ids: torch.Tensor, max_new_tokens: int, policy: str = DEFAULT_POLICY,
             keep: float = DEFAULT_KEEP, decode=None) -> tuple[torch.Tensor, Selection]:
    """Greedy decoding of ``ids`` [1, T] with a dense prefill, then the KV cache kept by
    ``policy`` at ``keep`` (see ``generate_policies``). Returns the new tokens
    [1, max_new_tokens] and the selection."""
    return generate_policies(model, ids, max_new_tokens, (policy,), keep, decode)[policy]
