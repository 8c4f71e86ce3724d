"""`autopar inspect MODEL`: capture a model on the meta device and show what the compiler sees.

Parameters, FLOPs per training step, nodes, the repeated block kinds, the largest activations; with
`--json`, the same as one JSON object on stdout.
"""

from __future__ import annotations

import json
import time

from rich.console import Console
from rich.table import Table

FLOPS_NOTE = ("3 x forward FLOPs (backward = 2 x forward); matmuls 2*M*N*K, attention over the "
              "full score matrix even when causal, elementwise ops 1 per element")


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a preset (gpt3-175b, llama-7b, mlp, ...) or a spec such as "
                                      "gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200")
    parser.add_argument("--batch", type=int, default=1, help="sequences per captured step (default 1)")
    parser.add_argument("--top", type=int, default=8, help="largest activations to list (default 8)")
    parser.add_argument("--json", action="store_true", help="print one JSON object instead of tables")


def run(args) -> int:
    from autopar.tracer import capture
    from autopar.models import build_model

    model, inputs = build_model(args.model, device="meta", batch=args.batch)
    status = Console(stderr=True)
    start = time.perf_counter()
    with status.status(f"capturing {args.model} on the meta device (batch {args.batch})"):
        graph = capture(model, inputs)
    summary = summarize(graph, model=args.model, batch=args.batch, top=args.top,
                        seconds=time.perf_counter() - start)
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        _print_tables(Console(), summary)
    return 0


def summarize(graph, *, model: str, batch: int, top: int = 8, seconds: float | None = None) -> dict:
    """The inspect report as plain data (what `--json` prints)."""
    from autopar.graph import Role

    parameters = graph.parameters
    # Later instances of a block repeat the first one's activations: list each once.
    repeats = {i for kind in graph.blocks for inst in kind.instances[1:]
               for i in range(inst.start, inst.stop)}
    activations = sorted((n for i, n in enumerate(graph.nodes)
                          if n.role is Role.ACTIVATION and i not in repeats),
                         key=lambda n: n.bytes, reverse=True)[:top]
    blocks = []
    for kind in graph.blocks:
        prefix = kind.instances[0].module_path + "."
        block_params = sum(_numel(n.shape) for n in parameters if n.param_fqn.startswith(prefix))
        blocks.append({"kind": kind.kind, "module_type": kind.module_type, "count": kind.count,
                       "nodes_per_block": kind.nodes_per_block,
                       "params_per_block": block_params,
                       "first": kind.instances[0].module_path,
                       "last": kind.instances[-1].module_path, "signature": kind.signature})
    forward = graph.forward_flops
    return {
        "model": model, "model_type": graph.model_type, "batch": batch,
        "params": graph.param_count, "nodes": len(graph.nodes),
        "ops": sum(1 for n in graph.nodes if n.role is Role.ACTIVATION),
        "forward_flops": forward, "flops_per_step": 3 * forward, "flops_counted": FLOPS_NOTE,
        "blocks": blocks,
        "largest_activations": [{"name": n.name, "target": n.target, "module_path": n.module_path,
                                 "shape": list(n.shape), "dtype": n.dtype, "bytes": n.bytes}
                                for n in activations],
        "capture_seconds": None if seconds is None else round(seconds, 3),
    }


def _print_tables(console: Console, summary: dict) -> None:
    overview = Table(title=f"{summary['model']} ({summary['model_type']}), batch {summary['batch']}",
                     show_header=False)
    overview.add_column(style="bold")
    overview.add_column(justify="right")
    overview.add_row("parameters", f"{_human(summary['params'])} ({summary['params']:,})")
    overview.add_row("FLOPs per training step", f"{_human(summary['flops_per_step'])}FLOP")
    overview.add_row("forward FLOPs", f"{_human(summary['forward_flops'])}FLOP")
    overview.add_row("nodes (ops)", f"{summary['nodes']:,} ({summary['ops']:,})")
    overview.add_row("block kinds", str(len(summary["blocks"])))
    overview.add_row("capture time", f"{summary['capture_seconds']:.2f} s")
    console.print(overview)
    console.print(f"[dim]FLOPs per step: {summary['flops_counted']}[/dim]")

    if summary["blocks"]:
        blocks = Table(title="repeated blocks")
        for column in ("kind", "module", "count", "nodes/block", "params/block", "instances"):
            blocks.add_column(column, justify="left" if column in ("module", "instances") else "right")
        for block in summary["blocks"]:
            blocks.add_row(str(block["kind"]), block["module_type"], str(block["count"]),
                           str(block["nodes_per_block"]), _human(block["params_per_block"]),
                           f"{block['first']} .. {block['last']}")
        console.print(blocks)
    else:
        console.print("no repeated blocks found")

    largest = Table(title="largest activations (one instance per block kind)")
    for column in ("node", "op", "module", "shape", "dtype", "size"):
        largest.add_column(column, justify="right" if column == "size" else "left",
                           overflow="fold")
    for act in summary["largest_activations"]:
        op = act["target"].removeprefix("aten.").removesuffix(".default")
        largest.add_row(act["name"], op, act["module_path"] or "(top)",
                        "x".join(map(str, act["shape"])), act["dtype"], f"{_human(act['bytes'])}B")
    console.print(largest)


def _numel(shape) -> int:
    count = 1
    for size in shape:
        count *= size
    return count


def _human(value: float) -> str:
    for unit, scale in (("P", 1e15), ("T", 1e12), ("G", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(value) >= scale:
            return f"{value / scale:.2f} {unit}"
    return f"{value:g} "
