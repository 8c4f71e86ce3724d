"""Where a one-GPU step's time goes: torch.profiler over steps of benchmarks/gpu_memory.py's cases.

    python benchmarks/gpu_profile.py --device h200-141g [--cases llama moe]

For each case: the wall time of a step, the time the GPU ran kernels in it (busy; the rest the
GPU waited for the host), the host's waits for the device (synchronizations), and the kernels
that took the most GPU time, by name, beside the estimator's compute time of the plan. A step the
GPU is busy for most of is priced by kernel efficiencies; one it is not is bound by the host.
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_memory import CASES, compile_case

STEPS = 3


def profile_case(name: str, device_name: str, top: int) -> None:
    spec, keywords = CASES[name]
    cm, ids, targets = compile_case(spec, keywords, device_name)
    for _ in range(3):          # warm: the optimizer's state, cuBLAS's choices, the allocator
        cm.step(ids, targets)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            cm.step(ids, targets)
        torch.cuda.synchronize()
    events = prof.events()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    start = min(e.time_range.start for e in events)
    end = max(e.time_range.end for e in events)
    busy = sum(e.device_time for e in kernels) / STEPS / 1e3          # microseconds -> ms
    syncs = sum(1 for e in events if e.name in ("cudaStreamSynchronize", "cudaDeviceSynchronize",
                                                 "cudaMemcpyAsync") and e.device_type != torch.autograd.DeviceType.CUDA)
    by_name = Counter()
    for e in kernels:
        by_name[e.name[:70]] += e.device_time / STEPS / 1e3
    wall = (end - start) / STEPS / 1e3
    print(f"{name}: step {wall:.1f} ms wall, GPU busy {busy:.1f} ms ({busy / wall:.0%}), "
          f"{len(kernels) // STEPS} kernels and {syncs // STEPS} host copies/syncs a step; "
          f"predicted {cm.plan.predicted['step_time_s'] * 1e3:.1f} ms", flush=True)
    for kernel, ms in by_name.most_common(top):
        print(f"    {ms:8.2f} ms  {kernel}")
    del cm


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100-80g", help="autopar device spec of the GPU")
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=["llama", "gpt", "moe"])
    parser.add_argument("--top", type=int, default=12, help="kernels listed per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_profile: no CUDA device is visible; run it where a GPU is")
    for name in args.cases:
        profile_case(name, args.device, args.top)


if __name__ == "__main__":
    main()
