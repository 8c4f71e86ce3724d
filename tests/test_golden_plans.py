"""Golden plans: planning the checked-in problems gives their JSON byte for byte (less the
solvers' wall seconds). A failure here means plans changed: if the change is meant, run
`python tests/golden/regenerate.py` and explain the new plans in the commit."""

import importlib.util
import json
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("golden_regenerate",
                                               Path(__file__).parent / "golden" / "regenerate.py")
golden = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(golden)


# the 175B plan is captured, solved and priced in the slow tier (a third of the module's time),
# and so is the llama-7b one (the default tier keeps a CPU plan and a GPU one); the default
# tier's 64-rank plan is tests/test_simulate.py's
SLOW = ("gpt3-175b", "llama-7b")
@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name.startswith(SLOW)
                                  else name for name in sorted(golden.PROBLEMS)])
def test_plan_equals_its_golden_json(name):
    expected = golden.path_of(name).read_text()
    planned = golden.golden_json(name)
    assert planned == expected, (f"the plan of {name} changed; if that is meant, run "
                                 f"`python tests/golden/regenerate.py {name}` and explain it")


@pytest.mark.parametrize("name", [pytest.param(name, marks=pytest.mark.slow) if name.startswith(SLOW)
                                  else name for name in sorted(golden.PROBLEMS)])
def test_golden_plans_record_their_own_price(name):
    """A saved plan priced again by `estimate_plan` gives the figures it records."""
    from autopar.cost import estimate_plan
    from autopar.plans import Plan

    graph = golden.captured(golden.PROBLEMS[name][0])
    plan = Plan.from_dict(json.loads(golden.path_of(name).read_text()))
    priced = estimate_plan(graph, plan).to_dict()
    devices = priced.pop("devices")
    assert priced == {k: v for k, v in plan.predicted.items() if k != "simulated_bubble_fraction"}
    assert [{k: v for k, v in s.predicted.items() if k != "chunk_time_per_micro_batch_s"}
            for s in plan.stages] == [devices[s.index % plan.pp] for s in plan.stages]


def test_a_plan_cut_short_by_the_clock_is_not_written_as_golden():
    data = json.loads(golden.path_of("gpt-tiny-4cpu").read_text())
    golden.check_reproducible("gpt-tiny-4cpu", data)
    for key, status in (("status", "time_limit"), ("intra_op", {"status": "feasible"})):
        cut = {**data, "solver": {**data["solver"], key: status}}
        with pytest.raises(RuntimeError, match="cannot be a golden plan"):
            golden.check_reproducible("gpt-tiny-4cpu", cut)


def test_planning_twice_gives_the_same_json():
    name = "gpt-tiny-4cpu"
    assert golden.golden_json(name) == golden.golden_json(name)
