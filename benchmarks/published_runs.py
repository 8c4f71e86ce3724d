"""Predicted against published step time for every row of both reference tables.

    python benchmarks/published_runs.py [--reference DIR] [--calibration FILE] [--json OUT]

Each row's model is captured on the meta device (forward + loss) and priced by
`autopar.cost.estimate` on the row's mesh and configuration, as the row's framework ran it:
Megatron-LM's tensor-parallel layout (`ReferenceRun.placements`) and the row's runtime (see
autopar/cost/reference.py for what is assumed about each run). Prints predicted against published
seconds per step per row, the median and worst |error|, and how many predictions are optimistic
(faster than published). Nothing is fitted to these figures.
"""

import argparse
import json
import statistics
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.commands.estimate import capture_training_step
from autopar.cost.estimator import estimate
from autopar.cost.reference import published_runs, sc21_runs

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "reference"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--json", type=Path, default=None, help="write the rows as JSON here")
    args = parser.parse_args()
    runs = (sc21_runs(args.reference / "megatron_sc21_table1.csv")
            + published_runs(args.reference / "published_runs.csv"))
    graphs, rows = {}, []
    for run in runs:
        if run.spec not in graphs:
            graphs[run.spec] = capture_training_step(run.spec)
        graph = graphs[run.spec]
        result = estimate(graph, run.mesh, run.config, attention=run.attention,
                          runtime=run.runtime, calibration=args.calibration,
                          placements=run.placements(graph))
        rows.append({"name": run.name, "runtime": run.runtime, "config": run.config.to_dict(),
                     "published_s": run.published_step_s, "predicted_s": result.step_time_s,
                     "error": result.step_time_s / run.published_step_s - 1,
                     "breakdown": result.breakdown, "comm": result.comm_breakdown,
                     "mfu": result.mfu, "memory_gib": result.memory_per_gpu_bytes / 2**30,
                     "fits": result.fits})
    _print(rows)
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2) + "\n")


def _print(rows: list[dict]) -> None:
    table = Table(title="published runs: predicted vs published seconds per step")
    for column in ("run", "tp", "pp", "dp", "zero", "rc", "published s", "predicted s", "error",
                   "compute", "exposed comm", "bubble", "MFU", "GiB"):
        table.add_column(column, justify="left" if column == "run" else "right")
    for row in rows:
        c, b = row["config"], row["breakdown"]
        table.add_row(row["name"], str(c["tp"]), str(c["pp"]), str(c["dp"]), str(c["zero"]),
                      c["recompute"][:3], f"{row['published_s']:.3f}", f"{row['predicted_s']:.3f}",
                      f"{row['error']:+.1%}", f"{b['compute']:.3f}", f"{b['exposed_comm']:.3f}",
                      f"{b['bubble']:.3f}", f"{row['mfu']:.1%}",
                      f"{row['memory_gib']:.1f}" + ("" if row["fits"] else "!"))
    console = Console(width=max(Console().width, 160))
    console.print(table)
    errors = [abs(r["error"]) for r in rows]
    worst = max(rows, key=lambda r: abs(r["error"]))
    optimistic = sum(r["error"] < 0 for r in rows)
    console.print(f"{len(rows)} runs: median |error| {statistics.median(errors):.1%}, worst "
                  f"{abs(worst['error']):.1%} ({worst['name']}), optimistic on {optimistic} of "
                  f"{len(rows)}, mean error {statistics.mean(r['error'] for r in rows):+.1%}")


if __name__ == "__main__":
    main()
