"""A process group named by the rank-grid axes its ranks span, as a plan's prices are keyed.

"tp", "pp", "dp" and "cp" when its ranks differ along one axis; "dp+cp" for the replicas that
hold the same weights under context parallelism (FSDP2's group); "ep" and "edp" for the groups
of a stage's split experts (autopar.runtime.rank_grid): ranks holding different experts, and
ranks holding the same ones.
"""

from __future__ import annotations

from collections.abc import Callable

from autopar.plans import Plan
from autopar.runtime.rank_grid import pipeline_layout

_AXES = ("pp", "dp", "cp", "tp")


def axis_namer(plan: Plan) -> Callable[[list[int]], str]:
    """A function from a group's global ranks to its name (module docstring)."""
    layout = pipeline_layout(plan)
    where: dict[int, tuple[int, int, int, int, int]] = {}
    for p, plane in enumerate(layout.grid):
        for replica, row in enumerate(plane):
            d, c = layout.batch_and_context(replica)
            for t, rank in enumerate(row):
                where[rank] = (p, d, c, t, replica * layout.tp + t)
    eps = sorted({stage.ep for stage in plan.stages} - {1})

    def name(ranks: list[int]) -> str:
        places = [where[r] for r in ranks]
        if len({place[0] for place in places}) == 1 and eps:
            flats = [place[4] for place in places]
            for ep in eps:
                if len(flats) == ep and len({f // ep for f in flats}) == 1:
                    return "ep"
                if len({f % ep for f in flats}) == 1 and len(flats) == layout.replicas * layout.tp // ep:
                    return "edp"
        varying = [axis for i, axis in enumerate(_AXES) if len({place[i] for place in places}) > 1]
        return "+".join(varying) or "self"
    return name
