"""Elastic worlds: a job that loses ranks mid-run starts again on the ranks it has, with the same
script (examples/elastic_gpt.py): `autopar.Mesh.from_world` is the new world, `autopar.compile`
plans for it with the same global batch, the last checkpoint loads into the new plan, and the
sampler resumes at the first sample not trained. The whole run equals one uninterrupted process
trained on the same global batches (each step's loss and the final parameters within
|d| <= 1e-6 + 1e-5 * scale; AdamW with eps=1e-3, so a lost or repeated batch shows).
"""

import importlib.util
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
import torch._dynamo  # noqa: F401  (imported before forking: each rank would pay for it)
import torch.distributed as dist

import autopar
from autopar.models import build_model, lm_loss
from autopar.runtime.launch import free_port
from autopar.runtime.checkpoint import export
from autopar.runtime.compiled_model import CompiledModel
from autopar.runtime.sampler import GlobalBatchSampler
from autopar.testing.equivalence import mismatches, train_single_process

EXAMPLE = Path(__file__).parents[1] / "examples" / "elastic_gpt.py"
STEPS = 7


def example():
    spec = importlib.util.spec_from_file_location("elastic_gpt", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def uninterrupted(module, global_batch: int = 8) -> tuple[list[float], dict]:
    """One process on the global batches of each epoch in order: epoch e's order is
    randperm(seeded e), cut into whole global batches (the rows left over are not trained)."""
    inputs, targets = module.dataset().tensors
    batches = []
    for epoch in range(STEPS):
        order = torch.randperm(len(inputs), generator=torch.Generator().manual_seed(epoch))
        for start in range(0, len(inputs) - global_batch + 1, global_batch):
            rows = order[start:start + global_batch]
            batches.append((inputs[rows], targets[rows]))
    model, _ = build_model(module.SPEC, device="cpu", batch=2)
    return train_single_process(model, batches[:STEPS], lm_loss,
                                lambda params: torch.optim.AdamW(params, lr=1e-2, eps=1e-3))


def lose_a_node_after(step: int, main, argv: list[str]) -> None:
    """The example on 4 ranks, whose second node (ranks 2 and 3) dies after `step`."""
    taken = CompiledModel.step

    def step_then_fail(self, *args, **kwargs):
        loss = taken(self, *args, **kwargs)
        if self.steps == step and dist.get_rank() >= 2:
            os.kill(os.getpid(), signal.SIGKILL)
        return loss
    CompiledModel.step = step_then_fail
    main(argv)


def resumed_on(ranks: int, main, argv: list[str]) -> dict:
    """The example on the ranks left: where it resumed, its mesh and plan, every loss."""
    seen = {}
    load = CompiledModel.load

    def load_and_note(self, path, strict=True):
        extra = load(self, path, strict)
        seen.update(steps=self.steps, samples=self.samples, dp=self.layout.dp,
                    micro_batches=self.plan.micro_batches, mesh=str(autopar.Mesh.from_world("cpu")))
        return extra
    CompiledModel.load = load_and_note
    losses = main(argv)
    return {**seen, "losses": losses}


@pytest.mark.multiprocess
def test_a_run_that_loses_a_node_resumes_on_the_ranks_left(tmp_path):
    module = example()
    argv = ["--checkpoint", str(tmp_path / "last"), "--steps", str(STEPS)]
    with pytest.raises(autopar.LaunchError, match="rank [23] .*killed by SIGKILL"):
        autopar.launch(lose_a_node_after, 4, 5, module.main, argv, timeout=120, pg_timeout=20)
    results = autopar.launch(resumed_on, 2, 2, module.main, argv, timeout=120)
    resumed = results[0]
    # the checkpoint of step 4 (32 samples) loaded into a plan for 2 ranks; step 5, trained by
    # the lost world and not saved, is trained again
    assert (resumed["steps"], resumed["samples"], resumed["mesh"]) == (4, 32, "2:cpu"), resumed
    assert results[1]["losses"] == resumed["losses"]
    export(tmp_path / "last", tmp_path / "final.safetensors")
    state = load_file(tmp_path / "final.safetensors")
    reference = uninterrupted(module)
    found = mismatches(reference, resumed["losses"], state)
    print(f"4 ranks, node lost after step 5, resumed on 2 ranks (dp {resumed['dp']}, "
          f"{resumed['micro_batches']} micro-batches per replica): largest loss difference "
          f"{max(abs(a - b) for a, b in zip(resumed['losses'], reference[0])):.2e}")
    assert found == [], found


@pytest.mark.slow
def test_torchrun_restarts_the_example_on_the_node_left(tmp_path):
    """Two torchrun agents of 2 ranks each, one job (`--nnodes 1:2`, c10d rendezvous): node 1
    holds after step 5 and is killed with its ranks, as a lost machine; torchrun restarts the job
    on node 0 alone, whose 2 ranks plan again and resume from the checkpoint of step 4. The
    losses and the final checkpoint equal one uninterrupted process's."""
    hold = tmp_path / "hold.log"
    command = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
               "--max-restarts", "3", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{free_port()}",
               "--rdzv-id", "elastic-test", "--rdzv-conf", "last_call_timeout=5",
               str(Path(__file__).parent / "torchrun_elastic.py"), "--hold-at-step", "5", "--hold-log",
               str(hold), "--checkpoint", str(tmp_path / "last"), "--steps", str(STEPS),
               "--losses", str(tmp_path / "losses.json")]
    # sessions of their own, as two machines: the first agent hosts the rendezvous store
    nodes = [subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                              start_new_session=True)]
    time.sleep(1)
    nodes.append(subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session=True))
    try:
        deadline = time.monotonic() + 240
        while len(hold.read_text().splitlines() if hold.exists() else []) < 2:
            assert time.monotonic() < deadline and nodes[0].poll() is None, "node 1 never held"
            time.sleep(0.2)
        os.killpg(nodes[1].pid, signal.SIGKILL)        # the agent of node 1, and then its ranks
        for line in hold.read_text().splitlines():     # (torchrun starts them in sessions of their own)
            os.kill(int(line.split()[2]), signal.SIGKILL)
        stdout, stderr = nodes[0].communicate(timeout=240)
    finally:
        for node in nodes:
            if node.poll() is None:
                os.killpg(node.pid, signal.SIGKILL)
    assert nodes[0].returncode == 0, stderr[-4000:]
    assert "4 ranks from step 0" in stdout and "2 ranks from step 4 (sample 32)" in stdout, stdout
    export(tmp_path / "last", tmp_path / "final.safetensors")
    losses = json.loads((tmp_path / "losses.json").read_text())
    found = mismatches(uninterrupted(example()), losses, load_file(tmp_path / "final.safetensors"))
    assert found == [], found


def test_the_world_is_the_launchers(monkeypatch):
    """Mesh.from_world: the launcher's WORLD_SIZE in nodes of LOCAL_WORLD_SIZE devices; a
    process no launcher started is a world of one; unequal nodes are refused, naming the fix."""
    for name in ("WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    assert str(autopar.Mesh.from_world("cpu")) == "1:cpu"
    monkeypatch.setenv("WORLD_SIZE", "16")
    assert str(autopar.Mesh.from_world("h100-80g")) == "16:h100-80g"
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    mesh = autopar.Mesh.from_world("h100-80g")
    assert (str(mesh), [axis.name for axis in mesh.axes]) == ("2x8:h100-80g", ["node", "gpu"])
    monkeypatch.setenv("WORLD_SIZE", "12")
    with pytest.raises(autopar.MeshError, match="not a whole number of equal nodes.*--nproc-per-node"):
        autopar.Mesh.from_world("h100-80g")
    monkeypatch.setenv("WORLD_SIZE", "two")
    with pytest.raises(autopar.MeshError, match="WORLD_SIZE='two'.*torchrun"):
        autopar.Mesh.from_world("cpu")
    with pytest.raises(autopar.MeshError, match="unknown device 'h1000'"):
        autopar.Mesh.from_world("h1000")


def replicas_rows(size: int, global_batch: int, replicas: int, position: int, **options) -> list[list[int]]:
    """Each global batch an iteration of every replica's sampler gives, as the rows it trains."""
    share = global_batch // replicas
    rows = [list(GlobalBatchSampler(size, global_batch=global_batch, replicas=replicas, replica=r,
                                    position=lambda: position, **options)) for r in range(replicas)]
    return [sorted(row for mine in rows for row in mine[k * share:(k + 1) * share])
            for k in range(len(rows[0]) // share)]


def test_the_sampler_resumes_at_the_data_position_under_any_number_of_replicas():
    """An epoch's global batches are the same rows under 1, 2 and 4 replicas; from a position
    inside an epoch, the batches that follow it; the next epoch is another order of the rows,
    whose leftover (28 = 3 x 8 + 4) is not trained."""
    whole = replicas_rows(28, 8, 1, 0, seed=3)
    assert len(whole) == 3 and len({row for batch in whole for row in batch}) == 24
    expected = torch.randperm(28, generator=torch.Generator().manual_seed(3))[:24].view(3, 8)
    assert whole == [sorted(batch) for batch in expected.tolist()]
    for replicas in (2, 4):
        assert replicas_rows(28, 8, replicas, 0, seed=3) == whole
        assert replicas_rows(28, 8, replicas, 16, seed=3) == whole[2:]
        assert replicas_rows(28, 8, replicas, 24 + 8, seed=3) == replicas_rows(28, 8, 1, 32, seed=3)
    assert replicas_rows(28, 8, 2, 24, seed=3) != whole           # epoch 1: another order
    in_order = replicas_rows(12, 4, 2, 4, shuffle=False)
    assert in_order == [[4, 5, 6, 7], [8, 9, 10, 11]]
    sampler = GlobalBatchSampler(28, global_batch=8, replicas=2, replica=1, position=lambda: 36)
    with pytest.raises(autopar.AutoparError, match="sample 12 of epoch 1, is not the start of a global batch of 8"):
        list(sampler)
    with pytest.raises(autopar.AutoparError, match="6 samples, fewer than one global batch of 8"):
        GlobalBatchSampler(6, global_batch=8, replicas=2, replica=0, position=lambda: 0)
