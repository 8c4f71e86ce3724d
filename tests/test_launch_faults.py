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
    with pytest.raises(autopar.LaunchError, match=r"rank 1 did not finish within 2 s \(timeout\); "
                                                  r"rank 0 did") as caught:
        autopar.launch(_rank_one_never_returns, 2, timeout=2, pg_timeout=30)
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


@pytest.mark.parametrize("signum", [signal.SIGTERM, signal.SIGINT])
def test_signal_to_launcher_stops_every_rank_and_cleans_up(tmp_path, signum):
    pids, scratch = tmp_path / "pids", tmp_path / "tmp"
    pids.mkdir()
    scratch.mkdir()
    launcher = subprocess.Popen([sys.executable, "-c", SIGTERM_SCRIPT, str(pids)],
                                env={**os.environ, "TMPDIR": str(scratch)},
                                stderr=subprocess.PIPE, text=True)
    try:
        for _ in range(1500):      # both ranks started (polling, no timing assumption)
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
