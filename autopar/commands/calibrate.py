"""`autopar calibrate [--out FILE] [--device cpu|cuda]`: time matmuls, attention, elementwise ops,
norms, softmax and reductions on the local device and write the efficiencies that `autopar
estimate --calibration FILE` uses in place of the published defaults."""

from __future__ import annotations

from pathlib import Path

from rich.console import Console
from rich.table import Table


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("calibration.json"),
                        help="where to write the efficiencies (default calibration.json)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of repeats per measured op (default 0.3)")


def run(args) -> int:
    from autopar.cost.calibrate import calibrate

    console = Console(stderr=True)
    with console.status("calibrating") as status:
        efficiencies, measurements = calibrate(
            args.device, budget_s=args.budget,
            progress=lambda label: status.update(f"timing {label} on {args.device}"))
    efficiencies.save(args.out, measurements)
    table = Table(title=f"{efficiencies.device}: measured efficiencies, written to {args.out}")
    for column in ("op", "family", "ms", "of peak FLOP/s", "of HBM bandwidth"):
        table.add_column(column, justify="left" if column in ("op", "family") else "right")
    for label, m in measurements.items():
        table.add_row(label, m["family"], f"{m['seconds'] * 1e3:.2f}", f"{m['flops_fraction']:.2f}",
                      f"{m['bandwidth_fraction']:.2f}")
    Console().print(table)
    return 0
