"""autopar.launch under faults: a stalled rank is named (not the peer that waited for it), with
its stack; a rank that dies is named with its signal; a launch that runs past its timeout names
the unfinished ranks; SIGTERM to the launching process stops every rank and removes the temporary
folder; bad arguments are refused before anything is forked."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the fork: see test_parallel_gpt.py)
import torch.distributed as dist

import autopar

pytestmark = pytest.mark.multiprocess


def _rank_one_stalls(marker: str):
    if dist.get_rank() == 1:
        time.sleep(600)     # the stall: far beyond pg_timeout, stopped by the launcher
    tensor = torch.ones(1)
    dist.all_reduce(tensor)  # the other ranks wait here for rank 1 and time out
    return dist.get_rank()


def _rank_two_dies():
    if dist.get_rank() == 2:
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()
    return dist.get_rank()


def _rank_one_never_returns():
    if dist.get_rank() == 1:
        time.sleep(600)
    return dist.get_rank()


PG_TIMEOUT = 5


def _rank_0_plans_longer_than_pg_timeout():
    """compile(plan=None): rank 0 searches while rank 1 waits. The search is made to outlast the
    launcher's process-group timeout (in this forked rank only); rank 1 must wait for it."""
    import autopar.api as api
    from autopar.models import build_model, lm_loss

    search = api.plan_graph

    def slow_search(*args, **kwargs):
        time.sleep(PG_TIMEOUT + 3)
        return search(*args, **kwargs)

    api.plan_graph = slow_search
    model, example = build_model("gpt:layers=1,hidden=16,heads=2,seq=8,vocab=32", device="cpu", batch=2)
    compiled = autopar.compile(model, "2:cpu", example_inputs=example, loss_fn=lm_loss,
                               optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
                               global_batch=4, time_limit=30)
    return compiled.plan.to_json()


@pytest.mark.slow
def test_planning_may_outlast_the_launchers_pg_timeout():
    plans = autopar.launch(_rank_0_plans_longer_than_pg_timeout, 2, timeout=240, pg_timeout=PG_TIMEOUT)
    assert plans[0] == plans[1]


def test_stalled_rank_is_named_not_its_waiting_peer():
    with pytest.raises(autopar.LaunchError) as caught:
        autopar.launch(_rank_one_stalls, 3, "m", timeout=60, pg_timeout=1)
    message = str(caught.value)
    assert message.startswith("rank 1 stalled")
    assert "ranks 0, 2 waited 1 s" in message
    assert "rank 1 was at:" in message and "_rank_one_stalls" in message


def test_killed_rank_is_named_with_its_signal():
    with pytest.raises(autopar.LaunchError, match=r"rank 2 failed: was killed by SIGKILL"):
        autopar.launch(_rank_two_dies, 3, timeout=60, pg_timeout=10)


def test_launch_timeout_names_the_unfinished_rank():
    with pytest.raises(autopar.LaunchError, match=r"rank 1 did not finish within 6 s \(timeout\); "
                                                  r"rank 0 did") as caught:
        autopar.launch(_rank_one_never_returns, 2, timeout=6, pg_timeout=30)
    assert "_rank_one_never_returns" in str(caught.value)


@pytest.mark.parametrize("kwargs, words", [
    ({"world_size": 0}, "world_size must be an integer from 1"),
    ({"world_size": 10**6}, "world_size must be an integer from 1"),
    ({"world_size": 2.0}, "world_size must be an integer"),
    ({"world_size": 2, "timeout": 0}, "timeout must be a finite number"),
    ({"world_size": 2, "pg_timeout": float("inf")}, "pg_timeout must be a finite number"),
    ({"world_size": 2, "pg_timeout": -1}, "pg_timeout must be a finite number"),
])
def test_bad_launch_arguments(kwargs, words):
    world_size = kwargs.pop("world_size")
    with pytest.raises(autopar.LaunchError, match=words):
        autopar.launch(_rank_one_never_returns, world_size, **kwargs)


SIGTERM_SCRIPT = textwrap.dedent("""
    import os, sys, time
    import autopar

    def rank(folder):
        open(os.path.join(folder, f"pid{os.getpid()}"), "w").close()
        time.sleep(600)

    autopar.launch(rank, 2, sys.argv[1], timeout=600, pg_timeout=600)
""")


@pytest.mark.parametrize("signum", [signal.SIGTERM, pytest.param(signal.SIGINT, marks=pytest.mark.slow)])
def test_signal_to_launcher_stops_every_rank_and_cleans_up(tmp_path, signum):
    pids, scratch = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    scratch.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(pids)],
                                env={**os.environ, "TMPDIR": str(scratch)},
                                stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(6000):      # both ranks started (polled; importing torch may take a while)
            if len(list(pids.iterdir())) == 2 or launcher.poll() is not None:
                break
            time.sleep(0.02)
        assert len(list(pids.iterdir())) == 2, launcher.stderr.read() if launcher.poll() else ""
        assert list(scratch.iterdir()), "the launcher's temporary folder exists while it runs"
        launcher.send_signal(signum)
        launcher.wait(30)
    finally:
        if launcher.poll() is None:
            launcher.kill()
    assert launcher.returncode != 0
    for pid in (int(p.name[3:]) for p in pids.iterdir()):
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)          # gone: killed and reaped by the launcher
    assert not list(scratch.iterdir()), "temporary folder left behind"
