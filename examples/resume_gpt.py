"""Training that survives a failed rank: under torchrun with restarts, every rank runs this script;
when a rank dies, torchrun stops the others and starts them all again, and the script resumes from
its last checkpoint with no lost or repeated steps. Nothing here deals with process groups:
autopar.compile starts the default one from torchrun's environment, in a way that survives its
restarts.

    torchrun --nproc-per-node 2 --max-restarts 1 examples/resume_gpt.py --checkpoint ckpt/last \\
        --fail-at-step 5      # rank 1 dies after step 5 of the first attempt; the run comes back

The checkpoint is a directory of torch.distributed.checkpoint shards (`CompiledModel.save`); it
loads under any plan and number of ranks, and `autopar checkpoint export ckpt/last --out
model.safetensors` turns it into one state dict. The same script runs under
`autopar.launch(main, n, argv, max_restarts=1)`.
"""

import argparse
import json
import os
import signal
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.models import build_model, lm_loss

SPEC = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"


def main(argv=None) -> list[float]:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--checkpoint", required=True, help="checkpoint directory, resumed when present")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--fail-at-step", type=int, help="kill rank 1 after this step, first attempt only")
    parser.add_argument("--losses", help="rank 0 writes every step's loss here (JSON) at the end")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    world = int(os.environ["WORLD_SIZE"])       # set by torchrun (and by autopar.launch)
    model, example_inputs = build_model(SPEC, device="cpu", batch=2)
    cm = autopar.compile(model, f"{world}:cpu", example_inputs=example_inputs,
                         loss_fn=lm_loss, optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3),
                         plan=autopar.Config(dp=world, global_batch=8, micro_batch=2))
    last = Path(args.checkpoint)
    # `last` is a link switched atomically by every save: it exists only as a complete checkpoint
    losses = cm.load(last)["losses"] if last.exists() else []
    first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
    for inputs, targets in batches(args.steps)[cm.steps:]:    # the data position is the step count
        losses.append(cm.step(inputs, targets))
        if first_attempt and cm.steps == args.fail_at_step and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if cm.steps % args.save_every == 0:
            cm.save(last, extra={"losses": losses})
    if args.losses and dist.get_rank() == 0:
        Path(args.losses).write_text(json.dumps(losses))
    return losses


def batches(steps: int):
    """The same batches on every rank and every attempt (one seed)."""
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (8, 8), generator=generator), torch.randint(0, 64, (8, 8), generator=generator))
            for _ in range(steps)]


if __name__ == "__main__":
    main()
    dist.destroy_process_group()
