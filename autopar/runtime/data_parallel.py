"""Data parallelism and ZeRO: FSDP2 over the "dp" axis, one group per layer of a rewritten stage.

Not a graph rewrite: FSDP2 wraps the modules the passes made. Each layer (a unit of the stage
split) is its own group, so that its collectives overlap the neighbouring layers' compute:
`replicate` (gradients all-reduced) for plain data parallelism, `fully_shard` for ZeRO (1 and 2
keep parameters gathered from forward to backward, 3 frees them between; 2 and 3 reduce-scatter the
gradients after every micro-batch, 1 once a step, schedule.py). It comes after tensor parallelism:
FSDP2 shards what tensor parallelism left. Under context parallelism the "dp" mesh holds the dp x cp
ranks of the same weights (rank_grid.py): their gradients are averaged over all of them.

The experts of a stage that splits them over ep ranks (autopar.passes.expert_parallel) are wrapped
first, over their own group: the ranks that hold the same experts ("edp"). FSDP2 leaves a wrapped
module's parameters to it, so the stage's own groups over "dp" then take the rest.

Offload (ZeRO-3 only): FSDP2's CPUOffloadPolicy keeps each rank's shards of the parameters, their
gradients and so the optimizer state in host memory, and the optimizer steps there; every
all-gather copies the shard to the device first, every reduce-scatter's shard comes back. Pinned
host memory (for copies beside the compute) where the device is an accelerator.
"""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.distributed._composable.replicate_with_fsdp import replicate
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

from autopar.errors import AutoparError
from autopar.plans.zero import holds_weights_in_fsdp, keeps_weights_gathered, reduces_every_micro_batch
from autopar.passes.expert_dispatch import ExpertParallel
from autopar.passes.tensor_parallel import TensorParallelStage
from autopar.plans import Plan
from autopar.plans.vocabulary import Schedule
from autopar.runtime.gloo_reduce import reduce_in_place_on_cpu
from autopar.runtime.schedule import (ReceivingStage, ReducingStage, ReshardingStage,
                                      WeightBackwardStage)


def data_parallel(module: nn.Module, zero: int, schedule: str, dp_mesh: DeviceMesh,
                  mp_policy=None, offload: bool = False) -> None:
    """Plain data parallelism or ZeRO over `dp_mesh`, one FSDP group per layer, then the rest;
    with `offload`, ZeRO-3's states on the host (module docstring).

    ZeRO-1 runs as ZeRO-2 but reduces its gradients once a step (schedule.py): FSDP2 shards them
    with the optimizer state after that reduce. Under zero-bubble schedules (backward split into input and weight
    parts) freeing parameters between forward and backward gives wrong weight gradients in this
    torch, so there ZeRO-3 keeps them, as ZeRO-2 does."""
    if offload and zero != 3:
        raise AutoparError(f"offload keeps ZeRO-3's shards, gradients and optimizer state on the "
                           f"host; this stage has ZeRO-{zero}: set zero=3")
    policy = {} if mp_policy is None else {"mp_policy": mp_policy}
    if offload:
        pinned = dp_mesh.device_type != "cpu"     # pinning needs an accelerator
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=pinned)
    if zero == 0:
        wrap = functools.partial(replicate, mesh=dp_mesh, **policy)
    else:
        wrap = functools.partial(fully_shard, mesh=dp_mesh, **policy,
                                 reshard_after_forward=not keeps_weights_gathered(zero, schedule),
                                 shard_placement_fn=_even_shards(dp_mesh.size()))
    for layer in _layers(module):
        wrap(layer)
    wrap(module)
    if zero:
        reduce_in_place_on_cpu(module)


def expert_data_parallel(module: nn.Module, zero: int, schedule: str, edp_mesh: DeviceMesh,
                         wrapped: bool, mp_policy=None, offload: bool = False) -> None:
    """The gradients of the stage's split experts reduced over `edp_mesh` (plain data parallelism
    or ZeRO there, as the stage's `zero` says), with FSDP2 as `data_parallel` does; also over a
    mesh of one rank when FSDP2 `wrapped` the stage (its groups must leave the experts alone;
    offloaded, the experts' states go to the host too: autopar.plans.zero). The experts' inputs
    are left as they come: a routing value cast to 16 bits would count exactly only up to 256."""
    if edp_mesh.size() == 1 and not wrapped:
        return
    policy = {} if mp_policy is None else {"mp_policy": MixedPrecisionPolicy(
        param_dtype=mp_policy.param_dtype, reduce_dtype=mp_policy.reduce_dtype,
        cast_forward_inputs=False)}
    if offload:
        policy["offload_policy"] = CPUOffloadPolicy(pin_memory=edp_mesh.device_type != "cpu")
    if zero == 0:
        wrap = functools.partial(replicate, mesh=edp_mesh, **policy)
    else:
        wrap = functools.partial(fully_shard, mesh=edp_mesh, **policy,
                                 reshard_after_forward=not keeps_weights_gathered(zero, schedule))
    for experts in [m for m in module.modules() if isinstance(m, ExpertParallel)]:
        placement = {"shard_placement_fn": _expert_shards(experts, edp_mesh.size())} if zero else {}
        wrap(experts, **placement)
        if zero:
            reduce_in_place_on_cpu(experts)


def _even_shards(ranks: int):
    """FSDP2's placement of a plain grouped weight ([experts, in, out]) over `ranks`: on its
    first dim where that divides among them, else on the first dim that does. FSDP2 pads a first
    dim that does not divide up to a multiple of the ranks, and gathers, reduces and keeps the
    padding: Mixtral's experts [8, ...] at ep=1 over 64 data-parallel ranks would be held as
    [64, ...], 8 times their share. Matrices and vectors keep FSDP2's split of their first dim
    (their padding is priced: cost/padding.py): a split on another dim costs FSDP2 a view per
    rank at every gather's copy-out, which at a thousand ranks outweighs a small padding (a
    router's [256, 7168] over 1024). Tensor-parallel DTensors keep FSDP2's split too."""
    def place(parameter: torch.Tensor):
        if isinstance(parameter, DTensor) or parameter.dim() < 3 or parameter.shape[0] % ranks == 0:
            return None
        dim = next((d for d in range(1, parameter.dim()) if parameter.shape[d] % ranks == 0), None)
        return None if dim is None else Shard(dim)
    return place


def _expert_shards(experts: ExpertParallel, edp: int):
    """FSDP2's placement of the split experts' weights over the `edp` ranks: on the experts
    (dim 0) where each rank's experts divide among them, else on each expert's rows (dim 1), as
    torchtitan does: with fewer local experts than edp ranks (Mixtral's 8 over ep=8), a split
    on dim 0 would leave one rank all of them and the others nothing but padding."""
    local = experts.num_experts // experts.ep
    placement = Shard(0) if local % edp == 0 else Shard(1)
    return lambda parameter: placement


def stage_class(plan: Plan, index: int, replicas: int) -> type:
    """ZeRO-2 and 3 stages reduce their gradients after each micro-batch's backward, ZeRO-3
    stages also free their gathered weights (schedule.py); `replicas`: the dp x cp ranks."""
    zero = plan.stages[index].zero
    wrapped = holds_weights_in_fsdp(replicas=replicas, offload=plan.stages[index].offload,
                                    precision=plan.precision)
    if wrapped and plan.schedule == Schedule.ZERO_BUBBLE:
        return WeightBackwardStage
    if not wrapped or not reduces_every_micro_batch(zero, plan.schedule):
        return ReceivingStage
    return ReshardingStage if zero == 3 else ReducingStage


def _layers(module: nn.Module) -> list[nn.Module]:
    """The stage's per-layer submodules (the split's units) that hold parameters of their own. A
    unit sharing a parameter with another (an LM head tied to the embedding in the same stage)
    stays in the stage's group: FSDP2 gives each parameter to one group."""
    inner = module.inner if isinstance(module, TensorParallelStage) else module
    units = [child for name, child in inner.named_children() if name.startswith("submod_")]
    owners: dict[int, int] = {}
    for unit in units:
        for param in unit.parameters():
            owners[id(param)] = owners.get(id(param), 0) + 1
    return [unit for unit in units
            if any(True for _ in unit.parameters()) and all(owners[id(p)] == 1 for p in unit.parameters())]
