"""Backend options: one definition of every default, shared by the API and the CLI."""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

SELECTORS = ("oracle", "predictor", "fixed", "gate", "threshold")
GRANULARITIES = ("head", "group")
INNER_COMPILERS = ("inductor", "eager")
RELAYOUTS = ("in_place", "copy")
OUT_LAYOUTS = ("auto", "transposed", "original")
BATCH_SELECTIONS = ("union", "row")
DECODE_ATTENTIONS = ("cuda", "always", "never")

DEFAULT_INNER = "inductor"
DEFAULT_GRANULARITY = "head"
DEFAULT_RELAYOUT = "in_place"
DEFAULT_OUT_LAYOUT = "auto"
# option out_layout "auto": the original layout for the output projections that read at most
# this fraction of their heads. Measured on an H100 (BENCHMARKS.md, sixty-first session), each
# kernel autotuned over its candidates, with the column kernel's tile of 8 rows, 4 heads a step
# and 8 warps among them: OPT-13B's output projection took 10.9 against 13.3 us on the
# transposed layout at head density 0.5 and 17.8 against 21.2 at 0.8 (cuBLAS dense 19.8),
# Llama-3-8B's 7.9 against 10.7 and 11.8 against 13.4 (cuBLAS 15.3), OPT-13B's at 0.1 3.3
# against 6.1; OPT-13B's step at head density 0.5 ran 1.2-2.8% faster in three rounds of
# three. On an H200 (sixty-third session, `dejavu bench --blocks attention`) the same: 9.0
# against 12.2 us at 0.5 and 14.1 against 20.9 at 0.8 on OPT-13B (cuBLAS 17.8), 7.1 against
# 8.3 and 10.6 against 11.7 on Llama-3-8B, and OPT-13B's step 3.46 against 3.50 ms in one
# round. Not measured above 0.8. Before that tile (H200, twenty-fifth session) the transposed
# layout was as fast or faster at 0.5 and 0.8, and the limit was 0.25
ORIGINAL_LAYOUT_MAX_DENSITY = 0.8
DEFAULT_BATCH_SELECTION = "union"
DEFAULT_DECODE_ATTENTION = "cuda"
# option decode_selected_heads left None: on for a decode attention whose K/V cache holds at
# least this many positions. Measured on an H100 (BENCHMARKS.md, fifty-third to fifty-ninth
# sessions): the attention call alone over 20 of OPT-13B's 40 heads took 5.0 against 5.4 us at
# 256 positions and 7.5 against 9.1 at 1024; OPT-13B's step was faster with it in every round
# from 769 positions up (at 769 by 1.7% and 2.4%, at 1024 by 1.4% and 1.6%, at 2048 by 4.0%
# and 4.5%) and in seven rounds of eight at 513: forced on (fifty-eighth session), 4.19
# against 4.24, 4.08 against 4.22, 4.13 against 4.18 and 4.15 against 4.19 ms; as this
# default (fifty-ninth), 4.15 against 4.29, 4.17 against 4.33 and 4.25 against 4.27 ms, and
# 4.31 against 4.19 (2.9% slower) in one round. At 257 positions it was 0.9% and 0.3%
# faster on the H100 (fifty-eighth session; in the fifty-sixth two processes of one step
# differed by 0.3%) and no faster on an H200 (3.56 against 3.52 ms, forty-ninth session), so
# it stays off there.
SELECTED_HEADS_MIN_POSITIONS = 512


def _check_density(name: str, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"option {name!r} must be a number in (0, 1], got {value!r}")
    if not 0.0 < float(value) <= 1.0:
        raise ValueError(f"option {name!r} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class DejavuOptions:
    """What ``torch.compile(model, backend="dejavu", options={...})`` accepts.

    profile: a profile YAML path or a loaded ``Profile``; it fixes the selector and per-layer
        densities. Without one, ``selector`` must be ``"oracle"`` and the densities below apply
        to every matched layer.
    selector: ``"oracle"`` (true top-k from the dense computation, a quality ceiling),
        ``"predictor"`` (needs a profile with predictor weights) or ``"fixed"`` (the first k
        units every token: no selection at all, to time the sparse ops alone; its outputs are
        not meant to be good) or ``"gate"`` (gated MLPs only: the gate projection, read densely,
        selects the neurons by |act(gate)|; then only their rows of the up projection and of the
        down projection are read) or ``"threshold"`` (TEAL, training-free: each MLP projection
        reads only the weights of its largest-magnitude input activations, the density's
        fraction of them per token). With a profile, ``"oracle"``, ``"fixed"``, ``"gate"`` or
        ``"threshold"`` replaces its selectors at the profile's densities.
    mlp_density / attention_density: fraction of MLP neurons / attention heads kept per decoded
        token when no profile is given; ``None`` leaves that block dense.
    attention_granularity: ``"head"`` (query heads) or ``"group"`` (whole KV groups of
        grouped-query attention) when no profile is given.
    dense_layers: layer indices kept dense whatever the densities say.
    inner: the compiler that receives the rewritten graph, ``"inductor"`` or ``"eager"``.
    cudagraphs: capture the compiled decode step in CUDA graphs (Inductor's, as with
        ``mode="reduce-overhead"``; ``torch.compile`` takes no ``mode`` beside ``options``).
    lookahead: ``None`` runs each predictor on the input its profile says it was trained on
        (``input: previous`` is the lookahead of paper section 4.3: layer l's predictor reads
        layer l-1's input and runs while layer l-1 computes, on a CUDA side stream); ``True``
        or ``False`` also require every predictor of the profile to be trained that way.
    fold_predictors: a learned predictor whose input a dense projection also reads (the K and V
        projections of the layer whose input a lookahead attention predictor reads, say) gets
        its first layer folded into that projection: one GEMV reads the input for both, and the
        selection step (``dejavu::select_hidden``) runs inline instead of on a side stream
        (issue 5's alternative to the side stream). Needs ``fuse_linears``.
    relayout: how the down and output projections that sparse ops read get their ``[in, out]``
        row-per-unit layout: ``"in_place"`` re-lays out the parameters themselves (no second
        copy; the parameters become transposed views, Dynamo recompiles once after the first
        call) or ``"copy"`` (a copy beside each original: more memory, parameters untouched).
    out_layout: the layout the attention output projections' sparse ops read:
        ``"transposed"`` (re-laid out as ``relayout`` says, a head's rows contiguous, paper
        section 4.4; its kernel splits the selected rows over programs that add into fp32 with
        atomics), ``"original"`` (the parameter untouched, ``[d_out, H * head_dim]``: each
        output row's selected heads are ``head_dim`` contiguous values, and one program per
        block of output rows reads all of them and stores finished outputs, no atomics;
        ``kernels/heads.py::_head_out_cols_kernel``), or ``"auto"``: on CUDA, per layer, the
        original layout where the layer's head density is at most
        ``ORIGINAL_LAYOUT_MAX_DENSITY``, where its kernel was the faster, the transposed one
        above it and on CPU (whose reference gathers a head's rows). No memory either way.
    batch_selection: how a decode step of several sequences selects: ``"union"`` (every row
        computes the units any row selected, so the weights read are the union's, once for the
        batch; a row's output then depends on the others' selections, never with fewer units
        than its own) or ``"row"`` (each row its own selection: a batch decodes exactly as each
        of its rows alone). Batch 1 is the same either way. Measured on an H200 (Llama-3-8B
        MLP, 8 rows): the union is 1.9x faster at density 0.5, ``"row"`` 1.5x faster at 0.1,
        where independent selections cover most neurons together (BENCHMARKS.md).
    fuse_linears: dense projections that read the same input (K and V, Q, K and V, gate and
        up) run as one linear on their stacked weights; the parameters become row slices of
        the stacked matrix (no copy kept).
    dense_gemv: the dense projections of the model's blocks that a decode step computes for
        one row (Q, K and V of a dense attention, an output projection, a dense layer's MLP;
        fused or not) run through ``dejavu::gemv``, a Triton GEMV that reads whole weight rows
        in one launch, instead of the inner compiler's GEMM (``kernels/dense.py``). The
        language-model head and other linears are left alone. ``None`` (the default): on CUDA
        tensors only; ``True``: on CPU too, where the op is ``F.linear``; ``False``: never.
        On an H200 in the fortieth session's captured steps (BENCHMARKS.md): Llama-3-8B at
        MLP 0.5, attention dense, 3.32 and 3.34 ms against 3.46 and 3.47 without it in two
        rounds; OPT-13B's default step (one dense layer) 3.41 against 3.43 ms in one.
    decode_attention: where a decode step's attention (SDPA with one query token, a boolean or no
        key mask, no dropout) runs as ``dejavu::decode_attention``, the split-K Triton kernel
        that reads each KV head once for its group of query heads (``kernels/
        decode_attention.py``): ``"cuda"`` (on CUDA tensors; on CPU SDPA stays), ``"always"``
        (on CPU too, through the op's PyTorch reference) or ``"never"``.
    reorder_for_locality: run Inductor's post-grad ``reorder_for_locality`` on the rewritten
        graph (Inductor's default). Off by default: it moves each producer right before its
        first consumer, which puts every lookahead predictor back beside the sparse op that
        reads it (``backend.inductor_patches``); on, it is there to compare.
    workspaces: on CUDA, give each sparse MLP and head-gathered output projection with per-row
        ids a workspace that its kernels leave zero (a constant of the graph), so it launches
        no zero-fill. Off, each call zero-fills a buffer of its own, as before ``fa5eef8``
        (bench mode ``dejavu_fill``). On an H200, in one run at ``bc51c4e``, the workspaces
        saved 41 us of kernels, 31 launches and 0.06 ms a Llama-3-8B step, back to back
        (BENCHMARKS.md, eleventh session).
    merge_attention: on CUDA, the decode attention's split kernel merges its chunks itself, its
        last program per KV head doing it on counters the graph keeps zero (one launch a layer
        instead of two). Off by default: on an H200 (BENCHMARKS.md, eleventh session, one run
        at ``f3622db``) the merging split kernel took 337 us a Llama-3-8B step against 103 +
        114 us for split and combine launches, and the step 5.57 against 5.35 ms (4.54 against
        4.43 back to back). Bench mode ``dejavu_merge`` turns it on.
    decode_selected_heads: a decode step's ``dejavu::decode_attention`` computes only the
        KV groups of the heads that its head-gathered output projection selects (paper section
        3: a head not selected is not computed at all), reading each of their KV heads once and
        no other part of the KV cache; the other heads' outputs, which nothing reads, are
        zeros. With one query head per KV head (OPT) that is the selected heads alone. Applies
        where that projection alone reads the attention's output through views, its ids are
        computed before the attention and no batch's union selection is used; counted in
        ``decode_selected_heads`` (``decode_selected_heads_skipped[...]`` says why not). The
        outputs do not change. ``None`` (the default): where the attention's K/V cache holds
        at least ``SELECTED_HEADS_MIN_POSITIONS`` (512) positions, a length known when the
        graph is compiled (a static cache; a length that varies is left alone); ``True``: at
        any length; ``False``: never. OPT-13B's step was 1.4-4.5% faster with it in every
        round from 769 positions up and in seven rounds of eight at 513 (H100; bench modes
        ``dejavu_captured_qkv_selattn_pdl`` and, with this default, ``dejavu_captured_qkv_pdl``
        against the step without it) and no faster at the bench's 129-256 positions (H200,
        3.56 against 3.52 ms: the split kernel over half the cache took 5.6 us a layer against
        5.3, bound by latency, not bytes); the comment at ``SELECTED_HEADS_MIN_POSITIONS``
        gives each round.
    graph_splits: layers before which the captured decode step is cut into another CUDA graph:
        ``(3, 10)`` makes three graphs, layers 0-2, 3-9 and the rest; Inductor's graphs with
        ``cudagraphs``, else those of ``CapturedStep`` (without either, the cuts are copies that
        change nothing). A graph's launch costs the host time in proportion to its kernels, and
        the GPU starts a graph only once its launch returns (on an H200 a step's time came out
        close to the host's time plus the GPU's: BENCHMARKS.md, twelfth session), so a small first
        graph lets the GPU start while the host launches the rest. The cut is a
        ``dejavu::graph_split`` op (a copy of the layer's block input) that Inductor's graph
        partition runs outside the graphs, or that ends one graph and begins the next while
        ``CapturedStep`` captures. A lookahead predictor whose side stream the cut would straddle
        is forked just after the cut instead (``graph_split_fork_moved`` in the report); a cut
        that cannot be made so is left out (``graph_split_skipped``). On an H200 (BENCHMARKS.md,
        thirteenth session) ``(2, 8)`` made Llama-3-8B's step 5-7% faster in two runs of two, and
        OPT-13B's 3.9% slower in one; in the fourteenth, OPT-13B's lookahead step 8% faster in one
        run, and under ``CapturedStep`` no faster (three launches cost the host more than one).
        Off by default.
    lazy_kv: an attention block with a head selector (predictor or fixed) computes the keys
        and values of its selected heads only, writes zeros for the others, and keeps each
        token's block input so that a head's missing positions are computed when it is next
        selected (paper section 4.2, "missing KV cache"; ``dejavu::lazy_kv``, state per cache
        in ``kernels/kv_state.py``): the K/V projections read the selected heads' weights only.
        It costs the kept inputs, [batch, cache length, hidden] per layer (half the cache's
        size when K/V heads equal query heads). Applies where the keys and values go from
        their projections to a static cache's ``index_copy_`` through views only (no rotary
        embedding: OPT's attention) and K/V heads equal query heads; other blocks keep dense
        K/V (``lazy_kv_skipped`` in the report). On an H200 (sixteenth session, BENCHMARKS.md)
        OPT-13B's captured lookahead step was 10-16% faster with it than with dense K/V, in
        three runs of three (4.44-4.61 ms); its outputs match dense K/V's up to rounding
        (tested). Off by default for now: the kept inputs grow with the context, and the
        default has not been measured on the GPU with it on.
    fuse_qkv: with ``lazy_kv``, a block's query projection runs in the lazy K/V op's launch
        (``dejavu::lazy_qkv``): its programs for the selected heads' query rows sit beside
        those for their key and value rows, which read the same input and selection, so one
        launch replaces the query's zero-fill, kernel and finish. Applies where lazy K/V does,
        the query, key and value projections are all biased or all not, and no batch's union
        selection is used (``fuse_qkv_skipped`` in the report says why not). On by default:
        on an H200 (twenty-first session, BENCHMARKS.md) OPT-13B's captured lazy step took
        4.06, 3.86 and 4.09 ms with it against 4.26, 4.13 and 4.22 without, in three rounds
        side by side (bench modes ``dejavu_captured_qkv_pdl`` and
        ``dejavu_captured_lazy_pdl``); the lazy K/V kernel's time a step rose 930 -> 1192 us
        while the query's kernel (447 us), zero-fill and finish went. Without ``lazy_kv`` it
        changes nothing.
    batch_positions: with ``lazy_kv``, the cache positions of the rewritten blocks (Hugging
        Face's static cache computes ``arange(n) + length`` and moves ``length`` on, one small
        kernel a layer: 39 launches and 46 us of OPT-13B's captured step at ``cd835fd``) are
        computed for every block at once by two foreach ops before the first lazy op, which
        Inductor can run as one kernel each on CUDA (on CPU it still emits one a layer). The
        values are the same (tested). Off by default: on OPT-13B on an H200 at ``55bdfee`` the step
        ran 4.11 and 3.91 ms with it and 4.02 ms without (bench mode
        ``dejavu_captured_qkv_bp_pdl``), inside the spread. Ignored with ``graph_splits``.
    positions_from_length: with ``lazy_kv``, in a one-token step each lazy block reads its
        layer's cache length itself as its position (``arange(1) + length`` is that value),
        and every layer's ``length.add_(1)`` runs in one foreach op at the end of the graph:
        no kernel a layer for the positions (``batch_positions`` keeps two, this keeps one,
        after the last layer). A prefill is left to ``batch_positions`` or as it is. The
        values and the cache's lengths are the same (tested). Off: on an H100 (seventy-sixth
        session, bench mode ``dejavu_captured_qkv_lenpos_pdl``) OPT-13B's step ran 4.01 and
        3.95 ms with it against 4.01 and 3.99 without, level. Ignored with ``graph_splits``.
    multi_kernel: Inductor compiles each reduction that qualifies both as a loop over the row
        and as one pass over a row held in registers (a persistent reduction), and keeps the
        faster, timed on the GPU at the first call (Inductor's ``triton.multi_kernel``). By
        default Inductor loops over rows longer than 1024: OPT-13B's fused add and layer norm
        (a row of 5120) ran as such loops, 3.4-4.3 us a launch, 78 launches and 296 us of a
        captured decode step (H200, BENCHMARKS.md, seventeenth session). Costs compile time
        (two kernels per such reduction); nothing changes on CPU. Off by default: in the one
        run on an H200 (bench mode ``dejavu_captured_lazy_mk_pdl``, BENCHMARKS.md, nineteenth
        session) Inductor kept the loops, and the step was no faster (5.01 against 5.07 ms).
    inductor_pdl: Inductor's own Triton kernels (the fused residual adds and layer norms,
        the cache positions) launch with programmatic dependent launch, as the dejavu kernels
        do (``kernels/triton_common.py``): each may start while the kernel before it drains,
        waits for it before reading what it wrote, and lets the next start once its own
        inputs are read (Inductor's ``triton.enable_pdl``; Hopper or later, nothing changes
        on CPU). Every kernel between two dejavu ops of OPT-13B's captured step is
        Inductor's, and without it each of them waits for the one before to finish and holds
        the next back until it has finished too. None (the default): on wherever the dejavu
        kernels launch programmatically (``triton_common.programmatic``: Hopper or later,
        not in deterministic mode, not ``DEJAVU_PDL=0``) and this PyTorch's Inductor has the
        switch; True asks for it (an Inductor without the switch is then an error naming the
        version); False keeps Inductor's launches plain. On an H200, side by side, OPT-13B's
        captured step ran faster with it in all four rounds of two sessions (3.67, 3.65,
        3.67 and 3.87 ms against 3.78, 3.74, 3.73 and 3.91; bench modes
        ``dejavu_captured_qkv_ipdl_pdl`` and ``dejavu_captured_qkv_pdl`` as they were then),
        and Llama-3-8B's in one round (3.44 ms against 3.65 with no programmatic launch at
        all); its GPU tests on a small OPT step and a small Llama lookahead step pass
        (BENCHMARKS.md, thirty-second and thirty-third sessions).
    fuse_norm: a sparse MLP or head-gathered output projection whose output goes (through an
        inference dropout) into a residual add, and that sum into a layer norm with weight and
        bias (OPT's layers and its final norm), becomes ``dejavu::sparse_mlp_norm`` or
        ``dejavu::sparse_head_out_norm``, which return the sum and its norm
        (``passes/lower.py::fuse_norms``); so does Llama's RMS norm, unless option
        ``fuse_rms_norm`` (below) is False. Anything else (Gemma's norm) is left as it is and
        counted (``fuse_norm_skipped``). On CUDA (``kernels/triton_common.py``,
        ``DEJAVU_NORM_FINISH``) the op's reducing kernel leaves its fp32 sums unfinished (no
        counter, no last program) and one add-norm launch of ours follows
        (``add_norm_sums``: a row a program, held in registers, the norm's weight and bias
        loaded before its wait), which adds the op's bias, rounds, adds the residual,
        normalises and zeroes the sums, in place of the reducing kernel's finish and of
        Inductor's fused add and layer norm, which loops over a row of 5120 twice; with
        ``kernel`` the op finishes as without the norm and the add-norm launch reads its
        output; with ``last``, the reducing kernel's last programs normalise the row instead
        (``finish_norm_last``: one kernel fewer a norm). The norm's mean and variance are
        summed in another order than Inductor's, so the outputs can differ in their last
        bits; the CPU reference computes the same ops as the graph it replaces. On by default:
        on an H200 (BENCHMARKS.md, thirty-seventh session, bench modes
        ``dejavu_captured_qkv_normk_pdl`` and ``dejavu_captured_qkv_nonorm_pdl``, the latter
        as the default step was before) OPT-13B's step ran 3.54, 3.71, 3.67 and 3.58 ms with
        the add-norm launches (``kernel``) against 3.82, 3.81, 3.77 and 3.72 without the
        option, in four rounds side by side: 1.8 us a norm against Inductor's 2.6; with the
        sums finished there (``sums``, the default since the thirty-eighth session) 3.63,
        3.48 and 3.49 ms against 3.68, 3.69 and 3.71 with ``kernel``. The finish in the last
        programs was slower than either (thirty-sixth session: 3.88 and 3.74 ms against 3.63
        and 3.67 without; the finish, a chain of memory round trips, added 1.9-5.8 us to each
        call of the two kernels).
    fuse_rms_norm: Llama's RMS norm after a sparse op's residual add (Llama, Mistral, Qwen2,
        SmolLM2: ``w * (x * rsqrt(mean(x^2) + eps)).to(dtype)`` with x the sum in fp32) is
        fused as ``fuse_norm`` fuses a layer norm (``passes/lower.py::_rms_norm_of``; the ops
        get ``rms=True``): on CUDA the add-norm launch computes that norm, rounding where the
        module does, and finishes the reducing kernel's sums as for a layer norm; on CPU the
        reference computes the module's own ops. Gemma's norm (``1 + w`` in fp32, applied to
        the op's output before the residual add) is no match and is left alone. None (the
        default) follows ``fuse_norm``; True needs ``fuse_norm``. On with ``fuse_norm`` since
        the thirty-ninth session: on an H200 Llama-3-8B's captured step (MLP 0.5, attention
        dense; bench modes ``dejavu_captured_ahead_rms_pdl`` and
        ``dejavu_captured_ahead_normi_pdl``, the latter as the default step was before) ran
        3.37, 3.36, 3.35 and 3.35 ms with it against 3.43, 3.43, 3.42 and 3.42 without, in
        four rounds side by side, and 3.56 against 3.46 in a fifth, the first on a fresh
        machine; the down kernel took 45 us a step less, its finish gone (BENCHMARKS.md,
        thirty-ninth session). On the real SmolLM2 on CPU the held-out perplexity was the
        same with and without it (21.39).
    shipped_configs: on a CUDA GPU whose model has a file in ``kernels/tuned/`` (named after
        ``torch.cuda.get_device_name``), the Triton kernels start from the configs it holds for
        their shapes instead of autotuning those (``kernels.tuning.seed_shipped``); other shapes
        still tune, and a config already chosen in the process is kept. The autotuner times a
        kernel alone, and inside a decode step its choice can be far from the fastest: on an
        H200 the OPT-13B down projection at MLP density 0.1 took 1366 us a step with the
        autotuner's tile against 564 us with the shipped one (BENCHMARKS.md, nineteenth
        session, two calls). The H200 file covers the OPT-13B shape at MLP 0.1 and heads 0.5. On by
        default; nothing changes on CPU.
    dump_dir: a folder that receives each graph before and after every pass, as readable
        Python (``graph{N}_{step}_{pass}.py``), for debugging the passes. The environment
        variable ``DEJAVU_DUMP_DIR`` sets it when the option is not given.
    """

    version: int = 1
    profile: Any = None
    selector: str | None = None
    mlp_density: float | None = None
    attention_density: float | None = None
    attention_granularity: str = DEFAULT_GRANULARITY
    dense_layers: tuple[int, ...] = ()
    inner: str = DEFAULT_INNER
    cudagraphs: bool = False
    lookahead: bool | None = None
    relayout: str = DEFAULT_RELAYOUT
    out_layout: str = DEFAULT_OUT_LAYOUT
    fuse_linears: bool = True
    batch_selection: str = DEFAULT_BATCH_SELECTION
    fold_predictors: bool = False
    dense_gemv: bool | None = None
    decode_attention: str = DEFAULT_DECODE_ATTENTION
    reorder_for_locality: bool = False
    workspaces: bool = True
    merge_attention: bool = False
    decode_selected_heads: bool | None = None
    graph_splits: tuple[int, ...] = ()
    lazy_kv: bool = False
    fuse_qkv: bool = True
    batch_positions: bool = False
    positions_from_length: bool = False
    multi_kernel: bool = False
    inductor_pdl: bool | None = None
    fuse_norm: bool = True
    fuse_rms_norm: bool | None = None
    shipped_configs: bool = True
    dump_dir: str | None = None

    def __post_init__(self) -> None:
        if self.version != 1:
            raise ValueError(f"unsupported options version {self.version}; this build reads 1")
        for f in dataclasses.fields(self):  # a switch given as "no" or 0 would read as on or off
            value = getattr(self, f.name)
            if f.type in ("bool", "bool | None") and not (
                    isinstance(value, bool) or (value is None and f.type == "bool | None")):
                allowed = "True or False" + (" or None" if f.type == "bool | None" else "")
                raise TypeError(f"option {f.name!r} must be {allowed}, got {value!r}")
        if self.selector is not None and self.selector not in SELECTORS:
            raise ValueError(f"option 'selector' must be one of {SELECTORS}, got {self.selector!r}")
        _check_density("mlp_density", self.mlp_density)
        _check_density("attention_density", self.attention_density)
        if self.attention_granularity not in GRANULARITIES:
            raise ValueError(
                f"option 'attention_granularity' must be one of {GRANULARITIES}, "
                f"got {self.attention_granularity!r}"
            )
        if self.fuse_rms_norm and not self.fuse_norm:
            raise ValueError("option 'fuse_rms_norm' needs fuse_norm=True (left None, it "
                             "follows fuse_norm)")
        if self.fold_predictors and not self.fuse_linears:
            raise ValueError("option 'fold_predictors' needs fuse_linears=True")
        if self.batch_selection not in BATCH_SELECTIONS:
            raise ValueError(f"option 'batch_selection' must be one of {BATCH_SELECTIONS}, "
                             f"got {self.batch_selection!r}")
        if self.relayout not in RELAYOUTS:
            raise ValueError(f"option 'relayout' must be one of {RELAYOUTS}, got {self.relayout!r}")
        if self.out_layout not in OUT_LAYOUTS:
            raise ValueError(f"option 'out_layout' must be one of {OUT_LAYOUTS}, "
                             f"got {self.out_layout!r}")
        if self.decode_attention not in DECODE_ATTENTIONS:
            raise ValueError(f"option 'decode_attention' must be one of {DECODE_ATTENTIONS}, "
                             f"got {self.decode_attention!r}")
        if self.inner not in INNER_COMPILERS:
            raise ValueError(f"option 'inner' must be one of {INNER_COMPILERS}, got {self.inner!r}")
        object.__setattr__(self, "dense_layers", tuple(int(i) for i in self.dense_layers))
        splits = self.graph_splits
        if isinstance(splits, (str, bytes)) or not all(
                isinstance(i, int) and not isinstance(i, bool) and i >= 1 for i in splits):
            raise ValueError(f"option 'graph_splits' must be layer numbers >= 1, got {splits!r}")
        object.__setattr__(self, "graph_splits", tuple(sorted(set(splits))))
        if self.graph_splits and self.inner != "inductor":
            raise ValueError("option 'graph_splits' needs inner='inductor'")
        if self.cudagraphs and self.inner != "inductor":
            raise ValueError("option 'cudagraphs' needs inner='inductor'")
        if self.profile is None:
            if self.selector is None:
                raise ValueError(
                    "backend 'dejavu' needs options={'profile': 'profiles/NAME.yaml'} or, for an "
                    "experiment without one, options={'selector': 'oracle', 'mlp_density': 0.5}"
                )
            if self.selector == "predictor":
                raise ValueError("selector 'predictor' needs a profile with predictor weights")
            if self.selector in ("gate", "threshold") and self.attention_density is not None:
                raise ValueError(f"selector {self.selector!r} is for MLP blocks; it has no "
                                 "attention form (leave attention_density unset)")
            if self.lookahead:
                raise ValueError("option 'lookahead' needs a profile whose predictors were "
                                 "calibrated with lookahead (dejavu calibrate --lookahead)")
        elif self.mlp_density is not None or self.attention_density is not None:
            raise ValueError(
                "give either a profile or mlp_density/attention_density, not both: "
                "the profile sets per-layer densities"
            )

    @property
    def rms_norms_fused(self) -> bool:
        """Whether the lower pass fuses Llama's RMS norms: ``fuse_rms_norm``, or when that is
        None, ``fuse_norm``."""
        return self.fuse_norm if self.fuse_rms_norm is None else self.fuse_rms_norm

    @classmethod
    def from_mapping(cls, options: Mapping[str, Any] | None) -> DejavuOptions:
        """Build options from the ``options`` dict of ``torch.compile``; unknown keys are errors."""
        options = dict(options or {})
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(options) - known)
        if unknown:
            raise ValueError(f"unknown dejavu option(s) {unknown}; known: {sorted(known)}")
        return cls(**options)


@dataclass
class Counters:
    """Rewrite counts, printed with the compile report."""

    values: dict[str, int] = field(default_factory=dict)

    def add(self, key: str, n: int = 1) -> None:
        self.values[key] = self.values.get(key, 0) + n
