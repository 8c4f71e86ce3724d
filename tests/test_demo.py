"""The demo and the examples run end to end at small sizes (subprocesses, as a user runs them)."""

import re
import subprocess
import sys
from pathlib import Path

import pytest

from autopar.plans import Plan

pytestmark = pytest.mark.multiprocess

ROOT = Path(__file__).resolve().parents[1]


def run(command: list[str], timeout: float) -> str:
    done = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{' '.join(command)} failed:\n{done.stdout}\n{done.stderr}"
    return done.stdout


def test_plan_offline_example_saves_a_plan(tmp_path):
    out = tmp_path / "plan.json"
    run([sys.executable, "examples/plan_offline.py", "--model", "gpt-tiny", "--mesh", "2x4:a100-80g",
         "--global-batch", "64", "--time-limit", "5", "--out", str(out)], timeout=300)
    plan = Plan.load(out)
    assert plan.world_size == 8
    assert plan.global_batch == 64


def test_train_gpt_example_under_torchrun():
    output = run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                  "--standalone", "examples/train_gpt.py", "--steps", "3"], timeout=300)
    losses = [float(x) for x in re.findall(r"step +\d+ +loss (\d+\.\d+)", output)]
    assert len(losses) == 3, output
    assert "plan: " in output


def test_demo_matches_one_process(tmp_path):
    png = tmp_path / "loss.png"
    output = run([sys.executable, "-m", "autopar.cli", "demo", "--steps", "3", "--png", str(png)],
                 timeout=300)
    match = re.search(r"largest difference (\S+) at step", output)
    assert match, output
    assert float(match.group(1)) <= 1e-5
    assert png.stat().st_size > 0
