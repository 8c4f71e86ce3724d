"""Mixed precision: compute in bf16 or fp16, keep fp32 master weights, optimizer state and gradients.

A plan's `precision` is "fp32", "bf16" or "fp16" (FSDP2's MixedPrecisionPolicy and torch.autocast, as
torchtitan and FSDP2 users run it):
- every stage's forward (and the loss) runs under `torch.autocast(dtype=bfloat16 or float16)`:
  matmuls and attention in 16 bits, reductions such as softmax and norms where autocast keeps them
  in fp32; the recomputed forward of a checkpointed layer runs under the same autocast state;
- data parallelism and ZeRO (FSDP2 `replicate` / `fully_shard`) get
  `MixedPrecisionPolicy(param_dtype=<16-bit>, reduce_dtype=float32)`: parameters are gathered and
  used in 16 bits (half the all-gather), gradients are reduced in fp32 (a choice: the sum over many
  replicas keeps fp32's precision, at twice the 16-bit traffic) and land on the fp32 shards;
- parameters, gradients and the optimizer's state stay fp32: the optimizer steps master weights.
Tensor-parallel collectives move activations in the dtype autocast gives them, as Megatron-LM does.

Under data parallelism FSDP2 hands the weights to the forward in 16 bits, while the graph was
traced with fp32 weights: a cast the model computes from a weight's dtype (`input.to(weight.dtype)`
before HuggingFace's grouped expert matmul, which autocast does not cover) was recorded as a cast
to fp32. The pass `autopar.passes.precision.cast_to_weight_dtypes` makes such casts read the weight's dtype when they run, as the
model's own code does; the graph keeps its ops and names (the plan's placements name them).

bf16 has fp32's exponent range, so it needs no loss scaling. fp16's range (6e-8 to 65504) loses
small gradients to underflow, so fp16 scales the loss (torch.amp.GradScaler's dynamic scaling:
multiply the loss by S, divide the gradients by S before the step, skip the step and halve S when a
gradient is inf or NaN, double S after 2000 good steps). The loss is scaled inside the schedule's
loss function, where every form (one stage, torch's pipeline schedules) computes it. Gradients are
sharded (ZeRO, tensor and pipeline parallelism): an overflow seen by one rank must skip the step on
every rank, so the found-inf flag is all-reduced over the whole job, as torch's ShardedGradScaler
does (`LossScaler` is that scaler, checking each rank's local shards).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy
from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError
from autopar.plans.vocabulary import PRECISIONS, Precision


def check_precision(precision: str) -> Precision:
    try:
        return Precision(precision)
    except ValueError:
        raise AutoparError(f"precision={precision!r} is not one of {', '.join(PRECISIONS)}; use "
                           f"'bf16' (or 'fp16' where bf16 is not supported) for mixed "
                           f"precision") from None


def compute_dtype(precision: str) -> torch.dtype | None:
    """The 16-bit dtype a mixed precision computes in (the plan language names it); None for fp32,
    which runs without autocast."""
    chosen = check_precision(precision)
    return None if chosen is Precision.FP32 else getattr(torch, chosen.dtype)


def mp_policy(precision: str) -> MixedPrecisionPolicy | None:
    """FSDP2's policy: 16-bit parameters in compute, fp32 gradient reduction."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return None
    return MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)


def autocast_stage(module: nn.Module, device: torch.device, precision: str) -> None:
    """Run `module`'s forward under autocast, through hooks so that the module (what FSDP wrapped
    and what checkpoints name) stays as it is. The export's dtype checks, which autocast's 16-bit
    values would fail, are gone already (autopar.passes.precision)."""
    dtype = compute_dtype(precision)
    if dtype is None:
        return
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


class LossScaler(ShardedGradScaler):
    """torch's ShardedGradScaler (dynamic loss scaling, found-inf all-reduced over the whole job),
    checking and unscaling each rank's local shards.

    Its own unscale hands DTensor gradients (FSDP2 shards, tensor-parallel parameters) to DTensor's
    rule for the check, which refuses a list that mixes plain tensors and DTensors and reads the
    first gradient's mesh for all of them (a stage holds parameters of the tp mesh, the (dp, tp)
    mesh and none). The flag is all-reduced over the world anyway, so each rank checks what it
    holds: the local tensors."""

    def __init__(self, device: torch.device):
        super().__init__(device.type, process_group=dist.group.WORLD)
        # Every rank needs a scale to unscale with, but only the last pipeline stage's ranks
        # compute the loss, which is where torch creates it.
        self.scale(torch.zeros((), device=device))

    def _unscale_grads_(self, optimizer, inv_scale, found_inf, allow_fp16=True):
        grads: dict[tuple, list[torch.Tensor]] = {}
        for group in optimizer.param_groups:
            for param in group["params"]:
                if param.grad is None:
                    continue
                if param.grad.is_sparse:
                    raise AutoparError("fp16 loss scaling does not handle sparse gradients; use "
                                       "precision='bf16', which needs no scaling")
                local = param.grad.to_local() if isinstance(param.grad, DTensor) else param.grad
                grads.setdefault((local.device, local.dtype), []).append(local)
        found = {}
        with torch.no_grad():
            for (device, _), tensors in grads.items():
                flag = found.setdefault(device, found_inf.to(device, copy=True))
                torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
        # a rank without gradients still takes part in the all-reduce of the flag
        return found or {found_inf.device: found_inf}


def loss_scaler(precision: str, device: torch.device) -> LossScaler | None:
    """The loss scaler the precision needs (fp16), or None."""
    return LossScaler(device) if check_precision(precision).scales_loss else None


def scaled_loss(loss_fn, scaler: LossScaler | None):
    """The loss the schedule backpropagates: multiplied by the scaler's current scale."""
    if scaler is None:
        return loss_fn

    def loss(outputs, targets):
        return scaler.scale(loss_fn(outputs, targets))
    return loss
