"""Checkpoints: training saved under one plan and resumed under the same or another plan (or another
number of ranks) continues exactly as an uninterrupted run; a rank killed mid-training or mid-save
brings the job back from the last checkpoint with no lost or repeated steps; `autopar checkpoint
export` writes one plain state dict.

Every comparison is with one process trained on the same batches without interruption: each
step's loss and the final parameters within |d| <= 1e-6 + 1e-5 * scale (autopar.testing.equivalence),
AdamW with eps=1e-3 so that a lost or wrong optimizer state shows.
"""

import json
import os
import signal
import subprocess
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before forking: each rank would pay for it)
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

import autopar
from autopar.cli import main as cli
from autopar.models import build_model, lm_loss
from autopar.plans import Plan, Stage
from autopar.runtime.checkpoint import CheckpointError
from autopar.testing.equivalence import mismatches, train_single_process
from autopar.runtime.build import build_runtime

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
    """The planner's placements for Config(tp=2) on dp x 2 (what compile(plan=Config) runs):
    column-parallel q, k, v and fc1, row-parallel wo and fc2."""
    model, example_inputs = build_model(SPEC, batch=2)
    graph = autopar.capture(model, example_inputs=example_inputs)
    config = autopar.Config(tp=2, dp=dp, global_batch=2 * dp, micro_batch=2)
    plan = autopar.plan_from_config(graph, f"{2 * dp}:cpu", config, time_limit=20)
    return plan.parameters, plan.nodes


def batches():
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=generator),
             torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=generator)) for _ in range(STEPS)]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)     # as examples/resume_gpt.py


def gpt(tied: bool = False, spec: str = SPEC):
    """The tiny GPT; `tied`: its LM head reuses the token embedding (one tensor, two names)."""
    model, example_inputs = build_model(spec, device="cpu", batch=2)
    if tied:
        model.lm_head.weight = model.tok_emb.weight
    return model, example_inputs


def compiled(plan: Plan, tied: bool = False, spec: str = SPEC):
    model, example_inputs = gpt(tied, spec)
    return build_runtime(model, plan, example_inputs=example_inputs, loss_fn=lm_loss, optimizer=adamw)


def uninterrupted(tied: bool = False, steps: int = STEPS) -> tuple[list[float], dict]:
    model, _ = gpt(tied)
    return train_single_process(model, batches()[:steps], lm_loss, adamw)


def differences(reference, losses: list[float], state: dict) -> dict:
    """The mismatches beyond tolerance, and the largest differences (for the report)."""
    ref_losses, ref_state = reference
    return {"mismatches": mismatches(reference, losses, state),
            "loss": max(abs(a - b) for a, b in zip(losses, ref_losses)),
            "parameter": max((state[k] - v).abs().max().item() for k, v in ref_state.items())}


def save_then_resume(cases: list[tuple], directory: str, stop: int) -> list:
    """For each (saving plan, resuming plan, checkpoint name, tied): train the first `stop` steps
    under the saving plan and save (no saving plan: the checkpoint is there already), then build
    the resuming plan from a fresh model, load, and train to the end. On rank 0, the differences
    of the whole run from one uninterrupted process."""
    data = batches()
    reports = []
    for saving, resuming, name, tied in cases:
        if saving is not None:
            cm = compiled(saving, tied)
            losses = [cm.step(*batch) for batch in data[:stop]]
            cm.save(Path(directory) / name, extra={"losses": losses, "next": stop})
        cm = compiled(resuming, tied)
        extra = cm.load(Path(directory) / name)
        assert cm.steps == extra["next"] == stop
        losses = extra["losses"] + [cm.step(*batch) for batch in data[stop:]]
        state = cm.full_state_dict()
        reports.append(differences(uninterrupted(tied), losses, state) if dist.get_rank() == 0 else None)
    return reports


def resume_and_refuse_another_model(cases: list[tuple], directory: str, stop: int) -> list:
    """save_then_resume, then a checkpoint of the tiny GPT loaded into a wider one: refused on
    every rank with the reason, before any rank waits in a collective."""
    reports = save_then_resume(cases, directory, stop)
    saved = Path(directory) / cases[0][2]
    world = dist.get_world_size()
    cm = compiled(make_plan(CUT, pp=2, dp=world // 2), spec=SPEC.replace("vocab=64", "vocab=128"))
    with pytest.raises(CheckpointError, match=r"tok_emb.weight has shape \(64, 32\) in .* but \(128, 32\)"):
        cm.load(saved)
    with pytest.raises(CheckpointError, match="does not exist"):
        cm.load(Path(directory) / "missing")
    check_other_depths(saved)
    return reports


def check_other_depths(saved: Path) -> None:
    """A checkpoint of the 2-layer GPT into a 1-layer and a 3-layer one: refused, naming the
    tensors one side lacks, unless strict=False asks for a partial load, which takes the tensors
    both have and leaves the others as they were."""
    stored = dcp.FileSystemReader(saved).read_metadata().state_dict_metadata
    for layers, words in ((1, r"it holds \['layers.1.ln1"), (3, r"this model's \['layers.2.ln1")):
        spec = SPEC.replace("layers=2", f"layers={layers}")
        units = [*UNITS[:3], *(f"layers.{i}" for i in range(layers)), *UNITS[-2:]]
        cm = build_runtime(build_model(spec, device="cpu", batch=2)[0],
                           make_plan([units], pp=1, dp=dist.get_world_size()),
                           example_inputs=gpt(spec=spec)[1], loss_fn=lm_loss, optimizer=adamw)
        before = cm.full_state_dict()
        with pytest.raises(CheckpointError, match=f"another model or optimizer: .*{words}.*strict=False"):
            cm.load(saved)
        with pytest.warns(UserWarning, match="partial load") if dist.get_rank() == 0 else nullcontext():
            cm.load(saved, strict=False)
        state = cm.full_state_dict()
        expected = {name: dcp_tensor(saved, name, tensor) if f"model.{name}" in stored else before[name]
                    for name, tensor in state.items()}
        assert all(torch.equal(state[name], expected[name]) for name in state), layers
        assert cm.steps == 3


def dcp_tensor(directory: Path, name: str, like: torch.Tensor) -> torch.Tensor:
    """One model tensor of a checkpoint, read in this process alone."""
    holder = {"model": {name: torch.empty_like(like)}}
    dcp.load(holder, checkpoint_id=directory, no_dist=True)
    return holder["model"][name]


def _plans_on_4_ranks() -> list[tuple]:
    dp4_zero1 = make_plan([UNITS], pp=1, dp=4, zero=1)
    tp2_pp2 = make_plan(CUT, pp=2, tp=2, layout=megatron_layout(1))
    pp2_dp2_zero3 = make_plan(CUT, pp=2, dp=2, zero=3)
    dp2_tp2 = make_plan([UNITS], pp=1, dp=2, tp=2, layout=megatron_layout(2))
    return [(dp4_zero1, dp4_zero1, "dp4-zero1", False), (None, tp2_pp2, "dp4-zero1", False),
            (pp2_dp2_zero3, dp2_tp2, "pp2-dp2-zero3", False)]


FOUR_NAMES = ["dp4 zero-1 -> same", "dp4 zero-1 -> tp2 x pp2", "pp2 x dp2 zero-3 -> dp2 x tp2"]


def _check(names: list[str], reports: list) -> None:
    for name, report in zip(names, reports, strict=True):
        print(f"{name}: largest loss difference {report['loss']:.2e}, parameter {report['parameter']:.2e}")
        assert report["mismatches"] == [], f"{name}: {report['mismatches']}"


def test_resume_under_the_same_and_other_plans(tmp_path):
    reports = autopar.launch(resume_and_refuse_another_model, 4, _plans_on_4_ranks(), str(tmp_path), 3,
                             timeout=120)[0]
    _check(FOUR_NAMES, reports)
    check_export(tmp_path, tied=False)


@pytest.mark.slow      # the default tier reshards between plans on 4 ranks (above)
def test_resume_on_fewer_ranks_and_a_tied_embedding(tmp_path):
    two = [(None, make_plan(CUT, pp=2), "dp4-zero1", False),
           (None, make_plan([UNITS], pp=1, tp=2, layout=megatron_layout(1)), "pp2-dp2-zero3", False),
           (make_plan(CUT, pp=2), make_plan([UNITS], pp=1, dp=2, zero=1), "tied-pp2", True)]
    reports = autopar.launch(save_then_resume, 4, _plans_on_4_ranks(), str(tmp_path), 3, timeout=120)[0]
    reports += autopar.launch(resume_and_refuse_another_model, 2, two, str(tmp_path), 3, timeout=120)[0]
    _check(FOUR_NAMES + ["4 ranks dp4 zero-1 -> 2 ranks pp2", "4 ranks pp2 x dp2 zero-3 -> 2 ranks tp2",
                         "tied embedding, pp2 -> dp2 zero-1"], reports)
    check_export(tmp_path, tied=True)


def check_export(directory: Path, tied: bool) -> None:
    """`autopar checkpoint export` of checkpoints saved on 4 ranks (and, with `tied`, of the tied
    embedding's saved on 2): one plain state dict equal to one process's after the same steps,
    tied names included; a sharded directory too."""
    from safetensors.torch import load_file

    if tied:
        saved = dcp.FileSystemReader(directory / "tied-pp2").read_metadata().state_dict_metadata
        assert "model.tok_emb.weight" in saved and "model.lm_head.weight" not in saved   # stored once
    for name, tied in (("dp4-zero1", False), ("tied-pp2", True))[:2 if tied else 1]:
        out = directory / f"{name}.safetensors"
        assert cli(["checkpoint", "export", str(directory / name), "--out", str(out)]) == 0
        exported = load_file(out)
        reference = uninterrupted(tied, steps=3)
        assert mismatches(reference, reference[0], exported) == []
        model, _ = gpt(tied)
        model.load_state_dict(exported)     # strict: every name of model.state_dict()
    shards = directory / "hf"
    assert cli(["checkpoint", "export", str(directory / "dp4-zero1"), "--out", str(shards),
                "--max-shard-size", "40KB"]) == 0
    index = json.loads((shards / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert len(files) > 1 and sorted(p.name for p in shards.glob("*.safetensors")) == files
    joined = {k: v for f in files for k, v in load_file(shards / f).items()}
    plain = load_file(directory / "dp4-zero1.safetensors")
    assert joined.keys() == plain.keys() and all(torch.equal(joined[k], t) for k, t in plain.items())
    assert cli(["checkpoint", "export", str(directory / "dp4-zero1"), "--out", str(shards)]) == 1


def train_resuming(directory: str) -> dict:
    """A training script that survives restarts: it resumes from `last` when there is one, saves
    every 2 steps, and logs each step it takes. Faults, by attempt: the first kills rank 1 after
    step 5 (a checkpoint of step 4 exists); the second kills rank 1 in the save after step 6, once
    its shard is written and before the checkpoint is finished (a crash mid-save); the third kills
    rank 0 in that save between the two steps of the switch (the new version complete and its link
    made, `last` not yet replaced), where an earlier two-rename swap left no `last` at all."""
    from torch.distributed.checkpoint.filesystem import FileSystemWriter

    attempt = int(os.environ["TORCHELASTIC_RESTART_COUNT"])
    last = Path(directory) / "last"
    cm = compiled(make_plan(CUT, pp=2))
    losses = cm.load(last)["losses"] if last.exists() else []
    start = cm.steps
    if attempt == 1 and dist.get_rank() == 1:
        write = FileSystemWriter.write_data

        def write_then_die(self, plan, planner):
            write(self, plan, planner).wait()
            os.kill(os.getpid(), signal.SIGKILL)
        FileSystemWriter.write_data = write_then_die
    if attempt == 2 and dist.get_rank() == 0:
        symlink_to = Path.symlink_to

        def link_then_die(self, target, *args, **kwargs):
            symlink_to(self, target, *args, **kwargs)
            os.kill(os.getpid(), signal.SIGKILL)
        Path.symlink_to = link_then_die
    for inputs, targets in batches()[start:]:
        losses.append(cm.step(inputs, targets))
        with open(Path(directory) / f"steps-rank{dist.get_rank()}.log", "a") as log:
            log.write(f"{attempt} {cm.steps}\n")
        if attempt == 0 and cm.steps == 5 and dist.get_rank() == 1:
            os.kill(os.getpid(), signal.SIGKILL)
        if cm.steps % 2 == 0:
            cm.save(last, extra={"losses": losses})
    state = cm.full_state_dict()
    return {"start": start, "losses": losses, "state": state if dist.get_rank() == 0 else None}


def test_killed_ranks_restart_from_the_last_checkpoint(tmp_path):
    results = autopar.launch(train_resuming, 2, str(tmp_path), max_restarts=3, timeout=120, pg_timeout=20)
    reference = uninterrupted()
    final = results[0]
    assert final["start"] == 4       # the later attempts' saves never finished: step 4's stood
    report = differences(reference, final["losses"], final["state"])
    print(f"killed and restarted twice: largest loss difference {report['loss']:.2e}, "
          f"parameter {report['parameter']:.2e}")
    assert report["mismatches"] == [], report["mismatches"]
    # each attempt took the steps after the checkpoint it found, and stopped where it was killed
    for rank in range(2):
        log = (tmp_path / f"steps-rank{rank}.log").read_text().split("\n")
        assert log[:-1] == ["0 1", "0 2", "0 3", "0 4", "0 5", "1 5", "1 6", "2 5", "2 6", "3 5", "3 6"], log
    # the last save cleared what the interrupted ones left: `last` links to its one version
    names = sorted(p.name for p in tmp_path.iterdir())
    assert names[0] == "last" and names[1].startswith("last.v-") and names[2:] == ["steps-rank0.log",
                                                                                   "steps-rank1.log"]
    assert (tmp_path / "last").is_symlink() and os.readlink(tmp_path / "last") == names[1]


@pytest.mark.slow
def test_torchrun_max_restarts_resumes_the_example(tmp_path):
    """examples/resume_gpt.py under torchrun --max-restarts 1: rank 1 killed after step 3 (the last
    checkpoint is of step 2); the restarted run's losses and final checkpoint equal one process's."""
    script = Path(__file__).parents[1] / "examples" / "resume_gpt.py"
    losses = tmp_path / "losses.json"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", str(script), "--checkpoint", str(tmp_path / "last"),
               "--fail-at-step", "3", "--losses", str(losses)]
    # a session of its own: on a timeout the workers go too, not only torchrun's agent
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        _, stderr = run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise
    assert run.returncode == 0, stderr[-4000:]
    # torchrun saw rank 1 killed, and the job still succeeded: a restart finished it
    assert "failed (exitcode: -9) local_rank: 1" in stderr, stderr[-4000:]
    out = tmp_path / "model.safetensors"
    assert cli(["checkpoint", "export", str(tmp_path / "last"), "--out", str(out)]) == 0
    from safetensors.torch import load_file

    report = differences(uninterrupted(), json.loads(losses.read_text()), load_file(out))
    print(f"torchrun, killed and restarted: largest loss difference {report['loss']:.2e}, "
          f"parameter {report['parameter']:.2e}")
    assert report["mismatches"] == [], report["mismatches"]


@pytest.mark.slow
def test_torchrun_restarts_a_plain_script_after_a_rank_is_killed_from_outside(tmp_path):
    """tests/torchrun_resume.py starts no process group itself (autopar.compile does); under
    torchrun --max-restarts 1, rank 1's process is killed from here after step 3 (the last
    checkpoint is of step 2). The restart takes steps 3 to 6 on every rank, and the losses and
    final checkpoint equal one uninterrupted process's."""
    script = Path(__file__).parent / "torchrun_resume.py"
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
               "--max-restarts", "1", str(script), "--directory", str(tmp_path), "--hold-at-step", "3"]
    run = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                           start_new_session=True)
    try:
        _kill_rank_at(run, tmp_path / "steps-rank1.log", "0 3 ", deadline=time.monotonic() + 240)
        _, stderr = run.communicate(timeout=240)
    except subprocess.TimeoutExpired:
        os.killpg(run.pid, signal.SIGKILL)
        raise
    assert run.returncode == 0, stderr[-4000:]
    assert "failed (exitcode: -9) local_rank: 1" in stderr, stderr[-4000:]
    for rank in range(2):
        log = (tmp_path / f"steps-rank{rank}.log").read_text().split("\n")[:-1]
        steps = [" ".join(line.split()[:2]) for line in log]
        assert steps == ["0 1", "0 2", "0 3", "1 3", "1 4", "1 5", "1 6"], steps
    out = tmp_path / "model.safetensors"
    assert cli(["checkpoint", "export", str(tmp_path / "last"), "--out", str(out)]) == 0
    from safetensors.torch import load_file

    report = differences(uninterrupted(), json.loads((tmp_path / "losses.json").read_text()), load_file(out))
    print(f"torchrun, rank killed from outside and restarted: largest loss difference "
          f"{report['loss']:.2e}, parameter {report['parameter']:.2e}")
    assert report["mismatches"] == [], report["mismatches"]


def _kill_rank_at(run: subprocess.Popen, log: Path, prefix: str, deadline: float) -> None:
    """SIGKILL the process that logged a line starting with `prefix` ("attempt step pid")."""
    while time.monotonic() < deadline and run.poll() is None:
        lines = log.read_text().splitlines() if log.exists() else []
        hit = [line for line in lines if line.startswith(prefix)]
        if hit:
            os.kill(int(hit[0].split()[2]), signal.SIGKILL)
            return
        time.sleep(0.1)
    raise AssertionError(f"no rank logged {prefix!r} in time: {log.read_text() if log.exists() else ''}")


def test_an_unfinished_checkpoint_is_refused_and_an_interrupted_replace_is_read(tmp_path):
    from autopar.runtime.checkpoint import readable

    with pytest.raises(CheckpointError, match="does not exist"):
        readable(tmp_path / "last")
    (tmp_path / "last").mkdir()       # a directory a crashed save or a user left, without metadata
    with pytest.raises(CheckpointError, match=r"not a finished checkpoint \(no .metadata\)"):
        readable(tmp_path / "last")
    (tmp_path / "last").rmdir()
    # a save killed between its two renames: the previous checkpoint is beside the path
    previous = tmp_path / "last.old-0123abcd"
    previous.mkdir()
    (previous / ".metadata").write_bytes(b"")
    assert readable(tmp_path / "last") == previous


def test_a_save_switches_the_path_to_its_version_in_one_rename(tmp_path):
    """`path` becomes a link to the new version by os.replace; a checkpoint directory an earlier
    autopar wrote there is replaced, and what interrupted saves left beside it is removed."""
    from autopar.runtime.checkpoint import _point

    def checkpoint_dir(name: str) -> Path:
        (tmp_path / name).mkdir()
        (tmp_path / name / ".metadata").write_bytes(b"")
        return tmp_path / name

    checkpoint_dir("last")                                  # an earlier autopar's checkpoint
    left = [checkpoint_dir("last.v-dead"), checkpoint_dir("last.old-dead")]   # interrupted saves
    (tmp_path / "last.link-dead").symlink_to("last.v-dead")
    version = checkpoint_dir("last.v-new")
    _point(tmp_path / "last", version, "new")
    assert os.readlink(tmp_path / "last") == "last.v-new" and readable_names(tmp_path) == ["last", "last.v-new"]
    assert not any(p.exists() for p in left)
    newer = checkpoint_dir("last.v-newer")
    _point(tmp_path / "last", newer, "newer")
    assert os.readlink(tmp_path / "last") == "last.v-newer" and readable_names(tmp_path) == ["last", "last.v-newer"]


def readable_names(directory: Path) -> list[str]:
    return sorted(p.name for p in directory.iterdir())


def test_export_refuses_bad_arguments_before_reading(tmp_path, capsys):
    from autopar.commands.checkpoint import parse_size

    assert parse_size("5GB") == 5 * 10**9 and parse_size("40KiB") == 40 * 2**10 and parse_size("1000") == 1000
    assert cli(["checkpoint", "export", str(tmp_path / "none"), "--out", str(tmp_path / "m.safetensors")]) == 1
    assert "does not exist" in capsys.readouterr().err
    for size in ("0", "-5GB", "lots"):
        assert cli(["checkpoint", "export", str(tmp_path), "--out", str(tmp_path / "o"),
                    f"--max-shard-size={size}"]) == 1
        assert "is not a size" in capsys.readouterr().err
