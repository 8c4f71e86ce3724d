"""The interleaved schedule, whose rank holds what its order of actions leaves it
(cost/interleaved_order.py walks that order): under ZeRO-3 torch's schedule runtime gathers a
chunk whole when it enters the next three chunks a rank computes, so with more chunks than that
some wait gathered whole beside the rank's fullest activations; under every ZeRO stage it reduces
and reshards a chunk right after the chunk's last backward, so with as many micro-batches as
pipeline ranks the gradients grow as the activations drain. What a simulated rank holds at its
fullest is what the plan predicts, within the band of a cluster plan."""

import pytest

from autopar.cost.config import Config
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import assert_holds_as_predicted, simulated, simulated_hf

SMALL = dict(num_hidden_layers=8, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=128, vocab_size=8192)


@pytest.mark.slow
@pytest.mark.parametrize("rank", [0, 3])
def test_chunks_gathered_ahead_wait_whole_beside_the_fullest_activations(rank):
    """Four chunks a rank: the runtime evicts and gathers whole again in the steady state.
    Priced as the running chunk's groups alone, the first rank held 7.3% more than predicted."""
    _, [report] = simulated("llama:layers=16,hidden=256,heads=8,kv_heads=4,ffn=512,seq=128,vocab=2048",
                            "1x4:h100-80g", Config(dp=2, pp=2, zero=3, recompute="full",
                                                   schedule="interleaved-1f1b", virtual=4,
                                                   global_batch=16, micro_batch=1), ranks=[rank])
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_the_gradients_a_fullest_moment_holds_are_those_of_the_backwards_before_it(monkeypatch):
    """Four micro-batches: the first chunk (its embedding) waits whole at the fullest forwards,
    but its first backward, and with it its gradients' shards and its embedding-sized
    reduce-scatter input, comes only at the steady state's end. Pricing the chunks waiting at
    the fullest moments beside every chunk's gradients over-predicted Qwen3's first rank by 7.4%."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    arch = Architecture(name="Qwen3ForCausalLM", model_class="Qwen3ForCausalLM",
                        config_class="Qwen3Config", kind="held out", config=SMALL)
    report = simulated_hf(arch, Config(dp=2, pp=2, zero=3, schedule="interleaved-1f1b", virtual=4,
                                       global_batch=8, micro_batch=1))
    assert_holds_as_predicted(report)


@pytest.mark.slow
@pytest.mark.parametrize("spec, config, rank", [
    ("llama:layers=8,hidden=256,heads=8,kv_heads=4,ffn=512,seq=128,vocab=2048",
     Config(dp=2, pp=2, zero=1, schedule="interleaved-1f1b", virtual=4, global_batch=4), 0),
    ("gpt:layers=6,hidden=256,heads=8,seq=128,vocab=2048",
     Config(dp=2, pp=2, zero=3, schedule="interleaved-1f1b", virtual=3, global_batch=4), 3),
])
def test_with_as_many_micro_batches_as_ranks_a_backward_holds_what_its_turn_leaves(spec, config, rank):
    """Two micro-batches on two pipeline ranks: every forward runs before the first backward,
    and each chunk is reduced and resharded right after its last. Priced as the most activations
    beside every chunk's gradients and gathered weights, the llama under ZeRO-1 was over-predicted
    by 22.2% and the GPT under ZeRO-3 by 23.7%."""
    _, [report] = simulated(spec, "1x4:h100-80g", config, ranks=[rank])
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_a_chunk_holds_its_last_reduce_scatter_input_until_its_next_backward_reduces():
    """A pipeline chunk's last op may be the next chunk's first (the boundary), whose FSDP group
    is not the chunk's: counted as a reduction at the backward's start, it hid the reduce-scatter
    input the chunk keeps from its earlier backward (the embedding's, on the first chunk), and
    Qwen3's first rank, on sequences short enough for its gradients to outweigh its activations,
    held 3.5% more than predicted."""
    arch = Architecture(name="Qwen3ForCausalLM", model_class="Qwen3ForCausalLM",
                        config_class="Qwen3Config", kind="held out", config=SMALL)
    report = simulated_hf(arch, Config(dp=2, pp=2, zero=3, schedule="interleaved-1f1b", virtual=4,
                                       global_batch=4, micro_batch=1))
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_the_last_rank_prices_the_loss_backward_at_its_own_turn():
    """The last pipeline rank's fullest backward is its loss's, with the logits' copies and
    gradients beside the activations of that turn. Priced at the walk's turns without the loss's
    transients (bf16 logits of a vocabulary of 8192), it held 14.0% more than predicted."""
    _, [report] = simulated("llama:layers=6,hidden=256,heads=8,kv_heads=4,ffn=512,seq=128,vocab=8192",
                            "1x4:h100-80g", Config(dp=2, pp=2, zero=2, schedule="interleaved-1f1b", virtual=3,
                                                   global_batch=8, micro_batch=2), ranks=[3])
    assert_holds_as_predicted(report)


@pytest.mark.slow
@pytest.mark.parametrize("schedule, virtual", [("interleaved-1f1b", 2), ("zero-bubble", 1)])
def test_a_middle_rank_counts_each_send_once(schedule, virtual, monkeypatch):
    """torch's schedule runtime holds every micro-batch's sends to the step's end, the chunk's
    sent output among them, which its stage also caches for the backward: counted with the sends
    and again with each micro-batch's kept bytes, Starcoder2's second of four ranks held 7.1%
    (interleaved) and 5.5% (zero-bubble) less than predicted."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    arch = Architecture(name="Starcoder2ForCausalLM", model_class="Starcoder2ForCausalLM",
                        config_class="Starcoder2Config", kind="held out",
                        config={**SMALL, "num_hidden_layers": 4 * virtual})     # a layer a chunk
    report = simulated_hf(arch, Config(pp=4, schedule=schedule, virtual=virtual, global_batch=8),
                          rank=1)
    assert_holds_as_predicted(report)
