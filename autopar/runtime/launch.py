"""Start gloo ranks on this machine: `autopar.launch(fn, world_size, *args)`.

Ranks are forked, not spawned (0.1 s instead of seconds for 4 ranks), so `fn` may be any callable,
a closure included. Each rank gets the default process group (gloo, a short timeout), runs
`fn(*args)` and writes its result to a file; the parent reads results after every rank exits.
A file and not a queue: a large result put on a queue that nobody reads until join deadlocks.

A rank that raises or dies makes the launcher stop the others and raise `LaunchError` naming the
failed rank and its traceback; nothing hangs past `timeout`. With `max_restarts=N` it starts all
ranks again instead, up to N times, as torchrun's --max-restarts does: `fn` resumes by itself from
its last checkpoint (`CompiledModel.load`), and reads the attempt from TORCHELASTIC_RESTART_COUNT
as under torchrun.
"""

from __future__ import annotations

import datetime
import functools
import multiprocessing
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from pathlib import Path

from autopar.errors import AutoparError


class LaunchError(AutoparError):
    """A rank failed; the message names it and carries its traceback."""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0,
           max_restarts: int = 0) -> list:
    """Run fn(*args) on `world_size` forked gloo ranks; return the list of their results by rank.
    When a rank fails, stop every rank and start them all again, up to `max_restarts` times
    (`timeout` is per attempt)."""
    if world_size < 1:
        raise LaunchError(f"world_size must be at least 1, got {world_size}")
    if max_restarts < 0:
        raise LaunchError(f"max_restarts must be 0 or more, got {max_restarts}")
    attempt = 0
    while True:
        try:
            return _launch_once(functools.partial(_attempt, attempt, fn), world_size, args, timeout,
                                pg_timeout)
        except LaunchError as err:
            if attempt == max_restarts:
                raise
            attempt += 1
            print(f"autopar.launch: {str(err).splitlines()[0]}; restart {attempt} of {max_restarts}",
                  file=sys.stderr)


def _attempt(attempt: int, fn, *args):
    os.environ["TORCHELASTIC_RESTART_COUNT"] = str(attempt)
    return fn(*args)


def _launch_once(fn, world_size: int, args: tuple, timeout: float, pg_timeout: float) -> list:
    port = free_port()
    context = multiprocessing.get_context("fork")
    with tempfile.TemporaryDirectory(prefix="autopar-launch-") as tmp:
        outputs = [Path(tmp) / f"rank{rank}.pkl" for rank in range(world_size)]
        procs = [context.Process(target=_run_rank, daemon=False,
                                 args=(fn, args, rank, world_size, port, pg_timeout, outputs[rank]))
                 for rank in range(world_size)]
        for proc in procs:
            proc.start()
        _wait(procs, outputs, timeout)
        return [_read(path)[1] for path in outputs]


def _run_rank(fn, args, rank, world_size, port, pg_timeout, output: Path):
    import torch
    import torch.distributed as dist

    # Forked children that inherit a multi-threaded intra-op pool can hang in their first matmul.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    status, payload, failed_at = "ok", None, None
    try:
        dist.init_process_group("gloo", rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=pg_timeout))
        payload = fn(*args)
    except BaseException as err:  # reported to the parent, which raises it with the rank's name
        status, payload = "error", f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        failed_at = time.monotonic_ns()   # one clock for all processes of the machine
    _write(output, status, payload, failed_at)
    if status == "ok" and dist.is_initialized():
        dist.destroy_process_group()
    # Skip interpreter teardown: gloo threads of a failed peer can block a normal exit.
    os._exit(0 if status == "ok" else 1)


def _write(path: Path, status: str, payload, failed_at: int | None) -> None:
    tmp = path.with_suffix(".tmp")
    try:
        tmp.write_bytes(pickle.dumps((status, payload, failed_at)))
    except Exception as err:
        tmp.write_bytes(pickle.dumps(("error", f"result of the rank could not be pickled: {err}",
                                      time.monotonic_ns())))
    tmp.rename(path)


def _read(path: Path):
    return pickle.loads(path.read_bytes())


def _wait(procs, outputs, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    failed = None
    while failed is None and any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            _stop(procs)
            raise LaunchError(f"ranks did not finish within {timeout:.0f} s; stopped them")
        time.sleep(0.02)
        failed = _first_failure(procs, outputs)
    # The first failure seen is the cause; ranks killed after it are not reported.
    failed = failed or _first_failure(procs, outputs)
    _stop(procs)
    if failed is not None:
        raise LaunchError(f"rank {failed[0]} failed: {failed[1]}")


def _first_failure(procs, outputs):
    """(rank, message) of a rank that died without writing a result, else of the one that raised
    first.

    Peers of a failed rank see the closed connection and raise within milliseconds, often before
    the next poll, but their errors are the consequence, not the cause."""
    for rank, (proc, path) in enumerate(zip(procs, outputs)):
        if not path.exists() and not proc.is_alive() and proc.exitcode is not None:
            return rank, f"exited with code {proc.exitcode} before returning a result"
    errors = []
    for rank, path in enumerate(outputs):
        if path.exists():
            status, payload, failed_at = _read(path)
            if status == "error":
                errors.append((failed_at, rank, payload))
    return min(errors)[1:] if errors else None


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        proc.join(5)
