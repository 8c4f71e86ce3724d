"""Predicted against published TFLOP/s per GPU for Megatron-LM's SC'21 table 1 rows.

    python benchmarks/estimate_megatron.py [--csv PATH] [--calibration FILE]

Each row's model is captured on the meta device (forward + loss) and priced by autopar's estimator
as Megatron-LM ran it in 2021 (see autopar/cost/reference.py); FlashAttention kernels are shown
beside it for comparison. Nothing is fitted to the published figures.
"""

import argparse
import time
from pathlib import Path

from rich.console import Console
from rich.table import Table

from autopar.commands.estimate import capture_training_step
from autopar.cost.compute import Efficiencies
from autopar.cost.estimator import estimate
from autopar.cost.reference import sc21_runs
from autopar.errors import AutoparError

DEFAULT_CSV = Path(__file__).resolve().parents[2] / "shared" / "reference" / "megatron_sc21_table1.csv"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--csv", type=Path, default=DEFAULT_CSV)
    parser.add_argument("--calibration", type=Path, default=None)
    args = parser.parse_args()
    efficiencies = Efficiencies.load(args.calibration) if args.calibration else None
    table = Table(title="Megatron-LM SC'21 table 1: predicted vs published TFLOP/s per GPU (A100 80GB)")
    for column in ("model", "gpus", "tp", "pp", "v", "B", "b", "published", "predicted", "error",
                   "flash attn", "MFU", "bubble", "memory GiB", "capture s"):
        table.add_column(column, justify="right")
    try:
        runs = sc21_runs(args.csv)
    except (AutoparError, OSError) as err:
        raise SystemExit(f"error: {err}") from None
    for run in runs:
        start = time.perf_counter()
        graph = capture_training_step(run.spec)
        seconds = time.perf_counter() - start
        placements = run.placements(graph)        # Megatron-LM's layout, as the run trained
        result = estimate(graph, run.mesh, run.config, efficiencies=efficiencies,
                          attention=run.attention, runtime=run.runtime, placements=placements)
        flash = estimate(graph, run.mesh, run.config, efficiencies=efficiencies, attention="flash",
                         runtime=run.runtime, placements=placements)
        c = run.config
        table.add_row(run.name, str(run.mesh.world_size), str(c.tp), str(c.pp), str(c.virtual),
                      str(c.global_batch), str(c.micro_batch), f"{run.published_tflops:.0f}",
                      f"{result.tflops_per_gpu:.1f}",
                      f"{result.tflops_per_gpu / run.published_tflops - 1:+.1%}",
                      f"{flash.tflops_per_gpu:.1f}", f"{result.mfu:.1%}",
                      f"{result.bubble_fraction:.3f}",
                      f"{result.memory_per_gpu_bytes / 2**30:.1f}", f"{seconds:.1f}")
    Console(width=max(Console().width, 170)).print(table)


if __name__ == "__main__":
    main()
