"""Pricing the search's pipeline candidates with the one estimator of autopar.cost.

A uniform Megatron configuration is priced by `estimate(graph, mesh, config)`, exactly as
`autopar estimate` and the benchmark's grid price it; any other candidate (uneven cuts, per-stage
recompute or ZeRO, another schedule) by `estimate_stages`, which prices non-uniform stages with the
same formulas. Results are cached: the local search proposes the same candidate more than once;
and the estimator keeps what candidates share (layouts, priced chunks) in one dict per search.
A candidate with tensor parallelism is priced on the per-op placements the sharding ILP chooses
for its tensor-parallel axis (solved once per degree and search), the placements its plan will
record, so that the price a plan is chosen by is the price of what it runs.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

from autopar.cost.config import Config
from autopar.cost.estimator import StageSpec, estimate, estimate_stages
from autopar.cost.offload import host_fits
from autopar.cost.layout import TensorPlacements
from autopar.cost.mesh import Mesh, MeshAxis
from autopar.plans.vocabulary import AxisRole
from autopar.errors import AutoparError
from autopar.graph import Graph, Role
from autopar.solver.candidates import Candidate, Priced, Unit


@dataclass(kw_only=True, slots=True)
class CandidatePricer:
    """Prices the search's pipeline candidates (step time, memory per device) with the estimator,
    on the ILP's placements for each tensor-parallel degree; one per search."""
    graph: Graph
    mesh: object                # autopar.cost.mesh.Mesh
    global_batch: int
    memory_limit: float
    precision: str | None = None    # the plan's (bf16, fp16, fp32); None: the device's training dtype
    efficiencies: object = None     # a calibration's Efficiencies; None: the device's published ones
    sequence_parallel: bool | None = None   # a forced configuration's; None: the ILP chooses
    cache: dict = field(default_factory=dict)       # candidate -> Priced, or None if refused
    estimates: dict = field(default_factory=dict)   # the estimator's own cache, for this search
    refusals: dict = field(default_factory=dict)    # the estimator's reason -> how many candidates
    deadline: float = float("inf")                  # time.monotonic() by which solves must end
    solved: dict = field(default_factory=dict)      # tp -> (the ILP's placements, TensorPlacements)

    def price(self, candidate: Candidate, units: list[Unit], uniform: bool = False) -> Priced | None:
        """The estimator's step time and memory; None when it refuses the candidate as invalid
        (a degree that does not divide the model's heads, a schedule torch cannot run)."""
        if candidate in self.cache:
            return self.cache[candidate]
        try:
            result = (estimate(self.graph, self.mesh, self.config(candidate),
                               cache=self.estimates, precision=self.precision,
                               placements=self.placements(candidate.shape.tp),
                               efficiencies=self.efficiencies)
                      if uniform else self.stages_estimate(candidate, units))
        except AutoparError as err:
            reason = str(err).split(";")[0]
            self.refusals[reason] = self.refusals.get(reason, 0) + 1
            result = None
        priced = None if result is None else Priced(
            candidate=candidate, step_time_s=result.step_time_s,
            memory_bytes=result.memory_per_gpu_bytes,
            fits=result.memory_per_gpu_bytes <= self.memory_limit and host_fits(result),
            estimate=result)
        self.cache[candidate] = priced
        return priced

    def config(self, candidate: Candidate) -> Config:
        shape = candidate.shape
        return Config(tp=shape.tp, pp=shape.pp, dp=shape.dp, ep=shape.ep, virtual=shape.virtual,
                      global_batch=self.global_batch, micro_batch=shape.micro_batch,
                      recompute=candidate.recompute[0], zero=candidate.zero[0],
                      sequence_parallel=self.splits_stream(shape), schedule=shape.schedule,
                      cp=shape.cp, cp_kind=shape.cp_kind, offload=shape.offload)

    def stages_estimate(self, candidate: Candidate, units: list[Unit]):
        shape = candidate.shape
        specs = [StageSpec(layers=chunk_layers(units, candidate, i),
                           tp=shape.tp, dp=shape.dp, ep=shape.ep,
                           recompute=candidate.recompute[i], zero=candidate.zero[i],
                           sequence_parallel=self.splits_stream(shape),
                           placements=self.placements(shape.tp), cp=shape.cp,
                           cp_kind=shape.cp_kind, offload=shape.offload, pipelined=candidate.chunks > 1)
                 for i in range(candidate.chunks)]
        return estimate_stages(self.graph, self.mesh, specs, global_batch=self.global_batch,
                               micro_batch=shape.micro_batch, schedule=shape.schedule,
                               virtual=shape.virtual, cache=self.estimates, precision=self.precision,
                               efficiencies=self.efficiencies)

    def splits_stream(self, shape) -> bool:
        """Whether `shape`'s stages run sequence parallelism: a forced configuration's as asked
        (its norms read the stream as it says), a free plan's where the ILP placed every value
        the norms read split on the tensor axis, as Megatron's sequence parallelism does (decided
        once per degree, with the placements). What the plan records and what prices its
        transfers between stages."""
        if shape.tp == 1:
            return False
        if self.sequence_parallel is not None:
            return self.sequence_parallel
        return self.tensor_axis(shape.tp)[0]["splits_stream"]

    def placements(self, tp: int) -> TensorPlacements | None:
        """The ILP's placements on a tensor-parallel axis of `tp` devices; None for tp = 1."""
        return self.tensor_axis(tp)[1]

    def tensor_axis(self, tp: int) -> tuple[dict, TensorPlacements | None]:
        """Per-op placements on the tensor-parallel axis from the intra-op ILP, solved once per
        degree, with memory left to the estimator (it prices stages, the ILP sees the whole
        graph). The data-parallel axis needs no solve: a plan fixes it to split the batch."""
        if tp not in self.solved:
            self.solved[tp] = self._solve(tp)
        return self.solved[tp]

    def _solve(self, tp: int) -> tuple[dict, TensorPlacements | None]:
        graph = self.graph
        if tp == 1:
            return {"parameters": {n.param_fqn: ["R"] for n in graph.parameters},
                    "nodes": {n.name: ["R"] for n in graph.nodes if n.role is not Role.PARAMETER},
                    "replicated_ops": [], "stats": {"status": "no tensor axis", "seconds": 0.0}}, None
        from autopar.solver import solve_intra_op

        axis = Mesh(self.mesh.device, (MeshAxis(AxisRole.TENSOR, tp, self.mesh.device.intra_node),))
        # the calibrated mesh's own link and efficiencies: the prices the estimator uses
        intra = solve_intra_op(graph, axis, roles={AxisRole.TENSOR: AxisRole.TENSOR}, memory_limit=float("inf"),
                               time_limit=max(1.0, self.deadline - time.monotonic()),
                               efficiencies=self.efficiencies,
                               sequence_parallel=self.sequence_parallel)
        solved = {"parameters": dict(intra.parameter_placements), "nodes": dict(intra.node_placements),
                  "splits_stream": stream_is_split(graph, intra.node_placements),
                  "replicated_ops": list(intra.replicated_ops),
                  "stats": {"seconds": intra.seconds, "status": intra.status, "gap": intra.gap,
                            "variables": intra.variables, "constraints": intra.constraints,
                            "objective_s": intra.objective_s}}
        fqns = {n.param_fqn: n.name for n in graph.parameters}
        return solved, TensorPlacements(
            nodes={name: placement[0] for name, placement in intra.node_placements.items()},
            parameters={fqns[fqn]: placement[0] for fqn, placement in intra.parameter_placements.items()})


def stream_is_split(graph: Graph, node_placements: dict) -> bool:
    """Whether placements on a tensor axis (node -> [placement]) split every value the graph's
    norms read, as Megatron's sequence parallelism does; False for a graph without norms."""
    reads = graph.norm_inputs()
    return bool(reads) and all(node_placements.get(value, ["R"])[0] != "R" for value in reads)


def chunk_layers(units: list[Unit], candidate: Candidate, index: int) -> list[str]:
    """Module paths of chunk `index`, in order."""
    return [layer for unit in units[candidate.cuts[index]:candidate.cuts[index + 1]]
            for layer in unit.layers]
