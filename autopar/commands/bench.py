"""`autopar bench [--json] [--out DIR] [--quick]`: autopar's plans against the best Megatron-style
configuration found by exhaustive grid search, both priced by the same estimator.

The grid: TP in the divisors of the node size up to 8, PP dividing the layers, DP the rest,
micro-batch sizes 1-16, recompute none/selective/full, interleaving with v chunks, ZeRO 0/1;
uniform stages. autopar searches a space that contains it (see autopar.solver.search), so the
ratio autopar / grid is at least 1 on every row; the `why` column names what autopar did that the
grid cannot express where it is above 1. Writes bench.md, bench.csv and bench.png to --out.
"""

from __future__ import annotations

import csv
import json
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.plans.vocabulary import Schedule

# (model, mesh, global batch): GPT-3 and Llama sizes on A100 and H100 clusters of 8 to 1024 GPUs,
# each model on clusters where it is trained in practice (weak scaling, as Megatron-LM's Table 1).
# Three more rows on 40 GB A100s, where memory binds and per-stage choices matter.
FULL_ROWS = [(model, f"{nodes}x8:{device}", batch)
             for device in ("a100-80g", "h100-80g")
             for model, nodes, batch in [
                 ("gpt3-1.3b", 1, 512), ("gpt3-2.7b", 2, 512), ("gpt3-6.7b", 8, 512),
                 ("gpt3-13b", 16, 1024), ("gpt3-175b", 128, 1536),
                 ("llama-7b", 8, 512), ("llama-13b", 16, 1024), ("llama-70b", 64, 1024)]] + [
             ("gpt3-6.7b", "1x8:a100-40g", 512), ("gpt3-13b", "2x8:a100-40g", 512),
             ("gpt3-175b", "64x8:a100-40g", 1536)]
QUICK_ROWS = [("gpt:layers=6,hidden=256,heads=8,seq=128,vocab=1024", "2x4:a100-80g", 64),
              ("gpt:layers=6,hidden=256,heads=8,seq=128,vocab=1024", "2x4:h100-80g", 16),
              ("llama-tiny", "1x4:a100-40g", 32)]


NOTABLE = 1e-3     # speed-ups below 0.1% are reported as a tie, not explained


@dataclass(kw_only=True, slots=True)
class Row:
    model: str
    cluster: str
    global_batch: int
    grid_config: str
    grid_step_s: float
    grid_tflops: float
    grid_samples_per_s: float
    autopar_plan: str
    autopar_step_s: float
    autopar_tflops: float
    autopar_samples_per_s: float
    ratio: float
    solve_s: float
    capture_s: float
    grid_configs: int
    why: str


def add_arguments(parser):
    parser.add_argument("--quick", action="store_true", help="a few small rows, for CI")
    parser.add_argument("--out", default="bench", help="folder for bench.md, bench.csv, bench.png")
    parser.add_argument("--json", action="store_true", help="print the rows as JSON")
    parser.add_argument("--time-limit", type=float, default=600.0,
                        help="seconds per plan (default 600: the benchmark measures quality)")


def run(args) -> int:
    from autopar.api import check_planning
    from autopar.commands.output import PLOT_EXTRA, can_plot, check_output, plain

    check_planning(1, args.time_limit, None)
    out = check_output(args.out, "--out", directory=True)
    console = Console(stderr=True)
    rows = []
    specs = QUICK_ROWS if args.quick else FULL_ROWS
    with console.status("bench") as status:
        for i, (model, cluster, batch) in enumerate(specs):
            status.update(f"bench {i + 1}/{len(specs)}: {model} on {cluster}")
            rows.append(bench_row(model, cluster, batch, time_limit=args.time_limit))
            console.print(f"{model} on {cluster}: ratio {rows[-1].ratio:.3f}, solved in "
                          f"{rows[-1].solve_s:.1f} s")
    out.mkdir(parents=True, exist_ok=True)
    written = [out / "bench.md", out / "bench.csv"]
    write_markdown(rows, written[0])
    write_csv(rows, written[1])
    if can_plot():
        written.append(out / "bench.png")
        write_plot(rows, written[-1])
    else:
        console.print(f"bench.png skipped: drawing it needs matplotlib ({PLOT_EXTRA})")
    if args.json:
        print(json.dumps([asdict(r) for r in rows], indent=1))
    else:
        Console().print(table(rows))
        Console().print(plain(f"written: {', '.join(map(str, written))}"))
    return 0


def bench_row(model: str, cluster: str, global_batch: int, *, time_limit: float) -> Row:
    from autopar.tracer import capture
    from autopar.cost.mesh import Mesh
    from autopar.models import build_model
    from autopar.solver.candidates import megatron_shapes
    from autopar.solver.planner import plan_and_search
    from autopar.solver.search import Search, grid_phase

    mesh = Mesh.parse(cluster)
    started = time.monotonic()
    graph = capture(*build_model(model))
    captured = time.monotonic()
    plan, search = plan_and_search(graph, mesh, global_batch=global_batch, time_limit=time_limit)
    solved = time.monotonic()
    # The grid, on its own search sharing only the estimator's memo of priced candidates (a pure
    # function's results): every configuration by `estimate`, the fastest that fits.
    grid_search = Search(pricer=search.pricer, units=search.units, deadline=float("inf"),
                         skipping=search.skipping)
    blocks = sum(1 for unit in grid_search.units if unit.block)
    priced = grid_phase(grid_search, megatron_shapes(blocks, mesh.world_size, mesh.gpus_per_node,
                                                     global_batch))
    grid = [p for p in priced if p.fits]
    if not grid:
        raise SystemExit(f"no grid configuration of {model} fits {cluster}; pick another row")
    best = min(grid, key=lambda p: p.step_time_s)
    grid_config = grid_search.pricer.config(best.candidate)
    step = plan.predicted["step_time_s"]
    return Row(model=model, cluster=cluster, global_batch=global_batch,
               grid_config=_config_text(grid_config), grid_step_s=best.step_time_s,
               grid_tflops=best.estimate.tflops_per_gpu,
               grid_samples_per_s=global_batch / best.step_time_s,
               autopar_plan=plan.summary(), autopar_step_s=step,
               autopar_tflops=plan.predicted["tflops_per_gpu"],
               autopar_samples_per_s=global_batch / step, ratio=best.step_time_s / step,
               solve_s=solved - captured, capture_s=captured - started,
               grid_configs=len(priced), why=why(plan, grid_config, best, step))


def _config_text(config) -> str:
    schedule = config.schedule + (f" v={config.virtual}" if config.virtual > 1 else "")
    return (f"tp={config.tp} pp={config.pp} dp={config.dp} {schedule} mbs={config.micro_batch} "
            f"recompute={config.recompute} zero={config.zero}")


def why(plan, config, grid_best, autopar_step: float) -> str:
    """What autopar's plan does that the grid cannot, when it is faster."""
    if autopar_step > grid_best.step_time_s * (1 - NOTABLE):
        return "as fast as the grid's best (within 0.1%)"
    reasons = []
    blocks = [sum(1 for layer in s.layers if layer.rsplit(".", 1)[-1].isdigit()) for s in plan.stages]
    if len(set(blocks)) > 1:
        reasons.append(f"uneven stages ({'/'.join(map(str, blocks))} blocks: the embedding and "
                       f"head are not free)")
    if plan.pp != config.pp and any(b != blocks[0] for b in blocks):
        reasons.append(f"pp={plan.pp}, which does not divide the layers")
    if plan.schedule not in (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED_1F1B):
        reasons.append(f"{plan.schedule} schedule")
    if plan.micro_batch_size & (plan.micro_batch_size - 1):
        reasons.append(f"micro-batch size {plan.micro_batch_size}, not a power of two")
    if len({s.recompute for s in plan.stages}) > 1:
        reasons.append("recompute per stage (" + "/".join(s.recompute for s in plan.stages) + ")")
    zero = [s.zero for s in plan.stages]
    if any(z > 1 for z in zero):
        reasons.append(f"ZeRO-{zero[0]}" if len(set(zero)) == 1 else
                       "ZeRO per stage " + "/".join(map(str, zero)))
    if (plan.tp, plan.pp, plan.dp, plan.micro_batch_size) != (config.tp, config.pp, config.dp,
                                                              config.micro_batch):
        reasons.append("another device layout made feasible or faster by the above")
    return "; ".join(reasons) or "refined recompute/ZeRO within the grid's layout"


def table(rows: list[Row]) -> Table:
    from autopar.commands.output import table as new_table

    result = new_table("autopar vs the best Megatron-style grid configuration (same estimator)",
                       ["model", "cluster", "grid best", "grid TFLOP/s", "autopar plan",
                        "autopar TFLOP/s", "ratio", "solve s", "why"],
                       right=("grid TFLOP/s", "autopar TFLOP/s", "ratio", "solve s"))
    for r in rows:
        result.add_row(r.model, r.cluster, r.grid_config, f"{r.grid_tflops:.1f}", r.autopar_plan,
                       f"{r.autopar_tflops:.1f}", f"{r.ratio:.3f}", f"{r.solve_s:.1f}", r.why)
    return result


def write_markdown(rows: list[Row], path: Path) -> None:
    lines = ["| model | cluster | batch | grid best | grid samples/s (TFLOP/s) | autopar plan | "
             "autopar samples/s (TFLOP/s) | ratio | solve s | capture s | why |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r.model} | {r.cluster} | {r.global_batch} | {r.grid_config} | "
                     f"{r.grid_samples_per_s:.2f} ({r.grid_tflops:.1f}) | {r.autopar_plan} | "
                     f"{r.autopar_samples_per_s:.2f} ({r.autopar_tflops:.1f}) | {r.ratio:.3f} | "
                     f"{r.solve_s:.1f} | {r.capture_s:.1f} | {r.why} |")
    path.write_text("\n".join(lines) + "\n")


def write_csv(rows: list[Row], path: Path) -> None:
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(asdict(rows[0])))
        writer.writeheader()
        writer.writerows(asdict(r) for r in rows)


def write_plot(rows: list[Row], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(max(6, 0.7 * len(rows) + 2), 4.5))
    labels = [f"{r.model.split(':')[0]}\n{r.cluster}" for r in rows]
    positions = range(len(rows))
    ax.bar([p - 0.2 for p in positions], [r.grid_tflops for r in rows], 0.4, label="grid best")
    ax.bar([p + 0.2 for p in positions], [r.autopar_tflops for r in rows], 0.4, label="autopar")
    for p, r in zip(positions, rows):
        ax.text(p + 0.2, r.autopar_tflops, f"{r.ratio:.2f}x", ha="center", va="bottom", fontsize=7)
    ax.set_xticks(list(positions), labels, fontsize=7, rotation=45, ha="right")
    ax.set_ylabel("predicted TFLOP/s per GPU")
    ax.set_title("autopar vs the best Megatron-style grid configuration", loc="left")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
