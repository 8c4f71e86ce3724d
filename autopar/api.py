"""The user's entry points: `autopar.plan` (offline planning) and `autopar.compile` (running a plan).

Planning needs no GPU and no process group: the model is captured on fake or meta tensors, priced
on the mesh's device specs, and the result is a `Plan` that can be saved, read and compared.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from autopar.errors import AutoparError

# ---------------------------------------------------------------------------------------------
# Planning: autopar.plan, autopar.plan_from_config
# ---------------------------------------------------------------------------------------------

_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
          "kib": 2**10, "mib": 2**20, "gib": 2**30, "tib": 2**40}


def parse_bytes(text: str | int | float) -> int:
    """A memory size: an int of bytes, or "80GiB", "40GB", "512MiB", "1e9"."""
    if isinstance(text, (int, float)):
        value, unit = float(text), ""
    else:
        match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([A-Za-z]*)\s*", text)
        if not match or match.group(2).lower() not in _UNITS:
            raise AutoparError(f"memory size {text!r} is not understood: write bytes or a number with "
                               f"a unit such as 80GiB, 40GB, 512MiB")
        value, unit = float(match.group(1)), match.group(2).lower()
    if value <= 0:
        raise AutoparError(f"memory size {text!r} must be positive")
    return int(value * _UNITS[unit])


def _as_mesh(mesh):
    from autopar.cost.mesh import Mesh

    return Mesh.parse(mesh) if isinstance(mesh, str) else mesh


def plan(model, mesh, *, example_inputs: tuple, global_batch: int, memory_limit=None,
         time_limit: float = 60.0, example_kwargs: dict | None = None,
         progress: Callable[[str, int, int], None] | None = None):
    """Plan `model` for `mesh` (a Mesh or a spec such as "128x8:a100-80g") and return a Plan.

    `example_inputs` are ONE micro-batch's inputs (meta or fake tensors are fine: nothing runs);
    `global_batch` the sequences per optimizer step over all replicas; `memory_limit` bytes per
    device or a size such as "80GiB" (default: the device's memory); `time_limit` seconds for the
    search. `progress(phase, done, total)` is called as the search goes."""
    from autopar.capture import capture

    graph = capture(model, example_inputs=example_inputs, example_kwargs=example_kwargs)
    return plan_graph(graph, mesh, global_batch=global_batch, memory_limit=memory_limit,
                      time_limit=time_limit, progress=progress)


def plan_graph(graph, mesh, *, global_batch: int, memory_limit=None, time_limit: float = 60.0,
               progress: Callable[[str, int, int], None] | None = None):
    """`plan` for an already captured Graph."""
    from autopar.solver.pipeline_plan import plan_graph as search

    limit = None if memory_limit is None else parse_bytes(memory_limit)
    return search(graph, _as_mesh(mesh), global_batch=global_batch, memory_limit=limit,
                  time_limit=time_limit, progress=progress)


def plan_from_config(graph, mesh, config, *, memory_limit=None, time_limit: float = 60.0):
    """A forced Megatron-style `Config` as a Plan: uniform stages, the estimator's predictions, and
    per-op placements from the ILP with the config's roles (data axis, tensor axis)."""
    from autopar.solver.pipeline_plan import plan_config

    limit = None if memory_limit is None else parse_bytes(memory_limit)
    return plan_config(graph, _as_mesh(mesh), config, memory_limit=limit, time_limit=time_limit)
