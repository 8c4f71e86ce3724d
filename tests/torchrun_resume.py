"""A plain training script for torchrun with restarts (tests/test_checkpoint.py runs it): it never
touches process groups (autopar.compile starts the default one), resumes from its last
checkpoint when there is one, saves every 2 steps and logs "attempt step pid" per rank. With
--hold-at-step N, rank 1 of the first attempt logs step N and then waits, so that the test can
kill it from outside at a known step."""

import argparse
import json
import os
import time
from pathlib import Path

import torch
import torch.distributed as dist

import autopar
from autopar.models import build_model, lm_loss

SPEC = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--directory", required=True)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--hold-at-step", type=int)
    args = parser.parse_args()
    torch.set_num_threads(1)
    directory, attempt = Path(args.directory), int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    model, example_inputs = build_model(SPEC, device="cpu", batch=2)
    cm = autopar.compile(model, "2:cpu", example_inputs=example_inputs, loss_fn=lm_loss,
                         optimizer=lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3),
                         plan=autopar.Config(dp=2, global_batch=8, micro_batch=2))
    last = directory / "last"
    losses = cm.load(last)["losses"] if last.exists() else []
    # the checkpoint's step count and the losses saved beside it must agree, or steps were lost
    # or repeated (the test then sees this rank fail)
    assert len(losses) == cm.steps, f"resumed at step {cm.steps} with {len(losses)} losses saved"
    assert attempt == 0 or cm.steps > 0, "a restarted attempt found no checkpoint to resume from"
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (8, 8), generator=generator), torch.randint(0, 64, (8, 8), generator=generator))
            for _ in range(args.steps)]
    for inputs, targets in data[cm.steps:]:
        losses.append(cm.step(inputs, targets))
        with open(directory / f"steps-rank{dist.get_rank()}.log", "a") as log:
            log.write(f"{attempt} {cm.steps} {os.getpid()}\n")
        if attempt == 0 and cm.steps == args.hold_at_step and dist.get_rank() == 1:
            time.sleep(300)      # killed from outside here
        if cm.steps % 2 == 0:
            cm.save(last, extra={"losses": losses})
    if dist.get_rank() == 0:
        (directory / "losses.json").write_text(json.dumps(losses))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
