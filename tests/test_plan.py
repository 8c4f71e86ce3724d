"""The Plan as data: exact JSON round trip, schema and fingerprint checks, explain and diff."""

import json

import pytest

from autopar.cli import main
from autopar.cost.mesh import Mesh
from autopar.errors import PlanMismatchError
from autopar.plans import SCHEMA_VERSION, Plan, Stage


def make_plan(recompute_last="none", fingerprint="0123456789abcdef") -> Plan:
    mesh = Mesh.parse("2x4:a100-80g")
    stages = [Stage(index=i, layers=layers, ranks=list(range(4 * i, 4 * i + 4)), tp=2, dp=2,
                    recompute=recompute, zero=1, sequence_parallel=True,
                    predicted={"stage": i, "time_per_micro_batch_s": 0.03 * (i + 1) + 1e-17,
                               "memory_bytes": 3.5 * 2**30})
              for i, (layers, recompute) in enumerate([
                  (["tok_emb", "pos_emb", "layers.0"], "full"),
                  (["layers.1", "layers.2", "norm_f", "lm_head"], recompute_last)])]
    return Plan(fingerprint=fingerprint, mesh=mesh.to_dict(), axes=[["dp", 2], ["tp", 2]],
                stages=stages, global_batch=64, micro_batches=8, micro_batch_size=4, schedule="1f1b",
                parameters={"tok_emb.weight": ["R", "S(0)"], "layers.0.attn.wq.weight": ["R", "S(0)"],
                            "lm_head.weight": ["S(0)", "S(0)"]},
                nodes={"mm": ["S(0)", "S(1)"], "add_3": ["S(0)", "P"]},
                predicted={"step_time_s": 0.1 / 3, "tflops_per_gpu": 123.456789012345,
                           "memory_per_gpu_bytes": 3758096384, "bubble_fraction": 1 / 7,
                           "breakdown": {"compute": 0.02, "exposed_comm": 0.005, "bubble": 0.004,
                                         "optimizer": 0.001}},
                solver={"seconds": 1.25, "status": "searched", "gap": None, "candidates": 17},
                replicated_ops=["aten.cumsum.default"], model_type="GPT")


def test_round_trip_is_exact(tmp_path):
    plan = make_plan()
    path = tmp_path / "plan.json"
    plan.save(path)
    loaded = Plan.load(path)
    assert loaded == plan
    assert loaded.predicted["step_time_s"] == 0.1 / 3      # floats survive bit for bit
    assert isinstance(loaded.stages[0], Stage)
    again = tmp_path / "again.json"
    loaded.save(again)
    assert again.read_bytes() == path.read_bytes()


def test_json_has_the_documented_fields(tmp_path):
    path = tmp_path / "plan.json"
    make_plan().save(path)
    data = json.loads(path.read_text())
    for key in ("mesh", "stages", "micro_batches", "micro_batch_size", "schedule", "parameters",
                "predicted", "solver", "fingerprint", "schema_version"):
        assert key in data
    assert data["schema_version"] == SCHEMA_VERSION
    assert data["parameters"]["lm_head.weight"] == ["S(0)", "S(0)"]
    for key in ("layers", "ranks", "tp", "dp", "recompute", "zero"):
        assert key in data["stages"][0]


def test_other_schema_version_is_refused(tmp_path):
    data = make_plan().to_dict()
    data["schema_version"] = SCHEMA_VERSION + 1
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(data))
    with pytest.raises(PlanMismatchError, match="schema version"):
        Plan.load(path)


def test_unknown_or_missing_fields_are_refused():
    data = make_plan().to_dict()
    with pytest.raises(PlanMismatchError, match="unknown fields \\['colour'\\]"):
        Plan.from_dict({**data, "colour": "blue"})
    del data["stages"][0]["ranks"]
    with pytest.raises(PlanMismatchError, match="lacks fields \\['ranks'\\]"):
        Plan.from_dict(data)


def test_not_a_plan_file(tmp_path):
    path = tmp_path / "x.json"
    path.write_text("not json")
    with pytest.raises(PlanMismatchError, match="not valid JSON"):
        Plan.load(path)
    with pytest.raises(PlanMismatchError, match="no plan file"):
        Plan.load(tmp_path / "missing.json")


def test_fingerprint_mismatch_is_refused():
    plan = make_plan()
    plan.check_graph("0123456789abcdef")
    with pytest.raises(PlanMismatchError, match="another model"):
        plan.check_graph("fedcba9876543210")


def test_fingerprint_of_a_captured_graph():
    from autopar.tracer import capture
    from autopar.models import build_model

    graph = capture(*_model("gpt-tiny"))
    other = capture(*_model("gpt-tiny", layers=3))
    plan = make_plan(fingerprint=graph.fingerprint())
    plan.check_graph(graph)
    with pytest.raises(PlanMismatchError):
        plan.check_graph(other)


def _model(spec, **overrides):
    from autopar.models import build_model

    model, inputs = build_model(spec, **overrides)
    return model, inputs


def test_degrees_and_summary():
    plan = make_plan()
    assert (plan.pp, plan.dp, plan.tp, plan.world_size) == (2, 2, 2, 8)
    assert "tp=2 pp=2 dp=2 1f1b mbs=4 m=8" in plan.summary()
    assert "blocks=1/2" in plan.summary()


def test_diff_names_the_changed_decisions():
    a, b = make_plan(), make_plan(recompute_last="selective")
    b.parameters["lm_head.weight"] = ["R", "S(1)"]
    paths = {path for path, _, _ in a.diff(b)}
    assert paths == {"stages[1].recompute", "parameters.lm_head.weight"}
    assert a.diff(make_plan()) == []
    c = make_plan()
    c.stages = c.stages[:1]
    assert ("stages[1]", a.to_dict()["stages"][1], None) in a.diff(c)


def test_explain_and_diff_commands(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("COLUMNS", "200")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    make_plan().save(a)
    make_plan(recompute_last="selective").save(b)
    png = tmp_path / "timeline.png"
    assert main(["explain", str(a), "--png", str(png)]) == 0
    out = capsys.readouterr().out
    assert "tok_emb, pos_emb, layers.0" in out and "0-3" in out and "4-7" in out
    assert png.stat().st_size > 10_000
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "stages[1].recompute" in out and "selective" in out


def test_expert_parallelism_is_recorded_shown_and_compared(tmp_path, capsys, monkeypatch):
    """A stage's ep: exact round trip, in the summary, a column of explain, a decision of diff."""
    monkeypatch.setenv("COLUMNS", "200")
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    make_plan().save(a)
    plan = make_plan()
    for stage in plan.stages:
        stage.ep = 4
    plan.save(b)
    assert Plan.load(b) == plan and Plan.load(b).ep == 4
    assert "ep=4" in plan.summary() and "ep=" not in make_plan().summary()
    assert main(["explain", str(b)]) == 0
    out = capsys.readouterr().out
    assert "ep=4" in out and "│ 2 x 2   │ 4  │" in out
    assert main(["diff", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    assert "stages[0].ep" in out and "stages[1].ep" in out


def test_explain_of_a_broken_file_is_a_clear_error(tmp_path, capsys):
    path = tmp_path / "bad.json"
    path.write_text("{}")
    assert main(["explain", str(path)]) == 1
    assert "schema version" in capsys.readouterr().err


def test_planned_gpt_round_trips_and_explains(tmp_path, capsys, monkeypatch):
    """`autopar plan` end to end on a small GPT: a plan file that loads equal, fits the graph it
    was made for, and explains; every parameter has a placement per axis."""
    monkeypatch.setenv("COLUMNS", "200")
    from autopar.tracer import capture
    from autopar.models import build_model

    out = tmp_path / "plan.json"
    spec = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=256"
    assert main(["plan", spec, "--mesh", "2x2:a100-80g", "--global-batch", "16", "--out", str(out),
                 "--time-limit", "30"]) == 0
    plan = Plan.load(out)
    plan.check_graph(capture(*build_model(spec)))
    assert plan.world_size == 4
    assert sorted(r for s in plan.stages[:plan.pp] for r in s.ranks) == list(range(4))
    assert all(len(p) == 2 for p in plan.parameters.values()) and "lm_head.weight" in plan.parameters
    assert plan.predicted["step_time_s"] > 0 and plan.solver["status"] in ("searched", "time_limit")
    assert Plan.load(out) == plan
    assert main(["explain", str(out)]) == 0
    assert "stages" in capsys.readouterr().out


def test_timeline_of_an_interleaved_plan(tmp_path):
    from autopar.timeline import plan_timeline, save_png

    plan = make_plan()
    plan.virtual, plan.schedule = 2, "interleaved-1f1b"
    plan.stages = [Stage(index=i, layers=[f"layers.{i}"], ranks=list(range(4 * (i % 2), 4 * (i % 2) + 4)),
                         tp=2, dp=2, predicted={"time_per_micro_batch_s": 0.02})
                   for i in range(4)]
    assert plan.pp == 2
    timeline = plan_timeline(plan)
    assert len(timeline.events) == 2 * 4 * plan.micro_batches
    assert timeline.bubble_fraction == pytest.approx((2 - 1) / (2 * plan.micro_batches))
    save_png(timeline, tmp_path / "t.png")
    assert (tmp_path / "t.png").stat().st_size > 10_000
