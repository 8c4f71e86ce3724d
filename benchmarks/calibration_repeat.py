"""Do two calibrations minutes apart agree? Runs `autopar calibrate` twice, `--gap` seconds apart
(or reads two calibration files), and prints, for every figure both measured (the names of their
"rounds" sections: efficiencies, host latencies, collective fits), the two values and their
ratio, larger over smaller, and how many agree within 15% (a ratio of at most 1.15). Each run's
load average is printed beside it: on a shared host the figures move with the other work.

    python benchmarks/calibration_repeat.py --mesh 4:cpu --gap 120 --out-dir cal/
    python benchmarks/calibration_repeat.py --files cal/first.json cal/second.json [--json]
"""

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

from autopar.cli import main as cli
from autopar.cost.calibration import figures, spread

AGREE = 1.15


def calibrate_twice(args) -> list[Path]:
    """Two calibrations `args.gap` seconds apart; the files they wrote."""
    args.out_dir.mkdir(parents=True, exist_ok=True)
    files = []
    for name in ("first", "second"):
        if files:
            time.sleep(args.gap)
        out = args.out_dir / f"{name}.json"
        command = ["calibrate", "--out", str(out), "--rounds", str(args.rounds), "--budget", str(args.budget)]
        command += ["--mesh", args.mesh] if args.mesh else []
        load = os.getloadavg()[0]
        started = time.monotonic()
        if cli(command) != 0:
            raise SystemExit(f"autopar {' '.join(command)} failed")
        print(f"{name}: {out}, {time.monotonic() - started:.0f} s, load average {load:.1f} "
              f"before, {os.getloadavg()[0]:.1f} after", file=sys.stderr)
        files.append(out)
    return files


def compare(first: dict, second: dict) -> list[dict]:
    """Each figure both files measured: the two values, their ratio, each file's own spread over
    its rounds; the widest ratio first."""
    values = [figures(first), figures(second)]
    names = [name for name in first.get("rounds", {}) if name in second.get("rounds", {})]
    rows = [{"figure": name, "first": values[0][name], "second": values[1][name],
             "ratio": spread([values[0][name], values[1][name]]),
             "spread_first": spread(first["rounds"][name]), "spread_second": spread(second["rounds"][name])}
            for name in names]
    return sorted(rows, key=lambda row: -row["ratio"])


def report(rows: list[dict]) -> dict:
    ratios = [row["ratio"] for row in rows]
    return {"figures": len(rows), "within_15_percent": sum(r <= AGREE for r in ratios),
            "median_ratio": statistics.median(ratios) if ratios else None,
            "worst_ratio": max(ratios) if ratios else None, "rows": rows}


def show(summary: dict) -> None:
    print(f"{'figure':45} {'first':>11} {'second':>11} {'ratio':>7} {'spreads in each':>16}")
    for row in summary["rows"]:
        flag = "" if row["ratio"] <= AGREE else "  *"
        print(f"{row['figure']:45} {row['first']:11.4g} {row['second']:11.4g} {_x(row['ratio']):>7} "
              f"{_x(row['spread_first']):>7} {_x(row['spread_second']):>8}{flag}")
    print(f"{summary['within_15_percent']} of {summary['figures']} figures agree within 15% "
          f"(* beyond); median ratio {_x(summary['median_ratio'])}, worst {_x(summary['worst_ratio'])}")


def _x(value: float) -> str:
    return "inf" if value == float("inf") else f"{value:.2f}x"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--files", nargs=2, type=Path, help="compare these two calibration files")
    parser.add_argument("--mesh", default="4:cpu", help="calibrate on this gloo mesh ('' for the local device)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget", type=float, default=0.3)
    parser.add_argument("--gap", type=float, default=120.0, help="seconds between the two calibrations")
    parser.add_argument("--out-dir", type=Path, default=Path("calibration_repeat"))
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    files = args.files or calibrate_twice(args)
    summary = report(compare(*(json.loads(path.read_text()) for path in files)))
    if args.json:
        print(json.dumps(summary, indent=2))
    else:
        show(summary)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
