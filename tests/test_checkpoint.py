"""Checkpoints: training saved under one plan and resumed under the same or another plan (or another
number of ranks) continues exactly as an uninterrupted run; a rank killed mid-training or mid-save
brings the job back from the last checkpoint with no lost or repeated steps; `autopar checkpoint
export` writes one plain state dict.

Every comparison is with one process trained on the same batches without interruption: each
step's loss and the final parameters within |d| <= 1e-6 + 1e-5 * scale (autopar.runtime.equivalence),
AdamW with eps=1e-3 so that a lost or wrong optimizer state shows.
"""

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before forking: each rank would pay for it)
import torch.distributed as dist

import autopar
from autopar.cli import main as cli
from autopar.models import build_model, lm_loss
from autopar.plan import Plan, Stage
from autopar.runtime.checkpoint import CheckpointError
from autopar.runtime.equivalence import mismatches, train_single_process
from autopar.runtime.forced_plan import megatron_plan
from autopar.runtime.pipeline import build_runtime

pytestmark = pytest.mark.multiprocess

SPEC = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"
UNITS = ["tok_emb", "pos_emb", "emb_dropout", "layers.0", "layers.1", "norm_f", "lm_head"]
CUT = [UNITS[:4], UNITS[4:]]
STEPS = 6
GLOBAL_BATCH = 8


def make_plan(chunks: list[list[str]], *, pp: int, dp: int = 1, tp: int = 1, zero: int = 0,
              layout: tuple[dict, dict] = ({}, {})) -> Plan:
    """Stage i on pipeline rank i, each on a dp x tp block of ranks; a global batch of 8 sequences
    in micro-batches of 2."""
    group = dp * tp
    stages = [Stage(index=i, layers=layers, ranks=list(range(i * group, (i + 1) * group)), dp=dp, tp=tp,
                    zero=zero) for i, layers in enumerate(chunks)]
    return Plan(fingerprint="", mesh={}, axes=[["dp", dp], ["tp", tp]], stages=stages,
                global_batch=GLOBAL_BATCH, micro_batches=GLOBAL_BATCH // (2 * dp), micro_batch_size=2,
                schedule="1f1b", parameters=layout[0], nodes=layout[1])


def megatron_layout(dp: int) -> tuple[dict, dict]:
    """Column-parallel q, k, v and fc1, row-parallel wo and fc2 over tp=2 (autopar's Megatron layout)."""
    model, example_inputs = build_model(SPEC, batch=2)
    graph = autopar.capture(model, example_inputs=example_inputs)
    config = autopar.Config(tp=2, dp=dp, global_batch=2 * dp, micro_batch=2)
    plan = megatron_plan(graph, autopar.Mesh.parse(f"{2 * dp}:cpu"), config)
    return plan.parameters, plan.nodes


def batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=generator),
             torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=generator)) for _ in range(STEPS)]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3, weight_decay=0.1)


def compiled(plan: Plan):
    model, example_inputs = build_model(SPEC, device="cpu", batch=2)
    return build_runtime(model, plan, example_inputs=example_inputs, loss_fn=lm_loss, optimizer=adamw)


def uninterrupted() -> tuple[list[float], dict]:
    model, _ = build_model(SPEC, device="cpu")
    return train_single_process(model, batches(), lm_loss, adamw)


def differences(reference, losses: list[float], state: dict) -> dict:
    """The mismatches beyond tolerance, and the largest differences (for the report)."""
    ref_losses, ref_state = reference
    return {"mismatches": mismatches(reference, losses, state),
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "parameter": max((state[k] - v).abs().max().item() for k, v in ref_state.items())}


def save_then_resume(cases: list[tuple[Plan | None, Plan, str]], directory: str, stop: int) -> list:
    """For each (saving plan, resuming plan, checkpoint): train the first `stop` steps under the
    saving plan and save (none: the checkpoint is already there), then build the resuming plan
    from the same fresh model, load, and train to the end. On rank 0, the differences of the
    whole run from one uninterrupted process."""
    data = batches()
    reports = []
    for saving, resuming, name in cases:
        losses = []
        if saving is not None:
            cm = compiled(saving)
            losses = [cm.step(*batch) for batch in data[:stop]]
            cm.save(Path(directory) / name, extra={"losses": losses, "next": stop})
        cm = compiled(resuming)
        extra = cm.load(Path(directory) / name)
        assert cm.steps == extra["next"] == stop
        losses = extra["losses"] + [cm.step(*batch) for batch in data[stop:]]
        state = cm.full_state_dict()
        reports.append(differences(uninterrupted(), losses, state) if dist.get_rank() == 0 else None)
    return reports


def test_resume_under_the_same_and_other_plans_and_fewer_ranks(tmp_path):
    dp4_zero1 = make_plan([UNITS], pp=1, dp=4, zero=1)
    tp2_pp2 = make_plan(CUT, pp=2, tp=2, layout=megatron_layout(1))
    pp2_dp2_zero3 = make_plan(CUT, pp=2, dp=2, zero=3)
    dp2_tp2 = make_plan([UNITS], pp=1, dp=2, tp=2, layout=megatron_layout(2))
    four = [(dp4_zero1, dp4_zero1, "dp4-zero1"), (None, tp2_pp2, "dp4-zero1"),
            (pp2_dp2_zero3, dp2_tp2, "pp2-dp2-zero3")]
    two = [(None, make_plan(CUT, pp=2), "dp4-zero1"),
           (None, make_plan([UNITS], pp=1, tp=2, layout=megatron_layout(1)), "pp2-dp2-zero3")]
    reports = autopar.launch(save_then_resume, 4, four, str(tmp_path), 3, timeout=120)[0]
    reports += autopar.launch(save_then_resume, 2, two, str(tmp_path), 3, timeout=120)[0]
    names = ["dp4 zero-1 -> same", "dp4 zero-1 -> tp2 x pp2", "pp2 x dp2 zero-3 -> dp2 x tp2",
             "4 ranks dp4 zero-1 -> 2 ranks pp2", "4 ranks pp2 x dp2 zero-3 -> 2 ranks tp2"]
    for name, report in zip(names, reports, strict=True):
        print(f"{name}: largest loss difference {report['loss']:.2e}, parameter {report['parameter']:.2e}")
        assert report["mismatches"] == [], f"{name}: {report['mismatches']}"
