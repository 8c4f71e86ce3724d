"""Where a plan's stages run: the rank grid (pp, dp, tp) and the process groups over it.

Stages with the same ranks share a pipeline rank (interleaved and V schedules place several stages
on one); each stage's ranks are row-major over the plan's (dp, tp) axes. The device mesh over that
grid gives every axis its process group: "pp" for the pipeline's sends, "dp" for FSDP2, "tp" for
the DTensors of tensor-parallel stages. Stages that split their experts over ep ranks get one more
mesh per distinct ep over the same grid, (pp, edp, ep): each stage's dp x tp ranks in row-major
order cut into consecutive blocks of ep ("ep": ranks holding different experts; "edp": ranks
holding the same ones, autopar.passes.expert_parallel).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autopar.errors import AutoparError, MeshError, PlanMismatchError
from autopar.plans import AxisRole, Plan


@dataclass(kw_only=True, slots=True)
class PipelineLayout:
    """Where the plan's stages live: the rank grid and each stage's pipeline rank."""
    grid: list[list[list[int]]]       # [pipeline rank][dp index][tp index] -> global rank
    stage_rank: list[int]             # stage index -> pipeline rank holding it
    dp: int
    tp: int

    @property
    def pp(self) -> int:
        return len(self.grid)

    @property
    def world_size(self) -> int:
        return self.pp * self.dp * self.tp

    def coordinates(self, rank: int) -> tuple[int, int, int]:
        for p, plane in enumerate(self.grid):
            for d, row in enumerate(plane):
                if rank in row:
                    return p, d, row.index(rank)
        raise MeshError(f"rank {rank} is in none of the plan's stages; the plan covers ranks "
                        f"0..{self.world_size - 1}")

    def own_stages(self, rank: int) -> list[int]:
        """The stages `rank` holds, in order."""
        pp_rank = self.coordinates(rank)[0]
        return [s for s, r in enumerate(self.stage_rank) if r == pp_rank]


def pipeline_layout(plan: Plan) -> PipelineLayout:
    """Stages with the same ranks share a pipeline rank (interleaved and V schedules place several
    stages on one); each stage's ranks are row-major over the plan's (dp, tp) axes."""
    first = plan.stages[0]
    for stage in plan.stages:
        if (stage.dp, stage.tp) != (first.dp, first.tp):
            raise AutoparError(
                f"stage {stage.index} runs on dp={stage.dp} x tp={stage.tp} but stage 0 on "
                f"dp={first.dp} x tp={first.tp}; the pipeline runtime needs one sub-mesh shape for all "
                f"stages: plan again with uniform stages")
        if len(stage.ranks) != stage.dp * stage.tp:
            raise PlanMismatchError(f"stage {stage.index} lists {len(stage.ranks)} ranks for "
                                    f"dp={stage.dp} x tp={stage.tp}")
    rank_sets: list[tuple[int, ...]] = []
    stage_rank = []
    for stage in plan.stages:
        key = tuple(stage.ranks)
        if key not in rank_sets:
            rank_sets.append(key)
        stage_rank.append(rank_sets.index(key))
    dp_major = plan.axis_roles[:1] != [AxisRole.TENSOR]
    grid = [[[ranks[_flat(d, t, first.dp, first.tp, dp_major)] for t in range(first.tp)]
             for d in range(first.dp)] for ranks in rank_sets]
    everyone = sorted(r for ranks in rank_sets for r in ranks)
    if everyone != list(range(len(everyone))):
        raise PlanMismatchError(f"the plan's stages use ranks {everyone}; each rank must appear in "
                                f"exactly one pipeline position")
    return PipelineLayout(grid=grid, stage_rank=stage_rank, dp=first.dp, tp=first.tp)


def _flat(d: int, t: int, dp: int, tp: int, dp_major: bool) -> int:
    return d * tp + t if dp_major else t * dp + d


def device_mesh(layout: PipelineLayout, device: torch.device) -> DeviceMesh:
    """The (pp, dp, tp) mesh of the rank grid; torch's init_device_mesh when the grid is in rank
    order (Megatron's, which the planner writes), a DeviceMesh over the grid as given otherwise."""
    grid = torch.tensor(layout.grid)
    names = ("pp", "dp", "tp")
    if torch.equal(grid.flatten(), torch.arange(grid.numel())):
        return init_device_mesh(device.type, tuple(grid.shape), mesh_dim_names=names)
    return DeviceMesh(device.type, grid, mesh_dim_names=names)


def expert_meshes(layout: PipelineLayout, plan: Plan, device: torch.device) -> dict[int, DeviceMesh]:
    """A (pp, edp, ep) mesh over the rank grid for each ep > 1 of the plan's stages (module doc),
    made in the same order on every rank (making one is a collective)."""
    grid = torch.tensor(layout.grid)
    ranks = layout.dp * layout.tp
    return {ep: DeviceMesh(device.type, grid.reshape(layout.pp, ranks // ep, ep),
                           mesh_dim_names=("pp", "edp", "ep"))
            for ep in sorted({stage.ep for stage in plan.stages} - {1})}
