"""Does a compiled run train exactly like one process? The check autopar's own tests use.

Some gradients are zero in exact arithmetic (a key projection's bias, by softmax's shift
invariance) and come out as float noise of ~1e-12, so parameters are compared with an absolute
floor: |a - b| <= atol + rtol * max|reference| per tensor, not per-element relative error.
Losses are compared per step with the same rule. Use SGD, or AdamW with eps around 1e-3: Adam's
default eps turns that noise into random-signed updates of lr * 1e-4.
"""

from __future__ import annotations

import torch

RTOL = 1e-5
ATOL = 1e-6


def train_single_process(model: torch.nn.Module, batches, loss_fn, optimizer, call=None,
                         scaler: torch.amp.GradScaler | None = None) -> tuple[list[float], dict]:
    """Losses per step and the final state dict of plain training on one process.
    `call(model, inputs)` runs the forward (default: `model(*inputs)`); with `scaler`, the loss
    is scaled and the step taken through it, as torch's fp16 recipe does."""
    call = call or (lambda m, inputs: m(*inputs))
    opt = optimizer(list(model.parameters()))
    losses = []
    for *inputs, targets in batches:
        loss = loss_fn(call(model, inputs), targets)
        if scaler is None:
            loss.backward()
            opt.step()
        else:
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {k: v.detach().clone() for k, v in model.state_dict().items()}


def mismatches(reference: tuple[list[float], dict], losses: list[float], state: dict,
               rtol: float = RTOL, atol: float = ATOL) -> list[str]:
    """Every difference beyond the tolerance, described; empty when the runs agree."""
    ref_losses, ref_state = reference
    found = []
    if len(losses) != len(ref_losses):
        found.append(f"{len(losses)} losses, the reference has {len(ref_losses)}")
    for step, (got, want) in enumerate(zip(losses, ref_losses)):
        if abs(got - want) > atol + rtol * abs(want):
            found.append(f"step {step}: loss {got!r} vs {want!r}")
    if set(state) != set(ref_state):
        found.append(f"state names differ: {sorted(set(state) ^ set(ref_state))[:4]}")
    for name in ref_state.keys() & state.keys():
        want, got = ref_state[name], state[name]
        if got.shape != want.shape:
            found.append(f"{name}: shape {tuple(got.shape)} vs {tuple(want.shape)}")
            continue
        diff = (got.double() - want.double()).abs().max().item() if want.numel() else 0.0
        bound = atol + rtol * (want.double().abs().max().item() if want.numel() else 0.0)
        if diff > bound:
            found.append(f"{name}: max |difference| {diff:.3g} > {bound:.3g}")
    return found


def train_forms_against_one_process(make, batches, loss_fn, optimizer, forms: dict,
                                    recompute_levels, *, kwargs: dict | None = None, call=None) -> dict:
    """On every rank: each form (a Config) at each recompute level, compiled and trained on
    `batches`, against one process's training of `make()`: {(name, recompute): (losses, the
    mismatches, how many recomputed regions the stages hold)}. A batch is (*inputs, targets);
    one capture serves every form of the same micro-batch size; `kwargs` are the model's
    constant keyword inputs."""
    from dataclasses import replace

    import autopar
    from autopar.passes.recompute import Recomputed
    reference = train_single_process(make(), batches, loss_fn, optimizer, call=call)
    results, graphs, kwargs = {}, {}, kwargs or {}
    for name, config in forms.items():
        example = tuple(tensor[:config.micro_batch] for tensor in batches[0][:-1])
        if config.micro_batch not in graphs:
            graphs[config.micro_batch] = autopar.capture(make(), example, kwargs)
        for recompute in recompute_levels:
            cm = autopar.compile(make(), f"{config.world_size}:cpu", loss_fn=loss_fn,
                                 optimizer=optimizer, example_inputs=example, example_kwargs=kwargs,
                                 graph=graphs[config.micro_batch],
                                 plan=replace(config, recompute=recompute))
            losses = [cm.step(*batch) for batch in batches]
            regions = sum(isinstance(m, Recomputed) for m in cm.stages.modules())
            results[(name, recompute)] = (losses, mismatches(reference, losses, cm.full_state_dict()),
                                          regions)
    return results
