"""A process group named by the rank-grid axes its ranks span, as a plan's prices are keyed.

"tp", "pp", "dp" and "cp" when its ranks differ along one axis; "dp+cp" for the replicas that
hold the same weights under context parallelism (FSDP2's group). Groups that ranks alone do not
tell apart are named by the runtime when it makes them (autopar/simulate/collectives.py): a
stage's cp group, and the groups of its split experts, "ep" (ranks holding different experts)
and "edp" (ranks holding the same ones), which may hold the same ranks as a cp or dp group.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.plans import Plan
from autopar.runtime.rank_grid import pipeline_layout

_AXES = ("pp", "dp", "cp", "tp")


def axis_namer(plan: Plan) -> Callable[[list[int]], str]:
    """A function from a group's global ranks to its name (module docstring)."""
    layout = pipeline_layout(plan)
    where: dict[int, tuple[int, int, int, int]] = {}
    for p, plane in enumerate(layout.grid):
        for replica, row in enumerate(plane):
            d, c = layout.batch_and_context(replica)
            for t, rank in enumerate(row):
                where[rank] = (p, d, c, t)

    def name(ranks: list[int]) -> str:
        places = [where[r] for r in ranks]
        varying = [axis for i, axis in enumerate(_AXES) if len({place[i] for place in places}) > 1]
        return "+".join(varying) or "self"
    return name
