"""Crafted plan files: `autopar explain` refuses each with a message naming the field and exits 1,
never a traceback and never exit 0. The first six are files that once passed or crashed; the rest
are other kinds of damage a file can carry."""

import json
import math
import re

import pytest

from autopar.cli import main
from autopar.cost.mesh import Mesh
from autopar.plans import Plan, Stage


def plan_dict() -> dict:
    """A valid two-stage plan on 2x4 devices: dp=2 x tp=2 per stage."""
    stages = [Stage(index=i, layers=layers, ranks=list(range(4 * i, 4 * i + 4)), tp=2, dp=2,
                    predicted={"time_per_micro_batch_s": 0.01, "memory_bytes": 2**30,
                               "memory": {"weights": 2**29}})
              for i, layers in enumerate([["tok_emb", "layers.0"], ["layers.1", "lm_head"]])]
    plan = Plan(fingerprint="0123456789abcdef", mesh=Mesh.parse("2x4:a100-80g").to_dict(),
                axes=[["dp", 2], ["tp", 2]], stages=stages, global_batch=64, micro_batches=8,
                micro_batch_size=4, parameters={"tok_emb.weight": ["R", "S(0)"],
                                                "lm_head.weight": ["S(0)", "S(1)"]},
                nodes={"mm": ["S(0)", "P"]}, solver={"status": "searched", "seconds": 1.5},
                predicted={"step_time_s": 0.1, "breakdown": {"compute": 0.08, "bubble": 0.02}},
                model_type="GPT")
    return json.loads(plan.to_json())


def nested(depth: int):
    value = 1
    for _ in range(depth):
        value = [value]
    return value


def changed(change) -> str:
    data = plan_dict()
    change(data)
    return json.dumps(data)    # NaN and Infinity written as JSON's extensions, as Python writes them


CRAFTED = {
    # the six files that passed (exit 0) or gave tracebacks
    "unknown-axis": (changed(lambda d: d.update(axes=[["dp", 2], ["xp", 2]])), r"'axes'.*'xp'"),
    "shard-dim-99": (changed(lambda d: d["parameters"].update({"tok_emb.weight": ["R", "S(99)"]})),
                     r"parameters\['tok_emb.weight'\].*S\(99\)"),
    "predicted-string": (changed(lambda d: d["predicted"].update(step_time_s="fast")),
                         "predicted.step_time_s"),
    "predicted-nan": (changed(lambda d: d["predicted"].update(step_time_s=math.nan)),
                      "predicted.step_time_s.*nan"),
    "deep-nesting": ('{"predicted": ' + "[" * 100_000 + "]" * 100_000 + "}", "nests"),
    "solver-null": (changed(lambda d: d.update(solver=None)), "'solver' is None; expected an object"),
    # more kinds of damage
    "nested-past-a-plan": (changed(lambda d: d["predicted"].update(extra=nested(40))), "predicted.*nests"),
    "stage-infinite-memory": (changed(lambda d: d["stages"][1]["predicted"].update(memory_bytes=math.inf)),
                              r"stages\[1\].predicted.memory_bytes"),
    "breakdown-not-object": (changed(lambda d: d["predicted"].update(breakdown=[0.1])),
                             "predicted.breakdown"),
    "negative-time": (changed(lambda d: d["stages"][0]["predicted"].update(time_per_micro_batch_s=-1)),
                      r"stages\[0\].predicted.time_per_micro_batch_s"),
    "stage-index-bool": (changed(lambda d: d["stages"][1].update(index=True)), r"stages\[1\].index"),
    "mesh-fit-words": (changed(lambda d: d["mesh"]["axes"][0]["link"].update(
        measured=[["all_reduce", "fast", 1e9, 4]])), r"axes\[0\].link.measured\[0\]"),
    "solver-count-word": (changed(lambda d: d["solver"].update(intra_op={"variables": "many"})),
                          "solver.intra_op.variables"),
    "placement-not-text": (changed(lambda d: d["nodes"].update(mm=["S(0)", 1])), r"nodes\['mm'\]"),
}


@pytest.mark.parametrize("name", sorted(CRAFTED))
def test_explain_refuses_a_crafted_plan_naming_the_field(name, tmp_path, capsys):
    text, field = CRAFTED[name]
    path = tmp_path / f"{name}.json"
    path.write_text(text)
    assert main(["explain", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.startswith("autopar explain: error: ") and "Traceback" not in err
    assert re.search(field, err, flags=re.DOTALL), err


def test_the_valid_file_the_crafted_ones_start_from_is_explained(tmp_path, capsys):
    path = tmp_path / "plan.json"
    path.write_text(json.dumps(plan_dict()))
    assert main(["explain", str(path)]) == 0
    assert Plan.load(path).to_dict() == plan_dict()


def test_a_plan_names_its_axes_by_role_and_records_typed_words():
    plan = Plan.from_dict(plan_dict())
    assert plan.axis_roles == ["dp", "tp"] and plan.axis_index("tp") == 1
    assert type(plan.schedule).__name__ == "Schedule" and type(plan.stages[0].recompute).__name__ == "Recompute"
    assert plan.to_json() == Plan.from_dict(json.loads(plan.to_json())).to_json()
