"""Contractions: the matmul family from einsum equations, attention, embedding lookups and
convolutions."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor._ops._einsum_strategy import EinsumDims

from autopar.cost.strategies.registry import OpStrategy, OpView, rule

LETTERS = "abcdefghijlmopqrstuvwxyz"     # k and n are kept for the contracted and output features


def einsum_strategies(equation: str) -> list[OpStrategy]:
    """One-axis strategies of a two-operand einsum, DTensor's rule: shard a batch dim everywhere,
    a free dim on its operand and the output, or the contracted dim on both (output Partial)."""
    (lhs, rhs), out = EinsumDims.parse_equation(equation)
    dims = EinsumDims.parse_dims([lhs, rhs], out)

    def placed(spec: str, char: str):
        return Shard(spec.index(char)) if char in spec else Replicate()

    found = []
    for char in dims.batch_dims + dims.lhs_out_only_dims + dims.rhs_out_only_dims:
        found.append(OpStrategy(Shard(out.index(char)), (placed(lhs, char), placed(rhs, char))))
    for char in dims.contracting_dims:
        found.append(OpStrategy(Partial(), (Shard(lhs.index(char)), Shard(rhs.index(char)))))
    return found


def with_bias(strategies: list[OpStrategy], bias_rank: int, out_rank: int,
              bias_first: bool = False) -> list[OpStrategy]:
    """Add a broadcast bias (aligned with the output's trailing dims) to each strategy: sharded
    with the output, or Partial with a Partial output (added on one rank only)."""
    found = []
    for strategy in strategies:
        out = strategy.output
        if isinstance(out, Partial):
            bias = Partial()
        elif isinstance(out, Shard) and out.dim >= out_rank - bias_rank:
            bias = Shard(out.dim - (out_rank - bias_rank))
        else:
            bias = Replicate()
        inputs = (bias, *strategy.inputs) if bias_first else (*strategy.inputs, bias)
        found.append(OpStrategy(out, inputs))
    return found


@rule("aten.linear.default")
def linear(view: OpView) -> list[OpStrategy]:
    lead = LETTERS[:len(view.input_shapes[0]) - 1]
    found = einsum_strategies(f"{lead}k,nk->{lead}n")
    if len(view.input_shapes) == 3:
        found = with_bias(found, len(view.input_shapes[2]), len(lead) + 1)
    return found


@rule("aten.mm.default")
def mm(view: OpView) -> list[OpStrategy]:
    return einsum_strategies("mk,kn->mn")


@rule("aten.bmm.default")
def bmm(view: OpView) -> list[OpStrategy]:
    return einsum_strategies("bmk,bkn->bmn")


@rule("aten.addmm.default")
def addmm(view: OpView) -> list[OpStrategy]:
    return with_bias(einsum_strategies("mk,kn->mn"), len(view.input_shapes[0]), 2, bias_first=True)


@rule("aten.baddbmm.default")
def baddbmm(view: OpView) -> list[OpStrategy]:
    return with_bias(einsum_strategies("bmk,bkn->bmn"), len(view.input_shapes[0]), 3,
                     bias_first=True)


@rule("aten.matmul.default")
def matmul(view: OpView) -> list[OpStrategy]:
    """torch.matmul: a 2-D operand against a batched one, or two operands with equal batch dims;
    other broadcasts (1-D operands, size-1 batch dims) run replicated."""
    lhs_shape, rhs_shape = view.input_shapes
    if len(lhs_shape) < 2 or len(rhs_shape) < 2:
        return []
    if len(rhs_shape) == 2:
        lead = LETTERS[:len(lhs_shape) - 2]
        return einsum_strategies(f"{lead}mk,kn->{lead}mn")
    if len(lhs_shape) == 2:
        lead = LETTERS[:len(rhs_shape) - 2]
        return einsum_strategies(f"mk,{lead}kn->{lead}mn")
    if lhs_shape[:-2] == rhs_shape[:-2]:
        lead = LETTERS[:len(lhs_shape) - 2]
        return einsum_strategies(f"{lead}mk,{lead}kn->{lead}mn")
    return []


ATTENTION_OPS = ("aten.scaled_dot_product_attention.default",
                 "aten._scaled_dot_product_flash_attention.default",
                 "aten._scaled_dot_product_efficient_attention.default",
                 "aten._scaled_dot_product_cudnn_attention.default",
                 "aten._scaled_dot_product_flash_attention_for_cpu.default",
                 "autopar.attention.default")


@rule(*ATTENTION_OPS)
def attention(view: OpView) -> list[OpStrategy]:
    """q, k, v [batch, heads, seq, head_dim]: batch or heads sharded on all three (and on a mask
    where it has that dim; autopar's attention with sinks [heads]: heads only, the sinks with
    them); the sequence stays whole because a causal mask needs absolute positions."""
    found = []
    sinks = any(len(shape) == 1 for shape in view.input_shapes[3:])
    # with sinks, the heads only: under a batch split their gradient is a partial sum, which
    # DTensor's rule for the op (passes/dtensor_rules.py) does not give
    for dim in (1,) if sinks else (0, 1):
        inputs = [Shard(dim)] * 3
        for shape in view.input_shapes[3:]:        # an attention mask broadcast to [b, h, s, s]
            if len(shape) == 1:                    # sinks: one logit per head
                inputs.append(Shard(0))
                continue
            offset = 4 - len(shape)
            inputs.append(Shard(dim - offset) if dim >= offset and shape[dim - offset] > 1
                          else Replicate())
        found.append(OpStrategy(Shard(dim), tuple(inputs)))
    return found


@rule("aten.embedding.default")
def embedding(view: OpView) -> list[OpStrategy]:
    """weight [vocab, hidden], ids [...]: ids sharded on any dim (the output follows); hidden
    sharded (the output's last dim); or vocab sharded, each rank looking up its own rows and
    zeroing the rest, an output of partial sums (Megatron's vocab-parallel embedding)."""
    ids_rank = len(view.input_shapes[1])
    found = [OpStrategy(Shard(d), (Replicate(), Shard(d))) for d in range(ids_rank)]
    found.append(OpStrategy(Shard(ids_rank), (Shard(1), Replicate())))
    found.append(OpStrategy(Partial(), (Shard(0), Replicate())))
    return found


CONVOLUTIONS = ("aten.conv1d.default", "aten.conv2d.default", "aten.conv3d.default",
                "aten.conv1d.padding", "aten.conv2d.padding", "aten.conv3d.padding")


@rule(*CONVOLUTIONS, "aten.convolution.default")
def convolution(view: OpView) -> list[OpStrategy]:
    """input [batch, in_channels, *spatial], weight [out_channels, in_channels, *kernel], bias
    [out_channels]: the batch sharded (the weight whole); the output channels sharded with the
    weight's rows and the bias; or the input channels sharded on the input and the weight's
    columns, each rank convolving its channels into a partial sum (the bias added on one rank).
    Channels are split only without groups and for a convolution that is not transposed (whose
    weight is laid out [in, out]); an input without a batch dim has no batch to split."""
    input_shape, weight_shape = view.input_shapes[:2]
    with_bias = len(view.input_shapes) == 3
    if view.target == "aten.convolution.default":
        transposed, groups = view.arg(6, False), view.arg(8, 1)
    else:
        transposed, groups = False, view.arg(6, 1)
    batched = len(input_shape) == len(weight_shape)
    channel = 1 if batched else 0
    found = [OpStrategy(Shard(0), (Shard(0), Replicate()) + ((Replicate(),) if with_bias else ()))] \
        if batched else []
    if transposed or groups != 1:
        return found
    found.append(OpStrategy(Shard(channel), (Replicate(), Shard(0)) + ((Shard(0),) if with_bias else ())))
    found.append(OpStrategy(Partial(), (Shard(channel), Shard(1)) + ((Partial(),) if with_bias else ())))
    return found
