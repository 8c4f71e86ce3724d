"""The parameter groups of an FSDP2 module, as torch's versions keep them: one group a module
(`FSDPState._fsdp_param_group`, torch <= 2.11) or a list of them (`_fsdp_param_groups`, later).
The runtime reads them to pick the reduce-scatter of a CPU mesh and to fold the gradients of a
zero-bubble weight backward."""

from __future__ import annotations

from torch.distributed.fsdp import FSDPModule


def fsdp_param_groups(module: FSDPModule) -> list:
    state = module._get_fsdp_state()
    if hasattr(state, "_fsdp_param_groups"):
        return list(state._fsdp_param_groups)
    group = getattr(state, "_fsdp_param_group", None)
    return [] if group is None else [group]
