"""Element-wise ops, normalizations, softmax, reductions, losses, dropout and creation ops."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard

from autopar.cost.strategies.registry import OpStrategy, OpView, rule

# Sums of partial sums stay partial sums; so do their scalings by one replicated factor.
ADDITIVE = ("aten.add.Tensor", "aten.sub.Tensor")
SCALING = ("aten.mul.Tensor", "aten.mul.Scalar", "aten.div.Tensor", "aten.div.Scalar",
           "aten.neg.default", "aten.clone.default", "aten._to_copy.default", "aten.to.dtype",
           "aten.alias.default", "aten.detach.default",
           "aten.type_as.default", "aten.contiguous.default", "aten.lift_fresh_copy.default",
           "aten.to.device", "aten.to.dtype_layout")
NONLINEAR = ("aten.add.Scalar", "aten.sub.Scalar", "aten.rsub.Scalar", "aten.gelu.default",
             "aten.relu.default", "aten.silu.default", "aten.tanh.default", "aten.sigmoid.default",
             "aten.exp.default", "aten.log.default", "aten.sqrt.default", "aten.rsqrt.default",
             "aten.pow.Tensor_Scalar", "aten.pow.Tensor_Tensor", "aten.erf.default",
             "aten.reciprocal.default", "aten.abs.default", "aten.sin.default", "aten.cos.default",
             "aten.where.self", "aten.masked_fill.Scalar", "aten.masked_fill.Tensor",
             "aten.maximum.default", "aten.minimum.default", "aten.clamp.default",
             "aten.eq.Scalar", "aten.eq.Tensor", "aten.ne.Scalar", "aten.lt.Scalar",
             "aten.gt.Scalar", "aten.logical_not.default", "aten.zeros_like.default",
             "aten.ones_like.default", "aten.full_like.default", "aten.empty_like.default",
             "aten.native_dropout.default", "aten.dropout.default", "aten.tril.default",
             "aten.triu.default", "aten.square.default", "aten.log1p.default", "aten.expm1.default",
             "aten.gelu_backward.default", "aten.bitwise_not.default", "aten.__and__.Tensor",
             "aten.__or__.Tensor", "aten.bitwise_and.Tensor", "aten.bitwise_or.Tensor",
             "aten.le.Tensor", "aten.lt.Tensor", "aten.ge.Tensor", "aten.gt.Tensor",
             "aten.le.Scalar", "aten.ge.Scalar", "aten.ne.Tensor")


def broadcast_strategies(view: OpView) -> list[OpStrategy]:
    """Shard any output dim; an input follows where it has that dim at full size (broadcasting
    aligns from the right) and is replicated where it broadcasts."""
    out = view.output_shape or view.input_shapes[0]
    found = []
    for dim, size in enumerate(out):
        if size == 1:
            continue
        inputs = []
        for shape in view.input_shapes:
            aligned = dim - (len(out) - len(shape))
            inputs.append(Shard(aligned) if aligned >= 0 and shape[aligned] == size else Replicate())
        found.append(OpStrategy(Shard(dim), tuple(inputs)))
    return found


@rule(*ADDITIVE)
def additive(view: OpView) -> list[OpStrategy]:
    found = broadcast_strategies(view)
    # x + scalar on partial sums would add the scalar once per rank
    if len(view.input_shapes) > 1 and all(s == view.output_shape for s in view.input_shapes):
        found.append(OpStrategy(Partial(), tuple(Partial() for _ in view.input_shapes)))
    return found


@rule(*SCALING)
def scaling(view: OpView) -> list[OpStrategy]:
    found = broadcast_strategies(view)
    divisor_index = 1 if view.target.startswith("aten.div") else None
    for k in range(len(view.input_shapes)):
        if k == divisor_index:
            continue        # a partial divisor is not linear
        inputs = tuple(Partial() if i == k else Replicate() for i in range(len(view.input_shapes)))
        found.append(OpStrategy(Partial(), inputs))
    return found


@rule(*NONLINEAR)
def nonlinear(view: OpView) -> list[OpStrategy]:
    return broadcast_strategies(view)


@rule("aten.layer_norm.default", "aten.native_layer_norm.default", "aten.rms_norm.default",
      "aten._fused_rms_norm.default")
def norm(view: OpView) -> list[OpStrategy]:
    """Statistics over the trailing `normalized_shape` dims: any other dim of x may be sharded
    (the sequence dim gives sequence parallelism), weight and bias replicated."""
    rank = len(view.input_shapes[0])
    normalized = view.arg(1) or [view.input_shapes[0][-1]]
    params = (Replicate(),) * (len(view.input_shapes) - 1)
    return [OpStrategy(Shard(d), (Shard(d), *params)) for d in range(rank - len(normalized))]


def _dim(view: OpView, index: int) -> int:
    return view.arg(index, -1) % len(view.input_shapes[0])


@rule("aten._softmax.default", "aten.softmax.int", "aten._log_softmax.default",
      "aten.log_softmax.int", "aten._safe_softmax.default", "aten.cumsum.default",
      "aten.diff.default")
def softmax(view: OpView) -> list[OpStrategy]:
    """Along `dim` (a normalization or a scan): any other dim sharded."""
    dim = _dim(view, 2 if view.target == "aten.diff.default" else 1)
    count = len(view.input_shapes)      # diff's prepend/append follow x on the other dims
    return [OpStrategy(Shard(d), (Shard(d),) * count)
            for d in range(len(view.input_shapes[0])) if d != dim]


SUMS = ("aten.sum.dim_IntList", "aten.sum.default")
REDUCTIONS = SUMS + ("aten.mean.dim", "aten.mean.default", "aten.amax.default",
                     "aten.amin.default", "aten.max.dim", "aten.argmax.default",
                     "aten.var.correction", "aten.var_mean.correction", "aten.logsumexp.default")


@rule(*REDUCTIONS)
def reduction(view: OpView) -> list[OpStrategy]:
    """Dims kept: sharded through. A summed dim sharded: each rank sums its part, a Partial output."""
    rank = len(view.input_shapes[0])
    dims = view.arg(1) if view.target not in ("aten.sum.default", "aten.mean.default") else None
    if dims is None or dims == []:
        reduced = set(range(rank))
    else:
        reduced = {d % rank for d in ([dims] if isinstance(dims, int) else dims)}
    keepdim = bool(view.arg(2, False))
    found = []
    for d in range(rank):
        if d in reduced:
            if view.target in SUMS:
                found.append(OpStrategy(Partial(), (Shard(d),)))
            continue
        out_dim = d if keepdim else d - sum(1 for r in reduced if r < d)
        found.append(OpStrategy(Shard(out_dim), (Shard(d),)))
    return found


@rule("aten.cross_entropy_loss.default", "aten.nll_loss_forward.default", "aten.nll_loss.default",
      "aten.nll_loss_nd.default")
def cross_entropy(view: OpView) -> list[OpStrategy]:
    """logits [N, C, ...], targets [N, ...] to a scalar loss: batch-sharded, each rank's loss a
    part of the whole (Partial); or vocab-parallel (Megatron): logits sharded on the class dim,
    targets replicated, the softmax normalizer combined across ranks inside the op."""
    extra = (Replicate(),) * (len(view.input_shapes) - 2)   # class weights
    found = [OpStrategy(Partial(), (Shard(0), Shard(0), *extra))]
    if view.target == "aten.cross_entropy_loss.default":
        found.append(OpStrategy(Partial(), (Shard(1), Replicate(), *extra)))
    return found


@rule("aten.arange.default", "aten.arange.start", "aten.arange.start_step", "aten.zeros.default",
      "aten.ones.default", "aten.full.default", "aten.empty.memory_format",
      "aten.scalar_tensor.default")
def creation(view: OpView) -> list[OpStrategy]:
    """No tensor inputs: made replicated (a sharded consumer slices it for free)."""
    return []


@rule("aten._assert_tensor_metadata.default", "aten._assert_scalar.default",
      "aten.sym_constrain_range_for_size.default", "aten.new_ones.default",
      "aten.new_zeros.default", "aten.new_empty.default", "aten.new_full.default")
def check_only(view: OpView) -> list[OpStrategy]:
    """Checks, and `new_*` factories that read only the dtype and device of their input: the
    input may be placed anyhow; an output is made replicated."""
    found = []
    for dim in range(len(view.input_shapes[0]) if view.input_shapes else 0):
        found.append(OpStrategy(Replicate(), (Shard(dim),)))
    if view.input_shapes:
        found.append(OpStrategy(Replicate(), (Partial(),)))
    return found
