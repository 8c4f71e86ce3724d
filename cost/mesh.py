"""Physical device meshes: devices, links and the axes of a cluster.

A mesh spec reads `NODESxGPUS:DEVICE` ("128x8:a100-80g", "2x2:cpu") or `GPUS:DEVICE` for one node
("8:h100-80g", "4:cpu"). Axes go outer to inner: "node" (across nodes, InfiniBand) then "gpu"
(inside a node, NVLink). A one-node spec has only the "gpu" axis.
"""

from __future__ import annotations

import json
import math
import re
import tomllib
from dataclasses import asdict, dataclass
from pathlib import Path

from autopar.errors import MeshError
from autopar.plans.mesh import MAX_DEVICES, check_mesh_dict


@dataclass(frozen=True, slots=True)
class Link:
    name: str
    bandwidth: float        # bytes/s each way, per device (what one GPU can push into the fabric)
    latency: float          # seconds per message (alpha)
    efficiency: float = 1.0  # fraction of `bandwidth` that NCCL's collectives reach (bus bandwidth)
    # Measured (kind, latency, bus bandwidth, group size) per collective kind ("all_reduce",
    # "all_gather", ...) and size of the group it ran on, as `autopar calibrate --mesh` fits them;
    # kinds not listed use `latency` and `bandwidth`.
    measured: tuple = ()

    def __post_init__(self):
        if not (0 < self.bandwidth < math.inf and 0 <= self.latency < math.inf
                and 0 < self.efficiency <= 1):
            raise MeshError(f"link {self.name!r} needs finite bandwidth > 0, latency >= 0 and "
                            f"0 < efficiency <= 1, got {self.bandwidth}, {self.latency}, "
                            f"{self.efficiency}")

    @property
    def effective_bandwidth(self) -> float:
        return self.bandwidth * self.efficiency

    def alpha_beta(self, kind: str, ranks: int = 0) -> tuple[float, float]:
        """(latency per step, bytes/s) of collective `kind` on a group of `ranks` over this link:
        the fit measured on the group size nearest `ranks` (the larger on a tie), since where
        ranks share a host's cores a pair waits on its peer differently from the whole mesh."""
        fits = [(size, latency, bandwidth) for name, latency, bandwidth, size in self.measured
                if name == kind]
        if not fits:
            return self.latency, self.effective_bandwidth
        _, latency, bandwidth = min(fits, key=lambda fit: (abs(fit[0] - ranks), -fit[0]))
        return latency, bandwidth


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    name: str
    peak_flops: dict        # dtype name -> dense FLOP/s ("bfloat16", "float16", "float32")
    hbm_bandwidth: float    # bytes/s
    memory_bytes: int
    intra_node: Link        # between devices of one node
    inter_node: Link        # between nodes, per device
    multiprocessors: int = 0  # streaming multiprocessors (GEMM tiles run in waves of them); 0: a CPU
    training_dtype: str = "bfloat16"   # what activations, weights and gradients are held in
    overlaps_communication: bool = True  # collectives run beside compute (a GPU's own engines)

    def flops(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"])


GB = 1e9
GIB = 1 << 30

# Vendors' public data sheets. NVLink figures are per direction (A100: 600 GB/s bidirectional);
# InfiniBand is per GPU: DGX A100 has 8x HDR 200 Gb/s, DGX H100/H200 8x NDR 400 Gb/s, one per GPU.
# Efficiencies are the bus bandwidth that nccl-tests' all_reduce_perf reports for large messages
# divided by the line rate: about 230 GB/s of NVLink3's 300 GB/s on a DGX A100 (NVSwitch, 8 GPUs),
# about 360 GB/s of NVLink4's 450 GB/s on a DGX H100, and about 90% of the InfiniBand line rate
# across nodes (protocol headers and the NIC's PCIe link take the rest). Latencies: a few
# microseconds per NCCL step inside a node, about twice that across the network. Streaming
# multiprocessors: 108 on an A100, 132 on an H100/H200 SXM. GPUs train in bf16 (mixed precision);
# autopar's runtime trains in fp32 on CPUs, where gloo's collectives take the cores that compute.
NVLINK3 = Link("nvlink3", 300 * GB, 5e-6, 0.77)
NVLINK4 = Link("nvlink4", 450 * GB, 5e-6, 0.80)
IB_HDR = Link("ib-hdr", 25 * GB, 10e-6, 0.90)
IB_NDR = Link("ib-ndr", 50 * GB, 10e-6, 0.90)
LOOPBACK = Link("loopback", 2 * GB, 50e-6, 1.0)

DEVICES = {
    "a100-40g": DeviceSpec("a100-40g", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                           1555 * GB, 40 * GIB, NVLINK3, IB_HDR, 108),
    "a100-80g": DeviceSpec("a100-80g", {"bfloat16": 312e12, "float16": 312e12, "float32": 19.5e12},
                           2039 * GB, 80 * GIB, NVLINK3, IB_HDR, 108),
    "h100-80g": DeviceSpec("h100-80g", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
                           3350 * GB, 80 * GIB, NVLINK4, IB_NDR, 132),
    "h200-141g": DeviceSpec("h200-141g", {"bfloat16": 989e12, "float16": 989e12, "float32": 67e12},
                            4800 * GB, 141 * GIB, NVLINK4, IB_NDR, 132),
    "cpu": DeviceSpec("cpu", {"bfloat16": 0.1e12, "float16": 0.1e12, "float32": 0.1e12},
                      20 * GB, 16 * GIB, LOOPBACK, LOOPBACK, training_dtype="float32",
                      overlaps_communication=False),
}


@dataclass(frozen=True, slots=True)
class MeshAxis:
    name: str               # "node" or "gpu"
    size: int
    link: Link


@dataclass(frozen=True, slots=True)
class Mesh:
    device: DeviceSpec
    axes: tuple[MeshAxis, ...]

    @classmethod
    def parse(cls, spec: str) -> Mesh:
        match = re.fullmatch(r"\s*(?:(\d+)x)?(\d+):([\w.-]+)\s*", spec)
        if not match:
            raise MeshError(f"mesh spec {spec!r} is malformed: expected NODESxGPUS:DEVICE "
                            f"such as '128x8:a100-80g', or GPUS:DEVICE such as '4:cpu'")
        nodes, gpus, device_name = match.groups()
        device = device_spec(device_name)
        return cls.build(device, gpus=int(gpus), nodes=int(nodes) if nodes else None)

    @classmethod
    def build(cls, device: DeviceSpec, *, gpus: int, nodes: int | None = None) -> Mesh:
        """A mesh of `nodes` nodes of `gpus` devices; nodes=None means a single node and a 1-D mesh."""
        if gpus < 1 or (nodes is not None and nodes < 1):
            raise MeshError(f"a mesh needs at least one node and one device, got {nodes}x{gpus}")
        if gpus * (nodes or 1) > MAX_DEVICES:
            raise MeshError(f"a mesh of {nodes or 1}x{gpus} = {gpus * (nodes or 1)} devices is more "
                            f"than autopar plans for ({MAX_DEVICES}); check the mesh spec")
        inner = MeshAxis("gpu", gpus, device.intra_node)
        if nodes is None:
            return cls(device, (inner,))
        return cls(device, (MeshAxis("node", nodes, device.inter_node), inner))

    @classmethod
    def load(cls, path: str | Path) -> Mesh:
        """A mesh from a JSON or TOML file with the fields of `to_dict`, for users' own clusters."""
        try:
            text = Path(path).read_text()
            data = tomllib.loads(text) if str(path).endswith(".toml") else json.loads(text)
        except (OSError, UnicodeDecodeError) as err:
            raise MeshError(f"mesh file {path} cannot be read: {err}") from None
        except (tomllib.TOMLDecodeError, json.JSONDecodeError) as err:
            kind = "TOML" if str(path).endswith(".toml") else "JSON"
            raise MeshError(f"mesh file {path} is not valid {kind}: {err}") from None
        try:
            return cls.from_dict(data)
        except MeshError as err:
            raise MeshError(f"mesh file {path}: {err}") from None

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(axis.size for axis in self.axes)

    @property
    def world_size(self) -> int:
        size = 1
        for axis in self.axes:
            size *= axis.size
        return size

    @property
    def gpus_per_node(self) -> int:
        return self.axes[-1].size

    @property
    def nodes(self) -> int:
        return self.world_size // self.gpus_per_node

    def axis(self, name: str) -> MeshAxis:
        for axis in self.axes:
            if axis.name == name:
                return axis
        raise MeshError(f"mesh {self} has no axis {name!r}; its axes are {[a.name for a in self.axes]}")

    def __str__(self) -> str:
        dims = "x".join(str(s) for s in self.shape)
        return f"{dims}:{self.device.name}"

    def to_dict(self) -> dict:
        """Plain JSON data (lists, not tuples), so that a saved and loaded copy compares equal."""
        return _plain({"device": asdict(self.device), "axes": [asdict(a) for a in self.axes]})

    @classmethod
    def from_dict(cls, data: dict) -> Mesh:
        """The inverse of `to_dict`; every value is checked first (autopar.plans.mesh, which
        checks a plan's mesh too), and a bad one is named by its key."""
        check_mesh_dict(data)
        dev = data["device"]
        device = DeviceSpec(
            name=dev["name"], peak_flops=dict(dev["peak_flops"]), hbm_bandwidth=dev["hbm_bandwidth"],
            memory_bytes=int(dev["memory_bytes"]), intra_node=_link(dev["intra_node"]),
            inter_node=_link(dev["inter_node"]), multiprocessors=dev.get("multiprocessors", 0),
            training_dtype=dev.get("training_dtype", "bfloat16"),
            overlaps_communication=dev.get("overlaps_communication", True))
        return cls(device, tuple(MeshAxis(a["name"], a["size"], _link(a["link"])) for a in data["axes"]))


def _link(link: dict) -> Link:
    # measured (collective, latency, bandwidth, group size) rows, as `autopar calibrate --mesh`
    # fits them; a row without a size (files before sizes) stands for any
    return Link(name=link["name"], bandwidth=link["bandwidth"], latency=float(link["latency"]),
                efficiency=float(link.get("efficiency", 1.0)),
                measured=tuple((*entry, 0) if len(entry) == 3 else tuple(entry)
                               for entry in link.get("measured", ())))


def _plain(value):
    if isinstance(value, dict):
        return {key: _plain(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(item) for item in value]
    return value


def device_spec(name: str) -> DeviceSpec:
    try:
        return DEVICES[name.lower()]
    except KeyError:
        raise MeshError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}") from None
