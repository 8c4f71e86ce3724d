"""ZeRO-2 accumulating a step over several micro-batches: FSDP2 reduce-scatters each one's
gradients into their shards and keeps the weights gathered to the step's last micro-batch (a
single stage) or to its end (a pipeline stage). What a simulated rank holds at its fullest is
what the plan predicts, within the band of a cluster plan."""

import pytest

from autopar.cost.config import Config
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import assert_holds_as_predicted, simulated, simulated_hf


def test_a_middle_micro_batch_holds_the_earlier_shards_with_the_weights_gathered():
    """The second of three micro-batches reduces its groups beside the shards of the first with
    every weight still gathered; only the third frees them group by group. Priced as the third,
    the middle one held 6.7% more than predicted."""
    _, [report] = simulated("llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=16,vocab=4096", "4:cpu",
                            Config(dp=4, zero=2, global_batch=12, micro_batch=1))
    assert_holds_as_predicted(report)


@pytest.mark.parametrize("rank", [0, 3])
def test_a_pipeline_stage_holds_its_weights_and_the_last_reduction_it_made(rank):
    """A pipeline stage keeps its weights gathered through every backward (8.8% under on the
    first stage when its later backwards were priced as freeing them), and into the next
    backward only the input of the reduce-scatter it made last, its first layer's, not its
    largest group's: the head stage was priced 8.9% over, its vocabulary-sized head counted
    again at the loss."""
    _, [report] = simulated("gpt:layers=2,hidden=64,heads=4,seq=64,vocab=4096", "4:cpu",
                            Config(dp=2, pp=2, zero=2, global_batch=8, micro_batch=1), ranks=[rank])
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_each_chunk_of_an_interleaved_rank_keeps_its_own_last_reduction():
    """Each of an interleaved rank's chunks is an FSDP2 root of its own and keeps the input of
    the reduce-scatter it made last until the step's last backward: four chunks, four such
    buffers. Priced as one, a rank of four chunks held 5.5% more than predicted (the GPT-3 175B
    plan's interleaved ZeRO-2 ranks, eight chunks each, 15%)."""
    _, [report] = simulated("gpt:layers=8,hidden=128,heads=4,seq=64,vocab=2048", "1x4:a100-80g",
                            Config(dp=2, pp=2, zero=2, schedule="interleaved-1f1b", virtual=4,
                                   global_batch=16, micro_batch=2))
    assert_holds_as_predicted(report)


@pytest.mark.slow
@pytest.mark.parametrize("config, precision", [
    (Config(dp=2, pp=2, zero=0, schedule="gpipe", global_batch=8), "bf16"),
    (Config(dp=2, pp=2, zero=1, global_batch=8, micro_batch=2), "bf16"),
    (Config(dp=2, pp=2, zero=1, global_batch=8, micro_batch=2), "fp32")], ids=["gpipe bf16", "1f1b bf16", "1f1b fp32"])
def test_a_first_stage_first_backward_holds_the_gradients_it_has_accumulated(config, precision):
    """Mistral's first stage, without recompute: at the end of the step's first backward it holds
    every other micro-batch's activations, the fp32 gradients of every group and, as FSDP2 copies
    the embedding's 16-bit gradient into fp32, that gradient too. Priced with no gradients (and
    the heaviest one beside the fullest flowing moment) it held 3.7% (gpipe) and 3.5% (1F1B, two
    micro-batches of two) more than predicted in bf16, and 8.0% less in fp32."""
    architecture = Architecture(name="mistral", model_class="MistralForCausalLM", config_class="MistralConfig",
                                kind="held out", config=dict(
                                    num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128,
                                    vocab_size=8192))
    report = simulated_hf(architecture, config, seq=128, precision=precision)
    assert_holds_as_predicted(report)
