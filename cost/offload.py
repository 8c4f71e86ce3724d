"""ZeRO with CPU offload: model states on the host, moved over PCIe, the optimizer stepped there.

Two forms, by the stage's ZeRO level (`StageSpec.offload`):
  ZeRO-3      (FSDP2's CPUOffloadPolicy, what autopar's runtime runs; DeepSpeed's ZeRO-Infinity
              to CPU) the sharded fp32 parameters, their gradients and Adam's state live on the
              host. Every all-gather first copies the rank's shard up (forward and backward of
              every micro-batch: the weights are freed after each use), every reduce-scatter's
              shard of gradients comes down, and the host steps Adam on the shard. The device
              holds only the weights gathered for the groups that run (and the one prefetched)
              and the unsharded gradients of the group being reduced.
  ZeRO-1/2    (DeepSpeed's ZeRO-Offload) Adam's state and the fp32 master weights live on the
              host: once per step the gradients come down and the updated 16-bit weights go
              up; the device keeps its 16-bit weights and gradients.
Copies run on their own engines, beside the compute (FSDP2 prefetches the next group's shard
with its all-gather; gradients come down while the backward goes on): what a step's copies take
beyond its forward and backward compute is exposed. The host's Adam step is not overlapped
(torch steps after the backward): it is memory-bound on the host, OPTIMIZER_STEP_BYTES_PER_PARAM
bytes per parameter at the host's memory bandwidth for one device (`DeviceSpec.host_figures`,
or what `autopar calibrate` measured: `Efficiencies.host_optimizer_bytes_per_s`), or bound by
the host's FLOP/s at ADAM_FLOPS_PER_PARAM, whichever is slower.
"""

from __future__ import annotations

from autopar.cost.mesh import Mesh
from autopar.cost.memory import (ADAM_STATE_BYTES, GRADIENT_BYTES, MASTER_COPY_BYTES,
                                 OPTIMIZER_STEP_BYTES_PER_PARAM)

# Adam with weight decay per element: the two moment updates, bias corrections, the square
# root, the division and the update (about 12), a host's vector units' work.
ADAM_FLOPS_PER_PARAM = 12
SHARD_BYTES = 4          # the host keeps fp32 parameters and gradients


def offload_time(*, params: float, shard: float, zero: int, gathers: int, reductions: int,
                 compute_s: float, device, host_devices: int, efficiencies) -> tuple[float, float]:
    """(exposed copies, host optimizer step) in seconds per step for one device holding `params`
    parameter elements (after tensor and expert parallelism), of which it steps `shard` (ZeRO's
    share); under ZeRO-3 the shard goes up `gathers` times and its gradients come down
    `reductions` times per step, beside `compute_s` of forward and backward. The host's memory
    and cores serve `host_devices` devices stepping at once."""
    if zero == 3:
        moved = shard * SHARD_BYTES * (gathers + reductions)
        transfers = gathers + reductions
    else:       # the gradients down, the updated 16-bit weights up, once per step
        moved = shard * GRADIENT_BYTES + params * 2
        transfers = 2
    host = device.host_figures
    copies = moved / (host.link.bandwidth * host.link.efficiency) + transfers * host.link.latency
    host_rate = (efficiencies.host_optimizer_bytes_per_s or host.bandwidth) / host_devices
    step = max(shard * OPTIMIZER_STEP_BYTES_PER_PARAM / host_rate,
               shard * ADAM_FLOPS_PER_PARAM / (host.flops / host_devices))
    return max(0.0, copies - compute_s), step


def host_bytes(*, params: float, shards: int, zero: int) -> float:
    """The bytes one device's offloaded states take on its host: ZeRO's shard of `params` with
    its gradients and Adam's state, and the fp32 parameters (ZeRO-3) or master weights (ZeRO-1/2).
    What stays on the device is `cost.memory.peak_bytes(offload=True)`'s."""
    shard = params / max(1, shards if zero >= 1 else 1)
    kept = SHARD_BYTES if zero == 3 else MASTER_COPY_BYTES
    return shard * (kept + GRADIENT_BYTES + ADAM_STATE_BYTES)


def host_memory_share(mesh: Mesh) -> float:
    """The host memory one device of `mesh` has for offloaded states: its host's memory over the
    devices the host serves (those of its node, at most the host's `gpus`); 0 where the host's
    memory is not stated."""
    host = mesh.device.host_figures
    return host.memory_bytes / min(host.gpus, mesh.gpus_per_node)


def host_fits(result) -> bool:
    """Whether the offloaded states fit the host's memory (where it is stated)."""
    limit = result.host_memory_limit_bytes
    return not limit or result.host_memory_bytes <= limit
