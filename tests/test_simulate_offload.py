"""What a simulated rank holds where ZeRO-3 offloads its states to the host, and where a pipeline
stage under ZeRO-3 frees each group's gathered weights after its backward.

A simulated rank's tensors all live on the CPU, so FSDP2's offloaded shards, their gradients and
Adam's state were once counted with the device's: an offloaded rank's simulated peak was the
device's and the host's together, against a prediction of the device's alone. They are now
counted apart (autopar/simulate/rank.py), and the estimator prices an offloaded device without
the gradient shards FSDP2 copies down (cost.memory.peak_bytes(offload=True)): it priced the
device as holding them and two gathered groups of gradients, 22.6% above the simulated device
(here, without recompute) and 30.1% above with full recompute; now 8.6% and 10.6%."""

from __future__ import annotations

from autopar.cost.config import Config
from autopar.simulate.memory import MemoryRecorder
from autopar.testing.simulated import assert_holds_as_predicted, simulated

SPEC = "llama:layers=4,hidden=256,heads=4,kv_heads=2,ffn=512,seq=256,vocab=2048"


def test_an_offloaded_rank_keeps_its_states_on_the_host():
    config = dict(dp=4, zero=3, global_batch=8, micro_batch=1)
    _, [kept] = simulated(SPEC, "4:cpu", Config(**config))
    plan, [offloaded] = simulated(SPEC, "4:cpu", Config(**config, offload=True))
    # never under-predicted; over by 8.6%: the block's backward is priced with the gradient of
    # the largest weight (the embedding's), which FSDP2 has reduced by then
    assert 0.9 <= offloaded.peak_memory_bytes / offloaded.predicted_memory_bytes <= 1.03
    host = plan.predicted["host_memory_bytes"]
    assert offloaded.predicted_host_memory_bytes == int(host)
    # the shards, their gradients and Adam's moments (16 bytes a parameter over 4 ranks), and
    # what the host's Adam step makes besides
    assert host <= offloaded.host_memory_bytes <= 1.15 * host
    assert kept.host_memory_bytes == 0
    # the device no longer holds them
    assert offloaded.peak_memory_bytes <= kept.peak_memory_bytes - 0.9 * host
    assert offloaded.to_dict()["host_memory_bytes"] == offloaded.host_memory_bytes


def test_a_storage_moved_to_the_host_leaves_the_devices_total():
    from torch._subclasses.fake_tensor import FakeTensorMode
    import torch

    fake = FakeTensorMode()
    with fake, MemoryRecorder(fake) as memory:
        shard = torch.empty(1024)
        memory.on_host(shard)
        with memory.allocating_on_host():
            state = torch.empty(512)
        activation = torch.empty(256)
        assert (memory.live, memory.host_live) == (1024, 6144)
        del shard, state
        assert (memory.live, memory.host_live, memory.host_peak) == (1024, 0, 6144)
    del activation


def test_a_pipeline_stage_under_zero_3_frees_each_group_after_its_backward():
    """pp2 x dp2, ZeRO-3, full recompute, the first stage (two layers and the embedding). torch's
    pipeline stage keeps every group gathered from its backward to the end of the stage's
    backward; the runtime frees each as its backward ends (autopar.runtime.schedule.
    ReshardingStage), without gathering any group more often (tests/test_simulate.py counts the
    gathers). Keeping them, this rank held 29.41 MiB, 1.3% over the prediction; now 27.16 MiB."""
    _, [report] = simulated(SPEC, "4:cpu", Config(pp=2, dp=2, zero=3, recompute="full",
                                                  global_batch=8, micro_batch=1))
    assert report.peak_memory_bytes < 0.95 * 29.41 * 2**20
    assert report.peak_memory_bytes <= 1.03 * report.predicted_memory_bytes


def test_a_pipeline_stage_under_zero_2_holds_what_was_predicted():
    """pp2 x dp2, ZeRO-2: both stages' ranks run autopar's ReducingStage (gradients
    reduce-scattered after every micro-batch, weights kept gathered), in the default tier."""
    _, reports = simulated(SPEC, "4:cpu", Config(pp=2, dp=2, zero=2, global_batch=8, micro_batch=1),
                           ranks=(0, 3))
    for report in reports:
        assert_holds_as_predicted(report)
