"""Does every ordinary global batch plan? Models x meshes x global batches, each case planned by
autopar and, independently, checked for whether any configuration fits at all.

    python benchmarks/batch_sweep.py [--time-limit 10] [--batches ...]     # the 56 cases below
    python benchmarks/batch_sweep.py --models gpt3-1.3b llama-7b --meshes 1x8:a100-80g 16x8:a100-80g

By default each model runs on the cluster `autopar bench` trains it on (its A100-80GB rows), at 7
global batches: 8 x 7 = 56 cases. With --models or --meshes, every model on every mesh.

"Some configuration fits" is decided here, without the planner: the Megatron-style grid (TP
dividing the node size, at most 8; PP dividing the blocks; DP the rest, dividing the global batch)
priced by autopar.cost.estimate at its least memory (micro-batch 1, full recompute, ZeRO-3 where
there is data parallelism, sequence parallelism with TP, 1F1B, or GPipe when there are fewer
micro-batches than stages, which is all 1F1B cannot run) against the device's memory. Memory only
shrinks with a smaller micro-batch, more recompute and a higher ZeRO stage, so a layout fits at
all exactly when that configuration does.

Prints one line per case as it goes, then a table (ok: planned; --: nothing fits and the
planner said why; FAIL: something fits but no plan; ok+: planned although the grid has nothing,
e.g. with stages the blocks do not divide into). Exits 1 when any case that fits did not plan.
"""

from __future__ import annotations

import argparse
import sys
import time

# the A100-80GB rows of `autopar bench`: each model on a cluster it is trained on in practice
PAIRS = (("gpt3-1.3b", "1x8:a100-80g"), ("gpt3-2.7b", "2x8:a100-80g"), ("gpt3-6.7b", "8x8:a100-80g"),
         ("gpt3-13b", "16x8:a100-80g"), ("gpt3-175b", "128x8:a100-80g"), ("llama-7b", "8x8:a100-80g"),
         ("llama-13b", "16x8:a100-80g"), ("llama-70b", "64x8:a100-80g"))
MODELS = ("gpt3-1.3b", "gpt3-6.7b", "llama-7b", "gpt3-175b")
MESHES = ("1x8:a100-80g", "2x8:a100-80g", "16x8:a100-80g", "128x8:a100-80g")
BATCHES = (100, 250, 500, 1000, 1024, 1500, 2000)
MAX_TP = 8


def least_memory_fits(graph, mesh, global_batch: int, blocks: int) -> str | None:
    """A configuration that fits the device's memory (as text), or None when none does."""
    from autopar.cost.config import Config
    from autopar.cost.estimator import estimate
    from autopar.cost.megatron import megatron_placements
    from autopar.errors import AutoparError

    cache: dict = {}
    for tp in (t for t in range(1, min(MAX_TP, mesh.gpus_per_node) + 1) if mesh.gpus_per_node % t == 0):
        for pp in (p for p in range(1, blocks + 1) if blocks % p == 0 and (mesh.world_size // tp) % p == 0):
            dp = mesh.world_size // (tp * pp)
            if global_batch % dp:
                continue
            m = global_batch // dp
            config = Config(tp=tp, pp=pp, dp=dp, global_batch=global_batch, micro_batch=1,
                            recompute="full", zero=3 if dp > 1 else 0, sequence_parallel=tp > 1,
                            schedule="1f1b" if m >= pp else "gpipe")
            try:        # Megatron-LM's layout: what a person forcing the configuration would run
                placements = megatron_placements(graph, tp, sequence_parallel=tp > 1)
                priced = estimate(graph, mesh, config, cache=cache, placements=placements)
            except AutoparError:
                continue            # a degree the model does not divide (heads, hidden)
            if priced.memory_per_gpu_bytes <= mesh.device.memory_bytes:
                return f"tp={tp} pp={pp} dp={dp}"
    return None


def sweep_case(graph, mesh, global_batch: int, blocks: int, time_limit: float) -> dict:
    from autopar.api import plan_graph
    from autopar.errors import AutoparError

    fits = least_memory_fits(graph, mesh, global_batch, blocks)
    started = time.monotonic()
    try:
        plan = plan_graph(graph, mesh, global_batch=global_batch, time_limit=time_limit)
        planned, detail = True, plan.summary()
    except AutoparError as err:
        planned, detail = False, f"{type(err).__name__}: {err}"
    return {"fits": fits, "planned": planned, "detail": detail, "seconds": time.monotonic() - started}


def cell(case: dict) -> str:
    if case["planned"]:
        return "ok" if case["fits"] else "ok+"
    return "FAIL" if case["fits"] else "--"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", help=f"models (with --meshes: {' '.join(MODELS)})")
    parser.add_argument("--meshes", nargs="+", help=f"meshes (with --models: {' '.join(MESHES)})")
    parser.add_argument("--batches", nargs="+", type=int, default=BATCHES)
    parser.add_argument("--time-limit", type=float, default=10.0, help="seconds per plan (default 10)")
    args = parser.parse_args()

    from autopar.tracer import capture
    from autopar.cost.mesh import Mesh
    from autopar.models import build_model

    if args.models is None and args.meshes is None:
        pairs = list(PAIRS)
    else:
        pairs = [(model, mesh) for model in args.models or MODELS for mesh in args.meshes or MESHES]
    total = len(pairs) * len(args.batches)
    results: dict[tuple, dict] = {}
    started = time.monotonic()
    graphs: dict = {}
    for model, mesh_text in pairs:
        if model not in graphs:
            graphs.clear()          # one captured model at a time: gpt3-175b's graph is large
            graphs[model] = capture(*build_model(model))
        graph = graphs[model]
        blocks = sum(len(kind.instances) for kind in graph.blocks)
        mesh = Mesh.parse(mesh_text)
        for batch in args.batches:
            case = sweep_case(graph, mesh, batch, blocks, args.time_limit)
            results[(model, mesh_text, batch)] = case
            print(f"[{len(results)}/{total}] {model} {mesh_text} batch {batch}: {cell(case)} "
                  f"({case['seconds']:.1f} s) {case['detail'][:140]}", file=sys.stderr, flush=True)

    width = max(len(f"{model} {mesh}") for model, mesh in pairs)
    print(f"{'model mesh':<{width}} " + " ".join(f"{b:>5}" for b in args.batches))
    for model, mesh_text in pairs:
        row = " ".join(f"{cell(results[(model, mesh_text, b)]):>5}" for b in args.batches)
        print(f"{model + ' ' + mesh_text:<{width}} {row}")
    planned = sum(c["planned"] for c in results.values())
    fits = sum(c["fits"] is not None for c in results.values())
    failed = [key for key, c in results.items() if c["fits"] and not c["planned"]]
    slowest = max(c["seconds"] for c in results.values())
    print(f"planned {planned}/{total}; some configuration fits in {fits}/{total}; fits but not "
          f"planned: {len(failed)}; slowest plan {slowest:.1f} s; {time.monotonic() - started:.0f} s "
          f"in all")
    for key in failed:
        print(f"FAIL {' '.join(map(str, key))}: {results[key]['detail']}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
