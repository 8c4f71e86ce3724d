"""`autopar validate`'s parts: the forced configurations it tries, its rank correlation, and one
configuration trained on real gloo ranks (no timed assertions)."""

from argparse import Namespace

import pytest

from autopar.commands.validate import candidate_configs, describe, kendall_tau, measure
from autopar.cost.config import Config
from autopar.cost.mesh import Mesh


def test_candidates_cover_the_parallel_forms_the_model_and_mesh_allow():
    configs = candidate_configs("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128", 4, 16, 2)
    names = [describe(c) for c in configs]
    assert len(configs) >= 12 and len(set(configs)) == len(configs)
    for expected in ("dp4", "dp4 zero1", "dp4 zero2", "dp4 zero3", "dp2 tp2 sp", "tp4",
                     "dp2 pp2 gpipe", "pp4 1f1b", "pp4 zero-bubble", "dp2 pp2 interleaved-1f1b v2"):
        assert expected in names
    assert all(c.world_size == 4 and c.global_batch == 16 for c in configs)
    # Three heads: no tensor parallelism of 2 or 4; two layers: no pipeline of 4.
    narrow = candidate_configs("gpt:layers=2,hidden=48,heads=3,seq=32,vocab=128", 4, 16, 2)
    assert all(c.tp == 1 and c.pp * c.virtual <= 2 for c in narrow)


def test_the_planners_row_is_named_as_the_forced_rows_are():
    """Which schedule the planner chose is what the reader compares with the forced rows."""
    from autopar.api import plan_from_config
    from autopar.commands.estimate import capture_training_step
    from autopar.commands.validate import _plan_summary

    graph = capture_training_step("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128")
    for config in (Config(pp=2, dp=2, global_batch=8, micro_batch=1, schedule="zero-bubble"),
                   Config(pp=2, dp=2, virtual=2, global_batch=8, micro_batch=1,
                          schedule="interleaved-1f1b"),
                   Config(dp=4, zero=3, global_batch=8, micro_batch=1)):
        plan = plan_from_config(graph, "4:cpu", config)
        assert _plan_summary(plan).split() == describe(config).split()


def test_kendall_tau():
    assert kendall_tau([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert kendall_tau([1, 2, 3, 4], [40, 30, 20, 10]) == pytest.approx(-1.0)
    assert kendall_tau([1, 2, 3], [1, 3, 2]) == pytest.approx(1 / 3)


def test_one_configuration_trains_on_gloo_ranks_and_is_measured():
    import torch._dynamo  # noqa: F401  (before forking)

    row = {"name": "dp2", "config": Config(dp=2, global_batch=4, micro_batch=1)}
    args = Namespace(model="gpt-tiny", global_batch=4, micro_batch=1, steps=1, warmup=1, calibration=None)
    measure(row, args, Mesh.parse("2:cpu"))
    assert "error" not in row, row.get("error")
    assert row["measured_s"] > 0 and row["measured_mib"] >= 0
