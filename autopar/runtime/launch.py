"""Start gloo ranks on this machine: `autopar.launch(fn, world_size, *args)`.

Ranks are forked, not spawned (0.1 s instead of seconds for 4 ranks), so `fn` may be any callable,
a closure included. Each rank gets the default process group (gloo, a timeout of `pg_timeout`
seconds per collective), runs `fn(*args)` and writes its result to a file; the parent reads
results after every rank exits. A file and not a queue: a large result put on a queue that nobody
reads until join deadlocks.

Faults are named by the rank that caused them. A rank that raises or dies makes the launcher stop
the others and raise `LaunchError` with that rank's traceback. A rank that stalls is found by its
peers' collectives timing out after `pg_timeout` while it neither finished nor failed: the error
names the stalled rank, not the peer that noticed, and shows where it was stuck (its Python stack,
dumped by `faulthandler` on SIGUSR1). Nothing runs past `timeout`. SIGINT or SIGTERM to the
launching process stops every rank and removes the temporary folder before it is re-raised.
With `max_restarts=N` a failed run starts all ranks again instead, up to N times, as torchrun's
--max-restarts does: `fn` resumes by itself from its last checkpoint (`CompiledModel.load`), and
reads the attempt from TORCHELASTIC_RESTART_COUNT as under torchrun.
"""

from __future__ import annotations

import contextlib
import ctypes
import datetime
import faulthandler
import math
import functools
import multiprocessing
import os
import pickle
import re
import signal
import socket
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path

from autopar.errors import AutoparError

# More ranks than this on one machine is a typo for a mesh size, and would fork that many
# processes before any check could run.
MAX_LOCAL_RANKS = 512
STACK_WAIT_S = 1.0      # how long a stalled rank gets to dump its stack
PEER_GRACE_S = 0.5      # after a failure, how long the other ranks get to report theirs
# gloo says "Timed out waiting 1000ms for recv", NCCL's watchdog "collective operation timeout"
TIMEOUT_PATTERN = re.compile(r"timed out|timeout", re.IGNORECASE)
PR_SET_PDEATHSIG = 1


class LaunchError(AutoparError):
    """A rank failed; the message names it and carries its traceback."""


def init_default_group(backend: str, timeout: datetime.timedelta | None = None) -> None:
    """The default process group from the environment, as `init_process_group(backend)` makes it
    (env://: torchrun's variables, or launch's own), under a store prefix of its own for each
    torchrun attempt (TORCHELASTIC_RESTART_COUNT, set by torchrun). torchrun's agent keeps one
    store across restarts (`--max-restarts`); without the prefix the killed attempt's keys (the
    gloo addresses of its ranks) stay in it, and a restarted rank connects to those dead
    addresses instead of its new peers'."""
    import torch.distributed as dist

    options = {} if timeout is None else {"timeout": timeout}
    attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT")
    if attempt is None:
        dist.init_process_group(backend, **options)
        return
    store, rank, world_size = next(dist.rendezvous("env://", **options))
    dist.init_process_group(backend, store=dist.PrefixStore(f"autopar/attempt-{attempt}", store),
                            rank=rank, world_size=world_size, **options)


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def launch(fn, world_size: int, *args, timeout: float = 120.0, pg_timeout: float = 30.0,
           max_restarts: int = 0) -> list:
    """Run fn(*args) on `world_size` forked gloo ranks; return the list of their results by rank.

    `timeout` bounds each attempt; `pg_timeout` how long a collective waits for a peer before the
    peer is reported as stalled. When `fn` plans (autopar.compile without a plan), the planning
    ranks wait on a group of their own whose timeout outlasts the time limit, not `pg_timeout`.
    When a rank fails, every rank is stopped and all start again, up to `max_restarts` times."""
    _check_arguments(world_size, timeout, pg_timeout)
    if not isinstance(max_restarts, int) or max_restarts < 0:
        raise LaunchError(f"max_restarts must be 0 or more, got {max_restarts!r}")
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
    with _stop_on_signals(), tempfile.TemporaryDirectory(prefix="autopar-launch-") as tmp:
        files = [_RankFiles(Path(tmp), rank) for rank in range(world_size)]
        procs = [context.Process(target=_run_rank, daemon=False,
                                 args=(fn, args, rank, world_size, port, pg_timeout, files[rank]))
                 for rank in range(world_size)]
        try:
            for proc in procs:
                proc.start()
            _wait(procs, files, timeout, pg_timeout)
        finally:
            _stop(procs)
        return [_read(f.result)[1] for f in files]


def _check_arguments(world_size, timeout, pg_timeout) -> None:
    if not isinstance(world_size, int) or isinstance(world_size, bool) or not (
            1 <= world_size <= MAX_LOCAL_RANKS):
        raise LaunchError(f"world_size must be an integer from 1 to {MAX_LOCAL_RANKS}, got "
                          f"{world_size!r}")
    for name, value in (("timeout", timeout), ("pg_timeout", pg_timeout)):
        if not isinstance(value, (int, float)) or isinstance(value, bool) or not 0 < value < math.inf:
            raise LaunchError(f"{name} must be a finite number of seconds above 0, got {value!r}")


class _RankFiles:
    """Where rank `rank` writes its result and, when asked, its stack."""

    def __init__(self, folder: Path, rank: int):
        self.result = folder / f"rank{rank}.pkl"
        self.stack = folder / f"rank{rank}.stack"


def _run_rank(fn, args, rank, world_size, port, pg_timeout, files: _RankFiles):
    import torch
    import torch.distributed as dist

    # The launcher's handlers were inherited by the fork: a rank is stopped by the launcher, and
    # dies with its launcher even if that is killed outright (no orphans holding the port).
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
    stack_file = files.stack.open("w")
    faulthandler.register(signal.SIGUSR1, file=stack_file, all_threads=False)
    # Forked children that inherit a multi-threaded intra-op pool can hang in their first matmul.
    torch.set_num_threads(1)
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank),
                      WORLD_SIZE=str(world_size), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world_size))
    status, payload, failed_at = "ok", None, None
    try:
        init_default_group("gloo", datetime.timedelta(seconds=pg_timeout))
        # A rank whose function returns at once would otherwise tear its sockets down while a
        # slower peer is still connecting, and that peer fails with "connection closed by peer".
        dist.barrier()
        payload = fn(*args)
    except BaseException as err:  # reported to the parent, which raises it with the rank's name
        status = "timeout" if TIMEOUT_PATTERN.search(str(err)) else "error"
        payload = f"{type(err).__name__}: {err}\n{traceback.format_exc()}"
        failed_at = time.monotonic_ns()   # one clock for all processes of the machine
    _write(files.result, status, payload, failed_at)
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


def _wait(procs, files, timeout: float, pg_timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not _failures(procs, files) and any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            raise LaunchError(_unfinished(procs, files, timeout))
        time.sleep(0.02)
    if not _failures(procs, files):
        return
    # A rank's death closes its sockets a moment before the process can be reaped, and its peers
    # may report the closed connection first; peers that waited on a stalled rank report their
    # own timeouts one after the other. Both settle within a short grace time.
    grace = time.monotonic() + PEER_GRACE_S
    while time.monotonic() < grace and any(_running(p, f) for p, f in zip(procs, files)):
        time.sleep(0.02)
    failures = _failures(procs, files)
    stalled = [rank for rank, (p, f) in enumerate(zip(procs, files)) if _running(p, f)]
    if stalled and all(kind == "timeout" for kind, _, _ in failures.values()):
        raise LaunchError(_stalled(stalled, procs, files, failures, pg_timeout))
    rank, (_, _, message) = min(failures.items(), key=lambda item: (item[1][1], item[0]))
    raise LaunchError(f"rank {rank} failed: {message}")


def _running(proc, files: _RankFiles) -> bool:
    return proc.is_alive() and not files.result.exists()


def _failures(procs, files) -> dict[int, tuple[str, int, str]]:
    """{rank: (kind, when, message)} of the ranks that died without a result or raised.

    Peers of a failed rank see the closed connection and raise within milliseconds, often before
    the next poll, but their errors are the consequence, not the cause: a rank that died comes
    first (when = -1), then the earliest error."""
    found = {}
    for rank, (proc, f) in enumerate(zip(procs, files)):
        if f.result.exists():
            status, payload, failed_at = _read(f.result)
            if status != "ok":
                found[rank] = (status, failed_at, payload)
        elif not proc.is_alive() and proc.exitcode is not None:
            found[rank] = ("died", -1, f"{_exit_text(proc.exitcode)} before returning a result")
    return found


def _exit_text(code: int) -> str:
    if code < 0:
        with contextlib.suppress(ValueError):
            return f"was killed by {signal.Signals(-code).name}"
    return f"exited with code {code}"


def _ranks(ranks) -> str:
    return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks))


def _stalled(stalled, procs, files, failures, pg_timeout: float) -> str:
    it = "it" if len(stalled) == 1 else "them"
    first = failures[min(failures)][2].splitlines()[0]
    lines = [f"{_ranks(stalled)} stalled: neither finished nor failed while {_ranks(sorted(failures))} "
             f"waited {pg_timeout:g} s for {it} in a collective (pg_timeout; rank {min(failures)} saw: "
             f"{first}); stopped every rank"]
    lines += _stacks(stalled, procs, files)
    return "\n".join(lines)


def _unfinished(procs, files, timeout: float) -> str:
    running = [rank for rank, (p, f) in enumerate(zip(procs, files)) if _running(p, f)]
    done = [rank for rank in range(len(procs)) if rank not in running]
    lines = [f"{_ranks(running)} did not finish within {timeout:g} s (timeout)"
             + (f"; {_ranks(done)} did" if done else "") + "; stopped every rank"]
    lines += _stacks(running, procs, files)
    return "\n".join(lines)


def _stacks(ranks, procs, files) -> list[str]:
    """Each rank's Python stack, asked for with SIGUSR1 (faulthandler writes it from the signal
    handler, even while the rank waits inside C code)."""
    for rank in ranks:
        with contextlib.suppress(ProcessLookupError):
            os.kill(procs[rank].pid, signal.SIGUSR1)
    deadline = time.monotonic() + STACK_WAIT_S
    while time.monotonic() < deadline and not all(
            files[r].stack.exists() and files[r].stack.stat().st_size for r in ranks):
        time.sleep(0.02)
    lines = []
    for rank in ranks:
        stack = files[rank].stack.read_text().strip() if files[rank].stack.exists() else ""
        lines.append(f"rank {rank} was at:\n{stack}" if stack else f"rank {rank}: no stack could be read")
    return lines


@contextlib.contextmanager
def _stop_on_signals():
    """SIGTERM raises SystemExit in the launching process, as SIGINT raises KeyboardInterrupt, so
    that the ranks are stopped and the temporary folder removed on the way out. Only the main
    thread can set handlers; elsewhere the caller's own handling applies."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return

    def terminate(signum, frame):
        raise SystemExit(128 + signum)

    previous = signal.signal(signal.SIGTERM, terminate)
    try:
        yield
    finally:
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _stop(procs) -> None:
    for proc in procs:
        if proc.is_alive():
            proc.kill()
    for proc in procs:
        if proc.pid is not None:
            proc.join(5)
