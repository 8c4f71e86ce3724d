"""A calibration file applied to the cost model: measured efficiencies replace the published
defaults, and measured collectives replace the mesh's links.

The file (`autopar calibrate --out eff.json`) holds the fields of `Efficiencies` and, when
collectives were measured (`--mesh 4:cpu`), a "collectives" section:

    {"device": "cpu", "ranks": 4, "backend": "gloo",
     "fits": {"all_reduce": {"latency_s": ..., "bandwidth": ..., "points": [[bytes, s], ...]}, ...},
     "group_fits": {"2": {"all_reduce": {...}, ...}}}

A fit is the alpha-beta model of cost/collectives.py solved for one link from the timings of one
collective at several sizes on `ranks` processes, alpha and bandwidth through the ring formula of
that collective (`ring_terms`; autopar.calibrate.measure fits them). "fits" are measured on the whole mesh, "group_fits" on groups of
each smaller size that divides it, all groups at once (as tensor- and data-parallel groups run):
where ranks share a host's cores, a pair's ring step waits on its peer longer than the whole
mesh's step does, so one fit does not stand for every group size. A collective is priced with
the fit of the nearest measured group size (`Link.alpha_beta`).
"""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

from autopar.cost.compute import Efficiencies
from autopar.cost.mesh import Link, Mesh, MeshAxis
from autopar.errors import AutoparError

KINDS = ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def ring_terms(kind: str, ranks: int) -> tuple[float, float]:
    """(steps, byte factor) of collective `kind` on a ring of `ranks`: its time is
    steps * alpha + byte factor * nbytes / bandwidth, nbytes the full tensor's size."""
    n = ranks
    return {"all_reduce": (2 * (n - 1), 2 * (n - 1) / n),
            "all_gather": (n - 1, (n - 1) / n),
            "reduce_scatter": (n - 1, (n - 1) / n),
            "all_to_all": (n - 1, (n - 1) / n / n),
            "send_recv": (1, 1.0)}[kind]


def load(path: str | Path) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise AutoparError(f"cannot read calibration file {path}: {err}; write one with "
                           f"`autopar calibrate --mesh 4:cpu --out {path}`") from err


def figures(data: dict) -> dict[str, float]:
    """Every figure of a calibration file by name: each efficiency ("compute.matmul",
    "memory.norm"), latency ("kernel_latency_s", ...) and collective fit's alpha and bandwidth
    ("all_reduce on 4 ranks: latency_s"). Those a calibration measured are the names of its
    "rounds" section; the others are the published defaults it carries."""
    found = {}
    for name, value in Efficiencies.from_dict(data).to_dict().items():
        if isinstance(value, dict):
            found.update({f"{name}.{family}": float(v) for family, v in value.items()})
        elif isinstance(value, float):
            found[name] = value
    collectives = data.get("collectives") or {}
    by_size = {collectives.get("ranks", 0): collectives.get("fits", {}),
               **{int(size): fits for size, fits in collectives.get("group_fits", {}).items()}}
    for size, fits in sorted(by_size.items(), reverse=True):
        for kind, fit in fits.items():
            for key in ("latency_s", "bandwidth"):
                found[f"{kind} on {size} ranks: {key}"] = float(fit[key])
    return found


def spread(values: list[float]) -> float:
    """The largest over the smallest of a figure's measurements: 1.0 when they agree; inf when
    one is 0 and another is not (a probe's difference of two timings that noise made 0)."""
    low, high = min(values), max(values)
    if high == low:
        return 1.0
    return high / low if low > 0 else float("inf")


def calibrated(mesh: Mesh, efficiencies: Efficiencies | None, calibration: str | Path | None,
               attention_kernel: str = "flash") -> tuple[Mesh, Efficiencies]:
    """The mesh and efficiencies to price with: the calibration file's where one is given
    (collectives only when it measured them on the mesh's device), else the published defaults
    for the runtime's `attention_kernel`."""
    if calibration is None:
        return mesh, efficiencies or Efficiencies.for_device(mesh.device.name, attention_kernel)
    if efficiencies is not None:
        raise AutoparError("give efficiencies or a calibration file, not both: the file's "
                           "efficiencies would replace the ones passed")
    data = load(calibration)
    measured = Efficiencies.from_dict(data)
    collectives = data.get("collectives")
    if not collectives:
        return mesh, measured
    if collectives.get("device") != mesh.device.name:
        raise AutoparError(f"{calibration} measured collectives on {collectives.get('device')!r} "
                           f"devices, but the mesh has {mesh.device.name}; calibrate on this mesh "
                           f"or pass a file without collectives")
    return with_measured_links(mesh, collectives["fits"], collectives.get("ranks", 0),
                               collectives.get("group_fits", {})), measured


def with_measured_links(mesh: Mesh, fits: dict, ranks: int = 0, group_fits: dict | None = None) -> Mesh:
    """`mesh` with every link replaced by one carrying the measured alpha and bandwidth per
    collective kind and group size: `fits` measured on `ranks` (0: any size), `group_fits` by
    group size (the whole mesh's all-reduce as the link's plain figures)."""
    by_size = {ranks: fits, **{int(size): sized for size, sized in (group_fits or {}).items()}}
    unknown = {kind for sized in by_size.values() for kind in sized} - set(KINDS)
    if unknown:
        raise AutoparError(f"calibration has unknown collectives {sorted(unknown)}; known: {KINDS}")
    entries = tuple((kind, fit["latency_s"], fit["bandwidth"], size)
                    for size, sized in sorted(by_size.items()) for kind, fit in sized.items())
    base = fits.get("all_reduce") or next(iter(fits.values()))

    def measured(link: Link) -> Link:
        return Link(f"{link.name}-measured", base["bandwidth"], base["latency_s"], 1.0, entries)

    device = replace(mesh.device, intra_node=measured(mesh.device.intra_node),
                     inter_node=measured(mesh.device.inter_node))
    axes = tuple(MeshAxis(a.name, a.size, measured(a.link)) for a in mesh.axes)
    return Mesh(device, axes)
