"""Process-free pieces of the runtime: placements, axis roles, the Megatron layout of a forced
configuration, gradient buckets and their owners, and the shape check."""

import pytest
import torch
from torch.distributed.tensor import Partial, Replicate, Shard

import autopar
from autopar.cost.config import Config
from autopar.cost.mesh import Mesh
from autopar.errors import PlanMismatchError
from autopar.models import build_model
from autopar.passes.verify import CheckShape
from autopar.runtime.forced_plan import megatron_plan
from autopar.runtime.grads import _make_buckets
from autopar.runtime.layout import data_axis_names, parse_placement


def test_placements_parse_as_dtensor_prints_them():
    assert parse_placement("S(2)") == Shard(2)
    assert parse_placement("R") == Replicate()
    assert isinstance(parse_placement("P"), Partial)
    with pytest.raises(PlanMismatchError, match="'S\\(dim\\)', 'R', 'P'"):
        parse_placement("Shard(0)")


@pytest.fixture(scope="module")
def gpt_graph():
    model, (ids,) = build_model("gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64", device="cpu", batch=4)
    return autopar.capture(model, (ids,))


def test_megatron_layout_column_then_row(gpt_graph):
    plan = megatron_plan(gpt_graph, Mesh.parse("4:cpu"), Config(dp=2, tp=2, global_batch=8, micro_batch=4))
    tp = {fqn: places[1] for fqn, places in plan.parameters.items()}
    for layer in ("layers.0", "layers.1"):
        for column in ("attn.wq", "attn.wk", "attn.wv", "mlp.fc1"):
            assert tp[f"{layer}.{column}.weight"] == "S(0)" and tp[f"{layer}.{column}.bias"] == "S(0)"
        for row in ("attn.wo", "mlp.fc2"):
            assert tp[f"{layer}.{row}.weight"] == "S(1)" and tp[f"{layer}.{row}.bias"] == "R"
        assert tp[f"{layer}.ln1.weight"] == "R"
    assert tp["lm_head.weight"] == "S(0)" and tp["tok_emb.weight"] == "R"
    assert plan.axes == [["dp", 2], ["tp", 2]] and plan.nodes["input_ids"] == ["S(0)", "R"]
    # Partial sums are reduced where the residual stream enters each norm.
    norm_inputs = [name for name, places in plan.nodes.items() if places == ["S(0)", "R"]]
    assert len(norm_inputs) == 1 + 2 * 2 + 1


def test_sequence_parallel_splits_norm_inputs_on_the_sequence(gpt_graph):
    plan = megatron_plan(gpt_graph, Mesh.parse("2:cpu"),
                         Config(tp=2, sequence_parallel=True, global_batch=4, micro_batch=4))
    assert sum(places == ["S(0)", "S(1)"] for places in plan.nodes.values()) == 2 * 2 + 1


def test_zero3_shards_every_divisible_parameter_on_dp(gpt_graph):
    plan = megatron_plan(gpt_graph, Mesh.parse("4:cpu"), Config(dp=4, zero=3, global_batch=8, micro_batch=2))
    assert all(places[0] == "S(0)" for places in plan.parameters.values())


def test_megatron_layout_rejects_a_config_for_another_mesh(gpt_graph):
    with pytest.raises(autopar.MeshError, match="choose dp x tp = 4"):
        megatron_plan(gpt_graph, Mesh.parse("4:cpu"), Config(dp=2, global_batch=4, micro_batch=2))


def test_data_axes_are_where_inputs_are_batch_sharded(gpt_graph):
    plan = megatron_plan(gpt_graph, Mesh.parse("4:cpu"), Config(dp=2, tp=2, global_batch=8, micro_batch=4))
    assert data_axis_names(plan, ["input_ids"]) == ("dp",)
    plan.nodes["input_ids"] = ["R", "R"]
    assert data_axis_names(plan, ["input_ids"]) == ()


def test_buckets_have_one_owner_and_owners_are_balanced():
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 300, 50, 50, 200, 100, 200)]
    buckets = _make_buckets(params, bucket_bytes=1600, owners=4)
    assert [p for b in buckets for p in b.params] == params
    owners = [b.owner for b in buckets]
    assert owners == sorted(owners) and set(owners) == {0, 1, 2, 3}
    assert all(sum(p.numel() * 4 for p in b.params) <= 1600 or len(b.params) == 1 for b in buckets)
    assert {b.owner for b in _make_buckets(params, bucket_bytes=1 << 20, owners=None)} == {None}


def test_shape_check_names_the_node():
    check = CheckShape("linear_3", (4, 8, 16), (4, 8, 16))
    assert check(torch.zeros(4, 8, 16)).shape == (4, 8, 16)
    with pytest.raises(PlanMismatchError, match="node linear_3 has shape \\(4, 8, 32\\)"):
        check(torch.zeros(4, 8, 32))
