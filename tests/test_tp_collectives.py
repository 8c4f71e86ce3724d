"""Tensor parallelism communicates each value once per placement its readers need.

A block under sequence parallelism (the residual stream split on the sequence, as Megatron-LM's
sequence parallelism) gathers its two norm outputs once each in forward, however many linears
read them (q, k and v read the first), and reduce-scatters its two partial outputs (attention,
MLP); backward does the reverse: 4 all-gathers and 4 reduce-scatters a block. Partial gradients
of the norms' weights are reduced in one bucket a step, not one all-reduce per parameter. Counted
on real 2-rank steps with torch's CommDebugMode, as the difference between a 3-block and a
2-block GPT, so that what the embedding and the head need does not enter."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork)
import torch.distributed as dist
from torch.distributed.tensor.debug import CommDebugMode

import autopar
from autopar.api import plan_from_config
from autopar.cost.config import Config
from autopar.models import build_model
from autopar.models.gpt import lm_loss

pytestmark = pytest.mark.multiprocess

BATCH, SEQ, HIDDEN = 4, 8, 32


def sequence_parallel_plan(graph):
    """The planner's tensor-parallel placements with every whole (batch, seq, hidden) activation
    (the residual stream, the norms) split on the sequence instead."""
    plan = plan_from_config(graph, "2:cpu", Config(tp=2, global_batch=BATCH, micro_batch=BATCH))
    for name, placements in plan.nodes.items():
        if placements[1] == "R" and graph.node(name).shape == (BATCH, SEQ, HIDDEN):
            placements[1] = "S(1)"
    return plan


def collectives_of_a_step(layers: int) -> dict[str, int]:
    spec = f"gpt:layers={layers},hidden={HIDDEN},heads=4,seq={SEQ},vocab=64"
    model = build_model(spec, device="cpu")[0]
    ids = torch.randint(0, 64, (BATCH, SEQ), generator=torch.Generator().manual_seed(0))
    graph = autopar.capture(model, example_inputs=(ids,))
    compiled = autopar.compile(model, "2:cpu", example_inputs=(ids,), loss_fn=lm_loss, graph=graph,
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                               plan=sequence_parallel_plan(graph))
    compiled.step(ids, ids)
    counter = CommDebugMode()
    with counter:
        compiled.step(ids, ids)
    dist.barrier()
    return {str(op).split(".")[-1]: count for op, count in counter.get_comm_counts().items()}


def per_block() -> dict[str, int]:
    two, three = collectives_of_a_step(2), collectives_of_a_step(3)
    return {op: three.get(op, 0) - two.get(op, 0) for op in set(two) | set(three)}


def test_a_sequence_parallel_block_gathers_each_norm_output_once():
    counts = autopar.launch(per_block, 2, timeout=240)[0]
    assert {op: n for op, n in counts.items() if n} == {"all_gather_into_tensor": 4,
                                                        "reduce_scatter_tensor": 4}


def _placed_locals() -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from autopar.passes import Redistribute
    mesh = init_device_mesh("cpu", (2,))
    tokens_first = torch.randn(2, 8, 4, 6)
    placed = Redistribute(mesh, (Replicate(),))
    heads_first = DTensor.from_local(tokens_first.transpose(1, 2), mesh, [Replicate()], run_check=False)
    every_other = DTensor.from_local(tokens_first[..., ::2], mesh, [Replicate()], run_check=False)
    kept, copied = placed(heads_first).to_local(), placed(every_other).to_local()
    return (kept.data_ptr() == tokens_first.data_ptr(), kept.stride() == heads_first.to_local().stride(),
            copied.is_contiguous())


def test_a_placed_value_is_copied_only_where_its_last_dim_is_strided():
    """Attention's q, k and v (heads before tokens: a transpose, its last dim dense) go on as they
    are; copying them also made attention's output heads-major, so each layer held a second copy of
    it for the output projection's backward. A local whose last dim is strided, which the CPU flash
    kernel misreads, is made dense."""
    assert autopar.launch(_placed_locals, 2, timeout=120)[0] == (True, True, True)


def _placed_weights() -> tuple:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard
    from autopar.passes import Redistribute
    mesh = init_device_mesh("cpu", (2,))
    shard = torch.randn(4, 16, 3)       # a rank's third dim of an expert weight [4, 16, 6]
    weight = DTensor.from_local(shard, mesh, [Shard(2)], run_check=False)
    transposed = weight.transpose(1, 2)                      # [4, 6, 16], split on dim 1, local last dim strided
    kept = Redistribute(mesh, (Shard(1),), weight=True)(transposed).to_local()
    copied = Redistribute(mesh, (Shard(1),))(transposed).to_local()
    return kept.data_ptr() == shard.data_ptr(), copied.data_ptr() != shard.data_ptr()


def test_a_transposed_weight_shard_goes_on_without_a_copy():
    """HuggingFace's experts read their weights transposed ([E, out, in] as [E, in, out]); split
    on their last dim, the transposed shard's last dim is strided. Matmuls take it as it is: a
    copy was made per layer and micro-batch, and kept for the backward (a tensor-parallel
    Mixtral rank held 15% more than planned)."""
    assert autopar.launch(_placed_weights, 2, timeout=120)[0] == (True, True)
