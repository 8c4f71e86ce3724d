"""Ops a GPU runs by another kernel than a CPU, whose kernels keep other tensors for the backward:
a simulated rank of a GPU plan (on CPU fake tensors) runs them as the GPU would, so its memory is
the GPU's.

- scaled_dot_product_attention whose values have another head size than its queries and keys
  (multi-head latent attention's): a GPU runs the memory-efficient kernel; CPU tensors fall back
  to the math kernel, which holds a [heads, tokens, tokens] matrix.
- rms_norm: a GPU runs torch's fused kernel (`_fused_rms_norm`), which keeps its input and each
  row's reciprocal RMS; the CPU's composite computes in fp32 and keeps fp32 copies of the input
  and of the normalized rows for its backward, 4x a bf16 input's bytes. Where the weight's dtype
  is not the input's, the GPU runs the composite too.

A recomputed region runs under these modes again (autopar/passes/recompute.py).
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch._subclasses.fake_tensor import is_fake

from autopar.cost.mesh import Mesh
from autopar.plans import Plan


class _GpuKernels(TorchFunctionMode):
    """The GPU's kernel for the ops of the module docstring."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.ops.aten.scaled_dot_product_attention.default \
                and args[0].shape[-1] != args[2].shape[-1] and not kwargs.get("enable_gqa"):
            return _efficient_attention(*args, **kwargs)
        if func is torch.ops.aten.rms_norm.default and torch.is_grad_enabled() and _fuses(*args):
            return _FusedRMSNorm.apply(*args, *kwargs.values())
        return func(*args, **kwargs)


def _efficient_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False,
                         scale=None, enable_gqa=False):
    # the log-sum-exp the backward reads, kept whenever autograd records (by the grad mode, not
    # the inputs: a recomputed forward must save what the first one saved)
    return torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, attn_mask, torch.is_grad_enabled(), dropout_p, is_causal,
        scale=scale)[0]


def _fuses(value, shape, weight=None, *rest) -> bool:
    """Whether a GPU runs this rms_norm fused: torch falls back to the composite where the weight
    has another dtype than the input (fp32 weights beside 16-bit activations under autocast)."""
    return weight is None or weight.dtype == value.dtype


class _FusedRMSNorm(torch.autograd.Function):
    """rms_norm keeping what the GPU's fused kernel keeps (its input, weight and the fp32
    reciprocal RMS of each row). Its backward on fake tensors is the fused backward's, which
    makes the input's and the weight's gradients and nothing else (the composite's fp32
    temporaries, several times the input's bytes, live in no GPU kernel); on real tensors, which
    have no CPU kernel for it, the composite's."""

    @staticmethod
    def forward(ctx, value, shape, weight=None, eps=None):
        with torch.no_grad():
            output = torch.ops.aten.rms_norm.default(value, shape, weight, eps)
            dims = tuple(range(-len(shape), 0))
            reciprocal = value.float().pow(2).mean(dims, keepdim=True).rsqrt()
        ctx.shape, ctx.eps = shape, eps
        ctx.save_for_backward(value, weight, reciprocal)
        return output

    @staticmethod
    def backward(ctx, grad):
        value, weight, reciprocal = ctx.saved_tensors
        if is_fake(value):
            grad_value, grad_weight = torch.ops.aten._fused_rms_norm_backward(
                grad, value, ctx.shape, reciprocal, weight, [True, weight is not None])
            return grad_value, None, grad_weight, None
        inputs = [value.detach().requires_grad_()]
        if weight is not None:
            inputs.append(weight.detach().requires_grad_())
        with torch.enable_grad():
            output = torch.ops.aten.rms_norm.default(inputs[0], ctx.shape,
                                                     inputs[1] if weight is not None else None, ctx.eps)
            grads = torch.autograd.grad(output, inputs, grad)
        return grads[0], None, grads[1] if weight is not None else None, None


def for_gpus(plan: Plan) -> bool:
    """Whether the plan's devices are GPUs: the simulation itself runs on CPU tensors, so where a
    GPU runs otherwise (kernels, collectives, the optimizer's step) it is told to."""
    return Mesh.from_dict(plan.mesh).device.name != "cpu"


@contextlib.contextmanager
def kernels_as_the_device_runs(plan: Plan):
    """A GPU plan's ops by the kernels a GPU would choose where the CPU's differ."""
    if not for_gpus(plan):
        yield
        return
    with _GpuKernels():
        yield
