"""Forward FLOPs of one ATen op, from the shapes in its fx node's `meta["val"]`.

What is counted: a multiply-add is 2 FLOPs. Matmuls (linear, mm, addmm, bmm, baddbmm, matmul,
mv, dot, einsum, convolution) count 2*M*N*K plus one per output element for a bias or `beta` term. Attention
(`scaled_dot_product_attention` and its fused variants) counts the two matmuls over the FULL
score matrix, 2*B*H*Sq*Sk*(Dqk + Dv), even when causal, as Megatron-LM's and the PaLM paper's
MFU formulas do, plus ~5 per score for the softmax. Norms ~5 per input element, softmax ~5,
elementwise ops 1 per output element, reductions 1 per input element, losses ~4 per input element.
A grouped matmul (`autopar::grouped_mm`, torch's `_grouped_mm` or transformers' `grouped_mm_fallback`,
the experts of a mixture-of-experts layer: rows [M, K]
sorted by expert times weights [E, K, N]) counts 2*M*N*K: each row meets one expert, so the count
is the experts the tokens actually use (k of E per token), however the rows fall among them.
Views, embeddings (a gather), factories and getitem count 0. A training step is usually estimated as
3x the forward (backward = 2x); `Graph.forward_flops` sums this over the graph.
"""

from __future__ import annotations

import math

import torch

from autopar.cost.compute import op_family

_PER_ELEMENT = {"norm": 5, "softmax": 5, "loss": 4, "reduction": 1}


def forward_flops(node: torch.fx.Node) -> int:
    """FLOPs of one forward execution of an ATen fx node (0 for placeholders and views)."""
    if node.op != "call_function" or not isinstance(node.target, torch._ops.OpOverload):
        return 0
    name = node.target.__name__.split(".")[0]
    counter = _MATMUL_COUNTERS.get(name)
    if counter is not None:
        return counter(node)
    family = op_family(str(node.target))
    if family == "attention":
        return _attention(node)
    if family in ("view", "embedding"):
        return 0
    if family == "elementwise":
        return _numel(node.meta.get("val"))
    # Families without a formula of their own (a matmul variant with no counter) count as
    # elementwise over their first input rather than failing.
    return _PER_ELEMENT.get(family, 1) * _numel(_tensor_arg(node, 0))


def _numel(value) -> int:
    if isinstance(value, torch.Tensor):
        return math.prod(int(size) for size in value.shape)
    if isinstance(value, (tuple, list)):
        return sum(_numel(item) for item in value)
    return 0


def _tensor_arg(node: torch.fx.Node, index: int):
    arg = node.args[index] if index < len(node.args) else None
    return arg.meta.get("val") if isinstance(arg, torch.fx.Node) else None


def _shape(node: torch.fx.Node, index: int) -> tuple[int, ...]:
    value = _tensor_arg(node, index)
    return tuple(int(size) for size in value.shape) if isinstance(value, torch.Tensor) else ()


def _output_numel(node: torch.fx.Node) -> int:
    value = node.meta.get("val")
    return _numel(value[0] if isinstance(value, (tuple, list)) else value)


def _linear(node: torch.fx.Node) -> int:
    """input [..., K] @ weight[N, K].T (+ bias): 2 * outputs * K (+ outputs)."""
    outputs = _output_numel(node)
    has_bias = len(node.args) > 2 and node.args[2] is not None
    inner = _shape(node, 1)[-1] if _shape(node, 1) else 0
    return 2 * outputs * inner + (outputs if has_bias else 0)


def _mm_like(first: int, with_bias: bool):
    """mm/bmm/matmul (operands at args[first], args[first+1]): 2 * outputs * K."""
    def count(node: torch.fx.Node) -> int:
        outputs = _output_numel(node)
        inner = _shape(node, first)[-1] if _shape(node, first) else 0
        return 2 * outputs * inner + (outputs if with_bias else 0)
    return count


def _convolution(node: torch.fx.Node) -> int:
    """2 * outputs * (in_channels / groups) * kernel elements (+ bias)."""
    weight = _shape(node, 1)
    outputs = _output_numel(node)
    has_bias = len(node.args) > 2 and node.args[2] is not None
    return 2 * outputs * math.prod(weight[1:]) + (outputs if has_bias else 0)


def _einsum(node: torch.fx.Node) -> int:
    """2 x the product of every index's size (each output element sums over the other indices)."""
    equation, operands = node.args[0], node.args[1]
    inputs = equation.replace(" ", "").split("->")[0].split(",")
    sizes = {}
    for letters, operand in zip(inputs, operands):
        value = operand.meta.get("val") if isinstance(operand, torch.fx.Node) else None
        if isinstance(value, torch.Tensor) and "." not in letters:
            sizes.update(zip(letters, (int(size) for size in value.shape)))
    return 2 * math.prod(sizes.values()) if sizes else 0


def _attention(node: torch.fx.Node) -> int:
    query, key, value = _shape(node, 0), _shape(node, 1), _shape(node, 2)
    if not (query and key and value):
        return 0
    *batch, q_len, qk_dim = query
    k_len, v_dim = key[-2], value[-1]
    scores = math.prod(batch) * q_len * k_len
    return 2 * scores * (qk_dim + v_dim) + 5 * scores


_MATMUL_COUNTERS = {
    "linear": _linear,
    "mm": _mm_like(0, False), "bmm": _mm_like(0, False), "matmul": _mm_like(0, False),
    "addmm": _mm_like(1, True), "baddbmm": _mm_like(1, True), "mv": _mm_like(0, False),
    "dot": _mm_like(0, False), "addmv": _mm_like(1, True), "einsum": _einsum,
    "grouped_mm": _mm_like(0, False), "_grouped_mm": _mm_like(0, False),
    "grouped_mm_fallback": _mm_like(0, False),
    "convolution": _convolution, "conv1d": _convolution, "conv2d": _convolution,
    "conv3d": _convolution, "_convolution": _convolution,
}
