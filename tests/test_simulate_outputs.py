"""The end of a forward under ZeRO-3: FSDP2 keeps the output of the last group's all-gather (to
overlap its copy-out with the next all-gather) until the root's post-forward, while the model's
outputs leave the stage. A tensor-parallel stage holds its 1/tp of the logits, the logits
gathered whole and their dense copy (autopar.passes.tensor_parallel) then, which with the head's
gathered weights can be fuller than the loss's backward."""

import pytest

from autopar.cost.config import Config
from autopar.testing.simulated import assert_holds_as_predicted, simulated, simulated_hf


@pytest.mark.parametrize("name", ["llama", pytest.param("phi", marks=pytest.mark.slow)])
def test_a_tensor_parallel_stage_holds_its_outputs_leaving_whole_beside_the_last_gathered_group(
        name, monkeypatch):
    """Priced at the loss's backward alone, Llama held 5.3% and Phi 5.9% more than predicted."""
    from autopar.models import hf_zoo

    monkeypatch.setattr(hf_zoo, "SEQ", 128)
    report = simulated_hf(name, Config(dp=2, tp=2, zero=3, global_batch=4, micro_batch=1),
                          num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=8192,
                          max_position_embeddings=128)
    assert_holds_as_predicted(report)


def test_a_later_forward_of_a_pipeline_stage_holds_a_gathered_group_beside_the_last_reduction():
    """Under ZeRO-3 a stage's next forward gathers each group (its weights and FSDP2's
    all-gather output, both alive) while it still holds the input of its last reduce-scatter
    and, with full recompute, what a block's forward makes as it runs. The head stage held 18.4%
    more than priced; the block's forward is now bounded by what its rerun keeps, which
    over-counts here (about 5%) rather than under."""
    _, [report] = simulated("llama-tiny", "4:cpu", Config(pp=2, dp=2, zero=3, recompute="full",
                                                          global_batch=12, micro_batch=1), ranks=[3])
    assert -0.06 <= report.memory_error <= 0.03, (report.peak_memory_bytes, report.predicted_memory_bytes)
