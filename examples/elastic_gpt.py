"""Training that continues on whatever world it is given: when a node is lost, or the job is
started again with fewer ranks, the same script plans for the ranks it has, loads its last
checkpoint into the new plan, keeps the global batch (each replica runs more micro-batches) and
trains the samples that follow the checkpoint: none lost, none repeated.

    # two nodes of 2 ranks; if one is lost, torchrun restarts the job on the one left
    torchrun --nnodes 1:2 --nproc-per-node 2 --max-restarts 3 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29400 examples/elastic_gpt.py --checkpoint ckpt/last
    # or a relaunch on fewer ranks, after a run on 4 was stopped
    torchrun --standalone --nproc-per-node 2 examples/elastic_gpt.py --checkpoint ckpt/last

Three things make it elastic. `autopar.Mesh.from_world(device)` is the mesh of the ranks the
launcher started (torchrun's WORLD_SIZE and LOCAL_WORLD_SIZE), and `autopar.compile` plans for it
on rank 0 with the global batch given. `cm.load` reshards the checkpoint (model, optimizer, step
count and data position) into whatever plan that is. `cm.sampler` hands each replica its rows of
the global batches in an order that does not depend on the number of replicas, starting at the
data position. The same script runs under `autopar.launch(main, n, argv)`.
"""

import argparse
import json
from pathlib import Path

import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, TensorDataset

import autopar
from autopar.models import build_model, lm_loss

SPEC = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory, resumed when present")
    parser.add_argument("--steps", type=int, default=7)
    parser.add_argument("--global-batch", type=int, default=8, help="sequences per step, in every world")
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--losses", help="rank 0 writes every step's loss here (JSON) at the end")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    model, example_inputs = build_model(SPEC, device="cpu", batch=2)
    mesh = autopar.Mesh.from_world("cpu")       # "h100-80g" on H100s: the nodes and GPUs started
    cm = autopar.compile(model, mesh, example_inputs=example_inputs, loss_fn=lm_loss,
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3),
                         global_batch=args.global_batch, time_limit=30)
    last = Path(args.checkpoint)
    # `last` is switched atomically by every save: when it exists, it is a complete checkpoint
    losses = cm.load(last)["losses"] if last.exists() else []
    if dist.get_rank() == 0:
        print(f"{mesh.world_size} ranks from step {cm.steps} (sample {cm.samples}): {cm.plan.summary()}")
    data = dataset()
    loader = DataLoader(data, batch_size=cm.local_batch, sampler=cm.sampler(data, seed=0))
    while cm.steps < args.steps:
        for inputs, targets in loader:          # the rest of the epoch the data position is in
            losses.append(cm.step(inputs, targets, local=True))
            if cm.steps % args.save_every == 0 or cm.steps == args.steps:
                cm.save(last, extra={"losses": losses})
            if cm.steps == args.steps:
                break
    if args.losses and dist.get_rank() == 0:
        Path(args.losses).write_text(json.dumps(losses))
    return losses


def dataset(sequences: int = 28) -> TensorDataset:
    """Token sequences and their next tokens, the same in every process (one seed). 28 sequences
    are 3 global batches of 8 per epoch; the 4 left over wait for the next epoch's order."""
    generator = torch.Generator().manual_seed(1)
    tokens = torch.randint(0, 64, (sequences, 9), generator=generator)
    return TensorDataset(tokens[:, :-1], tokens[:, 1:])


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
