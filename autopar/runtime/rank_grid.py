"""Where a plan's stages run: the rank grid (pp, dp, cp, tp) and the process groups over it.

Stages with the same ranks share a pipeline rank (interleaved and V schedules place several stages
on one); each stage's ranks are row-major over the plan's axes (dp, cp, tp). The device mesh over
that grid gives every axis its process group: "pp" for the pipeline's sends, "dp" for FSDP2, "tp"
for the DTensors of tensor-parallel stages. Context-parallel ranks hold the same weights as
data-parallel replicas do, so the mesh's "dp" axis holds the dp x cp replicas of a stage (FSDP2
shards and reduces over them all) and each cp group of ranks that split the same sequences is a
process group of its own (`context_group`). Stages that split their experts over ep ranks get one
more mesh per distinct ep over the same grid, (pp, edp, ep): each stage's dp x cp x tp ranks in
row-major order cut into consecutive blocks of ep ("ep": ranks holding different experts; "edp":
ranks holding the same ones, autopar.passes.expert_parallel), as Megatron-Core folds its expert
groups into the dp x cp x tp ranks of its attention.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import unset_fake_temporarily
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import AutoparError, MeshError, PlanMismatchError
from autopar.plans import AxisRole, Plan


@dataclass(kw_only=True, slots=True)
class PipelineLayout:
    """Where the plan's stages live: the rank grid and each stage's pipeline rank."""
    # [pipeline rank][replica][tp index] -> global rank; replica = dp index * cp + cp index
    grid: list[list[list[int]]]
    stage_rank: list[int]             # stage index -> pipeline rank holding it
    dp: int                           # replicas that split the batch
    tp: int
    cp: int = 1                       # ranks that split every sequence

    @property
    def pp(self) -> int:
        return len(self.grid)

    @property
    def replicas(self) -> int:
        """The ranks that hold the same weights and reduce their gradients: dp x cp."""
        return self.dp * self.cp

    @property
    def world_size(self) -> int:
        return self.pp * self.replicas * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        for p, plane in enumerate(self.grid):
            for d, row in enumerate(plane):
                if rank in row:
                    return p, d, row.index(rank)
        raise MeshError(f"rank {rank} is in none of the plan's stages; the plan covers ranks "
                        f"0..{self.world_size - 1}")

    def batch_and_context(self, replica: int) -> tuple[int, int]:
        """(dp index, cp index) of a replica: which rows of the batch and which chunks of it."""
        return divmod(replica, self.cp)

    def own_stages(self, rank: int) -> list[int]:
        """The stages `rank` holds, in order."""
        pp_rank = self.coordinates(rank)[0]
        return [s for s, r in enumerate(self.stage_rank) if r == pp_rank]


def pipeline_layout(plan: Plan) -> PipelineLayout:
    """Stages with the same ranks share a pipeline rank (interleaved and V schedules place several
    stages on one); each stage's ranks are row-major over the plan's axes."""
    first = plan.stages[0]
    for stage in plan.stages:
        if (stage.dp, stage.tp, stage.cp) != (first.dp, first.tp, first.cp):
            raise AutoparError(
                f"stage {stage.index} runs on dp={stage.dp} x cp={stage.cp} x tp={stage.tp} but "
                f"stage 0 on dp={first.dp} x cp={first.cp} x tp={first.tp}; the pipeline runtime "
                f"needs one sub-mesh shape for all stages: plan again with uniform stages")
        if len(stage.ranks) != stage.dp * stage.cp * stage.tp:
            raise PlanMismatchError(f"stage {stage.index} lists {len(stage.ranks)} ranks for "
                                    f"dp={stage.dp} x cp={stage.cp} x tp={stage.tp}")
    rank_sets: list[tuple[int, ...]] = []
    stage_rank = []
    for stage in plan.stages:
        key = tuple(stage.ranks)
        if key not in rank_sets:
            rank_sets.append(key)
        stage_rank.append(rank_sets.index(key))
    grid = [[[ranks[_flat(plan.axes, {AxisRole.DATA: d, AxisRole.CONTEXT: c, AxisRole.TENSOR: t})]
              for t in range(first.tp)] for d in range(first.dp) for c in range(first.cp)]
            for ranks in rank_sets]
    everyone = sorted(r for ranks in rank_sets for r in ranks)
    if everyone != list(range(len(everyone))):
        raise PlanMismatchError(f"the plan's stages use ranks {everyone}; each rank must appear in "
                                f"exactly one pipeline position")
    return PipelineLayout(grid=grid, stage_rank=stage_rank, dp=first.dp, tp=first.tp, cp=first.cp)


def _flat(axes: list[list], index: dict) -> int:
    """A stage's rank position of the given index on each axis, row-major over `axes`."""
    flat = 0
    for role, size in axes:
        flat = flat * size + index.get(role, 0)
    return flat


def device_mesh(layout: PipelineLayout, device: torch.device) -> DeviceMesh:
    """The (pp, dp, tp) mesh of the rank grid ("dp": the dp x cp replicas); torch's
    init_device_mesh when the grid is in rank order (Megatron's, which the planner writes), a
    DeviceMesh over the grid as given otherwise."""
    with unset_fake_temporarily():   # host data, real even under a fake tensor mode (simulate)
        grid = torch.tensor(layout.grid)
        names = ("pp", "dp", "tp")
        if torch.equal(grid.flatten(), torch.arange(grid.numel())):
            return init_device_mesh(device.type, tuple(grid.shape), mesh_dim_names=names)
        return DeviceMesh(device.type, grid, mesh_dim_names=names)


def expert_meshes(layout: PipelineLayout, plan: Plan, device: torch.device) -> dict[int, DeviceMesh]:
    """A (pp, edp, ep) mesh over the rank grid for each ep > 1 of the plan's stages (module doc),
    made in the same order on every rank (making one is a collective)."""
    with unset_fake_temporarily():   # host data (device_mesh)
        grid = torch.tensor(layout.grid)
        ranks = layout.replicas * layout.tp
        return {ep: DeviceMesh(device.type, grid.reshape(layout.pp, ranks // ep, ep),
                               mesh_dim_names=("pp", "edp", "ep"))
                for ep in sorted({stage.ep for stage in plan.stages} - {1})}


def context_group(layout: PipelineLayout, rank: int):
    """The process group of the cp ranks that split `rank`'s sequences (same pipeline, dp and tp
    index), and `rank`'s place in it; (None, 0) without context parallelism. Every rank creates
    every group, in the same order (torch's new_group is collective)."""
    if layout.cp == 1:
        return None, 0
    mine, place = None, 0
    for plane in layout.grid:
        for d in range(layout.dp):
            for t in range(layout.tp):
                ranks = [plane[d * layout.cp + c][t] for c in range(layout.cp)]
                group = dist.new_group(ranks, group_desc="cp")
                if rank in ranks:
                    mine, place = group, ranks.index(rank)
    return mine, place
