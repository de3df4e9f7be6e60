"""The compile report: per layer, which blocks were matched, how they run, and the bytes of
weights each decoded token reads, dense and sparse."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
from torch.utils.weak import WeakIdKeyDictionary

DISPATCH_CONTEXTS = (512, 2048, 8192, 32768, 131072)  # context lengths the report's gate lists


@dataclass
class BlockRow:
    """One block of one layer. Bytes are weight bytes read per decoded token (batch 1)."""

    kind: str
    selector: str
    kept: float  # fraction of units computed per token (1.0 when dense)
    k: int
    units: int
    dense_bytes: int
    sparse_bytes: int  # bytes the block's ops read at the kept fraction
    selector_bytes: int  # bytes the selector reads (predictor weights; dense weights for oracle)
    reason: str = ""

    @property
    def total_bytes(self) -> int:
        return self.sparse_bytes + self.selector_bytes


@dataclass
class LayerRow:
    layer: int
    mlp: BlockRow | None = None
    attention: BlockRow | None = None

    def blocks(self) -> list[BlockRow]:
        return [b for b in (self.attention, self.mlp) if b is not None]


@dataclass
class GraphReport:
    """What the backend did to one Dynamo graph."""

    index: int
    layers: list[LayerRow]
    unmatched: list[str]
    counters: dict[str, int]
    other_bytes: int  # parameters outside matched blocks (embeddings, norms, head), read densely
    decode: bool = True  # one new token per sequence (prefill graphs run dense)
    kv_bytes_per_token: int = 0  # KV cache bytes one context token adds (matched attention blocks)
    params: WeakIdKeyDictionary = field(default_factory=WeakIdKeyDictionary, repr=False)

    @property
    def bytes_dense(self) -> int:
        return self.other_bytes + sum(b.dense_bytes for r in self.layers for b in r.blocks())

    @property
    def bytes_sparse(self) -> int:
        return self.other_bytes + sum(b.total_bytes for r in self.layers for b in r.blocks())


@dataclass
class CompileReport:
    """Every graph compiled for one model; ``layers`` and the byte totals describe the latest
    decode graph covering the most layers (the decode step of a model Dynamo compiles whole)."""

    graphs: list[GraphReport]

    @property
    def main(self) -> GraphReport:
        return max(reversed(self.graphs), key=lambda g: (g.decode, len(g.layers)))

    @property
    def layers(self) -> list[LayerRow]:
        return self.main.layers

    @property
    def unmatched(self) -> list[str]:
        seen: dict[str, None] = {}
        for g in self.graphs:
            seen.update(dict.fromkeys(g.unmatched))
        return list(seen)

    @property
    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for g in self.graphs:
            for key, n in g.counters.items():
                total[key] = total.get(key, 0) + n
        return total

    @property
    def bytes_dense(self) -> int:
        return self.main.bytes_dense

    @property
    def bytes_sparse(self) -> int:
        return self.main.bytes_sparse

    def dispatch(self, contexts=DISPATCH_CONTEXTS, kv_keep: float | None = None,
                 costs_ms: dict[str, float] | None = None, bandwidth: float | None = None):
        """The dispatch gate on this compilation's byte account: per context length, the mode
        (dense, projection, kv, both) with the least predicted step time: bytes read (weights
        as compiled, the KV cache at ``kv_keep``) at ``bandwidth``, plus each mode's measured
        fixed cost (``dejavu bench --kv``); without costs, the fewest bytes. Returns the byte
        crossover and the choices."""
        from .plan import DEFAULT_KV_KEEP, MODES, crossover_tokens

        keep = DEFAULT_KV_KEEP if kv_keep is None else kv_keep
        kv, costs = self.main.kv_bytes_per_token, costs_ms or {}
        weights = {"dense": self.bytes_dense, "projection": self.bytes_sparse,
                   "kv": self.bytes_dense, "both": self.bytes_sparse}

        def step_ms(mode, n):
            cache = kv * n * (keep if mode in ("kv", "both") else 1.0)
            seconds = (weights[mode] + cache) / (bandwidth or 1e12)
            return seconds * 1e3 + costs.get(mode, 0.0)

        saved = self.bytes_dense - self.bytes_sparse
        cross = crossover_tokens(saved, kv, keep) if saved > 0 else None
        choices = {n: min(MODES, key=lambda m, n=n: step_ms(m, n)) for n in contexts}
        return {"kv_keep": keep, "crossover": cross, "projection_saves": saved,
                "kv_bytes_per_token": kv, "choices": choices}

    def to_dict(self) -> dict[str, Any]:
        def block(b: BlockRow | None):
            if b is None:
                return None
            return {
                "selector": b.selector, "kept": round(b.kept, 4), "k": b.k, "units": b.units,
                "dense_bytes": b.dense_bytes, "sparse_bytes": b.sparse_bytes,
                "selector_bytes": b.selector_bytes, "reason": b.reason,
            }

        return {
            "graphs": len(self.graphs),
            "bytes_per_token_dense": self.bytes_dense,
            "bytes_per_token_sparse": self.bytes_sparse,
            "other_bytes": self.main.other_bytes,
            "layers": [
                {"layer": r.layer, "attention": block(r.attention), "mlp": block(r.mlp)}
                for r in self.layers
            ],
            "unmatched": self.unmatched,
            "counters": self.counters,
            "dispatch": self.dispatch(),
        }

    def __str__(self) -> str:
        def cell(b: BlockRow | None) -> str:
            if b is None:
                return "-"
            if b.selector == "dense":
                return "dense"
            return f"{b.selector} {b.k}/{b.units}"

        mb = 1 / 2**20
        decode = sum(g.decode for g in self.graphs)
        lines = [
            f"dejavu compile report: {len(self.graphs)} graph(s) ({decode} decode, "
            f"{len(self.graphs) - decode} prefill), {len(self.layers)} layer(s)",
            f"{'layer':>5}  {'attention':<22} {'mlp':<22} {'dense MiB':>9} {'sparse MiB':>10}",
        ]
        for r in self.layers:
            dense = sum(b.dense_bytes for b in r.blocks()) * mb
            sparse = sum(b.total_bytes for b in r.blocks()) * mb
            lines.append(
                f"{r.layer:>5}  {cell(r.attention):<22} {cell(r.mlp):<22} {dense:>9.2f} {sparse:>10.2f}"
            )
        lines.append(
            f"bytes per decoded token: dense {self.bytes_dense * mb:.2f} MiB, sparse "
            f"{self.bytes_sparse * mb:.2f} MiB (selectors included; other parameters "
            f"{self.main.other_bytes * mb:.2f} MiB read densely)"
        )
        grouped: dict[tuple[str, str], list[int]] = {}
        for r in self.layers:
            for b in r.blocks():
                if b.reason and self.main.decode:
                    grouped.setdefault((b.kind, b.reason), []).append(r.layer)
        reasons = [f"{kind} dense in layers {_ranges(layers)}: {why}"
                   for (kind, why), layers in grouped.items()]
        for line in reasons + [f"dense: {u}" for u in self.unmatched]:
            lines.append(f"  {line}")
        gate = self.dispatch()
        if gate["kv_bytes_per_token"]:
            cross = gate["crossover"]
            lines.append(
                f"  byte account: projection sparsity saves {gate['projection_saves'] * mb:.2f} "
                f"MiB per token, KV selection at keep {gate['kv_keep']} saves "
                f"{(1 - gate['kv_keep']) * gate['kv_bytes_per_token']:,.0f} B per context token; "
                + (f"they cross at {cross:,} tokens" if cross is not None else "no crossover"))
            lines.append("  dispatch by bytes: " + ", ".join(
                f"{n:,} tokens -> {mode}" for n, mode in gate["choices"].items()))
        lines.append("  counters: " + ", ".join(f"{k}={v}" for k, v in sorted(self.counters.items())))
        return "\n".join(lines)


def _ranges(values: list[int]) -> str:
    """``[0, 1, 2, 5]`` -> ``"0-2, 5"``."""
    spans: list[list[int]] = []
    for v in sorted(values):
        if spans and v == spans[-1][1] + 1:
            spans[-1][1] = v
        else:
            spans.append([v, v])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _nbytes(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.numel() * t.element_size()


def _weights(lin) -> int:
    return _nbytes(lin.weight)


def _predictor_bytes(ctx, block, kind: str) -> int:
    """Bytes a block's predictor reads per token: its tensors in the dtype the sparsify pass
    casts them to (the block's weights'), not the dtype the profile stores them in."""
    prefix = f"layers.{block.layer}.{kind}."
    esize = block.linears()[0].weight.element_size()
    return sum(t.numel() * esize for name, t in ctx.predictors.items() if name.startswith(prefix))


def _mlp_row(ctx, block, plan) -> BlockRow:
    lins = block.linears()
    dense = sum(lin.nbytes() for lin in lins)
    frac = plan.kept_fraction
    gathered = sum(_weights(lin) for lin in lins) + _nbytes(block.first.bias)
    sparse = round(frac * gathered) + _nbytes(block.down.bias)
    if plan.selector == "oracle":
        selector = block.first.nbytes() + (_weights(block.up) if block.up is not None else 0)
    elif plan.selector == "predictor":
        selector = _predictor_bytes(ctx, block, "mlp")
    elif plan.selector == "fixed":
        selector = 0
    elif plan.selector == "threshold":
        # each projection reads the rows of its kept inputs: k_in of d for the first
        # projection(s), k of N for the down projection; magnitudes cost no weight reads
        k_in = max(1, min(block.hidden_size, round(plan.density * block.hidden_size)))
        firsts = [block.first] + ([block.up] if block.up is not None else [])
        sparse = sum(round(k_in / block.hidden_size * _weights(lin)) + _nbytes(lin.bias)
                     for lin in firsts)
        sparse += round(frac * _weights(block.down)) + _nbytes(block.down.bias)
        selector = 0
    elif plan.selector == "gate":
        # the gate is read densely (it selects); up and down only for the kept neurons
        selector = block.first.nbytes()
        sparse = round(frac * (_weights(block.up) + _weights(block.down))) + _nbytes(block.down.bias)
    else:
        sparse, selector = dense, 0
    return BlockRow("mlp", plan.selector, frac, plan.k, plan.units, dense, sparse, selector,
                    plan.reason)


def _attention_row(ctx, block, plan) -> BlockRow:
    dense = sum(lin.nbytes() for lin in block.linears())
    frac = plan.kept_fraction
    kv = block.k.nbytes() + block.v.nbytes()
    if block.layer in ctx.lazy_kv_layers:  # the selected heads' rows only
        kv = round(frac * (_weights(block.k) + _weights(block.v))) + _nbytes(block.k.bias) \
            + _nbytes(block.v.bias)
    o_part = round(frac * _weights(block.o)) + _nbytes(block.o.bias)
    if plan.selector == "oracle":
        # q stays dense (the oracle ranks heads on the dense attention output) and the oracle
        # reads the whole output projection to score heads.
        sparse = block.q.nbytes() + kv + o_part
        selector = _weights(block.o)
    elif plan.selector in ("predictor", "fixed"):
        sparse = round(frac * block.q.nbytes()) + kv + o_part
        selector = (_predictor_bytes(ctx, block, "attention")
                    if plan.selector == "predictor" else 0)
    else:
        sparse, selector = dense, 0
    return BlockRow("attention", plan.selector, frac, plan.k * plan.group,
                    plan.units * plan.group, dense, sparse, selector, plan.reason)


def build_graph_report(ctx, index: int) -> GraphReport:
    """Summarise one backend call from its ``PassContext`` (after all passes ran)."""
    disc = ctx.discovery
    rows = []
    in_blocks: set[int] = set()
    for layer in disc.layers:
        row = LayerRow(layer)
        if layer in disc.mlp:
            row.mlp = _mlp_row(ctx, disc.mlp[layer], ctx.plan[(layer, "mlp")])
            in_blocks.update(id(lin.weight) for lin in disc.mlp[layer].linears())
            in_blocks.update(id(lin.bias) for lin in disc.mlp[layer].linears())
        if layer in disc.attention:
            row.attention = _attention_row(ctx, disc.attention[layer], ctx.plan[(layer, "attention")])
            in_blocks.update(id(lin.weight) for lin in disc.attention[layer].linears())
            in_blocks.update(id(lin.bias) for lin in disc.attention[layer].linears())
        rows.append(row)
    params = [v for v in ctx.example_inputs if isinstance(v, torch.nn.Parameter)]
    seen: dict[int, torch.Tensor] = {id(p): p for p in params if id(p) not in in_blocks}
    report = GraphReport(
        index=index,
        layers=rows,
        unmatched=list(disc.unmatched),
        counters=dict(ctx.counters.values),
        other_bytes=sum(_nbytes(p) for p in seen.values()),
        decode=disc.tokens == 1,
        kv_bytes_per_token=sum(b.k.weight.shape[0] * b.k.weight.element_size()
                               + b.v.weight.shape[0] * b.v.weight.element_size()
                               for b in disc.attention.values()),
    )
    for p in params:
        report.params[p] = True
    return report
