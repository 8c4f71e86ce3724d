"""What a backward holds beside the kept activations, as priced, on models the zoo does not have:
a quotient's derivative, zero-bubble's split backward, and where the heaviest weight gradient
is made. Each case held less than predicted by more than the band (or, zero-bubble, more)."""

import pytest

from autopar.cost.config import Config
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import assert_holds_as_predicted, assert_sent_as_priced, simulated, simulated_hf

SMALL = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=128, vocab_size=8192)


def _hf(model_class: str, config_class: str) -> Architecture:
    return Architecture(name=model_class, model_class=model_class, config_class=config_class,
                        kind="held out", config=SMALL)


@pytest.fixture(autouse=True)
def _sequences_of_128(monkeypatch):
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)


def test_dividing_by_a_constant_makes_no_quotient_to_differentiate():
    """Granite divides its logits by a constant: the backward is the gradient divided, with none
    of a tensor quotient's temporaries. Priced with them, two logits-sized tensors too many a
    sample: -10.9%."""
    report = simulated_hf(_hf("GraniteForCausalLM", "GraniteConfig"),
                          Config(dp=4, zero=2, global_batch=8, micro_batch=2))
    assert_holds_as_predicted(report)


def test_a_split_input_backward_keeps_its_graph_and_the_gradients_its_weights_need():
    """Zero-bubble's input backward keeps the loss's copy until it runs and what its weights'
    backward reaches of its graph, and the gradients its weights' backward will read
    accumulate as it runs; it makes no weight gradient. The last stage held 7.5% more than
    priced."""
    _, [report] = simulated("gpt-tiny", "4:cpu", Config(pp=2, dp=2, zero=1, schedule="zero-bubble",
                                                        global_batch=8, micro_batch=2), ranks=(2,))
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_the_scaled_logits_of_a_split_backward_are_priced_once():
    """Cohere scales its logits: priced with the weight gradient an input backward does not make,
    the last zero-bubble stage was -5.2%."""
    report = simulated_hf(_hf("CohereForCausalLM", "CohereConfig"),
                          Config(dp=2, pp=2, schedule="zero-bubble", global_batch=8, micro_batch=1),
                          rank=2)
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_the_heaviest_weight_gradient_is_made_where_the_backward_has_freed_most():
    """The embedding's gradient, the stage's heaviest, is made last, when the micro-batch's
    activations and its rerun are freed: priced beside the fullest moment of the backward, a
    first stage under full recompute was -8.9%."""
    report = simulated_hf(_hf("Qwen3ForCausalLM", "Qwen3Config"),
                          Config(dp=2, pp=2, zero=1, recompute="full", global_batch=8, micro_batch=1))
    assert_holds_as_predicted(report)


def test_reduce_scatter_inputs_the_other_chunks_keep_stay_through_a_chunks_reductions():
    """An interleaved rank's other chunks keep their last reduce-scatter inputs while this chunk
    reduces its own groups: priced as this chunk's alone once it had reduced one, Qwen3's first
    chunk (its embedding's gradient reduced last) held 4.1% more than predicted."""
    arch = Architecture(name="Qwen3ForCausalLM", model_class="Qwen3ForCausalLM",
                        config_class="Qwen3Config", kind="held out",
                        config={**SMALL, "num_hidden_layers": 8})
    report = simulated_hf(arch, Config(dp=2, pp=2, zero=2, schedule="interleaved-1f1b", virtual=4,
                                       global_batch=8, micro_batch=1))
    assert_holds_as_predicted(report)


@pytest.mark.parametrize("stored, read_transposed", [(2, True), (0, False), (1, False), (2, False)])
def test_a_weight_gathered_whole_holds_the_copies_dtensor_makes(stored, read_transposed):
    """DTensor gathers a split tensor into one output stacked on the first dim, copies a strided
    local shard dense first, and concatenates the chunks where the split dim is another: the
    bytes alive at the fullest of the gather, on a fake process group of 2 ranks, are those
    `cost.layout._gathering` prices."""
    import torch
    import torch.distributed as dist
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate, Shard
    import torch.testing._internal.distributed.fake_pg  # noqa: F401

    from autopar.cost.layout import _gathering
    from autopar.simulate.memory import MemoryRecorder

    dist.init_process_group("fake", rank=0, world_size=2,
                            store=torch.testing._internal.distributed.fake_pg.FakeStore())
    try:
        mesh = init_device_mesh("cpu", (2,))
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        with fake:
            weight = DTensor.from_local(torch.empty(4, 64, 32), mesh, [Shard(stored)], run_check=False)
            read = weight.transpose(1, 2) if read_transposed else weight
            with MemoryRecorder(fake) as memory:
                whole = read.redistribute(mesh, [Replicate()]).to_local()
            split = read.placements[0].dim
            contiguous = read.to_local().is_contiguous()
        elements = whole.numel()
        assert memory.peak == _gathering(f"S({split})", contiguous, 2) * elements * 4
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_the_experts_gathered_whole_for_their_backward_are_priced_with_the_gathers_copies():
    """A tp2 stage runs GraniteMoe's experts replicated on weights split on their hidden dim:
    the backward gathers them again, a dense copy of the transposed shard, the all-gather's
    output and its concatenation alive at once, where two whole copies were priced: +3.8%."""
    arch = Architecture(name="GraniteMoeForCausalLM", model_class="GraniteMoeForCausalLM",
                        config_class="GraniteMoeConfig", kind="held out",
                        config={**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2})
    report = simulated_hf(arch, Config(tp=2, pp=2, global_batch=4), rank=0)
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_a_single_stage_of_replicas_backs_its_blocks_without_the_head_it_let_go():
    """Plain data parallelism over the cp ranks (tp2 x cp2, ZeRO-0) on a single stage: FSDP2
    reshards each group as its backward ends, the head's first, so the experts gathered whole
    in the last block's backward (its fullest moment, the tokens halved by cp) meet no gathered
    head. Priced with it, GraniteMoe, Mixtral and OLMoE (held out) were -5.0%..-5.6%."""
    arch = Architecture(name="GraniteMoeForCausalLM", model_class="GraniteMoeForCausalLM",
                        config_class="GraniteMoeConfig", kind="held out",
                        config={**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2})
    report = simulated_hf(arch, Config(tp=2, cp=2, global_batch=4), rank=1, seq=128)
    assert -0.02 <= report.memory_error <= 0.03, report.memory_error


@pytest.mark.slow
@pytest.mark.parametrize("model_class, config_class, extra, config", [
    # the tied weight's accumulated gradient beside its two new ones: was +2.5%
    ("Starcoder2ForCausalLM", "Starcoder2Config", {}, Config(dp=2, cp=2, global_batch=4)),
    # the step's only backward, the layers resharded before the head's: was -5.1%
    ("Gemma2ForCausalLM", "Gemma2Config", {"head_dim": 64}, Config(dp=4, global_batch=4)),
    # ZeRO-1's reduced groups keep their shard, not their accumulated gradients: was -6.1%
    ("Gemma2ForCausalLM", "Gemma2Config", {"head_dim": 64}, Config(dp=2, cp=2, zero=1, global_batch=4)),
], ids=["tied ZeRO-0, 2 micro-batches", "ZeRO-0, 1 micro-batch", "ZeRO-1, 2 micro-batches"])
def test_a_single_stage_reduces_each_group_as_its_last_backward_ends_it(model_class, config_class,
                                                                         extra, config):
    """A single stage of replicas (held out: Starcoder2, Gemma2) reduces its accumulated
    gradients group by group in the step's last backward, resharding each group: the input of
    the group reduced last stays until the next reduction, and the groups done hold their
    reduction's output in place of their accumulated gradients."""
    arch = Architecture(name=model_class, model_class=model_class, config_class=config_class,
                        kind="held out", config={**SMALL, **extra})
    report = simulated_hf(arch, config, rank=1, seq=128)
    assert -0.01 <= report.memory_error <= 0.01, report.memory_error


@pytest.mark.slow
def test_an_input_backward_lets_go_of_what_no_weight_gradient_reaches():
    """Gemma2 caps its logits with a tanh after the LM head: torch's input backward detaches
    the stage's outputs, and the tanh's kept output goes with the graph beyond the last weight,
    which the weight backward does not need. Priced as kept until the weight backward, the
    last zero-bubble stage of pp2 x cp2 (held out) held 7.1% less than predicted."""
    arch = Architecture(name="Gemma2ForCausalLM", model_class="Gemma2ForCausalLM",
                        config_class="Gemma2Config", kind="held out", config={**SMALL, "head_dim": 64})
    report = simulated_hf(arch, Config(pp=2, cp=2, schedule="zero-bubble", global_batch=4), rank=2,
                          seq=128)
    assert -0.01 <= report.memory_error <= 0.01, report.memory_error


@pytest.mark.slow
def test_a_weight_read_whole_is_gathered_again_by_a_split_weight_backward():
    """GraniteMoe's experts on a tp2 stage run replicated, their weights gathered whole as the
    backward unpacks them. Under zero-bubble the input backward does so, and holds them whole
    with the whole gradients the experts' backward makes; torch's weight backward reruns the
    op's backward and gathers them again (a stage after the first: torch runs the first one's
    backward whole, at its weight backward). Priced as an input backward's flowing gradients
    and one gather, the last stage held 9.5% more than predicted and gathered 36% more on tp."""
    arch = Architecture(name="GraniteMoeForCausalLM", model_class="GraniteMoeForCausalLM",
                        config_class="GraniteMoeConfig", kind="held out",
                        config={**SMALL, "num_local_experts": 4, "num_experts_per_tok": 2})
    for rank in (3, 0):
        report = simulated_hf(arch, Config(tp=2, pp=2, schedule="zero-bubble", global_batch=4),
                              rank=rank, seq=128)
        assert_sent_as_priced(report)
        assert -0.02 <= report.memory_error <= 0.01, (rank, report.memory_error)
