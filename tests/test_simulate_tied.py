"""An embedding tied to the LM head under tensor parallelism, simulated: the head reads the
table split on the vocabulary, and so does the lookup, which makes the gradient of the rank's
rows alone (autopar.passes.vocabulary_lookup). Tied, that gradient meets the head's in autograd's
sum, out of place for DTensors: three of them alive at once."""

from autopar.cost.config import Config
from autopar.testing.simulated import assert_holds_as_predicted, assert_sent_as_priced, simulated_hf


def test_a_lookup_on_a_vocabulary_split_tied_table_makes_its_rows_gradient_beside_the_heads():
    """With DTensor's lookup, which makes the whole table's gradient on every rank, the rank held
    20% more than priced; with the rows alone, priced as one more gradient, 15.5% more."""
    report = simulated_hf("qwen2", Config(dp=2, tp=2, zero=3, global_batch=4, micro_batch=1),
                          num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=8192,
                          max_position_embeddings=128, tie_word_embeddings=True)
    assert_sent_as_priced(report)
    assert_holds_as_predicted(report)


def test_copies_of_a_tied_weight_on_two_pipeline_ranks_sum_what_was_priced():
    """Each copy's ZeRO shard of its gradient, summed over the embedding group once a step:
    the per-rank bytes did not count it at all."""
    report = simulated_hf("gpt2", Config(dp=2, pp=2, zero=2, global_batch=8, micro_batch=1),
                          n_layer=2, n_embd=256, n_inner=512, n_positions=128, vocab_size=8192)
    tied = [entry for entry in report.collectives if (entry["kind"], entry["axis"]) == ("all_reduce", "pp")]
    assert len(tied) == 1 and tied[0]["sent_bytes"] == 8192 * 256 // 2 * 4
    assert_sent_as_priced(report)
    assert_holds_as_predicted(report)
