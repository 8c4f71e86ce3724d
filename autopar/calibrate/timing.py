"""How calibration times things: the median of repeats on one rank, or a step every rank of a
gloo mesh takes together (the slowest rank's median, equal repeats everywhere)."""

from __future__ import annotations

import time
from collections.abc import Callable

import torch


def median_seconds(fn: Callable[[], object], device: str, budget_s: float) -> float:
    """Median seconds of `fn` over repeats that fit `budget_s` (after one warm-up call)."""
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    fn()
    sync()
    times = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 3 or (time.perf_counter() < deadline and len(times) < 50):
        start = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - start)
    return sorted(times)[len(times) // 2]


def exchange(tensor: torch.Tensor, rank: int) -> None:
    """As a pipeline schedule moves activations: every rank sends to the next and receives from
    the one before at once (torch.distributed.pipelining's batched isend/irecv), so that the
    transfer is timed with every rank busy, as in a running pipeline, not with one pair alone."""
    import torch.distributed as dist

    ranks = dist.get_world_size()
    incoming = torch.empty_like(tensor)
    ops = [dist.P2POp(dist.isend, tensor, (rank + 1) % ranks),
           dist.P2POp(dist.irecv, incoming, (rank - 1) % ranks)]
    for work in dist.batch_isend_irecv(ops):
        work.wait()


def everywhere_seconds(fn: Callable[[], object], budget_s: float) -> float:
    """Median seconds of `fn`, a step every rank takes together, each repeat between barriers
    and the same number of repeats on every rank; the slowest rank's median."""
    import torch.distributed as dist

    fn()
    repeats = int(agreed(max(3, min(30, int(budget_s / max(timed(fn), 1e-6)))), min))
    times = []
    for _ in range(repeats):
        dist.barrier()
        times.append(timed(fn))
    return agreed(sorted(times)[len(times) // 2], max)


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def agreed(value: float, pick) -> float:
    """The same number on every rank (the smallest, with pick=min), so all run equal repeats."""
    import torch.distributed as dist

    values = [None] * dist.get_world_size()
    dist.all_gather_object(values, value)
    return pick(values)
