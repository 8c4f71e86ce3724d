"""Context parallelism: every sequence split over the cp ranks of a stage, for the whole model.

A rank runs the model's program exported for its own tokens: 2 chunks of each sequence, chunk r
and chunk 2cp-1-r of 2cp equal chunks (load-balanced causal attention, context_attention.py).
Almost every op of a transformer is the same on fewer tokens; what is not is found by comparing
the model exported at the rank's length L with an export at another length (L/2, or 2L where L
is under 4; `find_sequence_split`): a dim whose size changes with the length is a sequence dim,
in any op, whatever its size happens to equal. The other length is the shorter one where it can
be: at the model's full length a slice of a buffer of that length ([:L] of BERT's token types) is
no slice, and the export leaves it out. Then:

- positions: an `arange(0, L)` (a position embedding's ids, HuggingFace's cache positions) is
  rewritten into the rank's true positions, and a slice [0:L] of a table along a dim that is not
  the sequence's (Llama's rotary tables) into the slices of the rank's 2 chunks;
- attention (scaled_dot_product_attention, or autopar::attention with soft-capped scores or
  sinks; causal or not, without a mask or with autopar's sliding-window or padding mask: it keeps
  the window, and hands the [batch, tokens] padding, split like the tokens, to the attention)
  runs over the cp group as a ring or an all-to-all (the stage's `cp_kind`; context_attention.py);
- a running count along the sequence (`cumsum` of integers: OPT's and RoBERTa's positions from
  the attention mask) gets the counts of the chunks before each of the rank's own
  (context_scan.py);
- anything else that mixes tokens along the sequence refuses the split, naming the op and why: an
  explicit attention mask (padding, masks the model builds), attention written as its own matmul
  and softmax, a reduction, a cumulative op over values that take gradients, a convolution or
  batch norm over the sequence, a token selected from it (a pooler's first token); so does a
  model whose outputs do not keep the sequence on dim 1 (the targets are split there) or whose
  graph changes with the length.
Mixture-of-experts layers (found by structure, experts.py) sort and gather their routed rows along
the tokens, but under dropless top-k routing each token's output depends on that token alone:
their dispatch, experts and combine run on a rank's tokens as they are (`token_wise_nodes`), and
expert parallelism composes with the split (the experts' ranks are carved out of dp x cp x tp).

Weight gradients are each rank's gradients of its tokens' mean loss; the runtime averages them
over the dp x cp ranks as over data-parallel replicas (FSDP2 over both), which is the gradient of
the whole sequences' mean when every rank holds as many tokens (it does: 2 chunks each).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import fx, nn
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError
from autopar.models import capped_attention  # noqa: F401  (autopar::attention)
from autopar.models.hf_attention import padding_mask, sliding_window_mask
from autopar.passes.context_attention import ContextParallelAttention
from autopar.passes.context_scan import SequenceCumsum, counted
from autopar.passes.experts import token_wise_nodes
from autopar.passes.program import PassTarget, StageProgram

aten = torch.ops.aten
ATTENTION = {aten.scaled_dot_product_attention.default: False,              # op -> returns lse
             aten._scaled_dot_product_flash_attention_for_cpu.default: True,
             torch.ops.autopar.attention.default: False}         # soft-capped scores, sinks
SLIDING_WINDOW_MASK = sliding_window_mask._opoverload
PADDING_MASK = padding_mask._opoverload
ARANGES = (aten.arange.default, aten.arange.start, aten.arange.start_step)
# ops whose `dim` (or `dims`) argument names the dims they mix values along
MIXING_AT_DIM = {aten._softmax.default, aten.softmax.int, aten._log_softmax.default,
                 aten.log_softmax.int, aten.cumsum.default, aten.cumprod.default,
                 aten.logcumsumexp.default, aten.sum.dim_IntList, aten.mean.dim, aten.amax.default,
                 aten.amin.default, aten.max.dim, aten.min.dim, aten.argmax.default,
                 aten.argmin.default, aten.var.correction, aten.std.correction,
                 aten.logsumexp.default, aten.prod.dim_int, aten.sort.default, aten.topk.default,
                 aten.select.int, aten.index_select.default, aten.gather.default, aten.flip.default,
                 aten.roll.default, aten.linalg_vector_norm.default}
# ops that mix every dim of their input but the channels (batch norm) or reduce all of them
MIXING_ALL = {aten.sum.default, aten.mean.default, aten.max.default, aten.min.default,
              aten._native_batch_norm_legit.default, aten._native_batch_norm_legit_no_training.default,
              aten._native_batch_norm_legit_functional.default, aten.native_batch_norm.default,
              aten.batch_norm.default}
# matrix products: they sum over the first input's last dim
CONTRACTING = {aten.mm.default, aten.bmm.default, aten.matmul.default, aten.linear.default,
               aten.addmm.default, aten.baddbmm.default}
CONVOLUTIONS = {aten.convolution.default, aten.conv1d.default, aten.conv2d.default,
                aten.conv1d.padding, aten.conv2d.padding}


# What the split rewrites, marked on the nodes of the program (`node.meta[MARK]`), so that the
# copies the stage split makes of a constant (a table's slice in every layer that reads it)
# carry the mark with them.
MARK = "autopar_context_parallel"
POSITIONS, TABLE, ATTENTION_CALL, SCAN = "positions", "table", "attention", "scan"


@dataclass(frozen=True, kw_only=True, slots=True)
class SequenceSplit:
    """A program's sequence split over `cp` ranks of 2 chunks of `chunk` tokens each, its nodes
    marked with what becomes of them: arange(0, L) position ids, slices [0:L] of tables indexed
    by position, attention calls (with their causal flag, scale and whether they return the
    log-sum-exp)."""
    cp: int
    chunk: int
    marked: dict[str, tuple] = field(default_factory=dict)     # node name -> its mark


def sequence_dims(short: fx.GraphModule, long: fx.GraphModule) -> dict[str, frozenset[int]]:
    """Node name -> the dims of its tensor value whose size differs between two exports of the
    same model at different sequence lengths (one tensor per node; others left out). The two
    graphs must have the same nodes, or the model is refused."""
    theirs = {node.name: node for node in long.graph.nodes}
    mine = {node.name for node in short.graph.nodes}
    if mine != set(theirs):
        odd = sorted(mine ^ set(theirs))[:4]
        raise AutoparError(f"context parallelism: the model's graph changes with the sequence length "
                           f"(nodes {odd} exist at one length only), so autopar cannot tell how to "
                           f"split its sequence; use cp=1")
    found = {}
    for node in short.graph.nodes:
        a, b = node.meta.get("val"), theirs[node.name].meta.get("val")
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.dim() == b.dim():
            found[node.name] = frozenset(d for d in range(a.dim()) if a.shape[d] != b.shape[d])
    return found


def find_sequence_split(short: fx.GraphModule, long: fx.GraphModule, cp: int) -> SequenceSplit:
    """The rewrites that split `short` (the model's program for a rank's 2 chunks) over `cp` ranks,
    found against `long` (the same model at another length); AutoparError naming the op and the
    reason where the model cannot be split on its sequence (module docstring)."""
    seq = sequence_dims(short, long)
    length = _local_length(short, seq)
    live = _live(short)
    # a MoE layer's dispatch, experts and combine reorder rows, yet each token's output is its own
    routed = token_wise_nodes(short)
    # attention first: a model's mask is the reason to name, not the ops that build it
    marked = {node.name: (ATTENTION_CALL, *_attention(node, seq)) for node in live
              if node.op == "call_function" and node.target in ATTENTION}
    for node in live:
        if node.op != "call_function" or node.name in marked or node.name in routed:
            continue
        if node.target in ARANGES and 0 in seq.get(node.name, ()):
            _check_positions(node, length)
            marked[node.name] = (POSITIONS,)
        elif node.target is aten.slice.Tensor and _sliced_dim(node) in seq.get(node.name, ()):
            if _table_slice(node, seq, length):
                marked[node.name] = (TABLE,)
        elif _splittable_scan(node, seq, length):
            marked[node.name] = (SCAN,)
        else:
            _refuse_mixing(node, seq)
    if not any(mark[0] == ATTENTION_CALL for mark in marked.values()):
        raise AutoparError("context parallelism splits attention over the sequence, and this model "
                           "has no scaled_dot_product_attention call; use cp=1")
    _check_outputs(short, seq)
    for node in short.graph.nodes:
        if node.name in marked:
            node.meta[MARK] = marked[node.name]
    return SequenceSplit(cp=cp, chunk=length // 2, marked=marked)


def _live(program: fx.GraphModule) -> list[fx.Node]:
    """The nodes whose values reach the outputs or an op with an effect (a buffer's update), in
    graph order: what the stage split keeps (a mask built and never read is not looked at)."""
    reached = set()
    pending = [node for node in program.graph.nodes if node.op == "output" or node.is_impure()]
    while pending:
        node = pending.pop()
        if node not in reached:
            reached.add(node)
            pending.extend(node.all_input_nodes)
    return [node for node in program.graph.nodes if node in reached]


def _local_length(program: fx.GraphModule, seq: dict) -> int:
    """The tokens of a rank: dim 1 of the first input, which must be a sequence dim."""
    first = next(n for n in program.graph.nodes if n.op == "placeholder")
    value = first.meta.get("val")
    if not isinstance(value, torch.Tensor) or value.dim() < 2 or 1 not in seq.get(first.name, ()):
        raise AutoparError("context parallelism splits the sequence on dim 1 of the model's first "
                           "input ([batch, seq] token ids), which this model's is not; use cp=1")
    return value.shape[1]


def _describe(node: fx.Node) -> str:
    stack = node.meta.get("nn_module_stack") or {}
    where = list(stack.values())[-1][0] if stack else "the model's forward"
    return f"{node.target} ({node.name}, in {where or 'the model'})"


def _splittable_scan(node: fx.Node, seq: dict, length: int) -> bool:
    """A running count along the sequence (context_scan.py), which the split computes exactly:
    over a dim after the batch that holds the rank's tokens alone (not tokens flattened with the
    batch, whose 2 chunks are not its halves), of values that take no gradient (integers, or
    floats made from constants and integers alone, as OPT's mask of ones)."""
    if node.target is not aten.cumsum.default:
        return False
    source = node.args[0]
    value = source.meta["val"]
    dims = _dims(_dim_argument(node), value.dim())
    along = dims & seq.get(source.name, frozenset())
    return bool(along) and all(d > 0 and value.shape[d] == length for d in along) \
        and _without_gradient(source)


def _without_gradient(value: fx.Node) -> bool:
    """Whether no gradient flows into `value`: it holds counts (context_scan.counted), or every
    value it is computed from does, or is a constant; not a parameter or a float input."""
    pending, seen = [value], set()
    while pending:
        node = pending.pop()
        if node in seen:
            continue
        seen.add(node)
        val = node.meta.get("val")
        if isinstance(val, torch.Tensor) and counted(val):
            continue
        if node.op in ("placeholder", "get_attr") or (node.op == "call_module" and not node.args):
            return False
        pending.extend(node.all_input_nodes)
    return True


def _check_positions(node: fx.Node, length: int) -> None:
    start, end, step = _arange_bounds(node)
    if (start, end, step) != (0, length, 1):
        raise AutoparError(f"context parallelism: {_describe(node)} counts {start}..{end} by {step}, "
                           f"a range that follows the sequence length but is not the positions "
                           f"0..{length - 1} autopar can give each rank; use cp=1")


def _arange_bounds(node: fx.Node) -> tuple:
    if node.target is aten.arange.default:
        return 0, node.args[0], 1
    step = node.args[2] if len(node.args) > 2 else 1
    return node.args[0], node.args[1], step


def _sliced_dim(node: fx.Node) -> int:
    value = node.meta["val"]
    dim = node.args[1] if len(node.args) > 1 else 0
    return dim % value.dim() if value.dim() else 0


def _table_slice(node: fx.Node, seq: dict, length: int) -> bool:
    """Whether a slice whose output follows the sequence takes a table's first L rows (a position
    table: True), or is a no-op on a value that already has the sequence (False); any other cut
    of the sequence refuses."""
    source, dim = node.args[0], _sliced_dim(node)
    start = node.args[2] if len(node.args) > 2 else 0
    step = node.args[4] if len(node.args) > 4 else 1
    if dim in seq.get(source.name, ()):
        if source.meta["val"].shape[dim] == node.meta["val"].shape[dim]:
            return False    # the whole sequence: nothing is cut
        raise AutoparError(f"context parallelism: {_describe(node)} keeps part of the sequence, "
                           f"which each rank holds only 2 chunks of; use cp=1")
    if start not in (0, None) or step != 1 or node.meta["val"].shape[dim] != length:
        raise AutoparError(f"context parallelism: {_describe(node)} takes rows {start}.. of a table "
                           f"by the sequence length, not the positions 0..{length - 1}; use cp=1")
    return True


def _attention(node: fx.Node, seq: dict) -> tuple[bool, float | None, bool, int | None, float]:
    """(causal, scale, returns lse, sliding window, softcap) of an attention call that the split
    can run (softcap 0: none)."""
    returns_lse = ATTENTION[node.target]
    schema = [argument.name for argument in node.target._schema.arguments]
    given = {**dict(zip(schema, node.args)), **node.kwargs}
    window, mask = None, given.get("attn_mask")
    if isinstance(mask, fx.Node) and mask.target in (SLIDING_WINDOW_MASK, PADDING_MASK):
        window, causal, keep = _own_mask(mask)
        if keep is not None and seq.get(keep.name) != frozenset({1}):
            raise AutoparError(f"context parallelism: the attention_mask of {_describe(node)} does "
                               f"not hold the sequence on dim 1 alone; use cp=1")
        given["attn_mask"], given["is_causal"] = None, causal
    if given.get("attn_mask") is not None:
        raise AutoparError(f"context parallelism: {_describe(node)} takes an explicit mask the model "
                           f"builds (HuggingFace models build one whenever torch.export traces them), "
                           f"which autopar cannot split over the sequence; use "
                           f"autopar.models.hf_attention.causal_sdpa(model), whose causal, "
                           f"sliding-window and padding masks it splits, or cp=1")
    if given.get("dropout_p", 0.0):
        raise AutoparError(f"context parallelism: {_describe(node)} drops attention weights "
                           f"(dropout_p={given['dropout_p']}); autopar splits attention without "
                           f"dropout only: set the model's attention dropout to 0, or use cp=1")
    for name in ("query", "key", "value"):
        value = given[name]
        rank = value.meta["val"].dim()
        if seq.get(value.name) != frozenset({rank - 2}):
            raise AutoparError(f"context parallelism: the {name} of {_describe(node)} does not hold "
                               f"the sequence on its tokens' dim alone; use cp=1")
    return (bool(given.get("is_causal", False)), given.get("scale"), returns_lse, window,
            given.get("softcap", 0.0))


def _own_mask(mask: fx.Node) -> tuple[int | None, bool, fx.Node | None]:
    """(window, causal, the [batch, tokens] padding input or None) of a mask made by autopar's
    sliding_window_mask or padding_mask (autopar.models.hf_attention), which the split computes
    from every token's true position."""
    schema = [argument.name for argument in mask.target._schema.arguments]
    given = {**dict(zip(schema, mask.args)), **mask.kwargs}
    if mask.target is SLIDING_WINDOW_MASK:
        return given["window"], True, None
    return given.get("window"), given["causal"], given["keep"]


def _refuse_mixing(node: fx.Node, seq: dict) -> None:
    """Refuse an op that mixes values along a sequence dim of one of its inputs."""
    inputs = [value for value in node.args if isinstance(value, fx.Node)]
    carried = [seq.get(value.name, frozenset()) for value in inputs]
    if not any(carried):
        return
    first = carried[0] if inputs and inputs[0] is node.args[0] else frozenset()
    reason = None
    if node.target in MIXING_AT_DIM and first:
        dims = _dims(_dim_argument(node), node.args[0].meta["val"].dim())
        softmax = "softmax" in str(node.target)
        reason = None if not dims & first else \
            ("takes a softmax over the sequence (attention written as its own matmul and softmax? "
             "scaled_dot_product_attention can be split)" if softmax else "works along the sequence")
    elif node.target in MIXING_ALL and first:
        reason = "reduces over the sequence"
    elif node.target in CONTRACTING:
        rank = node.args[0].meta["val"].dim()
        reason = "sums over the sequence (attention written as its own matmul and softmax?)" \
            if rank - 1 in first else None
    elif node.target in CONVOLUTIONS and first - {0, 1}:
        reason = "convolves along the sequence"
    elif node.target is aten.constant_pad_nd.default and first:
        padded = {node.args[0].meta["val"].dim() - 1 - i // 2 for i, p in enumerate(node.args[1]) if p}
        reason = "pads the sequence" if padded & first else None
    if reason is not None:
        raise AutoparError(f"context parallelism: {_describe(node)} {reason}, which each rank "
                           f"holds only 2 chunks of; this model cannot be split on its sequence: "
                           f"use cp=1")


def _dim_argument(node: fx.Node):
    """The value of an op's `dim` or `dims` argument, as given or by its schema's default."""
    for index, argument in enumerate(node.target._schema.arguments):
        if argument.name in ("dim", "dims"):
            if index < len(node.args):
                return node.args[index]
            return node.kwargs.get(argument.name, argument.default_value)
    return None


def _dims(dim, rank: int) -> frozenset[int]:
    """The dims an op's `dim` argument names (None or []: all of them)."""
    if dim is None or dim == []:
        return frozenset(range(rank))
    dims = dim if isinstance(dim, (list, tuple)) else [dim]
    return frozenset(d % rank for d in dims)


def _check_outputs(program: fx.GraphModule, seq: dict) -> None:
    """The model's tensor outputs keep the sequence on dim 1, where the targets are split."""
    output = next(n for n in program.graph.nodes if n.op == "output")
    for value in _flat_nodes(output.args):
        if isinstance(value.meta.get("val"), torch.Tensor) and 1 not in seq.get(value.name, ()):
            raise AutoparError(f"context parallelism: the model's output {value.name} of shape "
                               f"{list(value.meta['val'].shape)} does not keep the sequence on dim 1, "
                               f"where autopar splits the targets (a pooled or classification "
                               f"output); use cp=1")


def _flat_nodes(args) -> list[fx.Node]:
    found = []
    fx.node.map_arg(args, found.append)
    return found


def split_sequence(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage's positions and attention rewritten for this rank's 2 chunks (module docstring)."""
    stage = plan.stages[program.index]
    split = target.sequence_split
    if stage.cp == 1 or split is None:
        return program
    rows = ChunkRows(_chunks(split, target.cp_rank))
    for graph_module in [m for m in program.module.modules() if isinstance(m, fx.GraphModule)]:
        for node in list(graph_module.graph.nodes):
            mark = node.meta.get(MARK, ("",)) if node.op == "call_function" else ("",)
            if mark[0] == POSITIONS:
                _rewrite(graph_module, node, _positions(graph_module, node, split, target.cp_rank))
            elif mark[0] == TABLE:
                _rewrite(graph_module, node, _table_rows(graph_module, node, rows))
            elif mark[0] == SCAN:
                if not hasattr(graph_module, "context_cumsum"):
                    graph_module.add_submodule("context_cumsum", SequenceCumsum(
                        target.cp_group, target.cp_rank, stage.cp))
                node.op, node.target = "call_module", "context_cumsum"
            elif mark[0] == ATTENTION_CALL:
                causal, scale, returns_lse, window, softcap = mark[1:]
                name = f"context_{node.name}"
                graph_module.add_submodule(name, ContextParallelAttention(
                    stage.cp_kind, target.cp_group, causal=causal, scale=scale,
                    returns_lse=returns_lse, window=window, softcap=softcap))
                keep = _padding_of(node)
                # autopar::attention's per-head sink logits
                sinks = node.args[8] if node.target is torch.ops.autopar.attention.default else None
                node.op, node.target, node.kwargs = "call_module", name, {}
                # both kinds move the kv heads before grouped-query attention repeats them:
                # the ring passes them, the all-to-all splits them (autopar.plans.head_split)
                node.args = (node.args[0], *(before_repeat(value) for value in node.args[1:3]))
                node.args += (keep, sinks) if sinks is not None else (keep,) if keep is not None else ()
        graph_module.graph.eliminate_dead_code()       # the repeats the attention no longer reads
        graph_module.graph.lint()
        graph_module.recompile()
    return program


def _padding_of(node: fx.Node) -> fx.Node | None:
    """The [batch, tokens] padding input of an attention call masked by autopar's padding_mask."""
    mask = node.kwargs.get("attn_mask", node.args[3] if len(node.args) > 3 else None)
    return _own_mask(mask)[2] if isinstance(mask, fx.Node) and mask.target is PADDING_MASK else None


_REPEAT_STEPS = {aten.reshape.default, aten.view.default, aten._unsafe_view.default,
                 aten.clone.default, aten.expand.default}


def before_repeat(value: fx.Node) -> fx.Node:
    """The keys or values an attention call reads, before grouped-query attention repeated their
    heads (`x[:, :, None].expand(b, kv, g, s, d).reshape(b, kv * g, s, d)`, as Llama and
    HuggingFace's repeat_kv write it): the ring then passes the kv heads and the all-to-all
    splits them, g times fewer bytes, and ContextParallelAttention repeats them on arrival, each
    g times in a row as here. The value itself where it was not repeated so."""
    node = value
    while node.op == "call_function" and node.target in _REPEAT_STEPS:
        if node.target is aten.expand.default:
            source = node.args[0]
            if source.op != "call_function" or source.target is not aten.unsqueeze.default \
                    or source.args[1] != 2 or not isinstance(source.args[0], fx.Node):
                return value
            kept, whole = source.args[0].meta["val"].shape, value.meta["val"].shape
            repeated = len(kept) == 4 and len(whole) == 4 and whole[1] % kept[1] == 0 and \
                (kept[0], kept[2], kept[3]) == (whole[0], whole[2], whole[3])
            return source.args[0] if repeated else value
        node = node.args[0]
    return value


def _chunks(split: SequenceSplit, rank: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The [start, stop) of this rank's 2 chunks."""
    c = split.chunk
    return (rank * c, (rank + 1) * c), ((2 * split.cp - 1 - rank) * c, (2 * split.cp - rank) * c)


def _positions(graph_module: fx.GraphModule, node: fx.Node, split: SequenceSplit, rank: int) -> fx.Node:
    """arange(0, L) -> cat(arange(chunk r), arange(chunk 2cp-1-r))."""
    graph = graph_module.graph
    parts = []
    with graph.inserting_before(node):
        for start, stop in _chunks(split, rank):
            part = graph.call_function(aten.arange.start, (start, stop), dict(node.kwargs))
            part.meta["val"] = node.meta["val"].narrow(0, 0, split.chunk)
            parts.append(part)
        return graph.call_function(aten.cat.default, (parts,))


MADE_TABLES = 8     # a stage's tables (rotary cos and sin, in one dtype or two)


class ChunkRows(nn.Module):
    """table[0:L] on dim d -> cat(table[chunk r], table[chunk 2cp-1-r]) on dim d, made once for
    every layer that reads the table: each layer's program slices the stage's rotary tables
    itself, and a copy made per layer would be kept by each layer's rotary product for its
    backward, per micro-batch in flight. A table that takes a gradient is cut at every call."""

    def __init__(self, chunks: tuple):
        super().__init__()
        self.chunks = chunks
        self._made: dict = {}       # (the table's storage and view, dim) -> (table, its rows)

    def forward(self, table: torch.Tensor, dim: int) -> torch.Tensor:
        # each layer may read the table through a tensor of its own (a DTensor's wrapper, a
        # view): the same storage, view and version are the same table
        local = table.to_local() if isinstance(table, DTensor) else table
        key = (local.untyped_storage()._cdata, local.storage_offset(), tuple(local.shape),
               local.stride(), local._version, dim)
        if key in self._made:
            return self._made[key][1]
        rows = torch.cat([table.narrow(dim, start, stop - start) for start, stop in self.chunks], dim)
        if not table.requires_grad:     # held, so that its storage is not reused meanwhile
            if len(self._made) >= MADE_TABLES:
                self._made.clear()
            self._made[key] = (table, rows)
        return rows


def _table_rows(graph_module: fx.GraphModule, node: fx.Node, rows: ChunkRows) -> fx.Node:
    """The stage's `ChunkRows` in place of a table's slice."""
    if not hasattr(graph_module, "context_table_rows"):
        graph_module.add_submodule("context_table_rows", rows)
    with graph_module.graph.inserting_before(node):
        return graph_module.graph.call_module("context_table_rows", (node.args[0], _sliced_dim(node)))


def _rewrite(graph_module: fx.GraphModule, node: fx.Node, replacement: fx.Node) -> None:
    replacement.meta["val"] = node.meta["val"]
    node.replace_all_uses_with(replacement)
    graph_module.graph.erase_node(node)


__all__ = ["SequenceSplit", "find_sequence_split", "sequence_dims", "split_sequence"]
