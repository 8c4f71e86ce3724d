"""A dropless mixture-of-experts layer whose captured graph shows what it is.

    router      linear(hidden -> experts), softmax, top-k, the k gates renormalized to sum to 1
                (Mixtral's softmax over the k chosen logits, Qwen3's `norm_topk_prob`)
    dispatch    each token's k copies sorted by expert (`argsort` of the chosen experts): rows
                [tokens * k, hidden], gathered from the tokens by `index`
    experts     SwiGLU per expert as three grouped matmuls (`autopar::grouped_mm`) over the
                sorted rows, each expert's weights one [experts, in, out] parameter
    combine     the rows put back in token order (the inverse permutation) and summed over the
                k copies, weighted by the gates
    shared      optionally a dense SwiGLU every token runs (DeepSeek's shared experts)

Dropless: every token reaches each of its k experts, whatever the balance, so the step is the
same computation however the experts are spread over ranks. The grouped matmul's output has a
static shape ([tokens * k, out]: each row is one token's copy at one of its experts), so the
graph captures on meta with fixed shapes and its FLOPs count what a token actually uses: k of
the experts' matmuls per token, 2 * tokens * k * in * out per grouped matmul, however the rows
fall among the experts. Which expert a row goes to is data (the `ends` offsets); a cost model
that splits experts over ranks needs an assumption on the balance, which autopar.cost states.

No auxiliary load-balancing loss is added: the model returns logits only, as the other
presets do.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


@torch.library.custom_op("autopar::grouped_mm", mutates_args=())
def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
    """rows [M, K] sorted by group, weight [G, K, N], ends [G] (int64, each group's end row,
    cumulative) -> [M, N]: row r of group g is rows[r] @ weight[g]. One grouped GEMM
    (`torch._grouped_mm`) on 16-bit CUDA operands laid out as it needs; elsewhere a loop over the
    groups, which reads the offsets on the host (on a GPU, a wait for the device each call)."""
    if _one_grouped_gemm(rows, weight):
        return torch._grouped_mm(rows, weight, offs=ends.to(torch.int32))
    out = rows.new_zeros(rows.shape[0], weight.shape[2])
    start = 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            out[start:end] = rows[start:end] @ weight[group]
        start = end
    return out


def _one_grouped_gemm(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    if rows.device.type != "cuda" or not hasattr(torch, "_grouped_mm"):
        return False
    if rows.dtype != torch.bfloat16 or weight.dtype != torch.bfloat16:
        return False
    return aligned_for_grouped_gemm(rows) and aligned_for_grouped_gemm(weight)


def aligned_for_grouped_gemm(tensor: torch.Tensor) -> bool:
    """Whether `torch._grouped_mm` takes `tensor` as it is laid out: 16-byte aligned, every
    stride but the unit one a multiple of 16 bytes."""
    size = tensor.element_size()
    return tensor.data_ptr() % 16 == 0 and all(
        stride * size % 16 == 0 for stride, dim in zip(tensor.stride(), tensor.shape)
        if stride != 1 and dim > 1)


@grouped_mm.register_fake
def _grouped_mm_shape(rows, weight, ends):
    return rows.new_empty(rows.shape[0], weight.shape[2])


@torch.library.custom_op("autopar::grouped_mm_weight_grad", mutates_args=())
def grouped_mm_weight_grad(rows: torch.Tensor, grad: torch.Tensor, ends: torch.Tensor,
                           groups: int) -> torch.Tensor:
    """The gradient of `grouped_mm`'s weight: per group, rows_g^T @ grad_g -> [G, K, N]. On a GPU
    one grouped GEMM over the groups' rows (zeros for a group without rows: an expert no token
    chose), else a loop."""
    if _one_grouped_gemm(rows, grad):
        out = torch._grouped_mm(rows.t(), grad, offs=ends.to(torch.int32))
        filled = torch.diff(ends, prepend=ends.new_zeros(1)) > 0
        return torch.where(filled.view(-1, 1, 1), out, out.new_zeros(()))
    out = rows.new_zeros(groups, rows.shape[1], grad.shape[1])
    start = 0
    for group, end in enumerate(ends.tolist()):
        if end > start:
            out[group] = rows[start:end].transpose(0, 1) @ grad[start:end]
        start = end
    return out


@grouped_mm_weight_grad.register_fake
def _weight_grad_shape(rows, grad, ends, groups):
    return rows.new_empty(groups, rows.shape[1], grad.shape[1])


def _grouped_mm_context(ctx, inputs, output):
    rows, weight, ends = inputs
    ctx.save_for_backward(rows, weight, ends)


def _grouped_mm_backward(ctx, grad):
    rows, weight, ends = ctx.saved_tensors
    # the weights transposed as a view: torch._grouped_mm takes them column-major as they are,
    # and a contiguous copy held a second copy of the experts' weights in every backward
    grad_rows = grouped_mm(grad, weight.transpose(1, 2), ends)
    grad_weight = grouped_mm_weight_grad(rows, grad.contiguous(), ends, weight.shape[0])
    return grad_rows, grad_weight, None


grouped_mm.register_autograd(_grouped_mm_backward, setup_context=_grouped_mm_context)


def _in_the_autocast_dtype(device_type: str):
    """grouped_mm under autocast: its floating operands in the autocast dtype (bf16 or fp16), as a
    plain matmul's would be (on a GPU one grouped GEMM, which takes 16-bit operands only). The
    casts' backward returns fp32 weights' gradients, and the experts keep 16-bit rows for their
    backward, as a GPU's do. (torch.library.register_autocast casts to one fixed dtype.)"""
    key = getattr(torch._C.DispatchKey, "Autocast" + torch._C._dispatch_key_for_device(device_type))

    def kernel(_keys, rows, weight, ends):
        dtype = torch.get_autocast_dtype(device_type)
        with torch._C._ExcludeDispatchKeyGuard(torch._C.DispatchKeySet(key)):
            return torch.ops.autopar.grouped_mm.default(rows.to(dtype), weight.to(dtype), ends)
    return kernel


for _device_type in ("cuda", "cpu"):
    grouped_mm._lib.impl("grouped_mm", _in_the_autocast_dtype(_device_type),
                         "Autocast" + torch._C._dispatch_key_for_device(_device_type), with_keyset=True)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x): a dense layer's MLP, and the shared experts'."""

    def __init__(self, hidden: int, ffn: int):
        super().__init__()
        self.w1 = nn.Linear(hidden, ffn, bias=False)
        self.w3 = nn.Linear(hidden, ffn, bias=False)
        self.w2 = nn.Linear(ffn, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Experts(nn.Module):
    """`experts` SwiGLU experts of width `ffn`, weights stored [experts, in, out]."""

    def __init__(self, hidden: int, ffn: int, experts: int):
        super().__init__()
        self.w1 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w3 = nn.Parameter(torch.empty(experts, hidden, ffn))
        self.w2 = nn.Parameter(torch.empty(experts, ffn, hidden))

    def forward(self, rows: torch.Tensor, ends: torch.Tensor) -> torch.Tensor:
        gate = grouped_mm(rows, self.w1, ends)
        up = grouped_mm(rows, self.w3, ends)
        return grouped_mm(F.silu(gate) * up, self.w2, ends)


class MoE(nn.Module):
    """Top-k routing over `experts` experts, dropless, plus optional shared experts."""

    def __init__(self, hidden: int, *, experts: int, top_k: int, ffn: int, shared_ffn: int = 0):
        super().__init__()
        self.num_experts, self.top_k = experts, top_k
        self.router = nn.Linear(hidden, experts, bias=False)
        self.experts = Experts(hidden, ffn, experts)
        self.shared = SwiGLU(hidden, shared_ffn) if shared_ffn else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        tokens = x.reshape(-1, shape[-1])
        gates, chosen = self.router(tokens).softmax(dim=-1).topk(self.top_k, dim=-1)
        gates = gates / gates.sum(dim=-1, keepdim=True)
        flat = chosen.reshape(-1)
        order = flat.argsort(stable=True)                     # rows sorted by expert
        counts = torch.zeros(self.num_experts, dtype=torch.int64, device=x.device)
        ends = counts.scatter_add(0, flat, torch.ones_like(flat)).cumsum(0)
        rows = tokens.index_select(0, order // self.top_k)    # dispatch
        out_rows = self.experts(rows, ends)
        back = out_rows.index_select(0, order.argsort())     # combine: token order again
        out = (back.view(-1, self.top_k, shape[-1]) * gates.unsqueeze(-1)).sum(dim=1)
        if self.shared is not None:
            out = out + self.shared(tokens)
        return out.view(shape)
