"""Weights that several pipeline stages read (tied embeddings), kept identical across stages.

An LM head that reuses the embedding matrix puts one parameter in the first and the last stage.
As in Megatron-LM, each stage that reads it holds its own copy; after the backward the copies'
gradients are summed over the ranks that hold one (Megatron's "embedding group", one per data-
and tensor-parallel coordinate), so every copy receives the gradient of the whole model and,
starting equal and stepped by the same optimizer, stays equal. Copies on one rank (two stages of
an interleaved or V schedule) are summed locally first.

The sum is one all-reduce per group, of every tied weight's gradient laid out the same way on
every rank of the group: what each rank reduces is derived from the plan alone, identically on
every rank, and checked once when the runtime is built, so a disagreement is an error naming the
weight and the ranks, never two all-reduces of different sizes meeting in the backend:
- each weight's copies are taken in the order of their names;
- a copy is reduced in its parameter's layout (its tensor-parallel shard, and its ZeRO shard
  when the stage shards over data-parallel ranks), unless the plan gives the stages holding it
  different ZeRO levels, some sharding the copy over data-parallel ranks (ZeRO 1-3) and some
  holding it whole (plain data parallelism). Then every copy is reduced whole over the
  data-parallel ranks: a sharded copy's gradient is gathered first and its shard kept after.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.errors import PlanMismatchError
from autopar.passes.program import TensorRef
from autopar.runtime.fake_tensors import simulated


class TiedWeights:
    """This rank's copies of tied weights and the group over which their gradients are summed.

    Built on every rank in the same order (it creates process groups and checks the reduction's
    layout, collectives of all ranks), from this rank's stage programs, whose `tied` map is the
    whole model's, and from the plan's ZeRO level of every stage (`zero[s]`) over `dp` ranks."""

    def __init__(self, programs, stage_rank: list[int], grid: list[list[list[int]]], pp_group=None,
                 *, zero: list[int] | None = None, dp: int = 1):
        tied = programs[0].tied if programs else {}
        me = dist.get_rank()
        position = next((p, d, t) for p, plane in enumerate(grid) for d, row in enumerate(plane)
                        for t, rank in enumerate(row) if rank == me)
        holders = {fqn: tuple(sorted({stage_rank[s] for s in stages})) for fqn, stages in tied.items()}
        groups: dict[tuple[int, ...], object] = {}
        for ranks in sorted(set(holders.values())):
            if len(ranks) == 1:
                continue
            if len(ranks) == len(grid) and pp_group is not None:
                groups[ranks] = pp_group      # every pipeline rank: the pipeline group is the group
                continue
            for d, plane_row in enumerate(grid[0]):
                for t in range(len(plane_row)):
                    group = dist.new_group([grid[p][d][t] for p in ranks])
                    if (d, t) == position[1:] and position[0] in ranks:
                        groups[ranks] = group
        self.copies: dict[str, list[nn.Parameter]] = {}
        for program in programs:
            for ref in program.module.modules():
                if isinstance(ref, TensorRef) and ref.fqn in tied and isinstance(ref.value, nn.Parameter):
                    self.copies.setdefault(ref.fqn, []).append(ref.value)
        self.copies = dict(sorted(self.copies.items()))    # the same order on every rank
        self.group_of = {fqn: groups.get(holders[fqn]) for fqn in self.copies}
        zero = zero or [0] * len(stage_rank)
        # where the plan's stages disagree on sharding a weight over dp, it is reduced whole
        self.whole_over_dp = {fqn for fqn, stages in tied.items()
                              if dp > 1 and len({zero[s] > 0 for s in stages}) > 1}
        self._check_layouts({fqn: tuple(grid[p][position[1]][position[2]] for p in holders[fqn])
                             for fqn in self.copies})

    def reduce_gradients(self) -> None:
        """Every copy's gradient becomes the sum over all copies of its weight."""
        by_group: dict[object, list[str]] = {}
        for fqn in self.copies:
            by_group.setdefault(self.group_of[fqn], []).append(fqn)
        for group, names in by_group.items():
            sums = [sum(self._reduced(fqn, p) for p in self.copies[fqn]) for fqn in names]
            if group is not None:
                flat = torch.cat([s.reshape(-1) for s in sums])
                dist.all_reduce(flat, group=group)
                sums = list(torch.split(flat, [s.numel() for s in sums]))
            for fqn, total in zip(names, sums):
                for param in self.copies[fqn]:
                    self._write_back(fqn, param, total)

    def _reduced(self, fqn: str, param: nn.Parameter) -> torch.Tensor:
        """The part of `param`'s gradient this rank reduces (module doc)."""
        grad = _local_grad(param)
        if fqn not in self.whole_over_dp or not isinstance(param.grad, DTensor):
            return grad
        return param.grad.redistribute(param.device_mesh, _whole_over_dp(param)).to_local()

    def _write_back(self, fqn: str, param: nn.Parameter, total: torch.Tensor) -> None:
        local = _local_grad(param)
        if fqn in self.whole_over_dp and isinstance(param.grad, DTensor):
            # from the reduction's layout back to the parameter's: a local slice, no collective
            whole = DTensor.from_local(total.view(self._reduced_shape(fqn, param)), param.device_mesh,
                                       _whole_over_dp(param), shape=param.shape, stride=param.stride())
            total = whole.redistribute(param.device_mesh, param.placements).to_local()
        local.copy_(total.view_as(local))

    def _reduced_shape(self, fqn: str, param: nn.Parameter) -> tuple[int, ...]:
        """The shape of what `_reduced` gives for this copy, known before any gradient."""
        if not isinstance(param, DTensor):
            return tuple(param.shape)
        placements = _whole_over_dp(param) if fqn in self.whole_over_dp else param.placements
        return tuple(compute_local_shape_and_global_offset(param.shape, param.device_mesh,
                                                           placements)[0])

    def _check_layouts(self, group_ranks: dict[str, tuple[int, ...]]) -> None:
        """Every rank of each group reduces each tied weight with the same shape and dtype: one
        exchange over all ranks when the runtime is built, so that a disagreement is named on
        every rank instead of aborting the step inside the backend."""
        if simulated():
            return      # one rank simulated alone has no peers to compare with (autopar simulate)
        mine = {fqn: (group_ranks[fqn], self._reduced_shape(fqn, copies[0]), str(copies[0].dtype))
                for fqn, copies in self.copies.items() if len(group_ranks[fqn]) > 1}
        everyone: list[dict] = [None] * dist.get_world_size()
        dist.all_gather_object(everyone, mine)
        for fqn in sorted({fqn for found in everyone for fqn in found}):
            seen = {rank: found[fqn] for rank, found in enumerate(everyone) if fqn in found}
            for rank, (ranks, _, _) in seen.items():
                layouts = {peer: seen[peer][1:] if peer in seen else None for peer in ranks}
                if len(set(layouts.values())) > 1:
                    described = ", ".join(f"rank {peer}: " + (f"shape {list(layout[0])} {layout[1]}"
                                                              if layout else "no copy")
                                          for peer, layout in layouts.items())
                    raise PlanMismatchError(
                        f"the copies of tied weight {fqn} on ranks {list(ranks)} would sum "
                        f"gradients of different layouts ({described}); the plan's stages hold "
                        f"the weight in layouts that autopar cannot reduce together: plan again")


def _whole_over_dp(param: DTensor) -> list:
    """`param`'s placements with every data-parallel shard replaced by Replicate."""
    names = param.device_mesh.mesh_dim_names or ()
    return [Replicate() if index < len(names) and names[index] == "dp" else placement
            for index, placement in enumerate(param.placements)]


def _local_grad(param: nn.Parameter) -> torch.Tensor:
    """This rank's part of `param`'s gradient, laid out as the parameter is. DTensor may leave a
    gradient in another placement than its parameter's (an embedding's backward from whole
    activations writes a whole gradient for a vocabulary-split weight); the copies in other stages
    are summed shard by shard, so each is first brought to its parameter's placement."""
    if param.grad is None:
        param.grad = torch.zeros_like(param)
    grad = param.grad
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != param.placements:
        grad = param.grad = grad.redistribute(param.device_mesh, param.placements)
    return grad.to_local()
