"""Capture of gpt3-175b on the meta device against a bare torch.export.export of the same model.

    python benchmarks/capture_175b.py [--model gpt3-175b] [--rounds 2]

Both run in this one process, alternating, after a small warm-up export; the figure is the ratio
of the median times (target <= 1.5). Times are CPU seconds of this process (time.process_time),
which other jobs on a shared machine disturb less than wall time; wall times are printed too.
The part autopar adds to the export (node table, FLOPs, block detection) is also timed alone.
Memory: the process's peak resident set (ru_maxrss) over everything, and the Python heap's peak
during one capture (tracemalloc, measured separately because tracing slows allocation). Target: peak under 1 GiB, one block kind with 96 instances.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
import time
import tracemalloc

import torch

from autopar.tracer import _nodes, _tied_parameters, capture, find_blocks
from autopar.models import build_model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt3-175b")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    torch.export.export(*build_model("gpt-tiny"), strict=False)      # warm-up: imports, caches
    model, inputs = build_model(args.model)
    export_times, capture_times, walls = [], [], []
    for _ in range(args.rounds):
        wall, start = time.perf_counter(), time.process_time()
        program = torch.export.export(model, inputs, strict=False)
        export_times.append(time.process_time() - start)
        walls.append(time.perf_counter() - wall)
        wall, start = time.perf_counter(), time.process_time()
        graph = capture(model, inputs)
        capture_times.append(time.process_time() - start)
        walls.append(time.perf_counter() - wall)
    start = time.process_time()
    find_blocks(*_nodes(program, _tied_parameters(model)))
    added = time.process_time() - start
    rss_gib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20    # KiB on Linux

    tracemalloc.start()
    capture(model, inputs)
    heap_gib = tracemalloc.get_traced_memory()[1] / 2**30
    tracemalloc.stop()

    ratio = statistics.median(capture_times) / statistics.median(export_times)
    result = {
        "model": args.model, "nodes": len(graph.nodes), "params": graph.param_count,
        "export_s": [round(t, 2) for t in export_times],
        "capture_s": [round(t, 2) for t in capture_times],
        "wall_s_export_capture_alternating": [round(t, 2) for t in walls],
        "autopar_added_s": round(added, 3),
        "ratio_capture_over_export": round(ratio, 3),
        "peak_rss_gib": round(rss_gib, 3), "capture_python_heap_peak_gib": round(heap_gib, 3),
        "blocks": [{"module_type": k.module_type, "count": k.count,
                    "nodes_per_block": k.nodes_per_block} for k in graph.blocks],
    }
    print(json.dumps(result, indent=2))
    ok = ratio <= 1.5 and rss_gib < 1.0 and len(graph.blocks) == 1
    print("targets (ratio <= 1.5, peak < 1 GiB, one block kind):", "met" if ok else "NOT met")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
