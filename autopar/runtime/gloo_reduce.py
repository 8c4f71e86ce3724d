"""FSDP2's gradient reduce-scatter on a CPU (gloo) mesh, without gloo's hidden copy.

gloo's `reduce_scatter_single` copies its whole input, all-reduces the copy and keeps its own
chunk. The copy is a second buffer the size of a layer's gradients, freed only when gloo's worker
thread lets go of it: on a busy machine that can be after the next layer's backward has begun,
so a rank's peak memory changed from run to run by one layer's gradients. FSDP2 already gives
the collective a buffer of its own that it throws away afterwards, so autopar all-reduces that
buffer in place and keeps its chunk: the same communication and the same sums, one buffer less,
and a peak that does not depend on thread timing. NCCL reduce-scatters without a copy, so GPU
meshes keep FSDP2's default."""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from autopar.runtime.fake_tensors import simulated
from autopar.runtime.fsdp_groups import fsdp_param_groups


class InPlaceReduceScatter(ReduceScatter):
    """Reduce-scatter as an in-place all-reduce of FSDP2's own input buffer."""

    def allocate(self, size, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor,
                 group: dist.ProcessGroup, op, async_op: bool = False) -> None:
        if simulated():     # a simulated rank stands for a GPU's, which reduce-scatters
            dist.reduce_scatter_tensor(output_tensor, input_tensor, op=op, group=group)
            return
        dist.all_reduce(input_tensor, op=op, group=group)
        chunks = input_tensor.view(dist.get_world_size(group), -1)
        output_tensor.copy_(chunks[dist.get_rank(group)])


def reduce_in_place_on_cpu(module: nn.Module) -> None:
    """Give every FSDP2 group under `module` on a CPU mesh the in-place reduce-scatter."""
    for sub in module.modules():
        if isinstance(sub, FSDPModule) and _on_cpu(sub):
            sub.set_custom_reduce_scatter(InPlaceReduceScatter())


def _on_cpu(module: FSDPModule) -> bool:
    return all(group.device.type == "cpu" for group in fsdp_param_groups(module))
