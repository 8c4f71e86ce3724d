"""Plan GPT-3 175B for 128 nodes of 8 A100-80GB: capture plus solve, against a bare torch.export of
the same model measured in the same run (the issue's bound: within 3x).

    python benchmarks/plan_175b.py [--time-limit S] [--out plan_175b.json]
"""

import argparse
import json

from autopar.plans.vocabulary import TIME_LIMIT_S
from plan_presets import timed_plan


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--mesh", default="128x8:a100-80g")
    parser.add_argument("--global-batch", type=int, default=1536)
    parser.add_argument("--time-limit", type=float, default=TIME_LIMIT_S)
    parser.add_argument("--out", default="")
    args = parser.parse_args()

    timed = timed_plan(args.model, args.mesh, args.global_batch, args.time_limit)
    graph, plan, export_s, capture_s, solve_s = (timed[k] for k in ("graph", "plan", "export_s",
                                                                      "capture_s", "plan_s"))
    if args.out:
        plan.save(args.out)
    print(json.dumps({
        "model": args.model, "mesh": args.mesh, "nodes": len(graph.nodes),
        "bare_export_s": round(export_s, 2), "capture_s": round(capture_s, 2),
        "solve_s": round(solve_s, 2), "ratio_to_export": round((capture_s + solve_s) / export_s, 2),
        "candidates_priced": plan.solver.get("candidates"), "status": plan.solver.get("status"),
        "plan": plan.summary(), "step_time_s": plan.predicted["step_time_s"],
        "tflops_per_gpu": plan.predicted["tflops_per_gpu"],
        "memory_per_gpu_gib": plan.predicted["memory_per_gpu_bytes"] / 2**30}, indent=1))


if __name__ == "__main__":
    main()
