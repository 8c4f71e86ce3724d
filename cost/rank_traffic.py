"""What each pipeline rank of a plan sends in one step, as the estimator prices it: the bytes
behind the times of the tensor-parallel collectives of each op (cost/layout.py), the pipeline's
sends (cost/traffic.py), the data-parallel reductions and ZeRO's gathers (cost/overlap.py),
context parallelism's ring (cost/context.py) and the closing loss all-reduce, keyed as
`autopar simulate` records a rank's collectives (autopar/simulate/collectives.py): the kind, the
rank-grid axes its group spans and the group's size, with the bytes the rank sends under ring
algorithms (all-reduce 2(n-1)/n of the payload, all-gather and reduce-scatter (n-1)/n of the
whole tensor, all-to-all (n-1)/n of its input, a send all of it). DTensor moves a split from
one dim to another by all-to-all, or by an all-gather over CPU process groups
(`tensor_parallel_kind`).

How often each runs, as autopar's runtime issues them (autopar/runtime/schedule.py): a
recomputed region's tensor-parallel collectives again up to its last op that keeps anything for
the backward (torch's checkpoint stops there), the reduction of weight gradients tensor
parallelism leaves as partial sums as `autopar.plans.zero.partial_gradient_reductions` says; gradients
are reduced once a step, or after every micro-batch where ZeRO-2/3 reduces every one
(`reduces_every_micro_batch`); ZeRO-1/2 gather the updated weights once, at the step's first
forward; ZeRO-3 gathers before every micro-batch's forward and again before its backward,
except where a zero-bubble schedule keeps them gathered through the step; split experts' weights
over the ranks that hold the same experts ("edp"), the rest over dp x cp. Mixture-of-experts
dispatch and combine are each an all-to-all over the ep ranks, forward, backward and in a
recomputed forward, and each forward dispatch first exchanges the rows per expert (8 bytes an
expert). A recomputed attention's second forward exchanges again what its first did (the
ring's forward hops, or its four all-to-alls).
"""

from __future__ import annotations

import math

from autopar.cost.calibration import calibrated
from autopar.cost.context import attention_bytes, scan_bytes, swapped_bytes
from autopar.cost.estimator import ACTIVATION_DTYPE, price_pipeline
from autopar.cost.plan_estimate import plan_stages
from autopar.cost.price_cache import PriceCache
from autopar.cost.chunk_price import partial_reductions, tensor_parallel_kind
from autopar.cost.forms import expert_data_parallel
from autopar.cost.traffic import captured_crossings, tied_gradient_bytes
from autopar.graph import Graph
from autopar.plans.vocabulary import ContextParallel, Precision, Schedule
from autopar.plans.zero import keeps_weights_gathered, reduces_every_micro_batch

# the order autopar.simulate.groups names groups in (cost sits below the simulator: not imported)
_AXES = ("pp", "dp", "cp", "tp")


def plan_collectives(graph: Graph, plan) -> list[list[dict]]:
    """Per pipeline rank, its collectives of one step: {"kind", "axis", "group_size",
    "sent_bytes"}, summed by kind and group (module docstring)."""
    mesh, specs = plan_stages(graph, plan)
    mesh, eff = calibrated(mesh, None, None)
    memo = PriceCache.of(None, graph, mesh, eff, ACTIVATION_DTYPE[plan.precision])
    pipe = price_pipeline(graph, mesh, specs, global_batch=plan.global_batch,
                          micro_batch=plan.micro_batch_size, virtual=plan.virtual, efficiencies=eff,
                          attention="flash", memo=memo)
    crossing, gathered = captured_crossings(memo, memo.split(specs), specs)
    element = 4 if plan.precision == Precision.FP32 else 2
    world = {"pp": len(pipe.devices), "dp": specs[0].dp, "cp": specs[0].cp, "tp": specs[0].tp}
    ranks = []
    for chunks in pipe.devices:
        found: dict[tuple, float] = {}
        spec = specs[chunks[0]]
        for c in chunks:
            _tensor_parallel(found, pipe.chunks[c], spec.tp, pipe, mesh, partial_reductions(
                spec, plan.schedule, plan.precision, pipe.micro_batches),
                # torch runs the first stage's backward whole, at its weight backward
                split=plan.schedule == Schedule.ZERO_BUBBLE and len(pipe.devices) > 1 and c > 0)
            _context_parallel(found, graph, memo, specs, c, pipe, element, pipe.chunks[c].rerun_attention)
            _expert_parallel(found, pipe.chunks[c], specs[c], pipe, world)
        _pipeline(found, crossing, gathered, specs, chunks, pipe)
        _tied(found, memo.readers(memo.split(specs)), memo.layout(spec), spec, chunks, pipe.devices)
        # experts not split over ep ranks are replicated as the rest: dp x cp reduce them too
        experts = sum(pipe.chunks[c].expert_params for c in chunks) if spec.ep > 1 else 0.0
        # ZeRO's shards as FSDP2 pads them (cost/padding.py)
        padding = [memo.shard_padding(memo.split(specs), specs[c])[c] for c in chunks] \
            if spec.zero else [(0.0, 0.0)]
        _data_parallel(found, sum(pipe.chunks[c].params for c in chunks) - experts
                       + sum(p[0] for p in padding), spec, plan.schedule, pipe.micro_batches, element)
        if spec.ep > 1:
            _data_parallel(found, experts + sum(p[1] for p in padding), spec, plan.schedule,
                           pipe.micro_batches, element, group=("edp", expert_data_parallel(spec)))
        _add(found, "all_reduce", _axis_name(world), math.prod(world.values()), 8.0)
        ranks.append([{"kind": kind, "axis": axis, "group_size": size, "sent_bytes": int(sent)}
                      for (kind, axis, size), sent in found.items()])
    return ranks


def _add(found: dict, kind: str, axis: str, size: int, payload: float) -> None:
    """Count one collective's bytes sent by this rank: `payload` the whole tensor gathered,
    reduced or moved (an all-to-all's input is the rank's 1/size of it: module docstring)."""
    if size < 2 or not payload:
        return
    share = {"all_reduce": 2 * (size - 1) / size, "send": 1.0,
             "all_to_all": (size - 1) / size**2}.get(kind, (size - 1) / size)
    found[kind, axis, size] = found.get((kind, axis, size), 0.0) + share * payload


def _tensor_parallel(found: dict, chunk, tp: int, pipe, mesh, partial: tuple[int, float],
                     split: bool = False) -> None:
    """The chunk's tensor-parallel collectives, and the reductions of its partial weight
    gradients, `partial` = (count, share) (`autopar.plans.zero.partial_gradient_reductions`);
    where the backward is `split` (zero-bubble), the weights read whole gathered again by the
    weight backward (cost.gradient_flow.split_whole_reads)."""
    for (kind, per_sample), nbytes in chunk.tensor_moved.items():
        _add(found, tensor_parallel_kind(kind, mesh), "tp", tp,
             nbytes * (pipe.samples if per_sample else 1) * pipe.micro_batches)
    for kind, nbytes in chunk.regathered.items() if split else ():
        _add(found, tensor_parallel_kind(kind, mesh), "tp", tp, nbytes * pipe.micro_batches)
    count, share = partial
    for kind, nbytes in chunk.step_moved.items():
        _add(found, kind, "tp", tp, count * share * nbytes)


def _context_parallel(found: dict, graph: Graph, memo: PriceCache, specs: list, c: int, pipe,
                      element: int, rerun: tuple = ()) -> None:
    """Ring (autopar's, passes/context_attention.py): cp - 1 hops of the K/V block (the kv heads,
    in the compute dtype) in the forward, cp hops of the block and its fp32 gradients in the
    backward (the last brings them home); all-to-all: q, k + v and the output swapped forward
    and backward; a forward's again where the backward reruns it (`rerun`: attention ops); a
    running count along the sequence, each rank's 2 chunk totals all-gathered."""
    spec = specs[c]
    if spec.cp < 2:
        return
    layout, owner = memo.layout(spec), memo.split(specs).owner
    for name, sizes in attention_bytes(graph, layout).items():
        if owner[layout.index[name]] != c:
            continue
        per_step = pipe.samples * pipe.micro_batches
        forwards = 2 if name in rerun else 1
        if spec.cp_kind == ContextParallel.RING:
            kv = sizes.kv
            hops = forwards * (spec.cp - 1) * kv + spec.cp * (kv + kv * 4 / element)
            _add(found, "send", "cp", spec.cp, hops * per_step)
        else:
            swapped = sum(swapped_bytes(sizes, spec.cp, layout.dtype)) * spec.cp * per_step
            _add(found, "all_to_all", "cp", spec.cp, (forwards + 1) * swapped)
    # running counts along the sequence: each rank's 2 chunk totals of every sequence of its
    # micro-batch (the estimator's `samples` are the micro-batch's sequences / cp), all-gathered
    for name, totals in scan_bytes(graph).items():
        if owner[layout.index[name]] == c:
            sequences = pipe.samples * spec.cp * pipe.micro_batches
            _add(found, "all_gather", "cp", spec.cp, spec.cp * totals * sequences)     # the whole


def _expert_parallel(found: dict, chunk, spec, pipe, world: dict) -> None:
    """Each MoE layer's dispatch and combine: an all-to-all of the rank's rows (1/tp of the
    routed rows where tensor-parallel ranks share them) over the ep ranks, forward, backward and
    again in a recomputed forward (cost/chunk_price.py counts the same exchanges' times), each
    forward's dispatch after an all-to-all of its rows per expert (not timed). An ep
    group of every rank is torch's default group, which carries no name of its own: it is
    named by the axes it spans, as the simulator names it."""
    if spec.ep > 1:
        axis = _axis_name(world) if spec.ep == math.prod(world.values()) else "ep"
        _add(found, "all_to_all", axis, spec.ep, (chunk.exchange_moved * pipe.samples
                                                  + chunk.counts_moved) * spec.ep * pipe.micro_batches)


def _pipeline(found: dict, crossing: list, gathered: list, specs: list, chunks: list, pipe) -> None:
    """Each chunk sends its outputs forward and its inputs' gradients back, each
    tensor-parallel rank its chunk; of the values the stage holds whole (`gathered`), it gathers
    the chunks of its inputs and of its outputs' gradients (cost/traffic.py, `add_sends`)."""
    last = len(specs) - 1
    per_step = pipe.samples * pipe.micro_batches
    for c in chunks:
        out, back = (crossing[c] if c < last else 0.0), (crossing[c - 1] if c > 0 else 0.0)
        _add(found, "send", "pp", len(pipe.devices), (out + back) * per_step)
        whole = (gathered[c] if c < last else 0.0) + (gathered[c - 1] if c > 0 else 0.0)
        if whole:
            _add(found, "all_gather", "tp", specs[c].tp, whole * specs[c].tp * per_step)


def _tied(found: dict, readers: dict, layout, spec, chunks: list, devices: list) -> None:
    """Megatron's embedding group (autopar/runtime/tied.py): a weight that chunks on several
    pipeline ranks read has a copy on each, whose fp32 gradient they sum once a step in the
    copy's layout: its tensor-parallel part, and its ZeRO shard where the stage shards it."""
    for name, reading in readers.items():
        holders = [d for d, held in enumerate(devices) if reading & set(held)]
        if len(holders) > 1 and reading & set(chunks):
            _add(found, "all_reduce", "pp", len(holders), tied_gradient_bytes(name, layout, spec))


def _data_parallel(found: dict, params: float, spec, schedule: str, m: int, element: int,
                   group: tuple[str, int] | None = None) -> None:
    """Gradients reduced in fp32 over the ranks holding the same weights (the dp x cp ranks, or
    `group`: (axis, size)); ZeRO's gathers of the weights in the compute dtype (module
    docstring)."""
    size = spec.dp * spec.cp
    axis = "+".join(name for name, n in (("dp", spec.dp), ("cp", spec.cp)) if n > 1)
    axis, size = group or (axis, size)
    gradients = params * 4
    if spec.zero == 0:
        _add(found, "all_reduce", axis, size, gradients)
        return
    reductions = m if reduces_every_micro_batch(spec.zero, schedule) else 1
    _add(found, "reduce_scatter", axis, size, reductions * gradients)
    gathers = 1 if spec.zero < 3 or keeps_weights_gathered(spec.zero, schedule) else 2 * m
    _add(found, "all_gather", axis, size, gathers * params * element)


def _axis_name(world: dict) -> str:
    return "+".join(axis for axis in _AXES if world[axis] > 1) or "self"



