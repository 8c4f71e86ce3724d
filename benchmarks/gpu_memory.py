"""A GPU's measured peak memory against the simulator's and the estimator's, on one-GPU plans.

    python benchmarks/gpu_memory.py measure --device h200-141g --out DIR    # on a machine with a GPU
    python benchmarks/gpu_memory.py simulate DIR                            # anywhere, no GPU

`autopar simulate` claims a rank's peak memory without the rank's GPU: it runs the rank's program
on fake tensors and stands in for the kernels a GPU runs where they keep other tensors than the
CPU's (autopar/simulate/kernels.py). This checks the claim where a GPU is at hand. `measure`
compiles each case's forced plan on the GPU (bf16, AdamW, the plan's micro-batches), trains one
step so that the optimizer holds its state, takes `torch.cuda.max_memory_allocated` over a
second step, and times the median of 5 more beside the plan's predicted step time. It writes each plan (`CASE.json`) and what it measured (`measured.json`) to DIR.
`simulate` runs `autopar simulate`'s rank 0 on each saved plan and prints measured, simulated
and predicted per case: simulated / measured - 1 is the simulator's own error, predicted /
measured - 1 the estimator's. The simulated plans are the ones the GPU ran, so both sides build
the same program from the same stages. Their fingerprints are of the graph the GPU machine's
torch captured, which another torch version may capture differently (2.11 and 2.13 do): the
simulation does not compare them. Results: docs/gpu_runs.md.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import statistics
import time
import traceback
from pathlib import Path

import torch

LLAMA = "llama:layers=4,hidden=2048,heads=16,kv_heads=4,ffn=5632,seq=4096,vocab=32000"
GPT = "gpt:layers=4,hidden=2048,heads=16,seq=2048,vocab=50304"
MOE = "moe:layers=4,hidden=1024,heads=16,kv_heads=4,seq=2048,vocab=32000,experts=8,top_k=2,expert_ffn=1408"

QWEN_MOE = ("moe:layers=2,hidden=1024,heads=16,kv_heads=4,head_dim=128,qk_norm=True,seq=2048,"
            "vocab=32000,experts=32,top_k=8,expert_ffn=512")
LONG = "llama:layers=2,hidden=2048,heads=16,kv_heads=4,ffn=5632,seq=16384,vocab=32000"

# name: (model spec, Config keywords); a case trains 2 micro-batches of 2 sequences a step unless
# its keywords say otherwise
CASES = {
    "llama": (LLAMA, {}),
    "llama-selective": (LLAMA, {"recompute": "selective"}),
    "llama-full": (LLAMA, {"recompute": "full"}),
    "gpt": (GPT, {}),
    "gpt-full": (GPT, {"recompute": "full"}),
    "moe": (MOE, {}),
    "llama-offload": (LLAMA, {"zero": 3, "offload": True}),
    "qwen-moe": (QWEN_MOE, {}),
    "llama-long": (LONG, {"global_batch": 2, "micro_batch": 1, "recompute": "selective"}),
}
TIMED_STEPS = 5


# a simulated rank's tensors are all on the CPU: an offloaded plan's host state counts in its peak
HOST_TOO = "  (simulated: device and host together)"


def compile_case(spec: str, keywords: dict, device_name: str):
    """The case's model compiled on this machine's GPU (else its CPU), and a batch of it."""
    import autopar
    from autopar.cost.config import Config
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss

    gpu = torch.cuda.is_available()
    config = Config(**{"global_batch": 4, "micro_batch": 2, **keywords})
    model, (ids,) = build_model(spec, device="cuda" if gpu else "cpu", batch=config.global_batch)
    cm = autopar.compile(model, autopar.Mesh.parse(f"1:{device_name}"),
                         example_inputs=(ids[:config.micro_batch],),
                         loss_fn=lm_loss, optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4),
                         plan=config, precision="bf16" if gpu else "fp32")
    del model          # what the compiled model does not hold is freed
    gc.collect()
    return cm, ids, torch.roll(ids, -1, 1)


def measure_case(name: str, spec: str, keywords: dict, device_name: str, out: Path) -> dict:
    gpu = torch.cuda.is_available()
    cm, ids, targets = compile_case(spec, keywords, device_name)
    cm.plan.save(out / f"{name}.json")
    cm.step(ids, targets)           # the optimizer's state exists after a first step
    if gpu:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    held = torch.cuda.memory_allocated() if gpu else None
    cm.step(ids, targets)
    peak = torch.cuda.max_memory_allocated() if gpu else None
    seconds = []
    for _ in range(TIMED_STEPS):       # after the measured step: its own time may be a warm-up's
        started = time.perf_counter()
        cm.step(ids, targets)
        if gpu:
            torch.cuda.synchronize()
        seconds.append(time.perf_counter() - started)
    row = {"case": name, "spec": spec, "config": keywords,
           "measured_bytes": peak,
           "held_between_steps_bytes": held,
           "predicted_bytes": cm.plan.stages[0].predicted["memory_bytes"],
           "step_s": statistics.median(seconds),
           "predicted_step_s": cm.plan.predicted.get("step_time_s")}
    del cm
    gc.collect()
    if gpu:
        torch.cuda.empty_cache()
    return row


def measure(args) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for name in args.cases or CASES:
        spec, keywords = CASES[name]
        print(f"{name}: compiling and training 2 steps on {args.device}", flush=True)
        try:
            rows.append(measure_case(name, spec, keywords, args.device, args.out))
            r = rows[-1]
            print(f"  peak {(r['measured_bytes'] or 0) / 2**30:.3f} GiB (predicted "
                  f"{r['predicted_bytes'] / 2**30:.3f}), step {r['step_s'] * 1e3:.0f} ms", flush=True)
        except Exception as error:       # one case's failure is reported, the others still run
            traceback.print_exc()
            print(f"  FAILED: {type(error).__name__}: {error}", flush=True)
            rows.append({"case": name, "spec": spec, "config": keywords, "error": repr(error)})
        (args.out / "measured.json").write_text(json.dumps({
            "device": args.device, "torch": torch.__version__, "rows": rows}, indent=1))


def simulate(args) -> None:
    from autopar.models import build_model
    from autopar.models.gpt import lm_loss
    from autopar.plans import Plan
    from autopar.simulate import simulate_ranks
    from autopar.tracer import capture

    measured = json.loads((args.dir / "measured.json").read_text())
    print(f"measured on {measured['device']} with torch {measured['torch']}; simulated with torch "
          f"{torch.__version__}; memory in GiB")
    print(f"{'case':<17}{'measured':>10}{'simulated':>11}{'predicted':>11}{'sim err':>9}{'pred err':>9}"
          f"{'step ms':>9}{'predicted':>10}")
    for row in measured["rows"]:
        if "error" in row:
            print(f"{row['case']:<17} failed on the GPU: {row['error']}")
            continue
        plan = Plan.load(args.dir / f"{row['case']}.json")
        model, inputs = build_model(row["spec"])
        graph = capture(model, example_inputs=inputs)
        run = simulate_ranks(model, plan, [0], example_inputs=inputs, targets=inputs[0],
                             loss_fn=lm_loss, graph=graph)[0]
        gib = lambda n: n / 2**30
        m, s, p = row["measured_bytes"], run.peak_memory_bytes, row["predicted_bytes"]
        print(f"{row['case']:<17}{gib(m):>10.3f}{gib(s):>11.3f}{gib(p):>11.3f}{s / m - 1:>+9.1%}"
              f"{p / m - 1:>+9.1%}{row['step_s'] * 1e3:>9.1f}{row['predicted_step_s'] * 1e3:>10.1f}"
              f"{HOST_TOO if plan.offload else ''}", flush=True)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    commands = parser.add_subparsers(dest="command", required=True)
    on_gpu = commands.add_parser("measure", help="train each case on this machine's GPU")
    on_gpu.add_argument("--device", default="h100-80g", help="autopar device spec of the GPU")
    on_gpu.add_argument("--out", type=Path, required=True)
    on_gpu.add_argument("--cases", nargs="*", choices=list(CASES))
    here = commands.add_parser("simulate", help="simulate the plans a `measure` run saved")
    here.add_argument("dir", type=Path)
    args = parser.parse_args(argv)
    if args.command == "measure":
        if not torch.cuda.is_available():
            sys.exit("gpu_memory measure: no CUDA device is visible; run it where a GPU is")
        measure(args)
    else:
        simulate(args)


if __name__ == "__main__":
    main()
