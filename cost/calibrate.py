"""Measure the compute model's efficiencies on the local device.

Each op family is timed on a few shapes; its efficiency is the achieved rate over the device
spec's peak: FLOP/s over peak FLOP/s for matmuls and attention, bytes/s over HBM bandwidth for the
memory-bound families. The best shape of a family stands for it (the roofline already charges
small shapes for their low arithmetic intensity). Rates above the spec's peak (a CPU whose spec is
nominal) are clipped to 1 and the raw figures kept under "measurements".
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from autopar.cost.compute import Efficiencies
from autopar.cost.mesh import DEVICES, DeviceSpec
from autopar.errors import AutoparError

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


def _seconds(fn: Callable[[], object], device: str, budget_s: float) -> float:
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
            seconds = _seconds(fn, device, budget_s)
            flop_rate = flops / seconds / spec.flops(str(dtype).removeprefix("torch."))
            byte_rate = moved / seconds / spec.hbm_bandwidth
            measurements[label] = {"family": family, "seconds": seconds, "flops": flops,
                                   "bytes": moved, "flops_fraction": flop_rate,
                                   "bandwidth_fraction": byte_rate}
            if family in ("matmul", "attention"):
                compute[family] = max(compute.get(family, 0.0), flop_rate)
            else:
                memory[family] = max(memory.get(family, 0.0), byte_rate)
    clip = lambda table: {f: min(1.0, max(v, 1e-6)) for f, v in table.items()}
    efficiencies = Efficiencies(compute=clip(compute), memory=clip(memory), device=spec.name)
    return efficiencies, measurements
