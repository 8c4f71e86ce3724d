"""Step time of expert parallelism against replicated experts, on 4 CPU ranks, in the same run.

    python benchmarks/expert_parallel_step.py [--experts 16] [--expert-ffn 1024] [--steps 7]

A MoE model (`autopar.models` "moe" spec) trained under two plans of the same 4 ranks:
- replicated: dp=4, every rank holds and computes every expert for its own rows, and all-reduces
  every expert's gradients;
- expert parallel: dp=4 x ep=4, each rank holds E/4 experts and computes them for the rows all
  four ranks route to them (all-to-all dispatch and combine), and reduces no expert gradient.
Both plans make the same FLOPs per step; what differs is the experts' weight traffic (their
gradients' all-reduce) against the rows' all-to-alls, and the grouped GEMMs' shape (E GEMMs of a
rank's rows / E rows each, or E/4 GEMMs of 4x as many). Steps of the two alternate after a
warm-up, each after a barrier; the figure is the median over pairs of consecutive steps of
(expert-parallel step / replicated step): a pair shares the machine's load. The cost model's
prediction of the same ratio, for the CPU mesh, is printed beside it.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork, which would each import it)
import torch.distributed as dist

import autopar
from autopar.cost.config import Config
from autopar.models import build_model, lm_loss


def spec(args) -> str:
    return (f"moe:layers={args.layers},hidden={args.hidden},heads=4,seq={args.seq},vocab={args.vocab},"
            f"experts={args.experts},top_k={args.top_k},expert_ffn={args.expert_ffn}")


def plans(args) -> dict[str, Config]:
    micro = args.batch // 4
    return {"replicated": Config(dp=4, global_batch=args.batch, micro_batch=micro),
            "expert parallel": Config(dp=4, ep=4, global_batch=args.batch, micro_batch=micro)}


def run_rank(args) -> dict:
    """On every rank: the two compiled models' steps, alternated; medians and the pair ratio."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    steps = {}
    for name, config in plans(args).items():
        torch.manual_seed(0)
        model = build_model(spec(args), device="cpu")[0]
        cm = autopar.compile(model, "4:cpu", loss_fn=lm_loss, plan=config,
                             optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
                             example_inputs=(ids[:config.micro_batch],))
        steps[name] = cm
    times = {name: [] for name in steps}
    for index in range(args.warmup + args.steps):
        for name, cm in steps.items():
            dist.barrier()
            start = time.perf_counter()
            cm.step(ids, ids.roll(-1, 1))
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    ratios = [ep / rep for ep, rep in zip(times["expert parallel"], times["replicated"])]
    predicted = {name: cm.plan.predicted["step_time_s"] for name, cm in steps.items()}
    return {"medians": {name: statistics.median(values) for name, values in times.items()},
            "ratio": statistics.median(ratios),
            "predicted_ratio": predicted["expert parallel"] / predicted["replicated"]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=1024)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--experts", type=int, default=16)
    parser.add_argument("--top-k", type=int, default=2)
    parser.add_argument("--expert-ffn", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=7)
    args = parser.parse_args()
    result = autopar.launch(run_rank, 4, args, timeout=3600, pg_timeout=600)[0]
    print(f"4 CPU ranks, {spec(args)}, global batch {args.batch}; {args.steps} step pairs")
    for name, seconds in result["medians"].items():
        print(f"  {name:<16} {seconds:.3f} s/step (median)")
    print(f"expert parallel / replicated: {result['ratio']:.3f} measured (median pair ratio), "
          f"{result['predicted_ratio']:.3f} predicted")


if __name__ == "__main__":
    main()
