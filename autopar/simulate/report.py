"""What a simulated rank measured, beside what the plan predicted for it.

The plan predicts each pipeline rank's memory (`Stage.predicted["memory_bytes"]`, the same for
every rank of a stage: the data-, context- and tensor-parallel ranks hold equal shares), so the
prediction of a rank is that of its pipeline rank. Collectives are summed by kind and group
(collectives.py), and set beside the bytes the estimator priced for the same kind and group
(`autopar.cost.rank_traffic.plan_collectives`): `predicted_sent_bytes` per entry, 0 where the
estimator priced none of that kind, and entries the estimator priced but the rank did not issue.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.errors import AutoparError
from autopar.plans import Plan
from autopar.runtime.rank_grid import pipeline_layout
from autopar.simulate.rank import RankRun


@dataclass(kw_only=True, slots=True)
class RankReport:
    rank: int
    stages: list[int]
    peak_memory_bytes: int
    predicted_memory_bytes: int | None
    collective_bytes: int                                 # sent by this rank in one step
    predicted_collective_bytes: int | None = None
    collectives: list[dict] = field(default_factory=list)  # by kind and group, in first-issue order
    seconds: float = 0.0
    build_peak_memory_bytes: int = 0                      # while its runtime was built
    host_memory_bytes: int = 0                            # offloaded states' peak on the host
    predicted_host_memory_bytes: int = 0

    @property
    def memory_error(self) -> float | None:
        """Simulated peak over predicted, minus one (+0.10: 10% more than predicted)."""
        if not self.predicted_memory_bytes:
            return None
        return self.peak_memory_bytes / self.predicted_memory_bytes - 1.0

    def to_dict(self) -> dict:
        return {"rank": self.rank, "stages": self.stages,
                "peak_memory_bytes": self.peak_memory_bytes,
                "predicted_memory_bytes": self.predicted_memory_bytes,
                "collective_bytes": self.collective_bytes,
                "predicted_collective_bytes": self.predicted_collective_bytes,
                "collectives": self.collectives, "seconds": round(self.seconds, 1),
                "build_peak_memory_bytes": self.build_peak_memory_bytes,
                "host_memory_bytes": self.host_memory_bytes,
                "predicted_host_memory_bytes": self.predicted_host_memory_bytes}


def rank_report(plan: Plan, run: RankRun, predicted_collectives: list | None = None) -> RankReport:
    """`run` summed by kind and group, with the plan's prediction of the rank's memory and, given
    `plan_collectives`' list for the plan, of what the rank sends (module docstring)."""
    totals: dict[tuple[str, str, int], dict] = {}
    new = lambda kind, axis, size: {"kind": kind, "axis": axis, "group_size": size, "count": 0,
                                    "payload_bytes": 0, "sent_bytes": 0}
    for c in run.collectives:
        entry = totals.setdefault((c.kind, c.axis, c.group_size), new(c.kind, c.axis, c.group_size))
        entry["count"] += 1
        entry["payload_bytes"] += c.payload_bytes
        entry["sent_bytes"] += c.sent_bytes
    predicted_sent = None
    if predicted_collectives is not None and run.stages:
        # the estimator's pipeline rank d holds chunks d, d + pp, ... (cost/estimator.py)
        mine = predicted_collectives[run.stages[0] % len(predicted_collectives)]
        for entry in totals.values():
            entry["predicted_sent_bytes"] = 0
        for p in mine:
            key = (p["kind"], p["axis"], p["group_size"])
            totals.setdefault(key, {**new(*key), "predicted_sent_bytes": 0})
            totals[key]["predicted_sent_bytes"] = p["sent_bytes"]
        predicted_sent = sum(p["sent_bytes"] for p in mine)
    predicted = plan.stages[run.stages[0]].predicted.get("memory_bytes") if run.stages else None
    return RankReport(rank=run.rank, stages=run.stages, peak_memory_bytes=run.peak_memory_bytes,
                      predicted_memory_bytes=None if predicted is None else int(predicted),
                      collective_bytes=sum(c.sent_bytes for c in run.collectives),
                      predicted_collective_bytes=predicted_sent,
                      collectives=list(totals.values()), seconds=run.seconds,
                      build_peak_memory_bytes=run.build_peak_memory_bytes,
                      host_memory_bytes=run.host_peak_memory_bytes,
                      predicted_host_memory_bytes=int(plan.predicted.get("host_memory_bytes") or 0))


def ranks_to_simulate(plan: Plan, text: str) -> list[int]:
    """"all": one rank of each pipeline rank (every rank of a pipeline rank holds an equal share
    of the same stages: they differ only in which); else a comma-separated list of ranks."""
    if text.strip() == "all":
        return [plane[0][0] for plane in pipeline_layout(plan).grid]
    try:
        ranks = [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise AutoparError(f"--ranks {text!r}: give 'all' or ranks separated by commas, e.g. 0,7") from None
    bad = [r for r in ranks if not 0 <= r < plan.world_size]
    if not ranks or bad:
        raise AutoparError(f"--ranks {text!r}: the plan's ranks are 0..{plan.world_size - 1}; give "
                           f"'all' or ranks separated by commas")
    return ranks
