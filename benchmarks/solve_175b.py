"""The intra-op ILP on GPT-3 175B over a 128x8 mesh of A100-80GB: one block, then all 96 layers.

    python benchmarks/solve_175b.py [--batch 128] [--mesh 128x8:a100-80g] [--untied-limit 60]

Targets: one block (with the embedding and head around it) solved in at most 1 s; the 96-layer
graph with its blocks tied in at most 2 s. Solve times are CPU seconds of this process
(time.process_time: HiGHS runs on one thread), which other jobs on a shared machine disturb less
than wall time; wall times are printed beside them. Also printed: variables and constraints with
and without tying, and the untied 96-layer solve under a time limit, for comparison.
"""

from __future__ import annotations

import argparse
import time

import torch
from rich.console import Console
from rich.table import Table

import autopar
from autopar.cost.mesh import Mesh
from autopar.models import build_model
from autopar.solver.build import build_problem
from autopar.solver.ilp import model_size, solve
from autopar.solver.intra_op import read_solution


def timed(fn):
    wall, cpu = time.perf_counter(), time.process_time()
    result = fn()
    return result, time.process_time() - cpu, time.perf_counter() - wall


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=128, help="sequences in the captured step")
    parser.add_argument("--mesh", default="128x8:a100-80g")
    parser.add_argument("--untied-limit", type=float, default=60.0,
                        help="time limit (s) of the untied 96-layer solve; 0 skips it")
    args = parser.parse_args()
    mesh = Mesh.parse(args.mesh)
    console = Console(width=160)
    table = Table(title=f"intra-op ILP, gpt3-175b, batch {args.batch}, mesh {mesh}")
    for column in ("graph", "tied", "nodes", "variables", "constraints", "build s",
                   "solve cpu s", "solve wall s", "status", "gap", "step s", "GiB/device"):
        table.add_column(column, justify="right")

    solution = None
    for label, layers, tied in [("1 layer", 1, True), ("96 layers", 96, True), ("96 layers", 96, False)]:
        model, inputs = build_model("gpt3-175b", layers=layers, batch=args.batch, dtype=torch.bfloat16)
        graph = autopar.capture(model, inputs)
        problem, build_s, _ = timed(lambda: build_problem(
            graph, mesh, memory_limit=mesh.device.memory_bytes, tie_blocks=tied))
        if not tied and args.untied_limit <= 0:
            variables, constraints = model_size(problem)
            table.add_row(label, "no (size only)", str(len(problem.nodes)), str(variables),
                          str(constraints), f"{build_s:.2f}", *[""] * 6)
            continue
        limit = 10.0 if tied else args.untied_limit
        found, cpu_s, wall_s = timed(lambda: solve(problem, time_limit=limit))
        if layers == 96 and tied:
            solution = read_solution(graph, problem, found)
        table.add_row(label, "yes" if tied else "no", str(len(problem.nodes)), str(found.variables),
                      str(found.constraints), f"{build_s:.2f}", f"{cpu_s:.2f}", f"{wall_s:.2f}",
                      found.status, f"{found.gap:.1e}", f"{found.objective_s:.3f}",
                      f"{found.memory_bytes / 2**30:.1f}")
    console.print(table)
    if solution is not None:
        layer = Table(title="layer 0 of the 96-layer solution: placement each op reads its weight in, per axis")
        for column in ("parameter", "stored", "used", "gradient/optimizer"):
            layer.add_column(column)
        for fqn, stored in solution.parameter_placements.items():
            if fqn.startswith("layers.0."):
                layer.add_row(fqn, ",".join(stored), ",".join(solution.parameter_use_placements[fqn]),
                              ",".join(solution.gradient_placements[fqn]))
        console.print(layer)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
