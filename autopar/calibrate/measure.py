"""Measure the compute model's efficiencies on the local device.

Each op family is timed on a few shapes; its efficiency is the achieved rate over the device
spec's peak: FLOP/s over peak FLOP/s for matmuls and attention, bytes/s over HBM bandwidth for the
memory-bound families. The best shape of a family stands for it (the roofline already charges
small shapes for their low arithmetic intensity). Rates above the spec's peak (a CPU whose spec is
nominal) are clipped to 1 and the raw figures kept under "measurements". The cost of launching
one op (tiny matmuls, norms and GELUs, forward and backward) becomes `kernel_latency_s`: on a CPU it is the eager dispatcher's, and
it dominates a small model's step.

`calibrate_mesh` does the same on every rank of a gloo mesh at once (each rank one thread, as
`autopar.launch` runs them, so ranks share the cores as a training run's do), then times each
collective at several sizes on the whole mesh and on every smaller group size that divides it,
and fits the alpha-beta model to each (`fit_link`, read by cost/calibration.py); times how long a blocking
collective waits for the last rank after a layer of compute; and times what the runtime's
machinery costs the host (host_probes.py: an op on a DTensor, an action of torch's pipeline
schedule, FSDP2's hooks, zero-bubble's split of the backward, a checkpointed region).
"""

from __future__ import annotations

import os
from collections.abc import Callable

import torch
import torch.nn.functional as F

from autopar.cost.calibration import KINDS, figures, ring_terms
from autopar.cost.compute import Efficiencies
from autopar.calibrate.host_probes import (checkpoint_latency, data_parallel_group_latency,
                                      data_parallel_reduce_latency, distributed_op_latency,
                                      pipeline_action_latency, split_backward_latency,
                                      tiny_op_latency)
from autopar.cost.mesh import DEVICES, DeviceSpec, Mesh
from autopar.calibrate.timing import agreed, everywhere_seconds, exchange, median_seconds
from autopar.errors import AutoparError

# Collective sizes timed (bytes of the full tensor): from latency-bound to bandwidth-bound.
COLLECTIVE_BYTES = (2**12, 2**16, 2**20, 2**24)

# cuda device names -> autopar device specs.
_CUDA_NAMES = (("H200", "h200-141g"), ("H100", "h100-80g"), ("A100-SXM4-40GB", "a100-40g"),
               ("A100", "a100-80g"))


def local_device_spec(device: str) -> DeviceSpec:
    if device == "cpu":
        return DEVICES["cpu"]
    if not torch.cuda.is_available():
        raise AutoparError("--device cuda asked for, but torch sees no CUDA device; use --device cpu")
    name = torch.cuda.get_device_name()
    for key, spec in _CUDA_NAMES:
        if key in name:
            return DEVICES[spec]
    raise AutoparError(f"no device spec for {name!r}; known devices: {', '.join(DEVICES)}")


def _cases(device: str, dtype: torch.dtype, scale: int) -> list[tuple]:
    """(family, label, fn, flops, bytes moved). `scale` shrinks shapes for a CPU."""
    def tensor(*shape):
        return torch.randn(*shape, device=device, dtype=dtype)

    cases = []
    for m, n, k in ((8192, 8192, 8192), (16384, 4096, 4096), (4096, 16384, 4096), (8192, 1024, 8192)):
        m, n, k = m // scale, n // scale, k // scale
        a, b = tensor(m, k), tensor(k, n)
        cases.append(("matmul", f"mm {m}x{k}x{n}", lambda a=a, b=b: a @ b, 2 * m * n * k,
                      (m * k + k * n + m * n) * a.element_size()))
    batch, heads, seq, dim = 4, 16 // min(scale, 4), 2048 // scale, 128
    q, k_, v = (tensor(batch, heads, seq, dim) for _ in range(3))
    # Causal: the kernel skips the upper half of the score blocks; count what it runs.
    flops = 4 * batch * heads * seq * seq * dim // 2
    cases.append(("attention", f"sdpa causal {batch}x{heads}x{seq}x{dim}",
                  lambda: F.scaled_dot_product_attention(q, k_, v, is_causal=True), flops,
                  4 * q.numel() * q.element_size()))
    rows, width = 8192 // scale, 8192 // max(1, scale // 4)
    x, y = tensor(rows, width), tensor(rows, width)
    size = x.numel() * x.element_size()
    weight, bias = tensor(width), tensor(width)
    cases += [
        ("elementwise", "add", lambda: x + y, x.numel(), 3 * size),
        ("elementwise", "gelu", lambda: F.gelu(x, approximate="tanh"), x.numel(), 2 * size),
        ("norm", "layer_norm", lambda: F.layer_norm(x, (width,), weight, bias), 5 * x.numel(), 2 * size),
        ("softmax", "softmax", lambda: torch.softmax(x, dim=-1), 5 * x.numel(), 2 * size),
        ("reduction", "sum", lambda: x.sum(dim=-1), x.numel(), size),
    ]
    return cases


def calibrate(device: str = "cpu", *, budget_s: float = 0.3,
              progress: Callable[[str], None] | None = None) -> tuple[Efficiencies, dict]:
    """Time every case on `device` ("cpu" or "cuda"); the efficiencies and the raw measurements."""
    if device not in ("cpu", "cuda"):
        raise AutoparError(f"--device {device!r}: expected cpu or cuda")
    spec = local_device_spec(device)
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    scale = 1 if device == "cuda" else 8
    compute, memory, measurements = {}, {}, {}
    with torch.no_grad():
        for family, label, fn, flops, moved in _cases(device, dtype, scale):
            if progress:
                progress(label)
            seconds = median_seconds(fn, device, budget_s)
            flop_rate = flops / seconds / spec.sustained_flops(str(dtype).removeprefix("torch."))
            byte_rate = moved / seconds / spec.hbm_bandwidth
            measurements[label] = {"family": family, "seconds": seconds, "flops": flops,
                                   "bytes": moved, "flops_fraction": flop_rate,
                                   "bandwidth_fraction": byte_rate}
            if family in ("matmul", "attention"):
                compute[family] = max(compute.get(family, 0.0), flop_rate)
            else:
                memory[family] = max(memory.get(family, 0.0), byte_rate)
    latency = tiny_op_latency(device, dtype, budget_s)
    measurements["tiny op, forward and backward"] = {
        "family": "latency", "seconds": latency, "flops": 1, "bytes": 0, "flops_fraction": 0.0,
        "bandwidth_fraction": 0.0}
    clip = lambda table: {f: min(1.0, max(v, 1e-6)) for f, v in table.items()}
    efficiencies = Efficiencies(compute=clip(compute), memory=clip(memory), device=spec.name,
                                kernel_latency_s=latency)
    return efficiencies, measurements


def calibrate_rounds(device: str = "cpu", *, budget_s: float = 0.3, rounds: int = 3,
                     progress: Callable[[str], None] | None = None) -> tuple[Efficiencies, dict, dict]:
    """`calibrate` `rounds` times, one round of every figure after another: each figure's median
    round, the measurements of that round, and every figure's value in each round."""
    if rounds < 1:
        raise AutoparError(f"--rounds {rounds}: give 1 or more rounds of measurements")
    measured = [calibrate(device, budget_s=budget_s, progress=progress) for _ in range(rounds)]
    return (median_efficiencies([eff for eff, _ in measured]),
            median_measurements([records for _, records in measured]),
            figure_rounds([{**eff.to_dict(), "measurements": records} for eff, records in measured]))


def calibrate_mesh(mesh: Mesh, *, budget_s: float = 0.3, sizes: tuple[int, ...] = COLLECTIVE_BYTES,
                   rounds: int = 3) -> tuple[Efficiencies, dict, dict, dict]:
    """Efficiencies and measurements as `calibrate` gives them, taken on rank 0 while every rank
    of the gloo mesh computes, the collectives section of a calibration file, and every figure's
    value in each round.

    Every figure is measured `rounds` times, one round of all of them after another, and the
    median round of each is kept (for a collective, the fit of each size's median time): on a
    shared host one measurement of the same figure moved 3x between two runs minutes apart, and
    a busy moment then falls on one round of several figures rather than on every round of one."""
    from autopar.runtime.launch import launch

    if mesh.device.name != "cpu":
        raise AutoparError(f"--mesh {mesh}: collectives are measured over gloo on this machine's "
                           f"CPUs; give a CPU mesh such as 4:cpu")
    ranks = mesh.world_size
    if ranks < 2:
        raise AutoparError(f"--mesh {mesh} has one device: no collective to measure; give 2 or more")
    if rounds < 1:
        raise AutoparError(f"--rounds {rounds}: give 1 or more rounds of measurements")
    results = launch(_rank_calibration, ranks, budget_s, sizes, rounds, timeout=300.0 * rounds,
                     pg_timeout=120.0)
    # each round: rank 0's efficiencies and measurements, the slowest rank's collective timings
    per_round = [(eff, measured, _slowest_rank([rank_rounds[i][2] for rank_rounds in results]))
                 for i, (eff, measured, _) in enumerate(results[0])]
    median_timings = {size: {kind: [_median([t[size][kind][p] for _, _, t in per_round])
                                    for p in range(len(sizes))]
                             for kind in per_round[0][2][size]}
                      for size in per_round[0][2]}
    collectives = {"device": mesh.device.name, "ranks": ranks, "backend": "gloo", "rounds": rounds,
                   **_fitted(median_timings, sizes, ranks)}
    return (median_efficiencies([eff for eff, _, _ in per_round]),
            median_measurements([measured for _, measured, _ in per_round]), collectives,
            figure_rounds([{**eff.to_dict(), "measurements": measured,
                            "collectives": {"ranks": ranks, **_fitted(timings, sizes, ranks)}}
                           for eff, measured, timings in per_round]))


def _fitted(timings: dict, sizes: tuple[int, ...], ranks: int) -> dict:
    """The "fits" (whole mesh) and "group_fits" (smaller groups) of {group size: {kind: seconds
    per size}}, each with the points it was fitted to."""
    by_size = {}
    for size in sorted(timings):
        by_size[size] = {}
        for kind, seconds in timings[size].items():
            points = list(zip(sizes, seconds))
            latency, bandwidth = fit_link(kind, size, points)
            by_size[size][kind] = {"latency_s": latency, "bandwidth": bandwidth, "points": points}
    return {"fits": by_size.pop(ranks), "group_fits": {str(size): fits for size, fits in by_size.items()}}


def figure_rounds(rounds: list[dict]) -> dict[str, list[float]]:
    """{figure: its value in each round} of calibration files made of one round each, for the
    figures a round measured (`cost.calibration.figures` names them): the families it timed,
    the cost of an op, and on a mesh the runtime's host costs and the collectives' fits."""
    named = [figures(data) for data in rounds]
    timed = {(table, record["family"]) for table, record in (
        ("compute" if record["family"] in ("matmul", "attention") else "memory", record)
        for record in rounds[0]["measurements"].values()) if record["family"] != "latency"}
    measured = [f"{table}.{family}" for table, family in sorted(timed)] + ["kernel_latency_s"]
    if "collectives" in rounds[0]:
        measured += [*MESH_FIGURES, *(name for name in named[0] if " ranks: " in name)]
    return {name: [round_figures[name] for round_figures in named] for name in measured}


def fit_link(kind: str, ranks: int, points: list[tuple[float, float]]) -> tuple[float, float]:
    """(alpha seconds per step, bandwidth bytes/s) of `kind` from (nbytes, seconds) points: the
    latency from the smallest size, the bandwidth from the time the largest adds over it. Two
    points rather than a least-squares line: on a shared machine one slow middle point would tilt
    a line below zero; when the largest is not slower (noise) its whole time counts as transfer."""
    points = sorted(points)
    if len(points) < 2 or points[0][0] == points[-1][0]:
        raise AutoparError(f"fitting {kind} needs timings at two or more sizes, got {points}")
    (small, t_small), (large, t_large) = points[0], points[-1]
    steps, factor = ring_terms(kind, ranks)
    slope = (t_large - t_small) / (large - small) if t_large > t_small else t_large / large
    return max(t_small - slope * small, 0.0) / steps, factor / slope


def _slowest_rank(timings: list[dict]) -> dict:
    """One round's {group size: {kind: seconds per size}} of every rank: the slowest rank's, a
    collective being done when its last rank is."""
    return {size: {kind: [max(points) for points in zip(*(t[size][kind] for t in timings))]
                   for kind in timings[0][size]}
            for size in timings[0]}


def median_efficiencies(rounds: list[Efficiencies]) -> Efficiencies:
    """Each figure's median over `rounds` (per family for the compute and memory tables)."""
    tables = [r.to_dict() for r in rounds]
    merged = {}
    for name, value in tables[0].items():
        if isinstance(value, dict):
            merged[name] = {key: _median([table[name][key] for table in tables]) for key in value}
        elif isinstance(value, float):
            merged[name] = _median([getattr(r, name) for r in rounds])
        else:
            merged[name] = value
    return Efficiencies(**merged)


def median_measurements(rounds: list[dict]) -> dict:
    """Each label's record from its median round, with every round's seconds beside it."""
    merged = {}
    for label in rounds[0]:
        records = sorted((r[label] for r in rounds), key=lambda record: record["seconds"])
        merged[label] = {**records[(len(records) - 1) // 2],
                         "rounds_seconds": [r[label]["seconds"] for r in rounds]}
    return merged


def _median(values: list[float]) -> float:
    """The lower median: a value that was measured (for two rounds, the smaller)."""
    return sorted(values)[(len(values) - 1) // 2]


# What a round on a mesh measures beyond the local device's efficiencies (`_one_round`)
MESH_FIGURES = ("distributed_op_latency_s", "pipeline_action_latency_s",
                "data_parallel_group_latency_s", "data_parallel_tensor_latency_s",
                "data_parallel_reduce_group_s", "data_parallel_reduce_byte_s", "sharded_reduce_group_s",
                "collective_wait_s", "collective_wait_span_s", "split_backward_op_latency_s",
                "checkpoint_region_latency_s", "checkpoint_op_latency_s")


def _rank_calibration(budget_s: float, sizes: tuple[int, ...], rounds: int) -> list:
    return [_one_round(budget_s, sizes) for _ in range(rounds)]


def _one_round(budget_s: float, sizes: tuple[int, ...]):
    efficiencies, measurements = calibrate("cpu", budget_s=budget_s)
    efficiencies.distributed_op_latency_s = distributed_op_latency(budget_s)
    efficiencies.pipeline_action_latency_s = pipeline_action_latency(budget_s)
    (efficiencies.data_parallel_group_latency_s,
     efficiencies.data_parallel_tensor_latency_s) = data_parallel_group_latency(budget_s)
    (efficiencies.data_parallel_reduce_group_s, efficiencies.data_parallel_reduce_byte_s,
     efficiencies.sharded_reduce_group_s) = data_parallel_reduce_latency(budget_s)
    efficiencies.collective_wait_s, efficiencies.collective_wait_span_s = _collective_wait(budget_s)
    efficiencies.split_backward_op_latency_s = split_backward_latency(budget_s)
    (efficiencies.checkpoint_region_latency_s,
     efficiencies.checkpoint_op_latency_s) = checkpoint_latency(budget_s)
    efficiencies.host_cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") \
        else os.cpu_count() or 0
    for label, seconds in (("op on a DTensor, placed, extra", efficiencies.distributed_op_latency_s),
                           ("pipeline schedule action, extra", efficiencies.pipeline_action_latency_s),
                           ("FSDP2 group hooks per micro-batch", efficiencies.data_parallel_group_latency_s),
                           ("FSDP2 hooks per parameter tensor", efficiencies.data_parallel_tensor_latency_s),
                           ("FSDP2 reduction per group, beyond its collective",
                            efficiencies.data_parallel_reduce_group_s),
                           ("FSDP2 reduction per MiB of a buffer, beyond its collective",
                            efficiencies.data_parallel_reduce_byte_s * 2**20),
                           ("FSDP2 ZeRO reduction per group, beyond its collective",
                            efficiencies.sharded_reduce_group_s),
                           ("collective after a layer of compute, wait", efficiencies.collective_wait_s),
                           ("zero-bubble split backward per op, extra",
                            efficiencies.split_backward_op_latency_s),
                           ("recomputed region, extra", efficiencies.checkpoint_region_latency_s),
                           ("recomputed region per op, extra", efficiencies.checkpoint_op_latency_s)):
        measurements[label] = {"family": "latency", "seconds": seconds, "flops": 1, "bytes": 0,
                               "flops_fraction": 0.0, "bandwidth_fraction": 0.0}
    return efficiencies, measurements, _group_timings(budget_s, sizes)


def _group_timings(budget_s: float, sizes: tuple[int, ...]) -> dict:
    """{group size: {kind: seconds per size}}: the whole mesh, then groups of each smaller size
    that divides it, consecutive ranks, every group timing at once. Point-to-point transfers are
    timed on the whole mesh only (each is one pair whatever the group)."""
    import torch.distributed as dist

    ranks, rank = dist.get_world_size(), dist.get_rank()
    timings = {ranks: {kind: [_collective_seconds(kind, n, budget_s) for n in sizes] for kind in KINDS}}
    for size in (size for size in range(2, ranks) if ranks % size == 0):
        groups = [dist.new_group(list(range(first, first + size))) for first in range(0, ranks, size)]
        group = groups[rank // size]
        timings[size] = {kind: [_collective_seconds(kind, n, budget_s, group) for n in sizes]
                         for kind in KINDS if kind != "send_recv"}
    return timings


def _collective_seconds(kind: str, nbytes: int, budget_s: float, group=None) -> float:
    """Median seconds one `kind` collective on a tensor of `nbytes` (full size, fp32) over
    `group` (the default process group when None) adds to a step, every rank running the same
    number of repeats.

    Timed as a training step issues it: after each rank's own compute (`_layer_of_compute`),
    less that compute's time with every rank computing at once. Where the host runs the compute,
    ranks reach a collective at different moments (they share the cores), and a blocking
    collective waits for the last; timed from a barrier, it would not."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    ranks, rank = dist.get_world_size(group), dist.get_rank()
    full = torch.zeros(max(ranks, nbytes // 4))
    part = torch.zeros(full.numel() // ranks)
    run = {"all_reduce": lambda: dist.all_reduce(full, group=group),
           "all_gather": lambda: dist.all_gather_single(full[:part.numel() * ranks], part, group=group),
           "reduce_scatter": lambda: dist.reduce_scatter_single(part, full[:part.numel() * ranks],
                                                                group=group),
           # as DTensor's shard-to-shard redistribution runs it: through the functional
           # collective, which a CPU process group answers with an all-gather and a chunk
           "all_to_all": lambda: funcol.wait_tensor(
               funcol.all_to_all_single(part, None, None, group or dist.group.WORLD)),
           "send_recv": lambda: exchange(full, rank)}[kind]
    compute = _layer_of_compute()
    followed = everywhere_seconds(lambda: (compute(), run()), budget_s)
    return max(followed - everywhere_seconds(compute, budget_s), 1e-6)


def _layer_of_compute(matmuls: int = 8):
    """A fixed piece of work between two collectives of a step: `matmuls` small matmuls (8: about
    a millisecond on a CPU core, what a tensor-parallel op computes between its collectives)."""
    a, b = torch.randn(160, 160), torch.randn(160, 160)

    def compute() -> None:
        for _ in range(matmuls):
            a @ b
    return compute


def _collective_wait(budget_s: float, rounds: int = 5) -> tuple[float, float]:
    """(seconds, span): what a tiny all-reduce after a layer's span of compute (48 matmuls,
    several milliseconds) costs beyond the same all-reduce after the short span the link fits
    were timed after (`Efficiencies.collective_wait_s`), and that span's seconds. The median
    over `rounds` of the two timed in turn: one such difference on a shared host swings by
    several times."""
    import torch.distributed as dist

    tiny = torch.zeros(4)
    short, long = _layer_of_compute(8), _layer_of_compute(48)

    def extra(compute) -> float:
        return (everywhere_seconds(lambda: (compute(), dist.all_reduce(tiny)), budget_s)
                - everywhere_seconds(compute, budget_s))
    waits = sorted(extra(long) - extra(short) for _ in range(rounds))
    span = everywhere_seconds(long, budget_s)
    return agreed(max(waits[rounds // 2], 0.0), max), agreed(span, max)
