"""ZeRO-2 accumulating a step over several micro-batches: FSDP2 reduce-scatters each one's
gradients into their shards and keeps the weights gathered to the step's last micro-batch (a
single stage) or to its end (a pipeline stage). What a simulated rank holds at its fullest is
what the plan predicts, within the band of a cluster plan."""

import pytest

from autopar.cost.config import Config
from autopar.testing.simulated import assert_holds_as_predicted, simulated


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
