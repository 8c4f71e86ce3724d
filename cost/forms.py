"""What expert and context parallelism and offload change in a stage's replicas, as the estimator
prices them per device: which ranks shard and reduce which parameters, and the host's share.

  dense parameters   reduced over the stage's cp x dp ranks (context parallelism's ranks hold the
                     same weights, as data parallelism's do), ZeRO sharding them there; the
                     group is the tensor-parallel ranks' stride (Megatron's order tp-cp-dp)
  experts (ep > 1)   reduced over their expert-data-parallel group, tp x cp x dp / ep ranks an
                     ep stride apart (ep consecutive ranks hold different experts), ZeRO
                     sharding them there (cost/experts.py)
  offload            the host's copies and optimizer step (cost/offload.py)
"""

from __future__ import annotations

from dataclasses import replace

from autopar.cost.context import check_sequence_split, ulysses_error
from autopar.plans.zero import (frees_each_group_after_its_backward, reduces_every_micro_batch,
                                reduces_group_by_group_at_the_last_backward)
from autopar.cost.offload import offload_time
from autopar.cost.overlap import DeviceWork, exposed_data_parallel
from autopar.plans.vocabulary import CONTEXT_PARALLEL, ContextParallel
from autopar.errors import AutoparError


def check_stages(graph, stages: list, memo) -> None:
    """What the stages ask of the model that only the graph can answer: experts to split
    (checked with the layout, cost/experts.py), a sequence to split into 2 x cp chunks, heads
    for the all-to-all form; and what each stage's own degrees allow."""
    for spec in {(s.tp, s.dp, s.cp, s.ep, s.cp_kind, s.zero, s.offload): s for s in stages}.values():
        if spec.ranks % spec.ep:
            raise AutoparError(f"ep={spec.ep} does not divide the tp x cp x dp = {spec.tp} x "
                               f"{spec.cp} x {spec.dp} = {spec.ranks} ranks of a stage; choose "
                               f"an ep that divides {spec.ranks}")
        if spec.cp_kind not in CONTEXT_PARALLEL:
            raise AutoparError(f"cp_kind={spec.cp_kind!r}: expected one of {CONTEXT_PARALLEL}")
        if spec.offload and spec.zero == 0:
            raise AutoparError("offload keeps ZeRO's states on the host: give the stage ZeRO 1-3")
        check_sequence_split(graph, spec.cp)
        if spec.cp > 1 and spec.cp_kind == ContextParallel.ALL_TO_ALL:
            error = ulysses_error(memo.layout(spec), spec.cp)
            if error is not None:
                raise AutoparError(error)


def expert_data_parallel(spec) -> int:
    """The ranks that hold the same experts and reduce their gradients."""
    return spec.ranks // spec.ep if spec.ep > 1 else spec.dp * spec.cp


def backward_reductions(spec, schedule: str, *, pipelined: bool) -> tuple[bool, tuple | None]:
    """How a stage's backward frees what FSDP2 holds: whether it reshards each group's gathered
    weights as the group's backward ends, every micro-batch (plain data parallelism on a single
    stage: autopar.plans.zero.frees_each_group_after_its_backward); and where the step's last
    backward reduces the accumulated gradients group by group
    (`reduces_group_by_group_at_the_last_backward`), the share of a reduced group's gradients a
    rank keeps, of its dense and of its experts' elements: all of them in plain data
    parallelism, ZeRO's shard above it (None where it does not)."""
    resharding = frees_each_group_after_its_backward(spec.zero, pipelined=pipelined)
    if not reduces_group_by_group_at_the_last_backward(spec.zero, schedule, pipelined=pipelined):
        return resharding, None
    if spec.zero == 0:
        return resharding, (1.0, 1.0)
    return resharding, (1 / (spec.dp * spec.cp), 1 / expert_data_parallel(spec))


def sharded_params(work: DeviceWork, spec) -> float:
    """The parameter elements whose optimizer state one device steps: ZeRO's shard of them."""
    if spec.zero == 0:
        return work.params
    dense = (work.params - work.expert_params) / (spec.dp * spec.cp)
    return dense + work.expert_params / expert_data_parallel(spec)


def sharded_traffic(work: DeviceWork, spec, *, micro_batches: int, mesh, runtime,
                    element_bytes: int) -> float:
    """Data-parallel communication on the critical path of a step (cost/overlap.py): the dense
    parameters' over cp x dp, the experts' over their own group, with the padding FSDP2 gives
    their shards (cost/padding.py)."""
    if spec.ep == 1 or not work.expert_params:
        return exposed_data_parallel(replace(work, params=work.params + sum(work.padding)),
                                     dp=spec.dp * spec.cp, tp=spec.tp, zero=spec.zero,
                                     micro_batches=micro_batches, mesh=mesh, runtime=runtime,
                                     element_bytes=element_bytes)
    dense = replace(work, params=work.params - work.expert_params + work.padding[0], expert_params=0.0)
    experts = replace(work, params=work.expert_params + work.padding[1], expert_params=0.0)
    return (exposed_data_parallel(dense, dp=spec.dp * spec.cp, tp=spec.tp, zero=spec.zero,
                                  micro_batches=micro_batches, mesh=mesh, runtime=runtime,
                                  element_bytes=element_bytes)
            + exposed_data_parallel(experts, dp=expert_data_parallel(spec), tp=spec.ep,
                                    zero=spec.zero, micro_batches=micro_batches, mesh=mesh,
                                    runtime=runtime, element_bytes=element_bytes))


def offload_step(work: DeviceWork, spec, *, micro_batches: int, schedule: str, mesh,
                 eff) -> tuple[float, float]:
    """(exposed host copies, the host's optimizer step) of one device per step: under ZeRO-3 its
    shard goes up for every gather (each micro-batch's forward, and its backward unless a
    zero-bubble schedule keeps the weights gathered) and its gradients come down for every
    reduction (cost.memory.reduces_every_micro_batch)."""
    gathers = micro_batches * (1 if work.kept_gathered else 2)
    reductions = micro_batches if reduces_every_micro_batch(spec.zero, schedule) else 1
    return offload_time(params=work.params, shard=sharded_params(work, spec), zero=spec.zero,
                        gathers=gathers, reductions=reductions,
                        compute_s=micro_batches * (work.forward_s + work.backward_s),
                        device=mesh.device,
                        host_devices=min(mesh.device.host_figures.gpus, mesh.gpus_per_node),
                        efficiencies=eff)
