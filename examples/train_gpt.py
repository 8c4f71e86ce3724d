"""Train a GPT with autopar under torchrun: every rank runs this script.

    torchrun --nproc-per-node 4 examples/train_gpt.py --steps 20          # CPU: gloo
    torchrun --nproc-per-node 8 examples/train_gpt.py --device a100-80g   # GPUs: NCCL

Rank 0 plans the model for the mesh of all ranks (or reads --plan) and every rank receives the same
plan; each rank then builds only its share of the model and trains on the global batch, taking
its own rows. The batches are a learnable toy language (sequences counting with a random stride).
"""

import argparse
import os

import torch
import torch.distributed as dist

import autopar
from autopar.models import build_model, lm_loss, parse_spec


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128",
                        help="a preset or a spec (default: a 4-layer GPT small enough for CPUs)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--global-batch", type=int, default=16, help="sequences per step, all ranks")
    parser.add_argument("--micro-batch", type=int, default=2, help="sequences the model is planned with")
    parser.add_argument("--device", default=None,
                        help="device of the mesh: cpu, a100-80g, h100-80g, ... (default: a100-80g "
                             "when CUDA is present, else cpu)")
    parser.add_argument("--memory-limit", help="bytes per device for the planner, e.g. 2MiB or 80GiB")
    parser.add_argument("--plan", help="a saved plan to run instead of planning")
    parser.add_argument("--lr", type=float, default=3e-3)
    args = parser.parse_args(argv)

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    dist.init_process_group("nccl" if cuda else "gloo")
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    mesh = f"{dist.get_world_size()}:{args.device or ('a100-80g' if cuda else 'cpu')}"

    model, example_inputs = build_model(args.model, device=device, batch=args.micro_batch, seed=0)
    compiled = autopar.compile(
        model, mesh, example_inputs=example_inputs, loss_fn=lm_loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=args.lr),
        global_batch=args.global_batch, memory_limit=args.memory_limit, plan=args.plan)
    rank = dist.get_rank()
    if rank == 0:
        print(f"plan: {compiled.plan.summary()}", flush=True)
    for step, (inputs, targets) in enumerate(counting_batches(args, device)):
        loss = compiled.step(inputs, targets)
        if rank == 0:
            print(f"step {step + 1:4d}  loss {loss:.4f}", flush=True)
    dist.destroy_process_group()
    return 0


def counting_batches(args, device):
    """Sequences start + stride * i (mod vocab), the same on every rank (one seed)."""
    config = parse_spec(args.model)
    generator = torch.Generator().manual_seed(0)
    positions = torch.arange(config.seq + 1)
    for _ in range(args.steps):
        start = torch.randint(0, config.vocab, (args.global_batch, 1), generator=generator)
        stride = torch.randint(1, 8, (args.global_batch, 1), generator=generator)
        tokens = (start + stride * positions) % config.vocab
        yield tokens[:, :-1].to(device), tokens[:, 1:].to(device)


if __name__ == "__main__":
    raise SystemExit(main())
