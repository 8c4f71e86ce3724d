"""What a recomputed layer's second forward sends again, on models the zoo does not have."""

import pytest

from autopar.cost.config import Config
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import assert_holds_as_predicted, assert_sent_as_priced, simulated_hf

SMALL = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=128, vocab_size=8192)


@pytest.mark.slow
def test_a_value_is_moved_again_where_the_rerun_passes_the_op_that_made_it():
    """Cohere runs attention and MLP side by side and adds both outputs to the residual at the
    layer's end, after the MLP's down projection, where torch's checkpoint stops the rerun. The
    runtime moves the attention's partial output to the sequence split right after the
    attention's output projection (passes.tensor_parallel.share_redistributions), before the
    MLP: the rerun reduce-scatters it again. Priced where the add reads it, after the stop,
    tp4 with sequence parallelism and full recompute (held out) sent 6/5 of the reduce-scatter
    bytes priced."""
    arch = Architecture(name="CohereForCausalLM", model_class="CohereForCausalLM",
                        config_class="CohereConfig", kind="held out", config=SMALL)
    report = simulated_hf(arch, Config(tp=4, sequence_parallel=True, recompute="full", global_batch=4),
                          rank=1, seq=128)
    assert_sent_as_priced(report)
    assert_holds_as_predicted(report)


@pytest.mark.slow
def test_an_op_run_whole_saves_into_the_checkpoint_around_it():
    """OLMoE's experts run replicated on a tp4 stage (passes.dtensor_rules.RunReplicated), which
    saves their weights as shards to gather again. Its saved-tensor hooks were the innermost, so
    torch's checkpoint never saw the experts' rows and activations: full recompute kept them
    through the forward, and the stage held 3.5% more than predicted (held out)."""
    arch = Architecture(name="OlmoeForCausalLM", model_class="OlmoeForCausalLM",
                        config_class="OlmoeConfig", kind="held out",
                        config={**SMALL, "num_experts": 4, "num_experts_per_tok": 2})
    report = simulated_hf(arch, Config(tp=4, sequence_parallel=True, recompute="full", global_batch=4),
                          rank=1, seq=128)
    assert -0.01 <= report.memory_error <= 0.01, report.memory_error
    assert_sent_as_priced(report)
