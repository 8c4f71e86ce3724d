"""Context parallelism and offload in the plan language: Stage.cp, cp_kind and offload, the "cp"
axis, their checks, exact JSON, explain and diff; plan_from_config writes them."""

import json

import pytest

from autopar.cli import main
from autopar.cost.config import Config
from autopar.cost.mesh import Mesh
from autopar.errors import PlanMismatchError
from autopar.plans import Plan, Stage


def context_plan(cp=2, kind="ring", offload=False, zero=3) -> Plan:
    """Two pipeline stages, each on dp=2 x cp=cp x tp=2 ranks."""
    group = 4 * cp
    stages = [Stage(index=i, layers=layers, ranks=list(range(group * i, group * (i + 1))), tp=2,
                    dp=2, cp=cp, cp_kind=kind, offload=offload, zero=zero)
              for i, layers in enumerate([["tok_emb", "layers.0"], ["layers.1", "lm_head"]])]
    return Plan(fingerprint="0123456789abcdef", mesh=Mesh.parse(f"{2 * group}:cpu").to_dict(),
                axes=[["dp", 2], ["cp", cp], ["tp", 2]], stages=stages, global_batch=16,
                micro_batches=4, micro_batch_size=2, schedule="1f1b",
                parameters={"tok_emb.weight": ["S(0)", "S(0)", "S(1)"]},
                nodes={"embedding": ["S(0)", "S(1)", "R"]})


def test_context_parallel_and_offload_round_trip(tmp_path):
    plan = context_plan(kind="all-to-all", offload=True)
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan and loaded.stages[0].cp_kind == "all-to-all"
    again = tmp_path / "again.json"
    loaded.save(again)
    assert again.read_bytes() == path.read_bytes()
    stage = json.loads(path.read_text())["stages"][0]
    assert (stage["cp"], stage["cp_kind"], stage["offload"]) == (2, "all-to-all", True)
    assert (plan.cp, plan.offload, plan.world_size) == (2, True, 16)
    assert "cp=2 (all-to-all)" in plan.summary() and "offload" in plan.summary()


def test_experts_are_carved_out_of_the_dp_x_cp_x_tp_ranks():
    # ep=8 does not divide dp x tp = 4, but it divides the 8 ranks of dp x cp x tp (Megatron-Core)
    data = context_plan().to_dict()
    for stage in data["stages"]:
        stage["ep"] = 8
    assert [stage.ep for stage in Plan.from_dict(data).stages] == [8, 8]


def test_forms_not_used_are_left_out_of_the_json():
    plain = Stage(index=0, layers=[], ranks=[0])
    plan = Plan(fingerprint="f", mesh=Mesh.parse("1:cpu").to_dict(), axes=[["dp", 1], ["tp", 1]],
                stages=[plain], global_batch=1, micro_batches=1, micro_batch_size=1)
    written = plan.to_dict()["stages"][0]
    assert not {"cp", "cp_kind", "offload"} & set(written)
    assert Plan.from_dict(plan.to_dict()) == plan


@pytest.mark.parametrize("change, message", [
    (lambda d: d["stages"][0].update(cp=4), "stages\\[0\\] has tp=2 x dp=2 x cp=4"),
    (lambda d: d["stages"][1].update(cp_kind="spiral"), "'stages\\[1\\].cp_kind' is 'spiral'"),
    (lambda d: d["stages"][0].update(offload="yes"), "'stages\\[0\\].offload' is 'yes'"),
    (lambda d: d["stages"][0].update(zero=2), "stages\\[0\\].offload is true with zero=2"),
    (lambda d: d["stages"][0].update(cp=0), "'stages\\[0\\].cp' is 0"),
    (lambda d: d.update(axes=[["dp", 2], ["sp", 2], ["tp", 2]]), "names axis 'sp'"),
    (lambda d: d["stages"][0].update(ep=3), "ep=3, which does not divide its dp x cp x tp = 2 x 2 x 2"),
])
def test_bad_context_fields_are_named(change, message):
    data = context_plan(offload=True).to_dict()
    change(data)
    with pytest.raises(PlanMismatchError, match=message):
        Plan.from_dict(data)


def test_diff_and_explain_show_the_forms(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    a, b = context_plan(), context_plan(kind="all-to-all", offload=True)
    assert {path for path, _, _ in a.diff(b)} == {f"stages[{i}].{key}" for i in (0, 1)
                                                   for key in ("cp_kind", "offload")}
    assert ("stages[0].offload", False, True) in a.diff(b)
    a.save(tmp_path / "a.json")
    b.save(tmp_path / "b.json")
    assert main(["explain", str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "tp x dp x cp" in out and "2 x 2 x 2 all-to-all" in out and "3, offloaded" in out
    assert main(["diff", str(tmp_path / "a.json"), str(tmp_path / "b.json")]) == 0
    out = capsys.readouterr().out
    assert "stages[0].cp_kind" in out and "stages[1].offload" in out


@pytest.fixture(scope="module")
def llama_graph():
    import autopar
    from autopar.models import build_model

    model, (ids,) = build_model("llama-tiny", device="cpu", batch=8)
    return autopar.capture(model, (ids[:2],))


def test_plan_from_config_writes_context_parallelism(llama_graph):
    import autopar

    plan = autopar.plan_from_config(llama_graph, "8:cpu", Config(dp=2, cp=2, tp=2, zero=3,
                                                                 global_batch=8, micro_batch=2))
    assert plan.axes == [["dp", 2], ["cp", 2], ["tp", 2]] and plan.world_size == 8
    assert {(s.cp, s.cp_kind, s.offload) for s in plan.stages} == {(2, "ring", False)}
    assert plan.stages[0].ranks == list(range(8))
    # ZeRO-3 shards over the dp x cp ranks holding the same weights; activations split on the sequence
    assert plan.parameters["layers.0.ffn_norm.weight"][:2] == ["S(0)", "S(0)"]
    assert plan.nodes["embedding"][1] == "S(1)"
    assert Plan.from_dict(plan.to_dict()) == plan


def test_plan_from_config_writes_offload(llama_graph):
    import autopar

    plan = autopar.plan_from_config(llama_graph, "4:cpu", Config(dp=4, zero=3, offload=True,
                                                                 global_batch=8, micro_batch=2))
    assert plan.axes == [["dp", 4], ["tp", 1]] and all(s.offload for s in plan.stages)
    assert plan.predicted["host_memory_bytes"] > 0
    assert "offload" in plan.summary()


def test_plan_from_config_refuses_a_sequence_that_does_not_split(llama_graph):
    import autopar
    from autopar.errors import AutoparError

    # llama-tiny's 32 tokens do not split into 2 x cp = 64 chunks
    with pytest.raises(AutoparError, match="does not split into 2 x cp = 64 equal chunks"):
        autopar.plan_from_config(llama_graph, "32:cpu", Config(cp=32, global_batch=8, micro_batch=8))
