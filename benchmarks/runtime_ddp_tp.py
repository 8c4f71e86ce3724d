"""Compiled data and tensor parallelism against torch's own, on 2 CPU ranks, in the same run.

    python benchmarks/runtime_ddp_tp.py [--hidden 512] [--layers 4] [--steps 5]

1. Data parallel: `autopar.compile(plan=Config(dp=2))` against a hand-written torch DDP loop
   (DistributedDataParallel, the same model, batch and optimizer).
2. Tensor parallel: `autopar.compile(plan=Config(tp=2))` against torch's `parallelize_module`
   with Megatron's layout (q/k/v and fc1 column-parallel, out-projection and fc2 row-parallel,
   the LM head column-parallel with its logits gathered), the same model and batch.
3. Baseline for 1: torch's own FSDP2 `replicate` (the mechanism autopar's data parallelism runs on,
   one group per block, then the model), hand-written, against DDP. On CPU ranks there are no
   streams, so FSDP2 reduces each group's gradients with a blocking all-reduce after copying them
   into one buffer, where DDP overlaps its buckets with the backward on gloo's own thread: this row
   says how much of row 1's gap is torch's mechanism on CPU and how much is autopar's.
Steps of the two contenders alternate after a warm-up, each after a barrier; the figure is the
median over pairs of consecutive steps of (compiled step / torch step), target at most 1.10: a
pair shares the machine's load, so a busy moment on this shared machine moves both. The model is a GPT whose
attention infers its local head count (`view(batch, seq, -1, head_dim)`), so that torch's
module-level TP runs it unchanged.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork, which would each import it)
import torch.distributed as dist
import torch.nn.functional as F
from rich.console import Console
from rich.table import Table
from torch import nn

import autopar
from autopar.cost.config import Config


class Attention(nn.Module):
    def __init__(self, hidden: int, head_dim: int):
        super().__init__()
        self.head_dim = head_dim
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(hidden, hidden) for _ in range(4))

    def forward(self, x):
        batch, seq, _ = x.shape
        q, k, v = (w(x).view(batch, seq, -1, self.head_dim).transpose(1, 2) for w in (self.wq, self.wk, self.wv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(batch, seq, -1))


class Block(nn.Module):
    def __init__(self, hidden: int, head_dim: int):
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(hidden), nn.LayerNorm(hidden)
        self.attn = Attention(hidden, head_dim)
        self.fc1, self.fc2 = nn.Linear(hidden, 4 * hidden), nn.Linear(4 * hidden, hidden)

    def forward(self, x):
        x = x + self.attn(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class BenchGPT(nn.Module):
    def __init__(self, *, layers: int, hidden: int, vocab: int, seq: int, head_dim: int = 64):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, hidden), nn.Embedding(seq, hidden)
        self.layers = nn.ModuleList(Block(hidden, head_dim) for _ in range(layers))
        self.norm = nn.LayerNorm(hidden)
        self.head = nn.Linear(hidden, vocab, bias=False)

    def forward(self, ids):
        x = self.tok(ids) + self.pos(torch.arange(ids.shape[1]))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def lm_loss(logits, targets):
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten())


def sgd(params):
    return torch.optim.SGD(params, lr=1e-3)


def training_step(model):
    """One hand-written step of `model` with its own SGD: the torch side of each comparison."""
    opt = sgd(model.parameters())

    def step(ids, targets):
        loss = lm_loss(model(ids), targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()
    return step


def torch_ddp_step(args):
    return training_step(torch.nn.parallel.DistributedDataParallel(new_model(args)))


def torch_replicate_step(args):
    from torch.distributed._composable.replicate_with_fsdp import replicate
    from torch.distributed.device_mesh import init_device_mesh

    model = new_model(args)
    mesh = init_device_mesh("cpu", (2,))
    for layer in model.layers:
        replicate(layer, mesh=mesh)
    replicate(model, mesh=mesh)
    return training_step(model)


def torch_tp_step(args):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    model = new_model(args)
    mesh = init_device_mesh("cpu", (2,))
    plan = {"head": ColwiseParallel(output_layouts=Replicate())}
    for i in range(args.layers):
        plan.update({f"layers.{i}.attn.wq": ColwiseParallel(), f"layers.{i}.attn.wk": ColwiseParallel(),
                     f"layers.{i}.attn.wv": ColwiseParallel(), f"layers.{i}.attn.wo": RowwiseParallel(),
                     f"layers.{i}.fc1": ColwiseParallel(), f"layers.{i}.fc2": RowwiseParallel()})
    parallelize_module(model, mesh, plan)
    return training_step(model)


def new_model(args):
    torch.manual_seed(0)
    return BenchGPT(layers=args.layers, hidden=args.hidden, vocab=args.vocab, seq=args.seq)


def compiled(args, config: Config):
    model = new_model(args)
    example = torch.zeros(config.micro_batch, args.seq, dtype=torch.long)
    return autopar.compile(model, "2:cpu", example_inputs=(example,), loss_fn=lm_loss, optimizer=sgd, plan=config)


def race(args, ours, theirs, ours_batch: slice, theirs_batch: slice) -> dict:
    """Alternate steps of the two after a warm-up; median seconds of each, and the median of
    the per-pair ratios."""
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, args.vocab, (args.batch, args.seq), generator=generator)
    times = {"compiled": [], "torch": []}
    for index in range(args.warmup + args.steps):
        for name, step, rows in (("compiled", ours, ours_batch), ("torch", theirs, theirs_batch)):
            dist.barrier()
            start = time.perf_counter()
            step(ids[rows], ids[rows])
            if index >= args.warmup:
                times[name].append(time.perf_counter() - start)
    medians = {name: statistics.median(values) for name, values in times.items()}
    ratios = [ours_time / theirs_time for ours_time, theirs_time in zip(times["compiled"], times["torch"])]
    return {**medians, "ratio": statistics.median(ratios)}


def run_rank(args) -> dict:
    rank = dist.get_rank()
    half = args.batch // 2
    own_rows = slice(rank * half, (rank + 1) * half)
    dp_model = compiled(args, Config(dp=2, global_batch=args.batch, micro_batch=half))
    dp = race(args, dp_model.step, torch_ddp_step(args), slice(None), own_rows)
    tp = race(args, compiled(args, Config(tp=2, global_batch=args.batch, micro_batch=args.batch)).step,
              torch_tp_step(args), slice(None), slice(None))
    baseline = race(args, torch_replicate_step(args), torch_ddp_step(args), own_rows, own_rows)
    return {"data parallel vs DDP": dp, "tensor parallel vs parallelize_module": tp,
            "baseline: torch FSDP2 replicate (by hand) vs DDP": baseline}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=512)
    parser.add_argument("--vocab", type=int, default=8192)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=8, help="global batch")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=9)
    args = parser.parse_args()
    results = autopar.launch(run_rank, 2, args, timeout=3600, pg_timeout=600)[0]
    table = Table(title=f"2 CPU ranks, GPT {args.layers}x{args.hidden}, vocab {args.vocab}, "
                        f"seq {args.seq}, global batch {args.batch}; {args.steps} step pairs")
    for column in ("comparison", "first s/step", "second s/step", "median pair ratio (target <= 1.10)"):
        table.add_column(column)
    for name, times in results.items():
        table.add_row(name, f"{times['compiled']:.3f}", f"{times['torch']:.3f}",
                      f"{times['ratio']:.3f}")
    console = Console()
    console.print(table)


if __name__ == "__main__":
    main()
