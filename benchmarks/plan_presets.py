"""Plan the README's cluster presets, dense and MoE, with the default time bound: capture and
search seconds, whether the search ended on its own or the clock cut it short, and the plan. The
search's seconds are also given as a ratio to a bare torch.export of the same model measured in
the same run (this host is shared and its speed varies).

    python benchmarks/plan_presets.py [--preset NAME ...] [--time-limit S] [--json]
"""

import argparse
import json
import time

import torch

from autopar.api import plan_graph
from autopar.models import build_model
from autopar.plans.vocabulary import TIME_LIMIT_S
from autopar.tracer import capture

PRESETS = [("gpt3-175b", "128x8:a100-80g", 1536), ("llama-70b", "8x8:h100-80g", 256),
           ("llama-70b:seq=131072", "16x8:h100-80g", 64), ("deepseek-v3", "128x8:h100-80g", 4096),
           ("qwen3-235b-a22b", "32x8:h100-80g", 1024), ("mixtral-8x22b", "16x8:h100-80g", 1024)]


def timed_plan(model_name: str, mesh: str, batch: int, time_limit: float) -> dict:
    """A bare torch.export of the model, then autopar's capture and plan, each timed."""
    model, inputs = build_model(model_name)
    started = time.monotonic()
    torch.export.export(model, inputs, strict=False)
    export_s = time.monotonic() - started
    started = time.monotonic()
    graph = capture(model, example_inputs=inputs)
    capture_s = time.monotonic() - started
    plan = plan_graph(graph, mesh, global_batch=batch, time_limit=time_limit - capture_s)
    return {"graph": graph, "plan": plan, "export_s": export_s, "capture_s": capture_s,
            "plan_s": time.monotonic() - started - capture_s}


def plan_preset(model_name: str, mesh: str, batch: int, time_limit: float) -> dict:
    timed = timed_plan(model_name, mesh, batch, time_limit)
    plan = timed["plan"]
    search_s = plan.solver["seconds"]
    return {"model": model_name, "mesh": mesh, "global_batch": batch,
            "capture_s": round(timed["capture_s"], 1), "search_s": round(search_s, 1),
            "search_to_export": round(search_s / timed["export_s"], 1), "status": plan.solver["status"],
            "candidates": plan.solver["candidates"], "plan": plan.summary(),
            "step_time_s": round(plan.predicted["step_time_s"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", action="append", help="a preset of the list (default: all)")
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    chosen = [row for row in PRESETS if not args.preset or row[0] in args.preset]
    if not chosen:
        parser.error(f"--preset must be among {', '.join(name for name, _, _ in PRESETS)}")
    rows = []
    for number, (name, mesh, batch) in enumerate(chosen, 1):
        print(f"[{number}/{len(chosen)}] planning {name} on {mesh} ...", flush=True)
        rows.append(plan_preset(name, mesh, batch, args.time_limit))
        row = rows[-1]
        print(f"  captured {row['capture_s']} s, searched {row['search_s']} s ({row['search_to_export']}x "
              f"a bare export), {row['status']}, {row['candidates']} candidates: {row['plan']} "
              f"{row['step_time_s']} s a step", flush=True)
    if args.json:
        print(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
