"""Golden plans: planning problems whose Plan JSON is checked in next to this file and compared
byte for byte by tests/test_golden_plans.py, so that every change of a plan shows in a diff and is
explained in its commit.

    python tests/golden/regenerate.py            # rewrite every golden plan
    python tests/golden/regenerate.py gpt-tiny   # rewrite one

Run it deliberately, after a change that is meant to change plans, and commit the new JSON with
the reason. The files hold the plan as `autopar plan --out` writes it, less the solver's wall
seconds (a measurement of the run, not a property of the plan). The time limit is generous so
that no search stops at it: a plan cut short by the clock would depend on the machine.
"""

from __future__ import annotations

import functools
import sys
from pathlib import Path

HERE = Path(__file__).parent
TIME_LIMIT = 600.0
# name -> (model spec, mesh, global batch)
PROBLEMS = {
    "gpt-tiny-4cpu": ("gpt-tiny", "4:cpu", 8),
    "gpt3-1.3b-1x8-a100": ("gpt3-1.3b", "1x8:a100-80g", 256),
    "llama-7b-4x8-a100": ("llama-7b", "4x8:a100-80g", 512),
    "gpt3-175b-128x8-a100": ("gpt3-175b", "128x8:a100-80g", 1536),
}


def without_measurements(data: dict) -> dict:
    """The plan's JSON data less the wall seconds of its solvers."""
    solver = {k: v for k, v in data["solver"].items() if k != "seconds"}
    if "intra_op" in solver:
        solver["intra_op"] = {k: v for k, v in solver["intra_op"].items() if k != "seconds"}
    return {**data, "solver": solver}


@functools.lru_cache(maxsize=None)
def captured(spec: str):
    """The graph of model `spec`, captured once per process (the 175B capture takes seconds, and
    the tests plan and price each problem)."""
    from autopar.models import build_model
    from autopar.tracer import capture

    model, inputs = build_model(spec)
    return capture(model, example_inputs=inputs)


def golden_json(name: str) -> str:
    """The golden text of problem `name`, planned now."""
    import json

    from autopar.api import plan_graph
    from autopar.cost.mesh import Mesh

    spec, mesh, batch = PROBLEMS[name]
    graph = captured(spec)
    plan = plan_graph(graph, Mesh.parse(mesh), global_batch=batch, time_limit=TIME_LIMIT)
    data = plan.to_dict()
    check_reproducible(name, data)
    return json.dumps(without_measurements(data), indent=1) + "\n"


def check_reproducible(name: str, data: dict) -> None:
    """Refuse a plan that another machine could plan differently: one whose stage search or
    sharding ILP stopped at the clock rather than at its optimum."""
    solver = data["solver"]
    stopped = [what for what, status in (("the stage search", solver["status"]),
                                         ("the sharding ILP", solver["intra_op"].get("status")))
               if status in ("time_limit", "feasible")]
    if stopped:
        raise RuntimeError(f"{name}: {' and '.join(stopped)} stopped at the {TIME_LIMIT:.0f} s limit, "
                           f"so the plan depends on this machine's speed; it cannot be a golden plan")


def path_of(name: str) -> Path:
    return HERE / f"{name}.json"


def main(names: list[str]) -> int:
    unknown = [n for n in names if n not in PROBLEMS]
    if unknown:
        print(f"unknown golden problems {unknown}; they are {sorted(PROBLEMS)}", file=sys.stderr)
        return 2
    for name in names or list(PROBLEMS):
        path_of(name).write_text(golden_json(name))
        print(f"wrote {path_of(name)}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
