"""What a simulated rank measured, beside what the plan predicted for it.

The plan predicts each pipeline rank's memory (`Stage.predicted["memory_bytes"]`, the same for
every rank of a stage: the data-, context- and tensor-parallel ranks hold equal shares), so the
prediction of a rank is that of its pipeline rank. Collectives are summed by kind and group
(collectives.py), and set beside the bytes the estimator priced for the same kind and group
(`autopar.cost.rank_traffic.plan_collectives`): `predicted_sent_bytes` per entry, 0 where the
estimator priced none of that kind, and entries the estimator priced but the rank did not issue.

Both are set against the plan priced as the simulation runs it (`priced_as_simulated`): fake
tensors are CPU tensors whatever the plan's device, so a 16-bit plan runs the CPU's autocast, which
keeps fewer values in fp32 than CUDA's (a GPU's layer_norm and softmax; autopar.mixed_dtypes).
The plan's own figures price CUDA's; those values are priced there, not simulated.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost.plan_estimate import estimate_plan
from autopar.cost.rank_traffic import plan_collectives
from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.mixed_dtypes import as_run_on
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


@dataclass(kw_only=True, slots=True)
class SimulatedPrices:
    """Per pipeline rank: its collectives (`plan_collectives`) and its memory, as the estimator
    prices the plan run as the simulation runs it (module docstring)."""
    collectives: list[list[dict]]
    memory_bytes: list[float]


def priced_as_simulated(graph: Graph, plan: Plan) -> SimulatedPrices:
    """The plan priced on `graph` (what it was made for) under the CPU's autocast."""
    graph = as_run_on(graph, "cpu")
    devices = estimate_plan(graph, plan).to_dict()["devices"]
    return SimulatedPrices(collectives=plan_collectives(graph, plan),
                           memory_bytes=[device["memory_bytes"] for device in devices])


def rank_report(plan: Plan, run: RankRun, prices: SimulatedPrices | None = None) -> RankReport:
    """`run` summed by kind and group, beside what `prices` (`priced_as_simulated`) give the rank:
    its memory and what it sends; without them, the plan's own memory (module docstring)."""
    predicted_collectives = None if prices is None else prices.collectives
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
    predicted = None
    if run.stages:
        predicted = plan.stages[run.stages[0]].predicted.get("memory_bytes") if prices is None \
            else prices.memory_bytes[run.stages[0] % len(prices.memory_bytes)]
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
