"""`autopar explain plan.json [--png timeline.png]`: a saved plan as tables per stage (devices,
layers, memory and time) and, with --png, the pipeline timeline of forward and backward per stage and
micro-batch."""

from __future__ import annotations

import re

from rich.console import Console
from rich.table import Table
from rich.text import Text

from autopar.commands.output import PLOT_EXTRA, can_plot, check_output, plain, table
from autopar.errors import AutoparError, format_bytes
from autopar.plans import Plan


def add_arguments(parser):
    parser.add_argument("plan", help="a plan written by `autopar plan --out`")
    parser.add_argument("--png", help="write the pipeline timeline picture to this file")


def run(args) -> int:
    if args.png:
        check_output(args.png, "--png")
        if not can_plot():   # asked for explicitly, so an error rather than a note
            raise AutoparError(f"--png needs matplotlib: {PLOT_EXTRA}")
    plan = Plan.load(args.plan)
    console = Console()
    render(plan, console)
    if args.png:
        from autopar.timeline import plan_timeline, save_png

        timeline = plan_timeline(plan)
        save_png(timeline, args.png, title=f"{plan.model_type or 'model'}: {plan.summary()}")
        console.print(plain(f"timeline written to {args.png} (simulated bubble "
                            f"{timeline.bubble_fraction:.1%})"))
    return 0


def render(plan: Plan, console: Console) -> None:
    console.print(headline(plan))
    console.print(stage_table(plan))
    console.print(breakdown_table(plan))
    solver = plan.solver
    if solver:
        intra = solver.get("intra_op", {})
        placements = (f"intra-op ILP {intra.get('status')} ({intra.get('variables')} variables, gap "
                      f"{_fmt_gap(intra.get('gap'))})" if "variables" in intra
                      else "no tensor axis: every op replicated within a data-parallel replica")
        console.print(plain(f"solver: {solver.get('status')} in {_fmt_s(solver.get('seconds', 0))}, "
                            f"{solver.get('candidates', '?')} candidates priced; {placements}; "
                            f"{len(plan.parameters)} parameters placed, {len(plan.replicated_ops)} "
                            f"ops without a sharding rule run replicated"))
        if solver.get("status") == "time_limit":
            console.print(plain("the search stopped at its time limit before pricing every "
                                "candidate: a faster plan may exist; plan again with a longer "
                                "--time-limit (time_limit= in Python)"))


def headline(plan: Plan) -> Text:
    mesh = plan.mesh
    device = mesh.get("device", {}).get("name", "?")
    shape = "x".join(str(a["size"]) for a in mesh.get("axes", []))
    share = mesh.get("device", {}).get("power_share", 1.0)
    capped = f", each held to {share:.0%} of its rated board power" if share < 1 else ""
    p = plan.predicted
    return Text.assemble(
        plain(plan.model_type or "model", "bold"),
        plain(f" on {shape}:{device} ({plan.world_size} devices{capped})"), "\n", plain(plan.summary()), "\n",
        plain(f"predicted step {_fmt_s(p.get('step_time_s'))}, {_fmt_num(p.get('tflops_per_gpu'))} "
            f"TFLOP/s per GPU, MFU {_fmt_pct(p.get('mfu'))}, memory "
            f"{_fmt_gib(p.get('memory_per_gpu_bytes'))} on the fullest device"
            + (f" (and {_fmt_gib(p['host_memory_bytes'])} of offloaded states on its host)"
               if p.get("host_memory_bytes") else "") + ", bubble "
            f"{_fmt_pct(p.get('bubble_fraction'))} (simulated with torch's schedule: "
            f"{_fmt_pct(p.get('simulated_bubble_fraction'))})"))


def stage_table(plan: Plan) -> Table:
    """One row per stage; a context-parallel degree (and its attention) and offload where used."""
    degrees = "tp x dp x cp" if plan.cp > 1 else "tp x dp"
    result = table("stages", ["stage", "ranks", "layers", degrees, "ep", "recompute", "ZeRO",
                              "time per micro-batch", "memory"], right=("stage", "memory"),
                   wrap=("layers", "time per micro-batch", "memory"))
    for stage in plan.stages:
        predicted = stage.predicted
        shape = f"{stage.tp} x {stage.dp}" + (f" x {stage.cp} {stage.cp_kind}" if plan.cp > 1 else "")
        zero = f"{stage.zero}, offloaded" if stage.offload else stage.zero
        result.add_row(*map(plain, (stage.index, rank_ranges(stage.ranks), compress_layers(stage.layers),
                                    shape, stage.ep, stage.recompute, zero,
                                    _stage_time(predicted), _fmt_gib(predicted.get("memory_bytes")))))
    return result


def breakdown_table(plan: Plan) -> Table:
    result = table("predicted step", ["part", "value"], right=("value",))
    for section in ("breakdown", "memory_breakdown"):
        parts = plan.predicted.get(section)
        for key, value in (parts.items() if isinstance(parts, dict) else ()):
            text = _fmt_gib(value) if section == "memory_breakdown" else _fmt_s(value)
            result.add_row(plain(f"{'memory' if section == 'memory_breakdown' else 'time'}: {key}"),
                           plain(text))
    return result


def _stage_time(predicted: dict) -> str:
    return _fmt_s(predicted.get("time_per_micro_batch_s"))


def compress_layers(layers: list[str]) -> str:
    """["tok_emb", "layers.0", "layers.1", "layers.2"] -> "tok_emb, layers.0-2"."""
    parts: list[str] = []
    run_prefix, run_start, run_end = None, None, None
    for layer in layers + [None]:
        match = re.fullmatch(r"(.*)\.(\d+)", layer) if layer else None
        if match and match.group(1) == run_prefix and int(match.group(2)) == run_end + 1:
            run_end += 1
            continue
        if run_prefix is not None:
            parts.append(f"{run_prefix}.{run_start}" + (f"-{run_end}" if run_end > run_start else ""))
            run_prefix = None
        if match:
            run_prefix, run_start, run_end = match.group(1), int(match.group(2)), int(match.group(2))
        elif layer:
            parts.append(layer)
    return ", ".join(parts)


def rank_ranges(ranks: list[int]) -> str:
    if ranks and ranks == list(range(ranks[0], ranks[-1] + 1)):
        return f"{ranks[0]}-{ranks[-1]}" if len(ranks) > 1 else str(ranks[0])
    return ",".join(map(str, ranks))


def _fmt_s(value) -> str:
    if not _is_number(value):
        return "-" if value is None else repr(value)
    # by size: a negative time (the cores idle ranks lend) reads in the unit of its magnitude
    if abs(value) >= 1:
        return f"{value:.3f} s"
    return f"{value * 1e3:.2f} ms" if abs(value) >= 1e-3 else f"{value * 1e6:.1f} us"


def _fmt_gib(value) -> str:
    """Bytes in the largest binary unit that keeps a leading digit: 1.50 GiB, 37.2 MiB, 512 B."""
    if not _is_number(value):
        return "-" if value is None else repr(value)
    return format_bytes(value)


def _is_number(value) -> bool:
    # a plan file may hold anything where a number belongs; it is shown, not formatted
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt_pct(value) -> str:
    return f"{value:.1%}" if _is_number(value) else "-" if value is None else repr(value)


def _fmt_num(value) -> str:
    return f"{value:.1f}" if _is_number(value) else "-" if value is None else repr(value)


def _fmt_gap(value) -> str:
    return f"{value:.2%}" if _is_number(value) else "-" if value is None else repr(value)
