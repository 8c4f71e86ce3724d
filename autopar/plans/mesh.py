"""The cluster a plan records (`Plan.mesh`, as `autopar.cost.mesh.Mesh.to_dict` writes it): its
JSON structure checked value by value, so that a plan file is checked without the cost model, and
the cost model builds its `Mesh` from what this module accepted.

    {"device": {"name", "peak_flops": {dtype: FLOP/s, "float32" required}, "hbm_bandwidth",
                "memory_bytes", "intra_node": LINK, "inter_node": LINK, "multiprocessors",
                "training_dtype", "overlaps_communication", "power_share",
                "host": {"link": LINK, "bandwidth", "flops", "gpus", "memory_bytes"}},
                                                            host: for offloaded states
     "axes": [{"name", "size", "link": LINK}, ...]}         outer to inner
    LINK = {"name", "bandwidth", "latency", "efficiency", "measured": [[kind, latency, bandwidth,
            group size], ...]}

Every refusal is a MeshError naming the key ("axes[1].size is -8; ...").
"""

from __future__ import annotations

import math

from autopar.errors import MeshError
from autopar.plans.vocabulary import Precision

# Larger than any cluster built (about 10^5 GPUs); past it a spec is a typo, and planning would
# enumerate factorizations of an astronomically large world.
MAX_DEVICES = 2**20
DEVICE_KEYS = ("name", "peak_flops", "hbm_bandwidth", "memory_bytes", "intra_node", "inter_node",
               "multiprocessors", "training_dtype", "overlaps_communication", "power_share", "host")
OPTIONAL_DEVICE_KEYS = ("multiprocessors", "training_dtype", "overlaps_communication", "power_share",
                        "host")
HOST_KEYS = ("link", "bandwidth", "flops", "gpus", "memory_bytes")
REQUIRED_HOST_KEYS = ("link", "bandwidth", "flops", "gpus")     # memory_bytes: not checked without
LINK_KEYS = ("name", "bandwidth", "latency", "efficiency", "measured")
AXIS_KEYS = ("name", "size", "link")


def check_mesh_dict(data) -> int:
    """The world size of the mesh `data` describes; MeshError naming the first bad value."""
    if not isinstance(data, dict):
        raise MeshError(f"a mesh description is an object {{'device': ..., 'axes': [...]}}, not {data!r}")
    _keys(data, ("device", "axes"), ("device", "axes"), "mesh")
    check_device_dict(data["device"])
    axes = data["axes"]
    if not isinstance(axes, list) or not axes:
        raise MeshError("'axes' must be a non-empty list of {name, size, link}")
    for i, axis in enumerate(axes):
        where = f"axes[{i}]"
        if not isinstance(axis, dict):
            raise MeshError(f"{where} is {axis!r}; expected an object {{name, size, link}}")
        _keys(axis, AXIS_KEYS, AXIS_KEYS, where)
        value(axis, "name", str, where)
        positive(axis, "size", where, integer=True)
        check_link_dict(axis["link"], f"{where}.link")
    names = [axis["name"] for axis in axes]
    if len(set(names)) != len(names):
        raise MeshError(f"mesh axes must have distinct names, got {names}")
    world = math.prod(axis["size"] for axis in axes)
    if world > MAX_DEVICES:
        raise MeshError(f"a mesh of {world} devices is more than autopar plans for ({MAX_DEVICES})")
    return world


def check_device_dict(device) -> None:
    if not isinstance(device, dict):
        raise MeshError(f"device is {device!r}; expected an object {{name, peak_flops, ...}}")
    required = [key for key in DEVICE_KEYS if key not in OPTIONAL_DEVICE_KEYS]
    _keys(device, DEVICE_KEYS, required, "device")
    value(device, "name", str, "device")
    flops = value(device, "peak_flops", dict, "device")
    if "float32" not in flops:
        raise MeshError("device.peak_flops needs a 'float32' entry (the fallback for other dtypes)")
    for dtype in flops:
        positive(flops, dtype, "device.peak_flops")
    positive(device, "hbm_bandwidth", "device")
    positive(device, "memory_bytes", "device")
    check_link_dict(device["intra_node"], "device.intra_node")
    check_link_dict(device["inter_node"], "device.inter_node")
    if "multiprocessors" in device and value(device, "multiprocessors", int, "device") < 0:
        raise MeshError(f"device.multiprocessors is {device['multiprocessors']}; expected 0 or more")
    dtypes = [precision.dtype for precision in Precision]
    if "training_dtype" in device and value(device, "training_dtype", str, "device") not in dtypes:
        raise MeshError(f"device.training_dtype is {device['training_dtype']!r}; expected one of "
                        f"{', '.join(dtypes)}")
    if not isinstance(device.get("overlaps_communication", True), bool):
        raise MeshError(f"device.overlaps_communication is {device['overlaps_communication']!r}; "
                        f"expected true or false")
    if "power_share" in device:
        share = value(device, "power_share", (int, float), "device")
        if not 0 < share <= 1:
            raise MeshError(f"device.power_share is {share}; expected the share of the rated board "
                            f"power the device is held to, in (0, 1]")
    if device.get("host") is not None:
        _check_host(device["host"])


def _check_host(host) -> None:
    """A device's host, whose memory and cores offloaded states use."""
    if not isinstance(host, dict):
        raise MeshError(f"device.host is {host!r}; expected an object {{link, bandwidth, flops, gpus}}")
    _keys(host, HOST_KEYS, REQUIRED_HOST_KEYS, "device.host")
    check_link_dict(host["link"], "device.host.link")
    positive(host, "bandwidth", "device.host")
    positive(host, "flops", "device.host")
    positive(host, "gpus", "device.host", integer=True)
    if "memory_bytes" in host and value(host, "memory_bytes", (int, float), "device.host") < 0:
        raise MeshError(f"device.host.memory_bytes is {host['memory_bytes']}; expected 0 (not "
                        f"stated) or more")


def check_link_dict(link, where: str) -> None:
    if not isinstance(link, dict):
        raise MeshError(f"{where} is {link!r}; expected an object {{name, bandwidth, latency}}")
    _keys(link, LINK_KEYS, ("name", "bandwidth", "latency"), where)
    value(link, "name", str, where)
    positive(link, "bandwidth", where)
    latency = value(link, "latency", (int, float), where)
    if not 0 <= latency < math.inf:
        raise MeshError(f"{where}.latency is {latency!r}; it must be a finite number of 0 or more")
    efficiency = value(link, "efficiency", (int, float), where) if "efficiency" in link else 1.0
    if not 0 < efficiency <= 1:
        raise MeshError(f"{where}.efficiency is {efficiency!r}; it must be above 0 and at most 1")
    measured = link.get("measured", [])
    if not isinstance(measured, list):
        raise MeshError(f"{where}.measured is {measured!r}; expected a list of fits")
    for k, fit in enumerate(measured):
        _check_fit(fit, f"{where}.measured[{k}]")


def _check_fit(fit, where: str) -> None:
    """[collective kind, latency, bus bandwidth, group size] as `autopar calibrate --mesh` fits
    them (files before group sizes have three entries)."""
    shape_ok = isinstance(fit, list) and len(fit) in (3, 4) and isinstance(fit[0], str)
    numbers = fit[1:] if shape_ok else []
    if not shape_ok or not all(_finite(x) and x >= 0 for x in numbers) or not numbers[1] > 0 \
            or (len(fit) == 4 and not isinstance(fit[3], int)):
        raise MeshError(f"{where} is {fit!r}; expected [kind, latency >= 0, bandwidth > 0, group size]")


def value(record: dict, key: str, kind, where: str):
    """`record[key]`, which must be of `kind` (never a bool where a number belongs)."""
    if key not in record:
        raise MeshError(f"{where} lacks {key!r}")
    found = record[key]
    if not isinstance(found, kind) or isinstance(found, bool):
        expected = "a number" if isinstance(kind, tuple) else f"a {kind.__name__}"
        raise MeshError(f"{where}.{key} is {found!r}; expected {expected}")
    return found


def positive(record: dict, key: str, where: str, integer: bool = False) -> float:
    """A finite number > 0 (an integer if asked): bandwidths, sizes and FLOP/s."""
    found = value(record, key, int if integer else (int, float), where)
    if not 0 < found < math.inf:
        raise MeshError(f"{where}.{key} is {found!r}; it must be a finite number above 0")
    return found


def _finite(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _keys(record: dict, known, required, where: str) -> None:
    unknown = sorted(str(key) for key in set(record) - set(known))
    if unknown:
        raise MeshError(f"{where} has unknown keys {unknown}")
    for key in required:
        if key not in record:
            raise MeshError(f"{where} lacks {key!r}")
