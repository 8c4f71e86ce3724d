"""What a tensor-parallel stage sends is what its plan was priced with, on a model whose plan
reads values in other placements than it writes them (GPT-2's fused q, k, v split in three)."""

import pytest

from autopar.cost.config import Config
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import assert_sent_as_priced, simulated_hf


@pytest.mark.parametrize("layers", [2, pytest.param(3, marks=pytest.mark.slow)])
def test_tensor_parallel_collectives_are_priced_as_the_runtime_issues_them(layers, monkeypatch):
    """Three causes, each found by this case:
    - the runtime places no value as a partial sum: an op the plan places P whose inputs arrive
      whole (the cast of a settled lookup) stays whole, and its reader reduces nothing; priced,
      it was one all-reduce more per micro-batch (+9% of the all-reduce bytes);
    - a gradient is moved where the runtime places each value, not once per storage: q and v
      split from one fused projection each gather their own gradient;
    - so is each piece of a tuple (a split's outputs), not once per tuple (4.5% of the gathers
      unpriced)."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    report = simulated_hf("gpt2", Config(dp=2, tp=2, zero=3, global_batch=2, micro_batch=1),
                          n_layer=layers, n_embd=256, n_inner=512, n_positions=128, vocab_size=8192)
    assert_sent_as_priced(report)


def test_a_vocabulary_split_table_keeps_the_gradient_of_its_own_rows(monkeypatch):
    """DTensor's lookup made the whole table's gradient, replicated, and the parameter kept it
    as its gradient (outside FSDP2, which would have taken its rows): the embedding stage of a
    tp2 x pp2 plan held 23% more than priced."""
    from autopar.models import hf_zoo
    from autopar.testing.simulated import assert_holds_as_predicted

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    report = simulated_hf("gpt2", Config(tp=2, pp=2, global_batch=4, micro_batch=1),
                          n_layer=2, n_embd=256, n_inner=512, n_positions=128, vocab_size=8192)
    assert_holds_as_predicted(report)
    assert_sent_as_priced(report)


def test_an_input_read_for_its_dtype_alone_gets_no_gradient_to_gather(monkeypatch):
    """Gemma's norm casts its output back with `type_as(x)`, which gives x no gradient: priced
    as gathering one, the tensor-parallel all-gathers were 5.5% over what the rank sends."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    report = simulated_hf("gemma", Config(dp=2, tp=2, zero=3, global_batch=2, micro_batch=1),
                          num_hidden_layers=1, hidden_size=256, intermediate_size=512, vocab_size=8192,
                          max_position_embeddings=128)
    assert_sent_as_priced(report)


def test_a_value_split_on_the_hidden_dim_crosses_stages_as_it_is_held(monkeypatch):
    """Phi's plan splits the residual stream on the hidden dim at the stage boundary: sent as
    sequence chunks, it took an all-to-all (over gloo, an all-gather) on each side in each
    direction, which the estimator did not price; now each rank sends the chunk it holds."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    report = simulated_hf("phi", Config(tp=2, pp=2, global_batch=4, micro_batch=1),
                          num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=8192,
                          max_position_embeddings=128)
    gathers = [entry for entry in report.collectives if (entry["kind"], entry["axis"]) == ("all_gather", "tp")]
    # the layers' own: 12 gathers of a 128 x 256 fp32 value over 2 ranks, none at the boundary
    assert gathers and gathers[0]["sent_bytes"] == 12 * 128 * 256 * 4 // 2
    assert_sent_as_priced(report)


def test_each_value_read_split_from_a_fused_projection_is_moved_once(monkeypatch):
    """Phi-3's fused q, k, v and gate-up projections are sliced into values the plan reads in
    another placement: the runtime moves each slice (one Redistribute per value), the layout
    moved one per storage, half the reduce-scatter bytes (HF Phi-3, outside the zoo)."""
    from autopar.models import hf_zoo
    from autopar.models.hf_zoo import Architecture

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    phi3 = Architecture(name="phi3", model_class="Phi3ForCausalLM", config_class="Phi3Config",
                        kind="held out", config=dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4,
                                                     num_key_value_heads=2, intermediate_size=512,
                                                     max_position_embeddings=128, vocab_size=8192))
    assert_sent_as_priced(simulated_hf(phi3, Config(tp=2, pp=2, global_batch=4, micro_batch=1)))


def test_a_copy_of_a_partial_sum_is_reduced_first(monkeypatch):
    """With fewer key/value heads than tensor-parallel ranks the plan leaves v a partial sum up to
    its repeat; the reshape after the repeat copies, and DTensor's copy of a partial sum reduces
    it (an all-reduce inside the op, which the simulation now records too). Priced as a
    reduce-scatter at the attention, the rank's reduce-scatters were 2x what it sent."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    report = simulated_hf("mistral", Config(tp=4, global_batch=2, micro_batch=1), rank=1,
                          num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=8192,
                          num_key_value_heads=2, max_position_embeddings=128)
    assert any(entry["kind"] == "all_reduce" for entry in report.collectives)
    assert_sent_as_priced(report)


@pytest.mark.slow
def test_a_factor_scaling_a_partial_sum_gets_a_partial_gradient(monkeypatch):
    """Qwen2-MoE's shared expert is gated by sigmoid(gate(x)), replicated, times the shared
    expert's output, a partial sum under sequence parallelism (mul(R, P) -> P). The gate's
    gradient is that output's gradient times the partial factor: partial, and all-reduced each
    micro-batch, which was priced as arriving whole (+15% of the all-reduce bytes unpriced)."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    report = simulated_hf("qwen2-moe", Config(tp=2, dp=2, sequence_parallel=True, global_batch=4),
                          num_hidden_layers=2, hidden_size=256, intermediate_size=512,
                          moe_intermediate_size=256, shared_expert_intermediate_size=256,
                          vocab_size=8192, max_position_embeddings=128)
    assert_sent_as_priced(report)


@pytest.mark.slow
def test_a_value_computed_from_weights_alone_is_moved_at_its_own_size(monkeypatch):
    """Gemma's norms scale by 1 + w, computed from the weight alone and placed split on a
    sequence-parallel stage: every micro-batch gathers it at its own size. Priced as an
    activation, per sample, its bytes doubled with two sequences a micro-batch and halved with
    half a sequence a rank (context parallelism)."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    sizes = dict(num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=8192,
                 max_position_embeddings=128)
    for config, rank in ((Config(tp=2, dp=2, sequence_parallel=True, global_batch=8, micro_batch=2), 0),
                         (Config(tp=2, cp=2, sequence_parallel=True, global_batch=2), 1)):
        assert_sent_as_priced(simulated_hf("gemma", config, rank=rank, **sizes))


@pytest.mark.slow
def test_each_piece_of_a_split_value_is_redistributed_on_its_own():
    """Phi3's fused gate_up projection is chunked in two; where the plan reduce-scatters both
    pieces (as it does when the embedding is tied to the head), the runtime places each getitem
    apart, one collective a piece. Priced once for the chunk, as one value, the stage
    reduce-scattered 1.5x the bytes priced."""
    phi3 = Architecture(name="phi3", model_class="Phi3ForCausalLM", config_class="Phi3Config", kind="held out",
                        config=dict(num_hidden_layers=4, hidden_size=256, num_attention_heads=4,
                                    num_key_value_heads=2, intermediate_size=512, max_position_embeddings=128,
                                    vocab_size=8192, tie_word_embeddings=True))
    report = simulated_hf(phi3, Config(tp=2, pp=2, global_batch=4), seq=128, precision="fp32")
    assert_sent_as_priced(report)
