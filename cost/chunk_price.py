"""What one chunk of a pipeline costs one of its devices per micro-batch: the estimator's
per-op pricing (cost/estimator.py describes the whole model).

Every op's forward and backward by roofline (cost/compute.py), its tensor-parallel collectives,
the forward again where a recomputed region reruns it, what it keeps for backward. An op's price
does not depend on the chunk that holds it, so `node_prices` prices every op of a layout once
(per micro-batch size and attention kernel) and a chunk sums its ops' prices: a planner that
prices a thousand stage splits of the same layers pays for each op once."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING

import sympy

from autopar.cost.collectives import Group
from autopar.cost.context import context_parallel_time, swapped_bytes
from autopar.cost.experts import exchange_time
from autopar.cost.compute import (BACKWARD, Efficiencies, attention_kernels, compute_time,
                                  gemm_utilization)
from autopar.cost.layout import GraphLayout, NodeLayout
from autopar.plans.vocabulary import DTYPE_BYTES, ContextParallel, Recompute
from autopar.plans.zero import partial_gradient_reductions
from autopar.cost.mesh import Mesh
from autopar.cost.stages import StageSpec, group_elements, selective_region
from autopar.cost.memory import GATHERED_GROUPS
from autopar.graph import Graph

if TYPE_CHECKING:
    from autopar.cost.chunk_shape import ChunkShape

# Of an op with parameters, the share of its backward that computes the weight gradient (dW, as
# long as dX): the half a zero-bubble schedule moves into the bubble.
WEIGHT_SHARE_OF_BACKWARD = 0.5


@dataclass(kw_only=True, slots=True)
class Chunk:
    """What one chunk costs one of its devices for one micro-batch."""
    forward_s: float = 0.0
    backward_s: float = 0.0
    recompute_s: float = 0.0
    tensor_comm_s: float = 0.0
    exchange_s: float = 0.0         # experts' dispatch and combine all-to-alls (cost/experts.py)
    send_s: float = 0.0
    host_s: float = 0.0             # the runtime's machinery on the host (cost/host.py)
    casts_s: float = 0.0            # 16-bit compute's casts of fp32 master weights (cost/master_weights.py)
    gradient_casts_s: float = 0.0   # of which the gradients', in the weight backward
    weight_backward_s: float = 0.0  # the weight-gradient half of backward_s (zero-bubble's W)
    autograd_ops: int = 0           # ops the backward differentiates (nodes of the autograd graph)
    recomputed_regions: int = 0     # checkpointed regions (a block under full, its attention under selective)
    recomputed_ops: int = 0         # the ops in them that the backward differentiates
    recomputed_flops: float = 0.0   # per sample, whole model (unsharded), forwards run twice
    rerun_attention: tuple = ()     # attention ops whose forward the backward reruns, and with it
                                    # their context-parallel exchanges (cost/rank_traffic.py)
    params: float = 0.0             # elements on this device
    expert_params: float = 0.0      # of which experts' (cost/experts.py), sharded over their own group
    padding: tuple = (0.0, 0.0)     # elements FSDP2 pads ZeRO's shards with: dense, experts (cost/padding.py)
    experts_by_rows: float = 0.0    # share of its experts FSDP2 shards on a later dim (price_cache)
    gathered: float = 0.0           # elements of its GATHERED_GROUPS largest FSDP groups
    group: float = 0.0              # elements of its largest FSDP group
    reduce_order: tuple = ()        # its FSDP groups as the step's one reduction meets them (cost/step_reduce.py)
    largest: float = 0.0            # elements of its largest parameter tensor
    tensors: int = 0                # parameter tensors on this device
    saved_per_sample: float = 0.0   # activation bytes kept per sample
    peak_per_sample: float = 0.0    # extra bytes live while the backward runs (recomputed region)
    loss_per_sample: float = 0.0
    # The same three as polynomials in the sequence length over the captured one, {power: bytes}
    # (the peak one per recomputed region), for memory at another sequence length.
    saved_poly: dict = field(default_factory=dict)
    peak_polys: list = field(default_factory=list)
    loss_poly: dict = field(default_factory=dict)      # elements of the outputs (logits)
    flowing_poly: dict = field(default_factory=dict)   # gradient bytes its backward adds
    split_flowing_poly: dict = field(default_factory=dict)     # its input backward's (zero-bubble)
    split_whole_polys: tuple = ()   # ((poly, elements), ...): its moments at weights read whole
    # bytes of the weights read whole that a split backward gathers again, by collective kind
    regathered: dict = field(default_factory=dict)
    paired_polys: tuple = ()        # ((poly, weight elements), ...): each with the gradients it makes
    moments: tuple = ()             # the same op by op, with FSDP2's reductions (cost/backward_moments.py)
    last_gathered: float = 0.0      # elements of the FSDP group its forward gathers last
    weight_read: float = 0.0        # elements of the largest weight an op reads
    sent_poly: dict = field(default_factory=dict)      # activations it sends to the next chunk
    received_poly: dict = field(default_factory=dict)  # what it receives: inputs, outputs' gradients
    # What a micro-batch keeps from its input backward to its weight backward when a zero-bubble
    # schedule splits them: the gradient of every op that reads a weight, which that weight's
    # gradient needs (torch's stage_backward_input keeps them for stage_backward_weight), less
    # what the ops after the last of them kept: it detaches the outputs, and with them the graph
    # the weights' gradients do not reach (a capped score's tanh, the loss's copy).
    deferred_poly: dict = field(default_factory=dict)
    # bytes of the tensor-parallel collectives of one micro-batch, whole tensors (cost/layout.py),
    # by (kind, per sample): what `tensor_comm_s` prices, for cost/rank_traffic.py
    tensor_moved: dict = field(default_factory=dict)
    # fp32 bytes of the weight gradients tensor parallelism leaves as partial sums, by the kind
    # of their reduction (how often, and in which dtype: `partial_reductions`)
    step_moved: dict = field(default_factory=dict)
    # bytes per sample the rank puts into the experts' all-to-alls: each exchange's forward, its
    # backward and its recomputed forward (cost/rank_traffic.py)
    exchange_moved: float = 0.0
    # bytes per micro-batch of the per-expert row counts each dispatch exchanges first (int64)
    counts_moved: float = 0.0


@dataclass(frozen=True, slots=True)
class Pricing:
    """What node prices depend on beyond the layout and the stage: the balance of the experts'
    routing (cost/experts.py), the dtype the matmuls run in where it is not the activations'
    (FP8), and each attention's bytes for context parallelism (cost/context.py)."""
    routing_imbalance: float = 1.0
    gemm_dtype: str = ""
    attention_bytes: dict = field(default_factory=dict)
    deduplicated_dispatch: bool = False     # cost.experts.exchange_time


def node_prices(layout: GraphLayout, spec: StageSpec, mesh: Mesh, b: float, eff: Efficiencies,
                attention: str, pricing: Pricing = Pricing(),
                experts: dict | None = None) -> dict[str, tuple]:
    """Node name -> (forward s, backward s, forward collectives s, backward collectives s, bytes of
    unfused attention scores kept, expert all-to-alls s of the forward and of the backward)
    for `b` samples (a micro-batch's sequences, divided by the
    context-parallel degree: each rank holds 1/cp of every sequence), the same in whichever
    chunk holds it. An expert layer's ops pay the routing imbalance and their all-to-alls over
    the stage's ep ranks (`experts`: node -> its cost.experts.ExpertLayer); attention under
    context parallelism its ring or all-to-alls over the cp ranks (cost/context.py)."""
    device = mesh.device
    tp_group = Group.strided(mesh, spec.tp, 1)
    ep_group = Group.strided(mesh, spec.ep, 1) if spec.ep > 1 else None
    cp_group = Group.strided(mesh, spec.cp, spec.tp) if spec.cp > 1 else None
    distributed = spec.tp > 1      # the runtime's ops on DTensors (FSDP2 computes on plain ones)
    prices = {}
    for node in layout.nodes:
        forward, backward, kept = _kernels(node, b, attention, DTYPE_BYTES[layout.dtype],
                                           pricing.gemm_dtype)
        use = gemm_utilization(node.gemm[0] * b, node.gemm[1], device,
                               *node.gemm[2:]) if node.gemm else 1.0
        work = _heads_attended(node, pricing) if cp_group is not None else 1.0
        fwd = sum(compute_time(f * work, by * work, device, fam, dtype or layout.dtype,
                               efficiencies=eff, utilization=use) for fam, f, by, dtype in forward)
        bwd = sum(compute_time(f * work, by * work, device, fam, dtype or layout.dtype,
                               efficiencies=eff, utilization=use) for fam, f, by, dtype in backward)
        if distributed:
            fwd += eff.distributed_op_latency_s
            bwd += eff.distributed_op_latency_s if node.requires_grad else 0.0
        comm_fwd = _collectives_time(tp_group, node.comm_forward, b, mesh)
        comm_bwd = _collectives_time(tp_group, node.comm_backward, b, mesh)
        if node.expert:
            fwd, bwd = fwd * pricing.routing_imbalance, bwd * pricing.routing_imbalance
        exchange = 0.0
        if node.exchange_bytes and ep_group is not None:
            layer = experts[node.name]
            exchange = pricing.routing_imbalance * exchange_time(
                ep_group, node.exchange_bytes * b, top_k=layer.top_k, experts=layer.experts,
                deduplicated=pricing.deduplicated_dispatch)
        if cp_group is not None and node.name in pricing.attention_bytes:
            sizes = pricing.attention_bytes[node.name]
            query, kv, output = sizes[:3]
            if spec.cp_kind == ContextParallel.ALL_TO_ALL:
                query, kv, output = swapped_bytes(sizes, spec.cp, layout.dtype)
            ring_fwd, ring_bwd = context_parallel_time(spec.cp_kind, cp_group,
                                                       (query, kv, output), b, fwd, bwd)
            comm_fwd, comm_bwd = comm_fwd + ring_fwd, comm_bwd + ring_bwd
        prices[node.name] = (fwd, bwd, comm_fwd, comm_bwd, kept, exchange)
    return prices


def _heads_attended(node: NodeLayout, pricing: Pricing) -> float:
    """The work of `node` under context parallelism over what its layout splits: where the
    key/value heads do not split over tp (multi-query), the runtime attends every head on each
    tp rank (cost.context.attention_bytes), twice the work of half the heads at tp2."""
    sizes = pricing.attention_bytes.get(node.name)
    return sizes.heads / node.attention["heads"] if sizes and node.attention else 1.0


def price_chunk(shape: ChunkShape, nodes: list[NodeLayout], prices: dict[str, tuple], b: int) -> Chunk:
    """Time, flops and kept activations of a chunk of `shape` whose nodes are `nodes`, from their
    `node_prices` at micro-batch `b` (the score matrices unfused attention keeps depend on them)."""
    out = replace(shape.chunk, saved_poly=dict(shape.chunk.saved_poly), tensor_moved={},
                  regathered={}, step_moved={})
    for node, (recomputed, moved_again, in_region) in zip(nodes, shape.reruns):
        price = prices[node.name]
        _add_times(out, node, price, recomputed=recomputed, moved_again=moved_again)
        if recomputed and node.attention:
            out.rerun_attention += (node.name,)
        if price[4] and not in_region:      # unfused attention's score matrices, by power of seq
            degree = node.attention["q_seq"] + node.attention["k_seq"]
            out.saved_poly[degree] = out.saved_poly.get(degree, 0.0) + price[4] / b
    out.saved_per_sample = poly_at(out.saved_poly, 1)
    return out


def _add_times(out: Chunk, node: NodeLayout, price: tuple, *, recomputed: bool, moved_again: tuple = ()) -> None:
    """A node's seconds (`node_prices`) added to its chunk's: forward, backward, tensor-parallel
    collectives and the experts' exchanges, again in the backward where it recomputes (its
    collectives where they run again: `moved_again`)."""
    fwd, bwd, comm_fwd, comm_bwd, _, exchange = price
    runs = [node.comm_forward, moved_again] + ([node.comm_backward] if node.requires_grad else [])
    out.exchange_moved += node.exchange_bytes * (1 + recomputed + node.requires_grad)
    out.counts_moved += node.routing_counts * 8 * (1 + recomputed)
    for collectives in runs:
        for kind, nbytes, per_sample in collectives:
            out.tensor_moved[kind, per_sample] = out.tensor_moved.get((kind, per_sample), 0.0) + nbytes
    for kind, nbytes, per_sample in node.comm_backward if node.weight_gathered else ():
        if not per_sample:
            out.regathered[kind] = out.regathered.get(kind, 0.0) + nbytes
    for kind, nbytes, _ in node.comm_step if node.requires_grad else ():
        out.step_moved[kind] = out.step_moved.get(kind, 0.0) + nbytes
    out.forward_s += fwd
    out.tensor_comm_s += comm_fwd
    out.exchange_s += exchange
    if node.requires_grad:
        out.backward_s += bwd
        out.weight_backward_s += bwd * WEIGHT_SHARE_OF_BACKWARD if node.param_bytes else 0.0
        out.autograd_ops += 1
        out.tensor_comm_s += comm_bwd
        out.exchange_s += exchange          # the gradients go back the same way
    if recomputed:
        out.recompute_s += fwd
        out.exchange_s += exchange
    if moved_again:     # the share of the forward's collectives run again, by their bytes
        out.tensor_comm_s += comm_fwd * sum(c[1] for c in moved_again) / sum(c[1] for c in node.comm_forward)


def partial_reductions(spec: StageSpec, schedule: str, precision: str,
                       micro_batches: int) -> tuple[int, float]:
    """`autopar.plans.zero.partial_gradient_reductions` for a stage."""
    return partial_gradient_reductions(zero=spec.zero, schedule=schedule, replicas=spec.dp * spec.cp,
                                       offload=spec.offload, precision=precision,
                                       micro_batches=micro_batches)


def partial_gradients_time(chunks: list[Chunk], mesh: Mesh, tp: int, count: int,
                           share: float) -> float:
    """A pipeline rank's tensor-parallel reductions of the weight gradients left as partial sums:
    `count` a step, `share` of their fp32 bytes each
    (`autopar.plans.zero.partial_gradient_reductions`), in one bucket a kind."""
    group = Group.strided(mesh, tp, 1)
    kinds = {kind for chunk in chunks for kind in chunk.step_moved}
    return count * sum(getattr(group, kind)(share * sum(chunk.step_moved.get(kind, 0.0)
                                                        for chunk in chunks)) for kind in kinds)


def _collectives_time(group: Group, collectives: tuple, b: int, mesh: Mesh) -> float:
    """A node's collectives over the tensor-parallel group, (kind, bytes, per sample) each."""
    return sum(getattr(group, tensor_parallel_kind(kind, mesh))(nbytes * b if per_sample else nbytes)
               for kind, nbytes, per_sample in collectives)


def tensor_parallel_kind(kind: str, mesh: Mesh) -> str:
    """The collective DTensor runs for a tensor-parallel `kind` on `mesh`: a split moved from one
    dim to another is an all-to-all, but an all-gather and a chunk over CPU (gloo) groups."""
    return "all_gather" if kind == "all_to_all" and mesh.device.name == "cpu" else kind


def chunk_states(graph: Graph, layout: GraphLayout, owner: list[int], chunks: int,
                 readers: dict[str, set[int]]) -> tuple[list[float], list[dict], list[int], list[float]]:
    """Per chunk: the parameter elements one of its devices holds, its outputs' elements per
    sample, the number of parameter tensors, and the elements of its GATHERED_GROUPS largest
    FSDP groups (what ZeRO-3 holds gathered at once) with those of its largest parameter and
    of its largest group. A weight that several chunks read (a tied
    embedding and LM head, one parameter in the graph) counts in each: the pipeline gives every
    stage that reads it its own copy. `readers`: `cost.traffic.parameter_readers`."""
    params, tensors = [0.0] * chunks, [0] * chunks
    # An export lists a tied weight under each of its names and reads it through one of them:
    # the unread names hold nothing of their own.
    tied_names = {fqn for n in graph.parameters if n.tied_to for fqn in (n.param_fqn, n.tied_to)}
    unread_ties = {n.name for n in graph.parameters if n.param_fqn in tied_names and n.name not in readers}
    for name, count in layout.param_local.items():
        if name in unread_ties:
            continue
        for chunk in readers.get(name) or {owner[layout.index[name]]}:
            params[chunk] += count
            tensors[chunk] += 1
    largest = [0.0] * chunks
    for name, count in layout.param_local.items():
        chunk = owner[layout.index[name]]
        largest[chunk] = max(largest[chunk], count)
    held = {name: count for name, count in layout.param_local.items() if name not in unread_ties}
    gathered = [(sum(sorted(groups.values())[-GATHERED_GROUPS:]), largest[c],
                 max(groups.values(), default=0.0))
                for c, groups in enumerate(group_elements(graph, owner, chunks, held, readers))]
    return params, _output_elements(graph, layout, owner, chunks), tensors, gathered


# FP8 matmuls (Transformer Engine's recipes) cast their 16-bit inputs to FP8 first, a pass that
# reads 2 bytes and writes 1 per element of the input (with its scaling's amax) in the forward,
# and again for the output's gradient in the backward: about 1.5x the input's bytes, which for a
# matmul's activations (input and output alike) is 0.75x of them.
FP8_CAST_SHARE = 0.75


def _kernels(node: NodeLayout, b: float, attention: str, dtype_bytes: int,
             gemm_dtype: str = "") -> tuple[list, list, float]:
    """The node's forward and backward kernels, (family, flops, bytes, dtype or "" for the
    activations'), and the unfused attention scores it keeps."""
    if node.family == "attention" and node.attention:
        if node.attention.get("recomputes_scores"):
            # autopar::attention (soft-capped scores, sinks): products and a softmax of a tile of
            # query rows at a time, unfused, keeping none of them; its backward computes the
            # forward's again
            forward, backward, _ = attention_kernels(node.attention, b, "unfused", dtype_bytes)
            backward, kept = forward + backward, 0.0
        else:
            forward, backward, kept = attention_kernels(node.attention, b, attention, dtype_bytes)
        return ([(*k, "") for k in forward], [(*k, "") for k in backward], kept)
    if node.family == "view" or (node.act_bytes == 0 and node.flops == 0):
        return [], [], 0.0
    flops, moved = node.flops * b, node.act_bytes * b + node.param_bytes
    flops_factor, bytes_factor = BACKWARD[node.family]
    fp8 = gemm_dtype if node.family == "matmul" and node.param_bytes else ""
    forward = [(node.family, flops, moved, fp8)]
    backward = [(node.family, flops * flops_factor, moved * bytes_factor, fp8)]
    if fp8:
        cast = ("elementwise", 0.0, FP8_CAST_SHARE * node.act_bytes * b, "")
        forward, backward = forward + [cast], backward + [cast]
    return forward, backward, 0.0


def recomputed_regions(graph: Graph, in_block: list, recompute: str) -> list[str | None]:
    """Per node, the region of the graph that reruns in the backward holding it, as the runtime
    checkpoints: its whole block under "full", its block's attention module under "selective"
    (cost.stages.selective_region); None where the node's activations are kept."""
    paths = {(inst.start, inst.stop): inst.module_path for kind in graph.blocks for inst in kind.instances}
    return [_recomputed_region(node, block, paths, recompute) for node, block in zip(graph.nodes, in_block)]


def _recomputed_region(node, block: tuple | None, paths: dict, recompute: str) -> str | None:
    if block is None or recompute == Recompute.NONE:
        return None
    path = paths.get(block, str(block))
    return path if recompute == Recompute.FULL else selective_region(node.module_path, path)


def _output_elements(graph: Graph, layout: GraphLayout, owner: list[int], chunks: int) -> list[dict]:
    """Per chunk, the elements of the floating outputs (logits) it returns, as {power of the
    sequence length: elements per sample}. Whole on every tensor-parallel rank: a stage hands
    its outputs on replicated, and the loss runs on them."""
    totals: list[dict] = [{} for _ in range(chunks)]
    for i, node in enumerate(graph.nodes):
        if node.target != "output":
            continue
        for name in node.inputs:
            out = graph.nodes[layout.index[name]]
            if not out.dtype.startswith(("float", "bfloat")):
                continue
            degree = layout.seq_degree.get(layout.storage[name], 0)
            value = out.bytes / layout.batch / DTYPE_BYTES[out.dtype]
            totals[owner[i]][degree] = totals[owner[i]].get(degree, 0.0) + value
    return totals



def poly_at(poly: dict, ratio):
    """A {power: bytes} polynomial at `ratio` = sequence length / captured sequence length."""
    return sum(value * ratio ** degree for degree, value in sorted(poly.items()))


def padded_ratios(chunk: Chunk) -> tuple[float, float]:
    """How much larger FSDP2's padded buffers are than a chunk's parameters (cost/padding.py):
    its dense parameters', its experts'."""
    dense = chunk.params - chunk.expert_params
    return (1 + chunk.padding[0] / dense if dense else 1.0,
            1 + chunk.padding[1] / chunk.expert_params if chunk.expert_params else 1.0)


def heaviest_gradient(chunks: list[Chunk]) -> float:
    """Elements of the weight gradient that adds most to a backward's peak: the largest weight of
    a chunk, whole (what the backward freed before reaching its op is freed once, in the
    gradient sweep: cost/gradient_flow.py)."""
    return max([0.0, *(max(c.largest, c.weight_read) for c in chunks)])
