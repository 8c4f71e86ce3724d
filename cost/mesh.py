"""Physical device meshes: devices, links and the axes of a cluster.

A mesh spec reads `NODESxGPUS:DEVICE` ("128x8:a100-80g", "2x2:cpu") or `GPUS:DEVICE` for one node
("8:h100-80g", "4:cpu"). Axes go outer to inner: "node" (across nodes, InfiniBand) then "gpu"
(inside a node, NVLink). A one-node spec has only the "gpu" axis.
"""

from __future__ import annotations

import json
import math
import os
import re
import tomllib
from dataclasses import asdict, dataclass, replace
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

    def measures(self, kind: str) -> bool:
        """Whether collective `kind` was measured on this link (`measured`)."""
        return any(entry[0] == kind for entry in self.measured)

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
class HostSpec:
    """The host of a device, for offloaded model states: the link to it (PCIe, or Grace's
    NVLink-C2C), and what the host's memory streams and its cores compute for an optimizer step,
    and how much memory it has for offloaded states, shared by the `gpus` devices it serves."""
    link: Link
    bandwidth: float            # bytes/s a CPU Adam step streams through the host's DRAM
    flops: float                # the host's FLOP/s for it
    gpus: int
    memory_bytes: float = 0.0   # the host's DRAM; 0: not stated, not checked


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
    # The host, for offloaded model states (cost/offload.py); None: the known device's (HOSTS)
    host: HostSpec | None = None
    # The board power the device is held to, as a share of the power of the part its compute
    # efficiencies were measured on (cost/compute.py). Dense tensor work is power-bound: the
    # 700 W H100 SXM already sustains its GEMMs well under boost clock, and a cap lowers the
    # clock further, the voltage being at its floor, so tensor throughput scales with the power
    # (first order; HBM bandwidth does not). 1: no cap beyond the part's own.
    power_share: float = 1.0

    def flops(self, dtype: str) -> float:
        """The data sheet's dense FLOP/s (what MFU is stated against)."""
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def sustained_flops(self, dtype: str) -> float:
        """The FLOP/s the device's compute efficiencies are fractions of: the data sheet's under
        the power the device is held to (`power_share`)."""
        return self.flops(dtype) * self.power_share

    @property
    def host_figures(self) -> HostSpec:
        return self.host or HOSTS.get(self.name, DEFAULT_HOST)


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
NVLINK2 = Link("nvlink2", 150 * GB, 5e-6, 0.80)
NVLINK3 = Link("nvlink3", 300 * GB, 5e-6, 0.77)
NVLINK4 = Link("nvlink4", 450 * GB, 5e-6, 0.80)
# The export parts (H800, A800): the same chips with 8 NVLinks of their 18 (H800) or 12 (A800),
# 400 GB/s bidirectional; DeepSeek-V3's report measures about 160 GB/s on an H800's NVLink
NVLINK_EXPORT = Link("nvlink-export", 200 * GB, 5e-6, 0.80)
NVLINK5 = Link("nvlink5", 900 * GB, 5e-6, 0.80)
IB_EDR = Link("ib-edr", 6.25 * GB, 10e-6, 0.90)    # DGX-2: 8 x 100 Gb/s for 16 GPUs
IB_HDR = Link("ib-hdr", 25 * GB, 10e-6, 0.90)
IB_NDR = Link("ib-ndr", 50 * GB, 10e-6, 0.90)
IB_XDR = Link("ib-xdr", 100 * GB, 10e-6, 0.90)      # ConnectX-8, 800 Gb/s per GPU (GB300)
LOOPBACK = Link("loopback", 2 * GB, 50e-6, 1.0)
# Cards without NVLink reach each other over PCIe 4.0 x16 (31.5 GB/s each way), through the host
# where peer-to-peer is off (GeForce cards): NCCL's bus bandwidth is about half the line rate.
PCIE_PEERS = Link("pcie4-peers", 32 * GB, 10e-6, 0.5)
ETHERNET_25G = Link("ethernet", 25e9 / 8, 20e-6, 0.90)   # a 100 GbE NIC shared by four cards
ETHERNET_100G = Link("ethernet", 100e9 / 8, 20e-6, 0.90)
# Host links: PCIe 3.0/4.0/5.0 x16 each way (pinned copies reach about 80% of it), Grace's
# NVLink-C2C (900 GB/s both ways) on GB200/GB300.
PCIE3 = Link("pcie3", 16 * GB, 10e-6, 0.75)
PCIE4 = Link("pcie4", 32 * GB, 10e-6, 0.80)
PCIE5 = Link("pcie5", 64 * GB, 10e-6, 0.80)
NVLINK_C2C = Link("nvlink-c2c", 450 * GB, 5e-6, 0.80)
# A CPU Adam step streams about 40% of the host DRAM's peak (an assumption; `autopar calibrate`
# measures it). DRAM peaks: DGX-2 2 x 6 channels DDR4-2666 (256 GB/s), DGX A100 2 x 8 DDR4-3200
# (410), DGX H100 2 x 8 DDR5-4800 (614), DGX B200 2 x 8 DDR5-5600 (717), Grace LPDDR5X (512 per
# two GPUs), a workstation 2 channels of DDR4-3200 (51) or DDR5-5600 (90), an L40S server 2 x 12
# DDR5-4800 (920). Host FLOP/s: their cores' fp32 vector rate, roughly. Host memory, as the
# systems ship: DGX-2 1.5 TB, DGX A100 1 TB, DGX H100/H200 and B200 2 TB, Grace 480 GB per two
# GPUs, an L40S server 1 TB; a desktop the most its platform takes (four DIMMs: 128 GB of DDR4,
# 256 GB of DDR5), which few have: state a host's own with the mesh spec's `,host=SIZE`.
_HOST_SHARE = 0.4


def _host_figures(peak: float, flops: float, gpus: int, link: Link, memory_gb: float) -> HostSpec:
    return HostSpec(link, _HOST_SHARE * peak * GB, flops, gpus, memory_gb * GB)


def _tensor_flops(bf16: float, fp32: float, fp8: float = 0.0) -> dict:
    table = {"bfloat16": bf16, "float16": bf16, "float32": fp32}
    return {**table, "float8": fp8} if fp8 else table


# Dense (not sparse) tensor-core FLOP/s from the vendors' data sheets and whitepapers:
# V100 SXM3 fp16 125 TFLOP/s, no bf16 (it falls back to fp32); A100 312; H100 SXM 989, FP8 1979
# (the H100 96 GB of Meta's Grand Teton hosts is the SXM part with 96 GB of HBM2e at 2.4 TB/s,
# held to 500 W of its 700: `power_share` 5/7; torchtitan's H100 runs are on it); H200 as
# H100; the export H800 and A800 as the H100 and A100 but for their NVLink (NVLINK_EXPORT); B200 (HGX/DGX, 1000 W) 2250 bf16 and 4500 FP8 (DGX B200: 72 PFLOP/s FP8 sparse for 8);
# GB200 2500 and 5000 (GB200 NVL72: 180 PFLOP/s bf16, 360 FP8 dense for 72); GB300 the same
# tensor rates with 288 GB (GB300 NVL72). GeForce cards run 16-bit matmuls with fp32
# accumulation at half their fp16-accumulate rate: RTX 3090 71 TFLOP/s (GA102 whitepaper,
# appendix A), RTX 4090 165.2 and FP8 330.3 (Ada whitepaper); L40S 362 bf16 and 733 FP8 (L40S
# data sheet, dense). FP8 prices a row's matmuls only where the device has a rate for it (a
# plan in "fp8" is priced at bf16 elsewhere). HBM/GDDR bandwidths likewise: V100 900 GB/s, RTX
# 3090 936, RTX 4090 1008, L40S 864, B200/GB200/GB300 8000. A GB200/GB300 mesh's "node" is its
# NVLink domain (up to 72 GPUs of an NVL72 rack): `4x64:gb200` is four racks of 64.
DEVICES = {device.name: device for device in (
    DeviceSpec("v100-32g", {"float16": 125e12, "float32": 15.7e12}, 900 * GB, 32 * GIB, NVLINK2,
               IB_EDR, 80),
    DeviceSpec("a100-40g", _tensor_flops(312e12, 19.5e12), 1555 * GB, 40 * GIB, NVLINK3, IB_HDR, 108),
    DeviceSpec("a100-80g", _tensor_flops(312e12, 19.5e12), 2039 * GB, 80 * GIB, NVLINK3, IB_HDR, 108),
    DeviceSpec("a800-80g", _tensor_flops(312e12, 19.5e12), 2039 * GB, 80 * GIB, NVLINK_EXPORT,
               IB_HDR, 108),
    DeviceSpec("h100-80g", _tensor_flops(989e12, 67e12, 1979e12), 3350 * GB, 80 * GIB, NVLINK4,
               IB_NDR, 132),
    DeviceSpec("h800-80g", _tensor_flops(989e12, 67e12, 1979e12), 3350 * GB, 80 * GIB,
               NVLINK_EXPORT, IB_NDR, 132),
    DeviceSpec("h100-96g", _tensor_flops(989e12, 67e12, 1979e12), 2400 * GB, 96 * GIB, NVLINK4,
               IB_NDR, 132, power_share=500 / 700),
    DeviceSpec("h200-141g", _tensor_flops(989e12, 67e12, 1979e12), 4800 * GB, 141 * GIB, NVLINK4,
               IB_NDR, 132),
    DeviceSpec("b200-180g", _tensor_flops(2250e12, 75e12, 4500e12), 8000 * GB, 180 * GIB, NVLINK5,
               IB_NDR, 148),
    DeviceSpec("gb200-186g", _tensor_flops(2500e12, 80e12, 5000e12), 8000 * GB, 186 * GIB, NVLINK5,
               IB_NDR, 148),
    DeviceSpec("gb300-288g", _tensor_flops(2500e12, 80e12, 5000e12), 8000 * GB, 288 * GIB, NVLINK5,
               IB_XDR, 160),
    DeviceSpec("rtx3090-24g", _tensor_flops(71e12, 35.6e12), 936 * GB, 24 * GIB, PCIE_PEERS,
               ETHERNET_25G, 82),
    DeviceSpec("rtx4090-24g", _tensor_flops(165.2e12, 82.6e12, 330.3e12), 1008 * GB, 24 * GIB,
               PCIE_PEERS, ETHERNET_25G, 128),
    DeviceSpec("l40s-48g", _tensor_flops(362e12, 91.6e12, 733e12), 864 * GB, 48 * GIB, PCIE_PEERS,
               ETHERNET_100G, 142),
    DeviceSpec("cpu", {"bfloat16": 0.1e12, "float16": 0.1e12, "float32": 0.1e12}, 20 * GB,
               16 * GIB, LOOPBACK, LOOPBACK, training_dtype="float32", overlaps_communication=False),
)}
HOSTS = {
    "v100-32g": _host_figures(256, 2e12, 16, PCIE3, 1500),
    "a100-40g": _host_figures(410, 4e12, 8, PCIE4, 1000),
    "a100-80g": _host_figures(410, 4e12, 8, PCIE4, 1000),
    "a800-80g": _host_figures(410, 4e12, 8, PCIE4, 1000),
    "h100-80g": _host_figures(614, 6e12, 8, PCIE5, 2000),
    "h800-80g": _host_figures(614, 6e12, 8, PCIE5, 2000),
    "h100-96g": _host_figures(614, 6e12, 8, PCIE5, 2000),
    "h200-141g": _host_figures(614, 6e12, 8, PCIE5, 2000),
    "b200-180g": _host_figures(717, 6e12, 8, PCIE5, 2000),
    "gb200-186g": _host_figures(512, 3e12, 2, NVLINK_C2C, 480),
    "gb300-288g": _host_figures(512, 3e12, 2, NVLINK_C2C, 480),
    "rtx3090-24g": _host_figures(51, 1e12, 1, PCIE4, 128),
    "rtx4090-24g": _host_figures(90, 1.5e12, 1, PCIE4, 256),
    "l40s-48g": _host_figures(920, 6e12, 8, PCIE4, 1000),
    # the CPU "device" is its host: offloading moves nothing (the memory is the device's)
    "cpu": HostSpec(LOOPBACK, 20 * GB, 0.1e12, 1, 16 * GIB),
}
DEFAULT_HOST = _host_figures(410, 4e12, 8, PCIE4, 1000)
# Rated board power (W) of each part, the power its efficiencies were measured at (a mesh spec's
# `,power=W` holds a device to less: `DeviceSpec.power_share`): V100 SXM3 350, A100/A800 SXM 400,
# H100/H800/H200 SXM 700 (the H100 96 GB is that part, held to 500 by its hosts), B200 1000,
# GB200 1200 and GB300 1400 per GPU, RTX 3090 350, RTX 4090 450, L40S 350.
RATED_POWER_W = {"v100-32g": 350, "a100-40g": 400, "a100-80g": 400, "a800-80g": 400,
                 "h100-80g": 700, "h800-80g": 700, "h100-96g": 700, "h200-141g": 700,
                 "b200-180g": 1000, "gb200-186g": 1200, "gb300-288g": 1400, "rtx3090-24g": 350,
                 "rtx4090-24g": 450, "l40s-48g": 350}
# The names users know the larger cards by
ALIASES = {"b200": "b200-180g", "gb200": "gb200-186g", "gb300": "gb300-288g"}


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
        """NODESxGPUS:DEVICE or GPUS:DEVICE, then optionally `,host=SIZE` for the memory of each
        host (the device's `HOSTS` entry otherwise) and `,power=W` for the board power each
        device is held to (its rated power otherwise): '1x1:rtx4090-24g,host=128g',
        '64x8:h100-80g,power=500w'."""
        match = re.fullmatch(r"\s*(?:(\d+)x)?(\d+):([\w.-]+)((?:,\w+=[\w.]+)*)\s*", spec)
        if not match:
            raise MeshError(f"mesh spec {spec!r} is malformed: expected NODESxGPUS:DEVICE "
                            f"such as '128x8:a100-80g', or GPUS:DEVICE such as '4:cpu', and "
                            f"optionally ',host=SIZE' (the memory of each host, e.g. ',host=256g') "
                            f"and ',power=W' (the board power each device is held to, e.g. ',power=500w')")
        nodes, gpus, device_name, options = match.groups()
        device = device_spec(device_name)
        for option in filter(None, options.split(",")):
            device = _with_option(device, spec, *option.split("=", 1))
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
    def from_world(cls, device: str | DeviceSpec) -> Mesh:
        """The mesh of the ranks this process trains among, for a script that compiles with the
        world it is given: after torchrun (`--nnodes MIN:MAX`) restarts it on fewer nodes, or a
        relaunch with fewer ranks, the same script plans for the new world.

        The world is the default process group's size when one is started, else what the
        launcher set (torchrun and autopar.launch: WORLD_SIZE, the same variables `compile`
        starts the process group from), else this one process. Devices per node are the
        launcher's LOCAL_WORLD_SIZE (torchrun's --nproc-per-node): a world of several nodes is
        a NODESxGPUS mesh whose inner axis has the fast links, one node a 1-D mesh."""
        spec = device if isinstance(device, DeviceSpec) else device_spec(str(device))
        world = _world_size()
        local = _launcher_count("LOCAL_WORLD_SIZE", world)
        if not 1 <= local <= world or world % local:
            raise MeshError(f"a world of {world} ranks with {local} per node (LOCAL_WORLD_SIZE) is not "
                            f"a whole number of equal nodes; start the same number of processes on "
                            f"every node (torchrun --nproc-per-node), or build the mesh with "
                            f"autopar.Mesh.parse('NODESxGPUS:{spec.name}')")
        return cls.build(spec, gpus=local, nodes=world // local if world > local else None)

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
        device = asdict(self.device)
        if device["host"] is None:      # the known device's host: nothing of its own to write
            del device["host"]
        if device["power_share"] == 1.0:    # uncapped: as plans wrote it before the field
            del device["power_share"]
        return _plain({"device": device, "axes": [asdict(a) for a in self.axes]})

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
            overlaps_communication=dev.get("overlaps_communication", True),
            power_share=dev.get("power_share", 1.0), host=_host_spec(dev["host"]) if dev.get("host") is not None else None)
        return cls(device, tuple(MeshAxis(a["name"], a["size"], _link(a["link"])) for a in data["axes"]))


def _world_size() -> int:
    """Ranks in the default process group, or those the launcher's environment names (the
    group is started by `autopar.compile`), or 1 for a process no launcher started."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size()
    return _launcher_count("WORLD_SIZE", 1)


def _launcher_count(name: str, default: int) -> int:
    """A count of ranks a launcher set in the environment (torchrun, autopar.launch)."""
    text = os.environ.get(name, str(default))
    if not text.isdigit() or int(text) < 1:
        raise MeshError(f"{name}={text!r} in this process's environment is not a number of ranks; "
                        f"start the script with torchrun or autopar.launch, which set it")
    return int(text)


def _host_spec(host: dict) -> HostSpec:
    """A mesh file's own host figures (`DeviceSpec.host`), checked by autopar.plans.mesh."""
    return HostSpec(link=_link(host["link"]), bandwidth=float(host["bandwidth"]),
                    flops=float(host["flops"]), gpus=int(host["gpus"]),
                    memory_bytes=float(host.get("memory_bytes", 0.0)))


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
        return DEVICES[ALIASES.get(name.lower(), name.lower())]
    except KeyError:
        raise MeshError(f"unknown device {name!r}; known devices: {', '.join(DEVICES)}") from None


def _with_option(device: DeviceSpec, spec: str, key: str, value: str) -> DeviceSpec:
    """`device` with a mesh spec's `,host=SIZE` or `,power=W`."""
    if key == "host":
        size = re.fullmatch(r"(\d+(?:\.\d+)?)([gGtT])[bB]?", value)
        if not size:
            raise MeshError(f"mesh spec {spec!r}: ',host=SIZE' takes a size such as 256g or 1.5tb")
        memory = float(size.group(1)) * (GB if size.group(2).lower() == "g" else 1000 * GB)
        if memory <= 0:
            raise MeshError(f"mesh spec {spec!r}: host memory must be more than 0")
        return replace(device, host=replace(device.host_figures, memory_bytes=memory))
    if key == "power":
        return replace(device, power_share=_power_share(device, spec, value))
    raise MeshError(f"mesh spec {spec!r}: unknown option {key!r}; options: ',host=SIZE', ',power=W'")


def _power_share(device: DeviceSpec, spec: str, value: str) -> float:
    """The share of its part's rated board power a device held to `value` watts runs at."""
    watts = re.fullmatch(r"(\d+(?:\.\d+)?)[wW]?", value)
    rated = RATED_POWER_W.get(device.name)
    if rated is None:
        raise MeshError(f"mesh spec {spec!r}: {device.name} has no rated board power to hold it "
                        f"under; ',power=W' is for the GPUs of the device table")
    if not watts or not 0 < float(watts.group(1)) <= rated:
        raise MeshError(f"mesh spec {spec!r}: ',power=W' takes the watts each {device.name} is "
                        f"held to, more than 0 and at most its rated {rated} W (e.g. ',power=500w')")
    return float(watts.group(1)) / rated
