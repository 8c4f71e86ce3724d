"""`autopar simulate plan.json --model MODEL --ranks all|R,R,... [--json]`: build each named rank's
program exactly as `autopar.compile` would on that rank and run one training step on fake tensors
over a fake process group, with no GPU: each rank's peak memory against the plan's prediction,
and the collectives it issues (autopar.simulate)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table


def add_arguments(parser):
    parser.add_argument("plan", type=Path, help="a plan written by `autopar plan --out`")
    parser.add_argument("--model", required=True,
                        help="the preset or spec the plan was made for (gpt3-175b, llama-70b, ...)")
    parser.add_argument("--ranks", default="all",
                        help="'all' (one rank of each pipeline rank, the default) or ranks such as 0,7")
    parser.add_argument("--json", action="store_true", help="print the reports as JSON on stdout")


def run(args) -> int:
    from autopar.errors import AutoparError
    from autopar.models import build_model, parse_spec
    from autopar.models.mlp import MLPConfig
    from autopar.models.gpt import lm_loss
    from autopar.plans import Plan
    from autopar.simulate import priced_as_simulated, rank_report, ranks_to_simulate, simulate_ranks
    from autopar.tracer import capture

    if isinstance(parse_spec(args.model), MLPConfig):
        raise AutoparError(f"{args.model}: autopar simulate steps language models (token ids in, "
                           f"next-token targets); an MLP spec has no targets to make. Simulate "
                           f"with autopar.simulate.simulate_ranks and your own loss and targets")
    plan = Plan.load(args.plan)
    ranks = ranks_to_simulate(plan, args.ranks)
    console = Console(stderr=True)
    with console.status(f"capturing {args.model}") as status:
        model, inputs = build_model(args.model)     # as `autopar plan` captures it
        graph = capture(model, example_inputs=inputs)
        plan.check_graph(graph)

        def progress(rank: int, done: int, total: int) -> None:
            status.update(f"simulating rank {rank} ({done + 1}/{total}): one step of "
                          f"{plan.micro_batches} micro-batches")

        predicted = priced_as_simulated(graph, plan)    # before the long part: it may refuse
        runs = simulate_ranks(model, plan, ranks, example_inputs=inputs, targets=inputs[0],
                              loss_fn=lm_loss, graph=graph, progress=progress)
    reports = [rank_report(plan, run, predicted) for run in runs]
    for r in reports:
        console.print(f"rank {r.rank} simulated in {r.seconds:.0f} s")
    if args.json:
        sys.stdout.write(json.dumps({"plan": str(args.plan), "summary": plan.summary(),
                                     "ranks": [r.to_dict() for r in reports]}, indent=1) + "\n")
    else:
        _print(plan, reports, Console())
    return 0


def _gib(nbytes) -> str:
    """Bytes in the largest binary unit that keeps a whole number before the point."""
    if nbytes is None:
        return "-"
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes} B"


def _print(plan, reports, console: Console) -> None:
    console.print(plan.summary())
    table = Table(title="one simulated step per rank")
    for column in ("rank", "stages", "peak", "predicted", "error", "sent", "predicted sent",
                   "collectives"):
        table.add_column(column, justify="right")
    for r in reports:
        error = "-" if r.memory_error is None else f"{r.memory_error:+.1%}"
        table.add_row(str(r.rank), ",".join(map(str, r.stages)), _gib(r.peak_memory_bytes),
                      _gib(r.predicted_memory_bytes), error, _gib(r.collective_bytes),
                      _gib(r.predicted_collective_bytes), str(sum(c["count"] for c in r.collectives)))
    console.print(table)
    for r in reports:
        console.print(f"rank {r.rank}: " + "; ".join(
            f"{c['kind']}@{c['axis']} x{c['count']} {_gib(c['sent_bytes'])}"
            f" (predicted {_gib(c.get('predicted_sent_bytes'))})" for c in r.collectives))
