"""`autopar plan MODEL --mesh NxG:DEVICE --global-batch B [--memory-limit 80GiB] [--time-limit S]
[--calibration eff.json] --out plan.json [--json]`: capture a model preset (or spec) on the meta device and plan it."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from rich.console import Console

from autopar.plans.vocabulary import TIME_LIMIT_S


def add_arguments(parser):
    parser.add_argument("model", help="a preset (gpt3-175b, llama-7b, gpt-tiny, ...) or a spec "
                                      "such as gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1000")
    parser.add_argument("--mesh", required=True, help="NODESxGPUS:DEVICE, e.g. 128x8:a100-80g, or GPUS:DEVICE; "
                        "then ,host=SIZE and ,power=W where they differ from the device's")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per optimizer step")
    parser.add_argument("--memory-limit", help="bytes per device, e.g. 80GiB or 40GB (default: the device's)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S,
                        help=f"seconds for all of planning, capture included (default {TIME_LIMIT_S:g}; "
                             f"the search normally ends well before)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="price with a file from `autopar calibrate` (default: published figures)")
    parser.add_argument("--out", help="write the plan here as JSON")
    parser.add_argument("--json", action="store_true", help="print the plan as JSON on stdout")


def run(args) -> int:
    from autopar.api import check_planning, plan_graph, remaining_time
    from autopar.tracer import capture
    from autopar.commands.output import check_output, plain
    from autopar.cost.mesh import Mesh
    from autopar.models import build_model, parse_spec

    # every argument checked before the capture and the search, which may take minutes
    mesh = Mesh.parse(args.mesh)
    check_planning(args.global_batch, args.time_limit, args.memory_limit)
    parse_spec(args.model)
    if args.out:
        check_output(args.out, "--out")
    console = Console(stderr=True)
    started = time.monotonic()
    with console.status(f"capturing {args.model}") as status:
        model, example_inputs = build_model(args.model)
        graph = capture(model, example_inputs=example_inputs)
        captured = time.monotonic() - started
        status.update(f"planning {args.model} for {mesh}")

        def progress(phase: str, done: int, total: int) -> None:
            status.update(f"planning {args.model} for {mesh}: {phase} ({done}/{total})")

        plan = plan_graph(graph, mesh, global_batch=args.global_batch, memory_limit=args.memory_limit,
                          time_limit=remaining_time(args.time_limit, started), progress=progress,
                          calibration=args.calibration)
    console.print(f"captured in {captured:.1f} s, planned in {time.monotonic() - started - captured:.1f} s")
    if args.out:
        plan.save(args.out)
        console.print(plain(f"plan written to {args.out}"))
    if args.json:
        sys.stdout.write(plan.to_json())
    else:
        from autopar.commands.explain import render

        render(plan, Console())
    return 0
