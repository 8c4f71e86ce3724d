"""The plan language: what a plan says and the rules it is read by, with no torch, solver or cost
model behind it. The planner writes plans in it, the estimator prices them, the runtime runs them,
and each reads the same rules here.

    records.py      `Plan` and `Stage`: the plan as data, exact JSON round trip, summary and diff
    checks.py       every value of a plan file checked on load, each refusal naming the field
    mesh.py         the recorded cluster's JSON structure (the cost model builds its Mesh on it)
    vocabulary.py   schedules, recompute levels, precisions, axis roles: str enums that write
                    plain JSON; dtype sizes
    placements.py   "R", "P", "S(d)": the one parser and printer of placements
    schedules.py    which schedule, pipeline depth and micro-batch count torch runs
    stage_flow.py   which pipeline unit computes each value, which values skip a stage
    zero.py         when gradients are reduced and weights kept gathered, per ZeRO stage and schedule
    head_split.py   how many key/value heads the all-to-all context-parallel attention swaps

    plan = Plan.load("plan.json")      # or Plan.from_dict(data); plan.save(path), plan.to_json()
"""

from autopar.plans.placements import Placement, parse_placement
from autopar.plans.records import SCHEMA_VERSION, Plan, Stage
from autopar.plans.vocabulary import (AXIS_ROLES, PRECISIONS, RECOMPUTE, SCHEDULES, AxisRole,
                                      Precision, Recompute, Schedule)

__all__ = ["AXIS_ROLES", "PRECISIONS", "RECOMPUTE", "SCHEDULES", "SCHEMA_VERSION", "AxisRole",
           "Placement", "Plan", "Precision", "Recompute", "Schedule", "Stage", "parse_placement"]
