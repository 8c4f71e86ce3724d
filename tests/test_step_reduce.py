"""A pipeline stage that accumulates its gradients whole reduces them once, after its last backward,
group by group (cost/step_reduce.py): a moment the estimator left out, when a stage held its
fp32 gradients, a group's reduce input and output, and the group's last gradient at once."""

import pytest

from autopar.cost.config import Config
from autopar.cost.step_reduce import REDUCED_BYTES, reduce_phases
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import assert_holds_as_predicted, simulated_hf

SMALL = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=128, vocab_size=8192)


def test_each_group_reduces_beside_the_groups_after_it_whole_and_those_before_it_as_shards():
    # an embedding (one tensor), then a layer whose last tensor is a norm's
    order = ((1000.0, 1000.0, False), (600.0, 10.0, False))
    first, second = reduce_phases(order, (1.0, 1.0), weights=2 * 1600.0, element=2, zero=1, splits=(4, 4))
    # the embedding's gradient (kept by FSDP2 until its reduce returns), its input and output,
    # and the layer's whole gradients; its 16-bit weights freed
    assert first == {"weights": 2 * 600.0, "gradients": REDUCED_BYTES * (1000 + 1000 + 250 + 600),
                     "activations": 0.0, "buffers": 0.0, "optimizer_step": 0.0}
    # the embedding's shard, the layer's input, output and last gradient
    assert (second["weights"], second["gradients"]) == (0.0, REDUCED_BYTES * (250 + 600 + 150 + 10))


def test_plain_data_parallelism_all_reduces_a_copy_of_each_group():
    order = ((1000.0, 1000.0, False), (600.0, 10.0, False))
    phases = reduce_phases(order, (1.0, 1.0), weights=2 * 1600.0, element=2, zero=0, splits=(1, 1))
    assert [phase["gradients"] for phase in phases] == [REDUCED_BYTES * (1600 + 1000), REDUCED_BYTES * (1600 + 600)]


@pytest.mark.slow
@pytest.mark.parametrize("config", [Config(dp=2, pp=2, zero=1, recompute="full", global_batch=8),
                                    Config(dp=2, pp=2, zero=3, schedule="zero-bubble", global_batch=8)],
                         ids=["zero1 full recompute", "zero3 zero-bubble"])
def test_a_first_stage_holds_what_its_step_end_reduction_was_priced_with(config):
    """Qwen3's first stage in bf16: the embedding's fp32 gradient, its reduce input and output
    at the step's end were 8.6% (ZeRO-1 under full recompute) and 4.1% (ZeRO-3 zero-bubble) more
    than the fullest backward the estimator priced."""
    architecture = Architecture(name="qwen3", model_class="Qwen3ForCausalLM", config_class="Qwen3Config",
                                kind="held out", config=SMALL)
    report = simulated_hf(architecture, config, seq=128, precision="bf16")
    assert_holds_as_predicted(report)
