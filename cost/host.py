"""What the host costs a step where the host runs the compute (gloo ranks on a CPU): the
runtime's machinery per micro-batch (`host_time`: pipeline schedule actions, FSDP2's hooks,
zero-bubble's split of the backward, checkpoints of recomputed regions) and the cores that ranks sharing a host lend each other
(`shared_host_time`). Every figure comes from `autopar calibrate --mesh` and is 0 on GPU meshes,
whose kernels hide the host."""

from __future__ import annotations

from autopar.cost.chunk_price import Chunk
from autopar.cost.compute import Efficiencies
from autopar.cost.mesh import Mesh
from autopar.cost.stages import StageSpec
from autopar.plans.vocabulary import Schedule


def ranks_per_core(mesh: Mesh, eff: Efficiencies) -> float:
    """How many of the mesh's ranks share each core of the host the calibration measured (1
    where ranks have devices of their own)."""
    if not eff.host_cores or eff.device != mesh.device.name:
        return 1.0
    return max(1.0, mesh.world_size / eff.host_cores)


def shared_host_time(per_mb: list[float], m: int, critical: float, sharing: float) -> float:
    """The time of a pipeline whose ranks share a host's cores, as gloo ranks on a CPU do.
    The calibrated prices are those of every rank computing at once; a rank waiting in the
    bubble or on a transfer sleeps and lends its core to the others. So the pipeline takes the
    average rank's work at those prices (the cores are what limits it), or its critical path at
    the speed of a rank with a core of its own, whichever is longer. Measured on 4 ranks sharing
    2 cores: every form's step was 1.1-1.2x its ranks' CPU seconds over 2, pipelines included."""
    return max(m * sum(per_mb) / len(per_mb), critical / sharing)


def host_time(spec: StageSpec, groups: int, chunk: Chunk, *, pipelined: bool, schedule: str,
              eff: Efficiencies) -> float:
    """Per micro-batch, what the runtime's machinery costs a chunk's host: under a pipeline
    schedule, its actions (a forward and a backward; zero-bubble splits the backward in two, and
    torch finds the two halves by walking the chunk's autograd graph, a cost per op), and with
    data parallelism, the hooks of each of its FSDP groups, which visit every parameter tensor
    of the group, and each recomputed region's checkpoint. Zero unless calibrated on a device whose host runs the compute
    (`Efficiencies`)."""
    split = pipelined and schedule == Schedule.ZERO_BUBBLE
    actions = (3 if split else 2) if pipelined else 0
    hooks = (groups * eff.data_parallel_group_latency_s
             + chunk.tensors * eff.data_parallel_tensor_latency_s if spec.dp > 1 else 0.0)
    walk = chunk.autograd_ops * eff.split_backward_op_latency_s if split else 0.0
    checkpoints = (chunk.recomputed_regions * eff.checkpoint_region_latency_s
                   + chunk.recomputed_ops * eff.checkpoint_op_latency_s)
    return actions * eff.pipeline_action_latency_s + hooks + walk + checkpoints
