"""A backward's moments where FSDP2 reduces group by group (ZeRO-2 and 3): the weight gradients
of the group that runs, the last reduce-scatter's input, the shards reduced so far and the groups
gathered, as cost.memory.peak_bytes weighs them."""

import pytest
import torch
from torch import nn

from autopar.cost.chunk_price import recomputed_regions
from autopar.cost.gradient_flow import backward_moments, first_keepers
from autopar.cost.layout import infer_layout
from autopar.cost.memory import peak_bytes
from autopar.cost.stages import block_mask, parameter_groups
from autopar.models import build_model
from autopar.tracer import capture

SPEC = "llama:layers=3,hidden=64,heads=4,kv_heads=2,ffn=128,seq=32,vocab=256"


def _moments():
    model, inputs = build_model(SPEC, device="meta")
    graph = capture(model, example_inputs=inputs)
    layout = infer_layout(graph, 1, compute_dtype="float32")
    first_kept = first_keepers(graph, layout, [None] * len(graph.nodes), layout.nodes)
    moments = backward_moments(graph, layout, layout.nodes, first_kept, [None] * len(layout.nodes))
    sizes: dict[str, float] = {}
    for name, group in parameter_groups(graph).items():
        sizes[group] = sizes.get(group, 0.0) + layout.param_local[name]
    return moments, sizes


def test_gradients_wait_for_their_group_and_reduce_scatters_follow_the_backward():
    """Within a group's backward the weight gradients never outgrow the group; after it, the
    group is the reduce-scatter input FSDP2 holds and its elements are reduced; under ZeRO-3 the
    running group and the next one the backward meets are gathered."""
    moments, sizes = _moments()
    blocks = sorted(size for group, size in sizes.items() if group.startswith("layers."))
    assert len(set(blocks)) == 1 and len(blocks) == 3
    block = blocks[0]
    assert all(moment.grads <= max(sizes.values()) for moment in moments)
    scattered = {moment.scattering for moment in moments}
    assert None in scattered and block in scattered       # before any reduction, and after a block's
    assert all(s is None or any(abs(s - size) < 1e-6 for size in sizes.values()) for s in scattered)
    reduced = sorted(sum(moment.reduced) for moment in moments)
    assert reduced[0] == 0.0 and reduced[-1] >= 2 * block
    in_blocks = [m for m in moments if m.scattering == block]
    assert in_blocks and all(m.gathered <= 2 * max(sizes.values()) for m in in_blocks)
    assert any(abs(m.gathered - 2 * block) < 1e-6 for m in in_blocks)   # a middle block and the next


def test_a_recomputed_block_lets_go_of_its_input_once_its_backward_is_done():
    """Under full recompute a block keeps only its input, which the checkpoint holds until the
    block's backward is done: by the first block's backward the rank has let go of the inputs
    the later blocks kept. (They were never freed before: a deep model's backward ended holding
    every block's input, and Mixtral 8x22B's ZeRO-3 plan over 128 ranks was over-predicted by 7%.)"""
    model, inputs = build_model(SPEC, device="meta")
    graph = capture(model, example_inputs=inputs)
    layout = infer_layout(graph, 1, compute_dtype="float32")
    regions = recomputed_regions(graph, block_mask(graph), "full")
    chunk_regions = [regions[layout.index[node.name]] for node in layout.nodes]
    moments = backward_moments(graph, layout, layout.nodes, first_keepers(graph, layout, regions, layout.nodes),
                               chunk_regions)
    _, sizes = _moments()
    block = next(size for group, size in sizes.items() if group.startswith("layers."))
    # each block's moments after the one before it was reduced, by how much it had freed
    freed = sorted({(sum(m.reduced), sum(part for _, part in m.freed)) for m in moments if m.scattering == block})
    block_input = 32 * 64 * 4               # a sample's hidden state, fp32
    assert [after - before for (_, before), (_, after) in zip(freed, freed[1:])] == [block_input] * 2


def test_identical_blocks_keep_only_their_first_and_last_moments():
    """Blocks after the first add the same moments, but for what was freed and reduced before
    them, which grows block by block: a plan's fullest is at the first or the last."""
    moments, _ = _moments()
    shapes: dict = {}
    for moment in moments:
        shapes.setdefault((moment.flowing, moment.grads, moment.gathered, moment.scattering), []).append(moment)
    assert max(len(same) for same in shapes.values()) <= 2


def test_a_moment_holds_the_reduce_scatter_input_and_new_shards():
    """Weighed: a first micro-batch's moment holds one group of fp32 gradients (the reduce-scatter
    input), 1/dp of each group reduced so far, the gradients of its group, and under ZeRO-3 what
    it gathers; ZeRO-2 has freed the reduced groups' gathered weights once it reshards them. A
    later micro-batch's holds every shard and the new output of the group it reduces."""
    group, dp, reduced, gathered, grads = 1e5, 4, 3e5, 2e5, 5e4
    moment = (1e6, grads, gathered, group, reduced, 0.0, (group, 0.0), None)
    sizes = dict(params=1e6, gathered=gathered, group=group, weight=1e4, dp=dp, precision="fp32",
                 micro_batches=1, held=1, pipelined=False, activations=0.0, logits=0.0, flowing=0.0,
                 reduce_every=True, moments=[moment])
    three = peak_bytes(**sizes, zero=3)
    assert three["gradients"] == 4 * group + 4 * reduced / dp
    assert three["weights"] == 4 * gathered
    assert three["buffers"] == 1e6 + 4 * grads
    two = peak_bytes(**sizes, zero=2)
    assert two["weights"] == 4 * (1e6 - reduced)
    # a later micro-batch's backward adds each group's reduce-scatter output into its shard
    later = peak_bytes(**{**sizes, "micro_batches": 2}, zero=3)
    assert later["gradients"] == 4 * 1e6 / dp + 4 * group + 4 * group / dp


class _TransposedLinear(nn.Module):
    """A layer that reads its weight through a transpose, as a grouped GEMM reads its experts'
    (w.transpose(-2, -1))."""

    def __init__(self, width: int = 64):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(width, width))

    def forward(self, x):
        return x @ self.weight.transpose(0, 1)


def test_a_model_without_blocks_is_grouped_by_its_units_and_counts_each_weight_gradient_once():
    """Without repeated blocks the runtime wraps each module unit of the stage as an FSDP group
    (cost.units.module_units), so each layer is a group of its own, not the whole model one. The
    gradient an op gives a view of a weight is the weight's gradient, already counted with its
    group's: no moment holds it a second time as a flowing gradient."""
    model = nn.Sequential(nn.Sequential(_TransposedLinear(), nn.ReLU(), _TransposedLinear()))
    graph = capture(model, example_inputs=(torch.randn(8, 64),))
    assert set(parameter_groups(graph).values()) == {"0.0", "0.2"}
    layout = infer_layout(graph, 1, compute_dtype="float32")
    regions = [None] * len(graph.nodes)
    first_kept = first_keepers(graph, layout, regions, layout.nodes)
    moments = backward_moments(graph, layout, layout.nodes, first_kept, regions)
    assert max(moment.grads for moment in moments) == 64 * 64        # one layer's, at a time
    row = 4 * 64                # a sample's activation gradient; at most two flow at once
    assert all(sum(part for _, part in moment.flowing) <= 2 * row for moment in moments)


class _TiedLM(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(32, 16)
        self.mid = nn.Linear(16, 16)
        self.head = nn.Linear(16, 32, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(torch.relu(self.mid(self.embed(ids))))


def test_layers_that_share_a_weight_are_one_group_gathered_and_unreduced_to_the_backward_end():
    """FSDP2 gives a parameter to one group, so the runtime leaves an embedding and the head tied
    to it in the stage's own group: gathered from the head's backward, the first it meets, and
    reduced only after the embedding's, the last. Between them (the middle layer's backward) the
    rank holds the tied weight gathered and its gradient unreduced; at the embedding's, the
    embedding's own gradient of it too, until autograd adds it into the head's."""
    graph = capture(_TiedLM(), example_inputs=(torch.randint(0, 32, (4, 8)),))
    groups = parameter_groups(graph)
    assert len({groups[node.name] for node in graph.parameters if "mid" not in node.param_fqn}) == 1
    layout = infer_layout(graph, 1, compute_dtype="float32")
    regions = [None] * len(graph.nodes)
    moments = backward_moments(graph, layout, layout.nodes, first_keepers(graph, layout, regions, layout.nodes),
                               regions)
    tied, mid = 32 * 16, 16 * 16 + 16
    assert any(moment.grads == tied + mid and moment.gathered >= tied + mid for moment in moments)
    assert max(moment.grads for moment in moments) == 2 * tied


def test_a_single_stage_of_replicas_prices_each_moment_without_the_groups_done_before_it():
    """Plain data parallelism in FSDP2 on a single stage frees each group's gathered weights as
    the group's backward ends, every micro-batch (autopar.plans.zero): a block's moment holds
    none of the head's weights nor those of the blocks backed before it. The moment right after
    the head's backward is priced with the head's weights gone."""
    from autopar.cost.backward_transients import block_transients
    from autopar.cost.chunk_price import Chunk
    from autopar.plans.zero import frees_each_group_after_its_backward

    moments, sizes = _moments()
    after_head = [m for m in moments if 0 < sum(m.reduced) <= sizes["lm_head"] + sizes["norm"]]
    assert after_head and all(sum(m.reduced) >= sizes["lm_head"] for m in after_head)
    for moment in after_head:
        chunk = Chunk(moments=(moment,), flowing_poly={0: 0.0})
        held, freed = (block_transients([chunk], 1, 1, 4, split=False, fsdp=True, resharding=resharding)[1]
                       for resharding in (False, True))
        assert held - freed == 4 * sum(moment.reduced)
    assert frees_each_group_after_its_backward(0, pipelined=False)
    assert not any(frees_each_group_after_its_backward(zero, pipelined=pipelined)
                   for zero, pipelined in ((0, True), (1, False), (2, False)))


def test_the_last_backward_reduces_each_group_as_it_ends_and_keeps_its_output():
    """A single stage that accumulates its gradients whole (ZeRO-0 and 1) reduces them group by
    group as the step's last backward ends each group (autopar.plans.zero), resharding it: a
    later moment holds, beside the accumulated gradients, the fp32 input of the group reduced
    last, and the groups done keep their reduction's output, whole under ZeRO-0, ZeRO's shard
    under ZeRO-1, in place of their accumulated gradients; a step's only backward accumulated
    none before it and keeps those outputs besides. The group being reduced holds its gradients
    and its input, not yet its output."""
    from autopar.cost.backward_transients import block_transients
    from autopar.cost.chunk_price import Chunk
    from autopar.plans.zero import reduces_group_by_group_at_the_last_backward as reduces

    moments, _ = _moments()
    later = [m for m in moments if m.scattering is not None and not any(m.releasing)]
    releasing = [m for m in moments if any(m.releasing)]
    assert later and releasing
    for moment in later + releasing:
        chunk = Chunk(moments=(moment,), flowing_poly={0: 0.0})
        weigh = lambda **kw: block_transients([chunk], 1, 1, 4, split=False, fsdp=True, **kw)[1]
        plain = weigh()
        done = sum(moment.reduced) - sum(moment.releasing)
        resharded = plain - 4 * sum(moment.reduced) + 4 * moment.scattering
        assert weigh(last_reduction=(1.0, 1.0), between=False) == pytest.approx(resharded)
        assert weigh(last_reduction=(0.25, 0.25), between=False) == pytest.approx(resharded - 3 * done)
        assert weigh(last_reduction=(1.0, 1.0), between=False, alone=True) == pytest.approx(resharded + 4 * done)
        # backwards between the first and the last reduce nothing
        assert weigh(last_reduction=(0.25, 0.25)) == pytest.approx(max(plain, resharded - 3 * done))
    assert reduces(0, "1f1b", pipelined=False) and reduces(1, "1f1b", pipelined=False)
    assert reduces(2, "zero-bubble", pipelined=False)
    assert not any((reduces(2, "1f1b", pipelined=False), reduces(3, "1f1b", pipelined=False),
                    reduces(0, "1f1b", pipelined=True), reduces(1, "gpipe", pipelined=True)))


def test_a_first_backward_holds_the_gradients_of_the_groups_done_in_fp32():
    """Where FSDP2 accumulates a step's gradients over its backwards, the step's first backward
    keeps each group's gradients once the group is done, in fp32 (its reduce dtype): in 16-bit
    training a group's end copies its 16-bit gradients into fp32, both alive at that moment; in
    fp32 the gradients are kept as they are. A step's only backward accumulates nothing."""
    from autopar.cost.backward_transients import block_transients
    from autopar.cost.chunk_price import Chunk

    moments, _ = _moments()
    assert any(any(m.releasing) for m in moments) and any(sum(m.reduced) > sum(m.releasing) for m in moments)
    for moment in moments:
        chunk = Chunk(moments=(moment,), flowing_poly={0: 0.0})
        done, ending = sum(moment.reduced) - sum(moment.releasing), sum(moment.releasing)
        for element in (2, 4):
            weigh = lambda **kw: block_transients([chunk], 1, 1, element, split=False, fsdp=True, **kw)
            plain = weigh()[1]
            copied = 4 * ending if element == 2 else 0.0
            assert weigh()[2] == pytest.approx(plain + 4 * done + copied)
            assert weigh(alone=True)[2] is None
