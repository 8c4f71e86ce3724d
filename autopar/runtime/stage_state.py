"""The model's state as the stages hold it: which stage holds each buffer, and whose values.

- `hold_unread_buffers`: every buffer of `model.state_dict()` is held by some stage, one that no
  op of the graph reads too (BatchNorm's `num_batches_tracked` in eval mode, which only training
  writes): by the stage whose layers hold its module, else the first. `full_state_dict`,
  checkpoints and `load_from` then see the model's whole state, each tensor once.
- `broadcast_from_first_rank`: what a stage's ranks copied from their own `model` is made the
  first rank's of the stage, before sharding, as torch's DDP broadcasts parameters and buffers
  from rank 0 at its start (rank 0 holds the first stage; stage k's first rank is the first of
  its pipeline position): replicas that start apart would drift apart. After that each replica
  keeps its own buffers (running statistics of its own samples); `full_state_dict` and
  checkpoints hold the first replica's, as DDP users save rank 0's.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.utils import _sync_module_states

from autopar.passes.program import StageProgram, TensorRef

# DDP's default bucket for the broadcast of its starting state
BROADCAST_BUCKET_BYTES = 250 * 2**20


def hold_unread_buffers(programs: list[StageProgram], model: nn.Module,
                        stage_layers: list[list[str]]) -> None:
    """Give each buffer of the model's state that no stage holds to a stage (see the module
    docstring); `programs` are all the stages of the plan, before any is dropped."""
    held = {ref.fqn for program in programs for ref in program.module.modules()
            if isinstance(ref, TensorRef)}
    names: dict[int, list[str]] = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        names.setdefault(id(buffer), []).append(name)
    parameters = {id(p) for p in model.parameters()}
    for key, tensor in model.state_dict(keep_vars=True).items():
        if id(tensor) in parameters or held.intersection(names.get(id(tensor), [key])):
            continue
        owner = next((index for index, layers in enumerate(stage_layers)
                      if any(key.startswith(layer + ".") for layer in layers)), 0)
        programs[owner].module.add_module(f"held_{key.replace('.', '_')}", TensorRef(key, tensor))
        held.add(key)


def broadcast_from_first_rank(module: nn.Module, mesh: DeviceMesh) -> None:
    """The stage's parameters and buffers as the first rank of its (dp, tp) sub-mesh has them:
    over each tp group from its first rank, then over each dp group from its first rank."""
    for axis in ("tp", "dp"):
        if mesh[axis].size() > 1:
            _sync_module_states(module, mesh[axis].get_group(), BROADCAST_BUCKET_BYTES, src=0,
                                params_and_buffers_to_ignore=())
