"""`autopar calibrate [--out FILE] [--device cpu|cuda] [--mesh 4:cpu [--rounds 3]]`: time matmuls, attention,
elementwise ops, norms, softmax, reductions and the cost of one op on the local device, and with
`--mesh` on every gloo rank of that mesh at once together with the mesh's collectives (latency
and bandwidth per collective, fitted over several sizes) and the host cost of the runtime's
machinery (DTensor dispatch, pipeline schedule actions, FSDP2 hooks); write the file that `autopar estimate
--calibration FILE` and `autopar.cost.estimate(..., calibration=FILE)` use in place of the
published defaults."""

from __future__ import annotations

from pathlib import Path

import torch

from rich.console import Console

from autopar.errors import AutoparError


def add_arguments(parser) -> None:
    parser.add_argument("--out", type=Path, default=Path("calibration.json"),
                        help="where to write the efficiencies (default calibration.json)")
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--mesh", default=None,
                        help="a CPU mesh such as 4:cpu: measure on that many gloo ranks at once, "
                             "collectives included")
    parser.add_argument("--budget", type=float, default=0.3,
                        help="seconds of repeats per measured op (default 0.3)")
    parser.add_argument("--rounds", type=int, default=3,
                        help="measure every figure this many times and keep each one's median "
                             "(default 3; a shared host's figures move between runs)")


def run(args) -> int:
    from autopar.commands.output import check_output, plain, table
    from autopar.calibrate.measure import calibrate_mesh, calibrate_rounds
    from autopar.cost.mesh import Mesh

    check_output(args.out, "--out")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise AutoparError("--device cuda: this machine has no CUDA device; calibrate --device cpu")
    if args.rounds < 1:
        raise AutoparError(f"--rounds {args.rounds}: give 1 or more rounds of measurements")
    if not 0 < args.budget <= 600:
        raise AutoparError(f"--budget {args.budget}: give seconds per op above 0 and at most 600")
    console = Console(stderr=True)
    collectives = None
    if args.mesh:
        mesh = Mesh.parse(args.mesh)
        with console.status(f"calibrating compute and collectives on {mesh.world_size} gloo ranks"):
            efficiencies, measurements, collectives, rounds = calibrate_mesh(
                mesh, budget_s=args.budget, rounds=args.rounds)
    else:
        with console.status("calibrating") as status:
            efficiencies, measurements, rounds = calibrate_rounds(
                args.device, budget_s=args.budget, rounds=args.rounds,
                progress=lambda label: status.update(f"timing {label} on {args.device}"))
    efficiencies.save(args.out, measurements, collectives, rounds)
    result = table(plain(f"{efficiencies.device}: measured efficiencies, written to {args.out}"),
                   ["op", "family", "ms", "spread", "of peak FLOP/s", "of HBM bw"],
                   right=("ms", "spread", "of peak FLOP/s", "of HBM bw"), wrap=("op",))
    for label, m in measurements.items():
        result.add_row(plain(label), m["family"], f"{m['seconds'] * 1e3:.3f}", _spread(m),
                       f"{m['flops_fraction']:.2f}", f"{m['bandwidth_fraction']:.2f}")
    Console().print(result)
    if collectives:
        Console().print(_collectives_table(collectives, rounds))
    Console().print(_spread_summary(rounds))
    return 0


def _collectives_table(collectives: dict, rounds: dict):
    """Each collective's fit by group size, with the spread of the rounds' own fits."""
    from autopar.commands.output import plain, table

    numbers = ("group", "latency per step us", "spread", "bandwidth MB/s", "spread ")
    fits = table(plain(f"collectives over gloo on {collectives['ranks']} ranks, by group size"),
                 ["collective", *numbers], right=numbers)
    sized = {collectives["ranks"]: collectives["fits"],
             **{int(size): group for size, group in collectives.get("group_fits", {}).items()}}
    for size, group in sorted(sized.items(), reverse=True):
        for kind, fit in group.items():
            name = f"{kind} on {size} ranks: "
            fits.add_row(kind, str(size), f"{fit['latency_s'] * 1e6:.1f}",
                         _ratio(rounds.get(name + "latency_s")), f"{fit['bandwidth'] / 1e6:.0f}",
                         _ratio(rounds.get(name + "bandwidth")))
    return fits


def _spread_summary(rounds: dict) -> str:
    """How far apart the rounds put the figures: the median figure's spread and the widest."""
    from autopar.cost.calibration import spread

    spreads = {name: spread(values) for name, values in rounds.items()}
    if not spreads or len(next(iter(rounds.values()))) < 2:
        return "one round: no spread measured (--rounds 3 or more to see how far figures move)"
    ordered = sorted(spreads.values())
    widest = max(spreads, key=spreads.get)
    within = sum(value <= 1.15 for value in ordered)
    return (f"{len(spreads)} figures over {len(next(iter(rounds.values())))} rounds (largest over "
            f"smallest round): median spread {_ratio_of(ordered[(len(ordered) - 1) // 2])}, widest "
            f"{_ratio_of(spreads[widest])} ({widest}); {within} within 1.15x. Each figure kept is "
            f"its median round; every round is in the file under \"rounds\"")


def _ratio(values) -> str:
    from autopar.cost.calibration import spread

    return _ratio_of(spread(values)) if values and len(values) > 1 else ""


def _ratio_of(value: float) -> str:
    return "from 0" if value == float("inf") else f"{value:.2f}x"


def _spread(measurement: dict) -> str:
    """Slowest over fastest of the rounds a figure was measured in ("" for one round)."""
    seconds = measurement.get("rounds_seconds", [])
    if len(seconds) < 2:
        return ""
    if min(seconds) <= 0:
        return "from 0"
    return f"{max(seconds) / min(seconds):.2f}x"
