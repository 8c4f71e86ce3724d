"""`autopar diff a.json b.json`: what two saved plans decide differently, and what each predicts."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from autopar.commands.explain import compress_layers
from autopar.plan import Plan

SHOWN_PLACEMENTS = 20   # parameter and node placements listed one by one; the rest are counted
# Solver statistics differ between any two runs; they are not a difference of the plans.
IGNORED = ("solver",)


def add_arguments(parser):
    parser.add_argument("a", help="first plan (JSON)")
    parser.add_argument("b", help="second plan (JSON)")


def run(args) -> int:
    a, b = Plan.load(args.a), Plan.load(args.b)
    render(a, b, Console(), names=(args.a, args.b))
    return 0


def render(a: Plan, b: Plan, console: Console, names=("a", "b")) -> None:
    summary = Table(title="plans", title_justify="left")
    summary.add_column("")
    summary.add_column(names[0])
    summary.add_column(names[1])
    summary.add_row("configuration", a.summary(), b.summary())
    for key, label in (("step_time_s", "step time (s)"), ("tflops_per_gpu", "TFLOP/s per GPU"),
                       ("memory_per_gpu_bytes", "memory per GPU (GiB)"), ("bubble_fraction", "bubble")):
        va, vb = a.predicted.get(key), b.predicted.get(key)
        scale = 2**30 if key == "memory_per_gpu_bytes" else 1
        summary.add_row(label, _num(va, scale), _num(vb, scale))
    if a.predicted.get("step_time_s") and b.predicted.get("step_time_s"):
        summary.add_row("speed b / a", "", f"{a.predicted['step_time_s'] / b.predicted['step_time_s']:.3f}x")
    console.print(summary)
    if a.fingerprint != b.fingerprint:
        console.print("[yellow]the plans were made for different models or input shapes[/yellow]")
    differences = [d for d in a.diff(b) if not d[0].startswith(IGNORED)]
    placements = [d for d in differences if d[0].startswith(("parameters.", "nodes."))]
    others = [d for d in differences if d not in placements]
    table = Table(title=f"{len(others)} decisions differ", title_justify="left")
    table.add_column("field")
    table.add_column(names[0])
    table.add_column(names[1])
    for path, va, vb in others + placements[:SHOWN_PLACEMENTS]:
        table.add_row(path, _value(va), _value(vb))
    console.print(table)
    if len(placements) > SHOWN_PLACEMENTS:
        console.print(f"... and {len(placements) - SHOWN_PLACEMENTS} more placements differ")
    if not differences:
        console.print("the plans make the same decisions")


def _num(value, scale=1) -> str:
    return "-" if value is None else f"{value / scale:.4g}"


def _value(value) -> str:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and len(value) > 3:
        return compress_layers(value)
    if isinstance(value, dict) and "layers" in value:     # a stage only one plan has
        return f"{compress_layers(value['layers'])} (tp={value.get('tp')} dp={value.get('dp')})"
    return str(value)
