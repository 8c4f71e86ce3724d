"""autopar's 2-stage 1F1B pipeline against a hand-built torch.distributed.pipelining of the same model.

    python benchmarks/pipeline_1f1b.py [--model gpt:layers=4,hidden=256,heads=8,seq=64,vocab=1024]
                                       [--micro-batches 4] [--micro-batch 4] [--rounds 5] [--steps 5]

Two gloo ranks on this machine. The model is cut at the same point both ways (first half of the
blocks with the embeddings on rank 0, the rest with the head on rank 1), with the same micro-batches,
schedule (Schedule1F1B) and optimizer (SGD). The hand-built side is what a person writes: two
nn.Modules made of the model's own submodules, PipelineStage, Schedule1F1B, optimizer.step. The
autopar side is `build_runtime` from a Plan: the exported graph cut into stages.

Both run in the same processes, alternating in rounds of `--steps` steps after a warm-up; the figure
is the median over rounds of (autopar round time / hand-built round time). Target: at most 1.10.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.pipelining import PipelineStage, Schedule1F1B

import autopar
from autopar.models import build_model, lm_loss
from autopar.plans import Plan, Stage
from autopar.runtime.build import build_runtime


class FirstHalf(nn.Module):
    def __init__(self, model: nn.Module, blocks: int):
        super().__init__()
        self.tok_emb, self.pos_emb, self.emb_dropout = model.tok_emb, model.pos_emb, model.emb_dropout
        self.layers = nn.ModuleList(model.layers[:blocks])

    def forward(self, input_ids):
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)
        x = self.emb_dropout(self.tok_emb(input_ids) + self.pos_emb(positions))
        for layer in self.layers:
            x = layer(x)
        return x


class SecondHalf(nn.Module):
    def __init__(self, model: nn.Module, blocks: int):
        super().__init__()
        self.layers = nn.ModuleList(model.layers[blocks:])
        self.norm_f, self.lm_head = model.norm_f, model.lm_head

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm_f(x))


def two_stage_plan(model: nn.Module, micro_batches: int, micro_batch: int) -> Plan:
    blocks = len(model.layers)
    first = ["tok_emb", "pos_emb", "emb_dropout"] + [f"layers.{i}" for i in range(blocks // 2)]
    second = [f"layers.{i}" for i in range(blocks // 2, blocks)] + ["norm_f", "lm_head"]
    stages = [Stage(index=0, layers=first, ranks=[0]), Stage(index=1, layers=second, ranks=[1])]
    return Plan(fingerprint="", mesh={}, axes=[["dp", 1], ["tp", 1]], stages=stages,
                global_batch=micro_batches * micro_batch, micro_batches=micro_batches,
                micro_batch_size=micro_batch, schedule="1f1b")


def hand_built_step(model: nn.Module, micro_batches: int):
    """The same split written by hand; returns step(inputs, targets)."""
    rank = dist.get_rank()
    blocks = len(model.layers) // 2
    module = FirstHalf(model, blocks) if rank == 0 else SecondHalf(model, blocks)
    stage = PipelineStage(module, rank, 2, torch.device("cpu"))
    schedule = Schedule1F1B(stage, micro_batches, loss_fn=lm_loss)
    optimizer = torch.optim.SGD(module.parameters(), lr=0.1)

    def step(inputs, targets):
        if rank == 0:
            schedule.step(inputs)
        else:
            schedule.step(target=targets)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step


def measure(spec: str, micro_batches: int, micro_batch: int, rounds: int, steps: int) -> dict:
    model, _ = build_model(spec, device="cpu", seed=0)
    batch = micro_batches * micro_batch
    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab
    inputs = torch.randint(0, vocab, (batch, model.config.seq), generator=generator)
    targets = torch.randint(0, vocab, (batch, model.config.seq), generator=generator)

    runner = build_runtime(model, two_stage_plan(model, micro_batches, micro_batch),
                            example_inputs=(inputs,), loss_fn=lm_loss,
                            optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    hand, _ = build_model(spec, device="cpu", seed=0)
    hand_step = hand_built_step(hand, micro_batches)
    steps_of = {"autopar": lambda: runner.step(inputs, targets),
                "hand-built": lambda: hand_step(inputs, targets)}
    for run in steps_of.values():          # warm-up: first sends, allocator, caches
        run()
        run()
    times = {name: [] for name in steps_of}
    for round_index in range(rounds):
        order = list(steps_of) if round_index % 2 == 0 else list(reversed(steps_of))
        for name in order:
            dist.barrier()
            start = time.perf_counter()
            for _ in range(steps):
                steps_of[name]()
            dist.barrier()
            times[name].append((time.perf_counter() - start) / steps)
    return times


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="gpt:layers=4,hidden=256,heads=8,seq=64,vocab=1024")
    parser.add_argument("--micro-batches", type=int, default=4)
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=5)
    args = parser.parse_args()
    times = autopar.launch(measure, 2, args.model, args.micro_batches, args.micro_batch, args.rounds,
                           args.steps, timeout=900)[0]
    ratios = [a / h for a, h in zip(times["autopar"], times["hand-built"])]
    for name, values in times.items():
        print(f"{name:>10}: median step {statistics.median(values) * 1e3:8.2f} ms "
              f"(rounds: {', '.join(f'{v * 1e3:.1f}' for v in values)})")
    ratio = statistics.median(ratios)
    print(f"step-time ratio autopar / hand-built: {ratio:.3f} (median of {len(ratios)} rounds; "
          f"target <= 1.10) -> {'ok' if ratio <= 1.10 else 'ABOVE TARGET'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
