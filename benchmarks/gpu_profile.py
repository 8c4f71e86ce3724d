"""Where a one-GPU step's time goes: torch.profiler over steps of benchmarks/gpu_memory.py's cases.

    python benchmarks/gpu_profile.py --device h200-141g [--cases llama moe]

For each case: the wall time of autopar's step, the time the GPU ran kernels in it (busy; the
rest the GPU waited for the host), the host's copies and waits for the device, the kernels that
took the most GPU time and the host ops that took the most host time, beside the estimator's
step. And the same model's eager step (the model's own forward under autocast, the same AdamW,
the same micro-batches accumulated) timed in the same run, so that the ratio says what autopar's
runtime adds to the host's part. A step the GPU is busy for is priced by kernel efficiencies;
one it is not is bound by the host.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections import Counter

import torch
from torch.profiler import ProfilerActivity, profile

from gpu_memory import CASES, compile_case

STEPS = 3
CUDA = torch.autograd.DeviceType.CUDA
HOST_WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync")


def median_step(step, steps: int = 5) -> float:
    for _ in range(3):          # warm: the optimizer's state, cuBLAS's choices, the allocator
        step()
    seconds = []
    for _ in range(steps):
        torch.cuda.synchronize()
        started = time.perf_counter()
        step()
        torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    return statistics.median(seconds)


def eager_step(spec: str, keywords: dict, ids: torch.Tensor, targets: torch.Tensor):
    """The model's own training step on this GPU: autocast bf16, fp32 weights, AdamW (foreach),
    the plan's micro-batches accumulated; recompute and offload are autopar's, not the model's."""
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss

    model = build_model(spec, device="cuda")[0]
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    micro = keywords.get("micro_batch", 2)

    def step():
        for rows in range(0, ids.shape[0], micro):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = lm_loss(model(ids[rows:rows + micro]), targets[rows:rows + micro])
            (loss * micro / ids.shape[0]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return step


def profile_case(name: str, device_name: str, top: int) -> None:
    spec, keywords = CASES[name]
    cm, ids, targets = compile_case(spec, keywords, device_name)
    autopar_s = median_step(lambda: cm.step(ids, targets))
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(STEPS):
            cm.step(ids, targets)
        torch.cuda.synchronize()
    predicted = cm.plan.predicted["step_time_s"]
    del cm
    eager_s = median_step(eager_step(spec, keywords, ids, targets))
    report(name, prof.events(), autopar_s, eager_s, predicted, top)


def report(name: str, events, autopar_s: float, eager_s: float, predicted: float, top: int) -> None:
    # a user annotation (Optimizer.step) spans kernels on the GPU's timeline: not a kernel
    kernels = [e for e in events if e.device_type == CUDA and not e.name.startswith("Optimizer.")
               and not getattr(e, "is_user_annotation", False)]
    busy = sum(e.device_time for e in kernels) / STEPS / 1e3          # microseconds -> ms
    waits = sum(1 for e in events if e.name in HOST_WAITS and e.device_type != CUDA)
    print(f"{name}: autopar {autopar_s * 1e3:.1f} ms a step, eager {eager_s * 1e3:.1f} ms (ratio "
          f"{autopar_s / eager_s:.2f}), predicted {predicted * 1e3:.1f} ms; GPU busy {busy:.1f} ms "
          f"({busy / (autopar_s * 1e3):.0%}), {len(kernels) // STEPS} kernels and "
          f"{waits // STEPS} host copies/waits a step", flush=True)
    by_kernel, by_host_op = Counter(), Counter()
    for e in kernels:
        by_kernel[e.name[:70]] += e.device_time / STEPS / 1e3
    for e in events:
        if e.device_type != CUDA:
            by_host_op[e.name[:70]] += e.self_cpu_time_total / STEPS / 1e3
    for title, counter in (("GPU", by_kernel), ("host (self)", by_host_op)):
        print(f"  {title}:")
        for what, ms in counter.most_common(top):
            print(f"    {ms:8.2f} ms  {what}")


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="h100-80g", help="autopar device spec of the GPU")
    parser.add_argument("--cases", nargs="*", choices=list(CASES), default=["llama", "gpt", "moe"])
    parser.add_argument("--top", type=int, default=10, help="kernels and host ops listed per case")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("gpu_profile: no CUDA device is visible; run it where a GPU is")
    for name in args.cases:
        profile_case(name, args.device, args.top)


if __name__ == "__main__":
    main()
