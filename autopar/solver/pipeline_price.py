"""Pricing pipeline candidates with the one estimator of autopar.cost.

A uniform Megatron configuration is priced by `estimate(graph, mesh, config)`, exactly as
`autopar estimate` and the benchmark's grid price it; any other candidate (uneven cuts, per-stage
recompute or ZeRO, another schedule) by `estimate_stages`, which prices non-uniform stages with the
same formulas. Results are cached: the local search proposes the same candidate more than once;
and the estimator keeps what candidates share (layouts, priced chunks) in one dict per search.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar.cost.config import Config
from autopar.cost.estimator import StageSpec, estimate, estimate_stages
from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.solver.pipeline import Candidate, Priced, Unit


@dataclass(kw_only=True, slots=True)
class Pricer:
    graph: Graph
    mesh: object                # autopar.cost.mesh.Mesh
    global_batch: int
    memory_limit: float
    precision: str | None = None    # the plan's (bf16, fp16, fp32); None: the device's training dtype
    cache: dict = field(default_factory=dict)       # candidate -> Priced, or None if refused
    estimates: dict = field(default_factory=dict)   # the estimator's own cache, for this search
    refusals: dict = field(default_factory=dict)    # the estimator's reason -> how many candidates

    def price(self, candidate: Candidate, units: list[Unit], uniform: bool = False) -> Priced | None:
        """The estimator's step time and memory; None when it refuses the candidate as invalid
        (a degree that does not divide the model's heads, a schedule torch cannot run)."""
        if candidate in self.cache:
            return self.cache[candidate]
        try:
            result = (estimate(self.graph, self.mesh, self.config(candidate),
                               cache=self.estimates, precision=self.precision)
                      if uniform else self.stages_estimate(candidate, units))
        except AutoparError as err:
            reason = str(err).split(";")[0]
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            result = None
        priced = None if result is None else Priced(
            candidate=candidate, step_time_s=result.step_time_s,
            memory_bytes=result.memory_per_gpu_bytes,
            fits=result.memory_per_gpu_bytes <= self.memory_limit, estimate=result)
        self.cache[candidate] = priced
        return priced

    def config(self, candidate: Candidate) -> Config:
        shape = candidate.shape
        return Config(tp=shape.tp, pp=shape.pp, dp=shape.dp, virtual=shape.virtual,
                      global_batch=self.global_batch, micro_batch=shape.micro_batch,
                      recompute=candidate.recompute[0], zero=candidate.zero[0],
                      sequence_parallel=shape.sequence_parallel, schedule=shape.schedule)

    def stages_estimate(self, candidate: Candidate, units: list[Unit]):
        shape = candidate.shape
        specs = [StageSpec(layers=[u.ref for u in units[candidate.cuts[i]:candidate.cuts[i + 1]]],
                           tp=shape.tp, dp=shape.dp,
                           recompute=candidate.recompute[i], zero=candidate.zero[i],
                           sequence_parallel=shape.sequence_parallel)
                 for i in range(candidate.chunks)]
        return estimate_stages(self.graph, self.mesh, specs, global_batch=self.global_batch,
                               micro_batch=shape.micro_batch, schedule=shape.schedule,
                               virtual=shape.virtual, cache=self.estimates, precision=self.precision)


def chunk_layers(units: list[Unit], candidate: Candidate, index: int) -> list[str]:
    """Module paths of chunk `index`, in order."""
    return [layer for unit in units[candidate.cuts[index]:candidate.cuts[index + 1]]
            for layer in unit.layers]
