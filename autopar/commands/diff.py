"""`autopar diff a.json b.json`: what two saved plans decide differently, and what each predicts."""

from __future__ import annotations

from rich.console import Console

from autopar.commands.explain import _fmt_gib, compress_layers
from autopar.commands.output import plain, table
from autopar.plans import Plan

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
    # the file names head the columns: plain text, and any width (the table wraps them)
    summary = table("plans", ["", plain(names[0]), plain(names[1])])
    summary.add_row("configuration", plain(a.summary()), plain(b.summary()))
    for key, label in (("step_time_s", "step time (s)"), ("tflops_per_gpu", "TFLOP/s per GPU"),
                       ("memory_per_gpu_bytes", "memory per GPU"), ("bubble_fraction", "bubble")):
        show = _fmt_gib if key == "memory_per_gpu_bytes" else _num
        summary.add_row(label, plain(show(a.predicted.get(key))), plain(show(b.predicted.get(key))))
    sa, sb = a.predicted.get("step_time_s"), b.predicted.get("step_time_s")
    if _is_number(sa) and _is_number(sb) and sa and sb:
        summary.add_row("speed b / a", "", f"{sa / sb:.3f}x")
    console.print(summary)
    if a.fingerprint != b.fingerprint:
        console.print("[yellow]the plans were made for different models or input shapes[/yellow]")
    differences = [d for d in a.diff(b) if not d[0].startswith(IGNORED)]
    placements = [d for d in differences if d[0].startswith(("parameters.", "nodes."))]
    others = [d for d in differences if d not in placements]
    changes = table(f"{len(others)} decisions differ", ["field", plain(names[0]), plain(names[1])])
    for path, va, vb in others + placements[:SHOWN_PLACEMENTS]:
        changes.add_row(plain(path), plain(_value(va)), plain(_value(vb)))
    console.print(changes)
    if len(placements) > SHOWN_PLACEMENTS:
        console.print(f"... and {len(placements) - SHOWN_PLACEMENTS} more placements differ")
    if not differences:
        console.print("the plans make the same decisions")


def _is_number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _num(value) -> str:
    return f"{value:.4g}" if _is_number(value) else "-" if value is None else repr(value)


def _value(value) -> str:
    if isinstance(value, list) and value and all(isinstance(v, str) for v in value) and len(value) > 3:
        return compress_layers(value)
    if isinstance(value, dict) and "layers" in value:     # a stage only one plan has
        return f"{compress_layers(value['layers'])} (tp={value.get('tp')} dp={value.get('dp')})"
    return str(value)
