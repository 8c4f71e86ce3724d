"""Plan GPT-3 175B for 1024 A100s (128 nodes x 8) on a laptop, and save the plan.

    python examples/plan_offline.py                       # gpt3-175b on 128x8:a100-80g
    python examples/plan_offline.py --model gpt3-1.3b --mesh 2x8:a100-80g --global-batch 256

Nothing is allocated: the model is captured on the meta device and priced on the mesh's device
specifications. The saved plan is what `autopar explain`, `autopar diff` and `autopar.compile` read.
"""

import argparse
import time

from rich.console import Console

import autopar
from autopar.models import build_model


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt3-175b", help="a preset or a spec (default gpt3-175b)")
    parser.add_argument("--mesh", default="128x8:a100-80g", help="NODESxGPUS:DEVICE (default 128x8:a100-80g)")
    parser.add_argument("--global-batch", type=int, default=1536,
                        help="sequences per optimizer step (default 1536, GPT-3's 3.2M tokens)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences the model is captured with")
    parser.add_argument("--memory-limit", help="bytes per device, e.g. 80GiB (default: the device's)")
    parser.add_argument("--time-limit", type=float, default=60.0, help="seconds for the search")
    parser.add_argument("--out", default="gpt3-175b-1024-a100.plan.json", help="where to save the plan")
    args = parser.parse_args(argv)

    console = Console()
    started = time.monotonic()
    model, example_inputs = build_model(args.model, batch=args.micro_batch)   # meta: no memory
    with console.status(f"planning {args.model} for {args.mesh}"):
        plan = autopar.plan(model, args.mesh, example_inputs=example_inputs,
                            global_batch=args.global_batch, memory_limit=args.memory_limit,
                            time_limit=args.time_limit)
    from autopar.commands.explain import render

    render(plan, console)
    plan.save(args.out)
    console.print(f"planned in {time.monotonic() - started:.1f} s; plan saved to {args.out} "
                  f"(show it again with `autopar explain {args.out}`)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
