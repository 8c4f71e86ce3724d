"""Predicted against published figures of training runs.

    python benchmarks/published_runs.py [--reference DIR] [--calibration FILE] [--json [OUT]]
    python benchmarks/published_runs.py --runs FILE [--json [OUT]]
    python benchmarks/published_runs.py --csv FILE [--kind moe|cp|offload] [--json]

Without --csv: every row of both older reference tables (SC'21 Table 1, published_runs.csv),
predicted against published seconds per step, with the median and worst |error| and how many
predictions are optimistic; `--runs FILE` prices the rows of another CSV with the columns of
published_runs.csv instead (benchmarks/zero3_at_scale.csv: SC'21 Table 2's ZeRO-3 runs on
384-2240 A100s, where one micro-batch a GPU leaves the gathers nothing to hide behind). With
--csv: any CSV with the columns of shared/reference/published_runs_moe_cp_offload.csv
(mixture-of-experts, context-parallel and offload runs; autopar/cost/published.py reads them), each row's own figure (model TFLOP/s by the
source's count, tokens/s, step time, MFU, memory) predicted against the published one; a row
that cannot be modeled is counted as failed, with the reason
(benchmarks/torchtitan_h100.csv: torchtitan's own runs of Llama 3.1 8B-405B on 8-512 H100s of
Grand Teton hosts, held to 500 W: FSDP, TP, PP, CP up to 8, bf16 and float8;
benchmarks/qwen3_moe_h100.csv: Megatron-Core's Qwen3-235B-A22B runs on 256 H100s that the
reference table leaves out). `--json` prints one JSON object
(with --csv: {"estimated", "failed", "median_abs_err", "worst_abs_err", "rows"}; errors are
predicted / published - 1); `--json OUT` writes the older tables' rows to OUT.

Each row's model is captured on the meta device (forward + loss) and priced by
`autopar.cost.estimate` on the row's mesh and configuration, as the row's framework ran it:
Megatron-LM's tensor-parallel layout (`ReferenceRun.placements`) and the row's runtime (see
autopar/cost/reference.py for what is assumed about each run). Nothing is fitted to these figures.
"""

import argparse
import json
import statistics
import sys
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.commands.estimate import capture_training_step
from autopar.cost.estimator import estimate
from autopar.cost.published import (KINDS, estimate_run, parse_row, predicted_figure,
                                    read_rows)
from autopar.cost.reference import published_runs, sc21_runs
from autopar.errors import AutoparError

DEFAULT_DIR = Path(__file__).resolve().parents[2] / "shared" / "reference"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reference", type=Path, default=DEFAULT_DIR)
    parser.add_argument("--calibration", type=Path, default=None)
    parser.add_argument("--csv", type=Path, default=None,
                        help="published runs with the columns of published_runs_moe_cp_offload.csv")
    parser.add_argument("--runs", type=Path, default=None,
                        help="price these rows (the columns of published_runs.csv) instead of both tables")
    parser.add_argument("--kind", choices=KINDS, default=None, help="only the --csv rows of this kind")
    parser.add_argument("--json", nargs="?", const="-", default=None,
                        help="print one JSON object (or, without --csv, write the rows to OUT)")
    args = parser.parse_args()
    if args.csv is not None:
        sys.exit(csv_main(args))
    if args.kind is not None:
        parser.error("--kind selects rows of a --csv file")
    try:
        runs = published_runs(args.runs) if args.runs else (
            sc21_runs(args.reference / "megatron_sc21_table1.csv")
            + published_runs(args.reference / "published_runs.csv"))
    except (AutoparError, OSError) as err:
        sys.exit(f"error: {err}")
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
    if args.json == "-":
        print(json.dumps(rows, indent=2))
        return
    _print(rows)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2) + "\n")


def csv_main(args) -> int:
    """Price every row of a published-runs CSV; 0 when it could be read (rows may still fail)."""
    if not args.csv.is_file():
        print(f"error: --csv {args.csv} is not a file", file=sys.stderr)
        return 2
    status = Console(stderr=True)
    graphs, rows = {}, []
    for index, row in enumerate(read_rows(args.csv)):
        if args.kind and (row.get("kind") or "").strip().lower() != args.kind:
            continue
        with status.status(f"row {index}: {(row.get('model') or '').strip()}"):
            rows.append(_price_row(row, index, graphs, args.calibration))
    summary = _summary(rows)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_csv(summary)
    return 0


def _price_row(row: dict, index: int, graphs: dict, calibration) -> dict:
    """One row priced: its figure predicted against the published one, or why it failed."""
    name = f"{index}: {(row.get('model') or '').strip()}"
    try:
        run = parse_row(row, index)
        if run.spec not in graphs:
            graphs[run.spec] = capture_training_step(run.spec)
        result = estimate_run(graphs[run.spec], run, calibration=calibration)
    except (AutoparError, ValueError) as err:
        return {"row": index, "name": name, "kind": (row.get("kind") or "").strip(),
                "status": "failed", "reason": str(err)}
    predicted = predicted_figure(run, result.step_time_s, result.memory_per_gpu_bytes)
    c = run.config
    return {"row": index, "name": name, "kind": run.kind, "status": "estimated",
            "figure": run.figure, "published": run.value, "predicted": predicted,
            "error": predicted / run.value - 1, "mesh": str(run.mesh), "spec": run.spec,
            "config": {"tp": c.tp, "pp": c.pp, "dp": c.dp, "ep": c.ep, "cp": c.cp,
                       "virtual": c.virtual, "micro_batch": c.micro_batch,
                       "global_batch": c.global_batch, "recompute": c.recompute, "zero": c.zero,
                       "offload": run.offload},
            "precision": run.precision, "runtime": run.runtime, "trust": run.trust,
            "causal_flops": run.causal_flops, "assumed": list(run.assumed),
            "step_time_s": result.step_time_s, "breakdown": result.breakdown,
            "comm": result.comm_breakdown, "memory_gib": result.memory_per_gpu_bytes / 2**30,
            "fits": result.fits}


def _summary(rows: list[dict]) -> dict:
    done = [r for r in rows if r["status"] == "estimated"]
    errors = [abs(r["error"]) for r in done]
    by_kind = {}
    for kind in sorted({r["kind"] for r in rows}):
        mine = [abs(r["error"]) for r in done if r["kind"] == kind]
        by_kind[kind] = {"estimated": len(mine),
                         "failed": sum(r["kind"] == kind for r in rows) - len(mine),
                         "median_abs_err": statistics.median(mine) if mine else None,
                         "worst_abs_err": max(mine) if mine else None}
    return {"estimated": len(done), "failed": len(rows) - len(done),
            "median_abs_err": statistics.median(errors) if errors else None,
            "worst_abs_err": max(errors) if errors else None, "by_kind": by_kind, "rows": rows}


def _print_csv(summary: dict) -> None:
    table = Table(title="published runs: predicted vs published (the row's own figure)")
    for column in ("row", "kind", "mesh", "tp", "pp", "ep", "cp", "figure", "published",
                   "predicted", "error"):
        table.add_column(column, justify="left" if column in ("row", "kind", "mesh", "figure") else "right")
    for row in summary["rows"]:
        if row["status"] != "estimated":
            table.add_row(row["name"][:40], row["kind"], "", "", "", "", "", "failed",
                          "", "", row["reason"][:60])
            continue
        c = row["config"]
        table.add_row(row["name"][:40], row["kind"], row["mesh"], str(c["tp"]), str(c["pp"]),
                      str(c["ep"]), str(c["cp"]), row["figure"], f"{row['published']:.4g}",
                      f"{row['predicted']:.4g}", f"{row['error']:+.1%}")
    console = Console(width=max(Console().width, 160))
    console.print(table)
    for kind, figures in summary["by_kind"].items():
        console.print(f"{kind}: {figures['estimated']} estimated, {figures['failed']} failed"
                      + (f", median |error| {figures['median_abs_err']:.1%}, worst "
                         f"{figures['worst_abs_err']:.1%}" if figures["estimated"] else ""))
    if summary["estimated"]:
        console.print(f"all: {summary['estimated']} estimated, {summary['failed']} failed, median "
                      f"|error| {summary['median_abs_err']:.1%}, worst {summary['worst_abs_err']:.1%}")


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
