"""Context parallelism against activation recomputation: step time and memory, in one run.

    python benchmarks/cp_vs_recompute.py [--layers 4] [--hidden 128] [--seq 1024] [--steps 3]

Both trade something for activation memory at long sequences: recomputation spends compute (a
second forward of each block), context parallelism spends communication (K/V blocks around a
ring, or all-to-alls) and splits every sequence's activations over cp ranks. On 4 CPU gloo ranks
a GPT at a long sequence trains under data parallelism with each recompute level and under
context parallelism without recompute (cp2 x dp2 and cp4, ring and all-to-all), every form at one
sequence a micro-batch (data parallelism's least), so that a context-parallel rank holds 1/cp of
the tokens a data-parallel rank holds at a time and runs cp times the micro-batches. For each form:
the peak tensor memory of a step on rank 0 (`autopar.testing.memory.LiveBytes`, as
benchmarks/memory_check.py measures it), the plan's predicted memory and step time, and the
measured step time (median of --steps steps after one warm-up step), as a ratio to the dp4 +
full recompute row measured in the same run (this machine is shared: only ratios carry over).
A CPU has no overlap of the ring's transfers with compute and gloo's latency is far above
NVLink's, so the ratios say how the forms compare here, not on GPUs.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork, which would each import it)

import autopar
from autopar.cost.config import Config
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.testing.memory import LiveBytes, rank_tensors

BATCH = 4
FORMS = {
    "dp4 recompute none": Config(dp=4, global_batch=BATCH, micro_batch=1),
    "dp4 recompute selective": Config(dp=4, global_batch=BATCH, micro_batch=1, recompute="selective"),
    "dp4 recompute full": Config(dp=4, global_batch=BATCH, micro_batch=1, recompute="full"),
    # one sequence a micro-batch, as dp4 runs: a rank holds 1/cp of its tokens at a time
    "cp2 x dp2 ring": Config(dp=2, cp=2, global_batch=BATCH, micro_batch=1),
    "cp4 ring": Config(cp=4, global_batch=BATCH, micro_batch=1),
    "cp4 all-to-all": Config(cp=4, cp_kind="all-to-all", global_batch=BATCH, micro_batch=1),
}
BASELINE = "dp4 recompute full"


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def measure(spec: str, steps: int) -> list[dict]:
    """On every rank: each form's measured peak memory and step times, and its predictions."""
    generator = torch.Generator().manual_seed(0)
    model, _ = build_model(spec, device="cpu")
    ids = torch.randint(0, model.config.vocab, (BATCH, model.config.seq), generator=generator)
    targets = torch.roll(ids, -1, dims=1)
    rows = []
    for name, config in FORMS.items():
        example = (ids[:config.micro_batch],)
        graph = autopar.capture(build_model(spec, device="meta")[0], example)
        cm = autopar.compile(build_model(spec, device="cpu")[0], "4:cpu", loss_fn=lm_loss,
                             optimizer=sgd, plan=config, example_inputs=example, graph=graph)
        cm.step(ids, targets)                                   # warm-up
        tracker = LiveBytes(rank_tensors(cm))
        with tracker:
            cm.step(ids, targets)
        seconds = []
        for _ in range(steps):
            torch.distributed.barrier()
            started = time.perf_counter()
            cm.step(ids, targets)
            seconds.append(time.perf_counter() - started)
        rows.append({"form": name, "peak": tracker.peak, "seconds": statistics.median(seconds),
                     "predicted_memory": cm.plan.stages[0].predicted["memory_bytes"],
                     "predicted_seconds": cm.plan.predicted["step_time_s"]})
        del cm
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=128)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--vocab", type=int, default=512)
    parser.add_argument("--steps", type=int, default=3, help="timed steps per form (median)")
    args = parser.parse_args()
    spec = f"gpt:layers={args.layers},hidden={args.hidden},heads=4,seq={args.seq},vocab={args.vocab}"
    print(f"{spec}, global batch {BATCH}, fp32, SGD, 4 gloo ranks; {len(FORMS)} forms ...", flush=True)
    rows = autopar.launch(measure, 4, spec, args.steps, timeout=3600, pg_timeout=600)[0]
    base = next(row for row in rows if row["form"] == BASELINE)
    print(f"{'form':<26}{'peak MiB':>10}{'predicted':>11}{'step s':>9}{'vs ' + BASELINE:>24}"
          f"{'predicted ratio':>17}")
    for row in rows:
        print(f"{row['form']:<26}{row['peak'] / 2**20:>10.1f}{row['predicted_memory'] / 2**20:>11.1f}"
              f"{row['seconds']:>9.3f}{row['seconds'] / base['seconds']:>23.2f}x"
              f"{row['predicted_seconds'] / base['predicted_seconds']:>16.2f}x")


if __name__ == "__main__":
    main()
