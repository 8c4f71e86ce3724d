"""The estimator's caller-owned cache: the same answers as without it, refused across graphs."""

import pytest

from autopar.cost.config import Config
from autopar.cost.estimator import StageSpec, estimate, estimate_stages
from autopar.cost.megatron import megatron_placements
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError

CONFIGS = [dict(tp=2, pp=2, dp=2), dict(tp=2, pp=2, dp=2, recompute="full"),
           dict(tp=2, pp=2, dp=2, sequence_parallel=True, recompute="selective"),
           dict(tp=1, pp=4, dp=2, zero=1), dict(tp=4, pp=2, dp=1, micro_batch=2),
           dict(tp=1, pp=2, dp=4, virtual=2, schedule="interleaved-1f1b"),
           dict(tp=2, pp=4, dp=1, schedule="zero-bubble", zero=3), dict(tp=1, pp=1, dp=8, zero=2),
           # the first's chunks at other micro-batch sizes: their shapes are shared (cost/chunk_shape.py)
           dict(tp=2, pp=2, dp=2, micro_batch=1), dict(tp=2, pp=2, dp=2, micro_batch=8, zero=3)]


@pytest.fixture(scope="module")
def tiny_gpt():
    from autopar.commands.estimate import capture_training_step
    return capture_training_step("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1024,dropout=0.1")


def _config(fields: dict) -> Config:
    return Config(**{"global_batch": 32, "micro_batch": 4, **fields})


def megatron_estimate(graph, mesh, config, **options):
    """`estimate` on Megatron-LM's placements (cost.megatron)."""
    placements = megatron_placements(graph, config.tp, sequence_parallel=config.sequence_parallel)
    return estimate(graph, mesh, config, placements=placements, **options)


def _stages(graph, tp: int, dp: int, recompute: str) -> list[StageSpec]:
    placements = megatron_placements(graph, tp)
    return [StageSpec(layers=["model.layers.0"], tp=tp, dp=dp, recompute=recompute, placements=placements),
            StageSpec(layers=["model.layers.1", "model.layers.2"], tp=tp, dp=dp, placements=placements),
            StageSpec(layers=["model.layers.3"], tp=tp, dp=dp, recompute=recompute, zero=1,
                      placements=placements)]


def test_a_shared_cache_gives_the_same_estimates_as_none(tiny_gpt):
    mesh = Mesh.parse("8:a100-80g")
    cache: dict = {}
    stage_caches: dict = {}     # one per mesh
    for _ in range(2):      # the second round answers from the caches alone
        for fields in CONFIGS:
            fresh = megatron_estimate(tiny_gpt, mesh, _config(fields))
            cached = megatron_estimate(tiny_gpt, mesh, _config(fields), cache=cache)
            assert cached.to_dict() == fresh.to_dict(), fields
        for tp, dp, recompute in [(1, 2, "full"), (2, 1, "none"), (1, 2, "selective")]:
            kwargs = dict(global_batch=16, micro_batch=2, schedule="1f1b")
            stages_mesh = Mesh.parse(f"{3 * tp * dp}:a100-80g")
            fresh = estimate_stages(tiny_gpt, stages_mesh, _stages(tiny_gpt, tp, dp, recompute), **kwargs)
            cached = estimate_stages(tiny_gpt, stages_mesh, _stages(tiny_gpt, tp, dp, recompute), **kwargs,
                                     cache=stage_caches.setdefault(tp * dp, {}))
            assert cached.to_dict() == fresh.to_dict(), (tp, dp, recompute)
    assert any(key[0] == "chunk" for key in cache if isinstance(key, tuple))
    shapes = sum(1 for key in cache if isinstance(key, tuple) and key[0] == "chunk_shape")
    assert shapes < sum(1 for key in cache if isinstance(key, tuple) and key[0] == "chunk")


def test_the_graphs_own_analyses_are_made_once(tiny_gpt, monkeypatch):
    """What depends on the graph alone (its expert layers, module units, whether its sequence
    splits) is made on first ask and kept with the graph, not made again per candidate."""
    from autopar.cost import context, units

    expected = context.sequence_split_error(tiny_gpt), units.module_units(tiny_gpt)
    made = []
    for module, name in ((context, "_sequence_split_error"), (units, "_module_units")):
        real = getattr(module, name)
        monkeypatch.setattr(module, name, lambda graph, real=real, name=name: made.append(name) or real(graph))
    graph = type(tiny_gpt)(nodes=tiny_gpt.nodes, blocks=tiny_gpt.blocks)     # none made yet
    for _ in range(3):
        assert (context.sequence_split_error(graph), units.module_units(graph)) == expected
    assert sorted(made) == ["_module_units", "_sequence_split_error"]


def test_a_shared_cache_keeps_host_costs_apart_on_a_calibrated_cpu_mesh(tiny_gpt):
    """Where the host's figures are measured, a chunk's price depends on more of its stage (ZeRO-3
    parameters are DTensors, dearer per op): a chunk priced for an interleaved ZeRO-3 pipeline
    and the same layers in a plain pipeline are different cache entries."""
    from autopar.cost.compute import Efficiencies

    mesh = Mesh.parse("4:cpu")
    host = Efficiencies(device="cpu", distributed_op_latency_s=5e-5, pipeline_action_latency_s=1e-3,
                        data_parallel_group_latency_s=5e-4, data_parallel_tensor_latency_s=5e-5,
                        split_backward_op_latency_s=3e-5, checkpoint_region_latency_s=3e-4,
                        checkpoint_op_latency_s=3e-5, collective_wait_s=1e-3,
                        collective_wait_span_s=1e-2, host_cores=2)
    cache: dict = {}
    for fields in (dict(pp=2, dp=2, virtual=2, schedule="interleaved-1f1b", zero=3),
                   dict(pp=4), dict(pp=4, schedule="zero-bubble"),
                   dict(pp=4, recompute="selective"),
                   dict(pp=2, dp=2, zero=3, recompute="full"), dict(pp=2, dp=2), dict(dp=4, zero=3),
                   dict(dp=4)):
        fresh = megatron_estimate(tiny_gpt, mesh, _config(fields), efficiencies=host)
        cached = megatron_estimate(tiny_gpt, mesh, _config(fields), efficiencies=host, cache=cache)
        assert cached.to_dict() == fresh.to_dict(), fields


def test_a_cache_is_refused_for_another_mesh_or_graph(tiny_gpt):
    cache: dict = {}
    megatron_estimate(tiny_gpt, Mesh.parse("8:a100-80g"), _config(CONFIGS[0]), cache=cache)
    with pytest.raises(AutoparError, match="another graph, mesh"):
        megatron_estimate(tiny_gpt, Mesh.parse("8:h100-80g"), _config(CONFIGS[0]), cache=cache)


def test_the_estimator_is_autopar_cost_estimate(tiny_gpt):
    import autopar.cost

    mesh = Mesh.parse("8:a100-80g")
    result = autopar.cost.estimate(tiny_gpt, mesh, _config(CONFIGS[0]),
                                   placements=megatron_placements(tiny_gpt, 2))
    assert isinstance(result, autopar.cost.Estimate)
    assert result.to_dict() == megatron_estimate(tiny_gpt, mesh, _config(CONFIGS[0])).to_dict()
    assert autopar.cost.StageSpec is StageSpec and callable(autopar.cost.max_batch)
    with pytest.raises(AttributeError, match="no attribute 'nonsense'"):
        autopar.cost.nonsense
