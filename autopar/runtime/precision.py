"""Mixed precision: compute in bf16, keep fp32 master weights, optimizer state and gradients.

A plan's `precision` is "fp32" or "bf16" (FSDP2's MixedPrecisionPolicy and torch.autocast, as
torchtitan and FSDP2 users run it):
- every stage's forward (and the loss) runs under `torch.autocast(dtype=bfloat16)`: matmuls and
  attention in bf16, reductions such as softmax and norms where autocast keeps them in fp32;
  the recomputed forward of a checkpointed layer runs under the same autocast state;
- data parallelism and ZeRO (FSDP2 `replicate` / `fully_shard`) get
  `MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32)`: parameters are gathered and
  used in bf16 (half the all-gather), gradients are reduced in fp32 (a choice: the sum over many
  replicas keeps fp32's precision, at twice bf16's traffic) and land on the fp32 shards;
- parameters, gradients and the optimizer's state stay fp32: the optimizer steps master weights.
Tensor-parallel collectives move activations in the dtype autocast gives them (bf16), as
Megatron-LM does. bf16 has fp32's exponent range, so no loss scaling is needed.

fp16 would need loss scaling (its range underflows small gradients) with the inf check agreed
across every rank of every axis; autopar refuses it rather than train without it.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy

from autopar.errors import AutoparError
from autopar.runtime.pipeline_tensor import drop_metadata_checks

PRECISIONS = {"fp32": None, "bf16": torch.bfloat16}


def check_precision(precision: str) -> None:
    if precision == "fp16":
        raise AutoparError("precision='fp16' needs loss scaling, which autopar does not run yet; use "
                           "precision='bf16' (same speed on GPUs since A100, fp32's range, no scaling)")
    if precision not in PRECISIONS:
        raise AutoparError(f"precision={precision!r} is not one of {sorted(PRECISIONS)}")


def compute_dtype(precision: str) -> torch.dtype | None:
    check_precision(precision)
    return PRECISIONS[precision]


def mp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy: bf16 parameters in compute, fp32 gradient reduction."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def autocast_stage(module: nn.Module, device: torch.device, precision: str) -> None:
    """Run `module`'s forward under autocast, through hooks so that the module (what FSDP wrapped
    and what checkpoints name) stays as it is. The export's dtype checks are dropped: values are
    bf16 where the trace saw fp32, and the checks compute nothing."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return
    drop_metadata_checks(module)
    active: list[torch.autocast] = []

    def enter(_module, _args):
        active.append(torch.autocast(device.type, dtype=dtype))
        active[-1].__enter__()

    def leave(_module, _args, _output):
        active.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    # always_call: leave autocast even when the forward raises
    module.register_forward_hook(leave, always_call=True)


def autocast_loss(loss_fn, device: torch.device, precision: str):
    """The loss under the same autocast as the forward, as a single-process autocast run computes
    it (autocast keeps cross-entropy in fp32)."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return loss_fn

    def loss(outputs, targets):
        with torch.autocast(device.type, dtype=dtype):
            return loss_fn(outputs, targets)
    return loss
