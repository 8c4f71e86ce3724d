"""Graph rewrites: from the model's exported program to the program each of its ranks runs.

A Plan (autopar.plans: stages of layers, per-axis placements, recompute, precision) reaches a
rank's program in one direction:

    program.py          export_for_pipeline: the model for one micro-batch as one flat ATen
                        GraphModule whose tensors are TensorRef modules (named as in the model)
    stage_split.py      split_model: that program cut into the plan's stages (StageProgram), by
                        the rules of autopar.plans.stage_flow that the planner priced with
    stage_interfaces.py what crosses from stage to stage: relays, input and output order,
                        mixed precision's 16-bit boundaries, the meta tensors each stage sends
    then, on each stage the rank holds, the PASSES below in order:
    expert_parallel.py  split_experts: MoE layers (found by structure, experts.py) whose experts
                        are split over the stage's ep ranks, rows dispatched and combined by
                        all-to-all (expert_dispatch.py)
    precision.py        cast_to_weight_dtypes: casts to a weight's dtype follow the weight's
                        dtype at run time (FSDP2 may hand weights in 16 bits)
    recompute.py        recompute_layers: layers (or their attention) under checkpoints
    batch_norm.py       normalize_batch_norms: BatchNorm over each replica's samples, or over
                        all replicas' (sync_batchnorm), with fp32 weights under mixed precision
    context_parallel.py split_sequence: a rank's positions and attention (a ring or all-to-all
                        over the cp ranks, context_attention.py) for its chunks of each sequence
    tensor_parallel.py  shard_tensor_parallel: DTensors with the plan's placements on "tp", a
                        Redistribute where the plan places a value (collectives.py), and what
                        DTensor needs to run an export (dtensor_adapters.py, dtensor_rules.py)
    stage_boundaries.py split_stage_boundaries: values crossing to another stage as each
                        tensor-parallel rank's 1/tp chunk, rebuilt by the receiver (Megatron's
                        scatter/gather)
    precision.py        drop_traced_dtype_checks: mixed precision's values are 16-bit where the
                        trace saw fp32

The runtime (autopar.runtime) runs this: it copies each stage's tensors in before the passes and
wraps the rewritten stage for data parallelism and ZeRO afterwards (FSDP2 is no graph rewrite).
Passes never import the runtime; what both read (TensorRef, StageProgram) is here.
"""

from autopar.passes.batch_norm import normalize_batch_norms
from autopar.passes.collectives import Redistribute
from autopar.passes.expert_parallel import split_experts
from autopar.passes.context_parallel import SequenceSplit, find_sequence_split, split_sequence
from autopar.passes.precision import cast_to_weight_dtypes, drop_traced_dtype_checks
from autopar.passes.program import PassTarget, StageProgram
from autopar.passes.recompute import Recomputed, checkpoint_regions, recompute_layers
from autopar.passes.stage_boundaries import split_stage_boundaries
from autopar.passes.stage_split import split_model
from autopar.passes.tensor_parallel import shard_tensor_parallel

# Each pass: (a stage's program, the plan, where it runs) -> the rewritten program.
PASSES = (
    # first, on each layer's graph as the split traced it: the MoE layers are found by their ops,
    # and their experts' weights placed before tensor parallelism places the rest
    split_experts,
    # on the traced graph, before recompute puts a cast and the op that reads it with a weight
    # in different regions and tensor parallelism inserts its redistributions: casts to a
    # weight's dtype read that weight's dtype at run time (FSDP2 may hand it in 16 bits)
    cast_to_weight_dtypes,
    # on the layers as the split left them: tensor parallelism wraps the stage, and it
    # distributes the tensors of whatever the checkpoints hold
    recompute_layers,
    # BatchNorm over each replica's samples or, under sync_batchnorm, over all replicas'
    normalize_batch_norms,
    # before tensor parallelism, on the traced ATen ops it finds by name; its attention takes
    # the DTensors tensor parallelism hands it (and its positions become replicated ones)
    split_sequence,
    # before FSDP2 (which the runtime applies after the passes): FSDP2 shards what tp left
    shard_tensor_parallel,
    # after tensor parallelism, whose wrapper sends and receives the chunks
    split_stage_boundaries,
    # last: it drops checks from every graph the passes before it made
    drop_traced_dtype_checks,
)


def run_passes(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """`program` rewritten by every pass of PASSES, in order."""
    for rewrite in PASSES:
        program = rewrite(program, plan, target)
    return program


__all__ = ["PASSES", "PassTarget", "Recomputed", "Redistribute", "SequenceSplit", "StageProgram",
           "checkpoint_regions", "find_sequence_split", "run_passes", "split_model"]
