"""`autopar calibrate [--out FILE] [--device cpu|cuda]`: time matmuls, attention, elementwise ops,
norms, softmax and reductions on the local device and write the efficiencies that `autopar
estimate --calibration FILE` uses in place of the published defaults."""

from __future__ import annotations

from pathlib import Path

import torch

from rich.console import Console

from autopar.errors import AutoparError


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("calibration.json"),
                        help="where to write the efficiencies (default calibration.json)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of repeats per measured op (default 0.3)")


def run(args) -> int:
    from autopar.commands.output import check_output, plain, table
    from autopar.cost.calibrate import calibrate

    check_output(args.out, "--out")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda: this machine has no CUDA device; calibrate --device cpu")
    if not 0 < args.budget <= 600:
        raise AutoparError(f"--budget {args.budget}: give seconds per op above 0 and at most 600")
    console = Console(stderr=True)
    with console.status("calibrating") as status:
        efficiencies, measurements = calibrate(
            args.device, budget_s=args.budget,
            progress=lambda label: status.update(f"timing {label} on {args.device}"))
    efficiencies.save(args.out, measurements)
    result = table(plain(f"{efficiencies.device}: measured efficiencies, written to {args.out}"),
                   ["op", "family", "ms", "of peak FLOP/s", "of HBM bandwidth"],
                   right=("ms", "of peak FLOP/s", "of HBM bandwidth"), wrap=("op",))
    for label, m in measurements.items():
        result.add_row(plain(label), m["family"], f"{m['seconds'] * 1e3:.2f}", f"{m['flops_fraction']:.2f}",
                       f"{m['bandwidth_fraction']:.2f}")
    Console().print(result)
    return 0
