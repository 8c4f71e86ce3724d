"""Time of one op on one device: a roofline with an efficiency per op family.

    time = max(flops / (peak_flops * compute_eff[family]),
               bytes_moved / (hbm_bandwidth * memory_eff[family])) + kernel_latency

The default efficiencies come from published measurements on NVIDIA datacenter GPUs (cited next to
each figure), per device where they differ (`Efficiencies.for_device`); `autopar calibrate`
measures them on the local device and writes a JSON file that `Efficiencies.load` reads back,
replacing the defaults.

A matmul with a weight also pays for how its output tiles fill the GPU (`gemm_utilization`):
cuBLAS computes an M x N output in tiles, one thread block per tile on each streaming
multiprocessor, in waves; a GEMM of 1.1 waves takes as long as one of 2. Small and skinny GEMMs
(a tensor-parallel shard, a small micro-batch) lose most; the memory roofline (operand bytes over
HBM bandwidth) covers GEMMs too thin to be compute-bound at all.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from autopar.errors import AutoparError
from autopar.cost.mesh import DeviceSpec

FAMILIES = ("matmul", "attention", "norm", "softmax", "elementwise", "reduction", "embedding",
            "loss", "view")

_MATMUL = {"mm", "addmm", "bmm", "baddbmm", "matmul", "linear", "addbmm", "addmv", "mv", "dot",
           "einsum", "_scaled_mm", "_grouped_mm", "convolution", "conv1d", "conv2d", "conv3d", "_convolution"}
_ATTENTION_PREFIX = ("_scaled_dot_product", "scaled_dot_product", "_flash_attention",
                     "_efficient_attention", "_cudnn_attention", "flex_attention")
_NORM = {"layer_norm", "native_layer_norm", "rms_norm", "_fused_rms_norm", "group_norm",
         "native_group_norm", "batch_norm", "_native_batch_norm_legit",
         "_native_batch_norm_legit_no_training", "_native_batch_norm_legit_functional", "instance_norm"}
_SOFTMAX = {"_softmax", "softmax", "_log_softmax", "log_softmax", "_safe_softmax"}
_LOSS = {"nll_loss", "nll_loss_forward", "nll_loss2d_forward", "cross_entropy_loss", "mse_loss",
         "binary_cross_entropy", "binary_cross_entropy_with_logits", "nll_loss_nd"}
_EMBEDDING = {"embedding", "index_select", "gather", "embedding_bag", "_embedding_bag"}
_REDUCTION = {"sum", "mean", "amax", "amin", "max", "min", "var", "var_mean", "std", "norm",
              "linalg_vector_norm", "prod", "argmax", "argmin", "logsumexp", "cumsum", "any", "all"}
# Ops that only reinterpret metadata: no kernel runs, nothing moves.
_VIEW = {"view", "_unsafe_view", "reshape", "permute", "transpose", "t", "expand", "slice",
         "select", "unsqueeze", "squeeze", "alias", "detach", "split", "split_with_sizes", "chunk",
         "unbind", "as_strided", "view_as", "expand_as", "unflatten", "flatten", "narrow",
         "lift_fresh_copy", "_assert_tensor_metadata", "sym_size", "sym_numel", "sym_stride",
         "getitem", "_local_scalar_dense", "empty", "empty_like", "scalar_tensor", "arange",
         "zeros", "ones", "full", "zeros_like", "ones_like", "full_like", "empty_strided",
         "numpy_T", "mT", "mH", "adjoint", "swapaxes", "swapdims", "movedim"}

# Backward cost relative to forward, per family: (flops factor, bytes factor). A matmul's backward
# is two matmuls of the forward's size (input and weight gradients). FlashAttention-2's backward
# runs five matmuls to the forward's two (Dao 2023). Memory-bound ops read the output gradient
# and what they saved and write the input gradient(s): about 1.5x to 2x the forward's traffic.
BACKWARD = {"matmul": (2.0, 2.0), "attention": (2.5, 2.0), "norm": (2.0, 2.0),
            "softmax": (1.0, 1.5), "elementwise": (1.0, 1.5), "reduction": (1.0, 1.0),
            "embedding": (0.0, 2.0), "loss": (1.0, 1.5), "view": (0.0, 0.0)}


# Ops of libraries other than ATen that run kernels: the experts of a mixture-of-experts layer
# as one grouped matmul, autopar's own (autopar/models/experts.py) and the one HuggingFace
# transformers runs where torch._grouped_mm does not (rows sorted by expert, [E, K, N] weights);
# attention with soft-capped scores or sinks (autopar/models/capped_attention.py), which runs
# unfused (cost/chunk_price.py prices its matmuls and softmax as such).
_OWN_OPS = {"autopar.grouped_mm": "matmul", "transformers.grouped_mm_fallback": "matmul",
            "autopar.attention": "attention"}


def op_family(target: str) -> str:
    """The family of an ATen op target such as "aten.mm.default" (or its packet, "aten.mm")."""
    own = _OWN_OPS.get(target.rsplit(".", 1)[0] if target.count(".") == 2 else target)
    if own is not None:
        return own
    name = target.split(".")[1] if target.startswith("aten.") and "." in target else target.split(".")[-1]
    name = name.rstrip("_") if name.endswith("_") and not name.startswith("_") else name
    if name in _MATMUL:
        return "matmul"
    if name.startswith(_ATTENTION_PREFIX):
        return "attention"
    for family, names in (("norm", _NORM), ("softmax", _SOFTMAX), ("loss", _LOSS),
                          ("embedding", _EMBEDDING), ("reduction", _REDUCTION), ("view", _VIEW)):
        if name in names:
            return family
    if target in ("placeholder", "output", "get_attr") or not target.startswith("aten."):
        return "view"
    return "elementwise"


def _default_compute() -> dict[str, float]:
    # Fraction of peak dense FLOP/s. Large bf16 cuBLAS GEMMs sustain about 230-250 TFLOP/s of an
    # A100's 312 (NVIDIA's "Matrix Multiplication Background" guide; clocks drop under sustained
    # load), so 0.75. FlashAttention-2 forward+backward reaches about 170 TFLOP/s on an A100 at head
    # dimension 128 (Dao 2023, fig. 4): 0.55 of peak. Memory-bound families never reach their compute
    # roof; their figure only matters if flops dominate, which they do not.
    return {"matmul": 0.75, "attention": 0.55, "norm": 0.5, "softmax": 0.5, "elementwise": 0.5,
            "reduction": 0.5, "embedding": 0.5, "loss": 0.5, "view": 1.0}


# Where a device differs from the A100 figures above. H100 SXM: cuBLAS bf16 GEMMs on training shapes
# sustain about 600-720 TFLOP/s of the data sheet's 989 (the 700 W power limit holds the clocks
# well under boost), so 0.68; FlashAttention-2, which the H100 runs of 2023 used, has no Hopper
# kernels and reaches about 330 TFLOP/s forward + backward (Dao 2023, H100 figure): 0.33.
# The 96 GB H100 (HBM2e, Meta's Grand Teton hosts) is the same chip held to 500 W: the same
# fractions, of the lower throughput its power allows (`DeviceSpec.power_share`).
_DEVICE_COMPUTE = {
    "h100-80g": {"matmul": 0.68, "attention": 0.33},
    "h100-96g": {"matmul": 0.68, "attention": 0.33},
    "h200-141g": {"matmul": 0.68, "attention": 0.33},
    "h800-80g": {"matmul": 0.68, "attention": 0.33},
}

# Attention where the runtime runs another kernel than FlashAttention-2 (`Runtime.attention_kernel`).
# Transformer Engine, under Megatron-Core, prefers cuDNN's fused attention on Hopper and later.
# cuDNN on an H100 SXM, head dimension 128, 4k-16k tokens (Shah et al. 2024, FlashAttention-3,
# figs. 5-6): causal forward 518-539 TFLOP/s, backward 499-518. With the backward's five matmuls
# to the forward's two, 7 / (2/530 + 5/510) = 515 TFLOP/s of 989: 0.52. (The same arithmetic on
# that paper's FlashAttention-2 figures, forward 330 and backward 320, gives the 0.33 above.)
_KERNEL_COMPUTE = {
    "cudnn": {name: {"attention": 0.52} for name in ("h100-80g", "h100-96g", "h200-141g",
                                                     "h800-80g")},
}


def _default_memory() -> dict[str, float]:
    # Fraction of HBM bandwidth. Streaming kernels (copy, elementwise) reach about 80-90% of the
    # data-sheet bandwidth on A100/H100 (STREAM-like measurements, e.g. BabelStream); norms,
    # softmax and reductions do a second pass over a row and run a little lower; the embedding's
    # gather and its scatter-add backward are irregular.
    return {"matmul": 0.8, "attention": 0.8, "norm": 0.7, "softmax": 0.7, "elementwise": 0.8,
            "reduction": 0.7, "embedding": 0.5, "loss": 0.7, "view": 1.0}


@dataclass(kw_only=True, slots=True)
class Efficiencies:
    compute: dict[str, float] = field(default_factory=_default_compute)
    memory: dict[str, float] = field(default_factory=_default_memory)
    kernel_latency_s: float = 4e-6     # launch and tail of one GPU kernel: a floor for tiny ops
    # What an op of a tensor-parallel stage adds on the host: DTensor's sharding propagation and
    # dispatch, and the runtime placing its output where the plan puts it. (ZeRO-3's ops do not
    # pay it: FSDP2 computes on the gathered weights as plain tensors.) A GPU's kernels run
    # asynchronously behind the host, which hides it for models large enough to keep the GPU
    # busy, hence 0; on a CPU the host is the device, and `autopar calibrate --mesh` measures it.
    distributed_op_latency_s: float = 0.0
    # The same for the runtime's own machinery, per micro-batch: one action of torch's pipeline
    # schedule (a stage's forward or backward, its send and receive posted and waited for) beyond
    # the compute and the transfer it runs, and one FSDP2 group's hooks (its pre-forward,
    # pre-backward and post-backward) around a micro-batch. Hidden behind a GPU's kernels;
    # measured by `autopar calibrate --mesh` where the host is the device.
    pipeline_action_latency_s: float = 0.0
    data_parallel_group_latency_s: float = 0.0
    data_parallel_tensor_latency_s: float = 0.0     # the hooks' share of each parameter tensor
    # FSDP2's reduction of a group's gradients beyond the collective itself, per reduction: it
    # copies them into a buffer it allocates for the call, reduces, and hands each parameter a
    # view of the result (a cost per group), and on a CPU the fresh buffers' pages are faulted in
    # as the copies first touch them (a cost per byte of each buffer: cost/overlap.py counts
    # them). Hidden behind a GPU's kernels; measured by `autopar calibrate --mesh` where the
    # host is the device.
    data_parallel_reduce_group_s: float = 0.0     # replicate: plain data parallelism
    data_parallel_reduce_byte_s: float = 0.0
    sharded_reduce_group_s: float = 0.0           # fully_shard: ZeRO's reduce-scatter
    # Zero-bubble schedules split each backward into its input and weight halves; torch finds
    # them by walking the stage's autograd graph in Python, a cost per op of the stage.
    split_backward_op_latency_s: float = 0.0
    # A recomputed region (torch.utils.checkpoint, non-reentrant) on the host, beyond the
    # forward it runs again: the rerun's set-up per region, and per op of the region the hooks
    # that pack and unpack what it saves.
    checkpoint_region_latency_s: float = 0.0
    checkpoint_op_latency_s: float = 0.0
    # Cores of the host that the calibrated ranks shared (`autopar calibrate --mesh` on a CPU);
    # 0 where each rank has a device of its own. Where a mesh has more ranks than this, a rank
    # idle in a pipeline's bubble lends its core to the others (cost/host.py).
    host_cores: int = 0
    # Where ranks share a host's cores, a rank that reaches a blocking collective after a long
    # stretch of compute (a layer's backward before FSDP2 reduces its gradients) waits for peers
    # that the scheduler ran less: ranks drift apart in proportion to the compute since they last
    # met, up to about one scheduling period. `autopar calibrate --mesh` measures the wait of a
    # tiny collective after `collective_wait_span_s` of compute beyond its wait after the short
    # span its link fits were timed after; shorter spans wait in proportion (`wait_after`). A
    # GPU's ranks drift by microseconds, hence 0.
    collective_wait_s: float = 0.0
    collective_wait_span_s: float = 0.0
    # Bytes/s an optimizer step streams on the host (offloaded states: cost/offload.py), measured
    # by `autopar calibrate` where it ran; 0 for the device's published host figure.
    host_optimizer_bytes_per_s: float = 0.0
    device: str = ""                   # the device they were measured on; "" for the defaults

    def wait_after(self, span_s: float) -> float:
        """Seconds a blocking collective waits for the last rank after `span_s` of compute."""
        if self.collective_wait_s <= 0 or self.collective_wait_span_s <= 0 or span_s <= 0:
            return 0.0
        return self.collective_wait_s * min(1.0, span_s / self.collective_wait_span_s)

    def __post_init__(self):
        for table_name in ("compute", "memory"):
            table = {**(_default_compute() if table_name == "compute" else _default_memory()),
                     **getattr(self, table_name)}
            for family, value in table.items():
                if family not in FAMILIES:
                    raise AutoparError(f"efficiency family {family!r} is unknown; families: {FAMILIES}")
                if not 0 < value <= 1:
                    raise AutoparError(f"{table_name} efficiency of {family} is {value}; it must be "
                                       f"a fraction of the peak in (0, 1]")
            setattr(self, table_name, table)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def for_device(cls, name: str, attention_kernel: str = "flash") -> Efficiencies:
        """The published defaults for device `name` (a DeviceSpec name) running attention with
        `attention_kernel` ("flash" or "cudnn"); the A100's where the device has no figures of its
        own. `device` stays "": these are not measurements."""
        kernel = _KERNEL_COMPUTE.get(attention_kernel, {}).get(name, {})
        return cls(compute={**_default_compute(), **_DEVICE_COMPUTE.get(name, {}), **kernel})

    @classmethod
    def from_dict(cls, data: dict) -> Efficiencies:
        known = {f.name for f in fields(cls)}
        # the raw timings and each figure's rounds are for readers, not for pricing
        unknown = set(data) - known - {"measurements", "collectives", "rounds"}
        if unknown:
            raise AutoparError(f"calibration file has unknown fields {sorted(unknown)}; "
                               f"expected {sorted(known)}")
        return cls(**{k: v for k, v in data.items() if k in known})

    @classmethod
    def load(cls, path: str | Path) -> Efficiencies:
        try:
            data = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as err:
            raise AutoparError(f"cannot read calibration file {path}: {err}; "
                               f"write one with `autopar calibrate --out {path}`") from err
        return cls.from_dict(data)

    def save(self, path: str | Path, measurements: dict | None = None,
             collectives: dict | None = None, rounds: dict | None = None) -> None:
        """Write a calibration file: these efficiencies, the raw measurements, the mesh's
        measured collectives (cost/calibration.py) when given, and `rounds`, each figure's value
        in every round it was measured in (`cost.calibration.figures` names them)."""
        data = self.to_dict()
        if measurements:
            data["measurements"] = measurements
        if collectives:
            data["collectives"] = collectives
        if rounds:
            data["rounds"] = rounds
        Path(path).write_text(json.dumps(data, indent=2) + "\n")


def compute_time(flops: float, bytes_moved: float, device: DeviceSpec, family: str,
                 dtype: str = "bfloat16", efficiencies: Efficiencies | None = None,
                 utilization: float = 1.0) -> float:
    """Seconds for one kernel of `family` doing `flops` and moving `bytes_moved` through HBM;
    `utilization`, the share of the device's compute units the kernel's work fills
    (`gemm_utilization`)."""
    if family not in FAMILIES:
        raise AutoparError(f"op family {family!r} is unknown; families: {FAMILIES}")
    if family == "view" or (flops == 0 and bytes_moved == 0):
        return 0.0
    eff = efficiencies or Efficiencies.for_device(device.name)
    compute_s = flops / (device.sustained_flops(dtype) * eff.compute[family] * utilization)
    memory_s = bytes_moved / (device.hbm_bandwidth * eff.memory[family])
    return max(compute_s, memory_s) + eff.kernel_latency_s


# cuBLAS's output tile for large 16-bit GEMMs on A100 and H100, either way round (NVIDIA, "Matrix
# Multiplication Background User's Guide": tile and wave quantization).
GEMM_TILES = ((256, 128), (128, 256))


# A grouped GEMM (the experts of a mixture-of-experts layer) runs every group's tiles in one
# persistent kernel (CUTLASS's grouped GEMM, which Transformer Engine and torch._grouped_mm use),
# whose tiles are 128 x 128 as often as larger.
GROUPED_GEMM_TILES = GEMM_TILES + ((128, 128),)


def gemm_utilization(rows: float, cols: float, device: DeviceSpec, groups: int = 1) -> float:
    """The share of a GPU's streaming multiprocessors that an output of `rows` x `cols` keeps busy
    over its waves of tiles, with the better of cuBLAS's tile orientations; with `groups` > 1,
    of that many such outputs computed together by one grouped kernel (their tiles share the
    waves, each group's last row and column tiles partly empty). 1 on a device without
    multiprocessors (a CPU) or for an empty shape."""
    if not device.multiprocessors or rows <= 0 or cols < 1:
        return 1.0
    units = device.multiprocessors
    best = 0.0
    for tile_rows, tile_cols in GROUPED_GEMM_TILES if groups > 1 else GEMM_TILES:
        tiles = groups * math.ceil(rows / tile_rows) * math.ceil(cols / tile_cols)
        waves = math.ceil(tiles / units)
        best = max(best, groups * rows * cols / (tile_rows * tile_cols) / (waves * units))
    return best


ATTENTION_KERNELS = ("flash", "unfused")


def attention_kernels(info: dict, samples: float, kernel: str = "flash",
                      dtype_bytes: int = 2) -> tuple[list, list, float]:
    """The kernels that run one attention op on `samples` sequences: (forward, backward,
    score bytes kept for the backward), each kernel a (family, flops, bytes_moved) triple.

    `info` has heads (per sample, on this device), q_len, k_len, head_dim, causal, dropout.
    "flash" is one fused kernel (FlashAttention-2): a causal mask skips half the score blocks and
    the scores never reach HBM. "unfused" is what Megatron-LM ran before FlashAttention: two batched
    matmuls around a fused scale-mask-softmax kernel and a dropout kernel, computing the full
    score matrix and keeping the softmax output, the dropout mask and its output for the backward.
    """
    if kernel not in ATTENTION_KERNELS:
        raise AutoparError(f"attention kernel {kernel!r}: expected one of {ATTENTION_KERNELS}")
    heads = info["heads"] * samples
    q, k, d = info["q_len"], info["k_len"], info["head_dim"]
    matmul_flops = 4 * heads * q * k * d                # QK^T and PV, the full score matrix
    qkvo = heads * (2 * q + 2 * k) * d * dtype_bytes
    if kernel == "flash":
        executed = matmul_flops * (0.5 if info["causal"] and q == k else 1.0)
        flops_factor, bytes_factor = BACKWARD["attention"]
        return ([("attention", executed, qkvo)],
                [("attention", executed * flops_factor, qkvo * bytes_factor)], 0.0)
    scores = heads * q * k * dtype_bytes
    mask = heads * q * k                                 # one byte per score
    dropout = info["dropout"] > 0
    forward = [("matmul", matmul_flops / 2, heads * (q + k) * d * dtype_bytes + scores),
               ("softmax", 0.0, 2 * scores)]
    backward = [("matmul", matmul_flops, 2 * (heads * (q + k) * d * dtype_bytes + scores)),
                ("softmax", 0.0, 3 * scores)]
    if dropout:
        forward.append(("elementwise", 0.0, 2 * scores + mask))
        backward.append(("elementwise", 0.0, 2 * scores + mask))
    forward.append(("matmul", matmul_flops / 2, scores + heads * (k + q) * d * dtype_bytes))
    backward.append(("matmul", matmul_flops, 2 * (scores + heads * (k + q) * d * dtype_bytes)))
    kept = scores + (scores + mask if dropout else 0.0)
    return forward, backward, kept
