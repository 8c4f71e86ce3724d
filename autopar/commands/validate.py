"""`autopar validate MODEL --mesh 4:cpu --global-batch B`: predicted against measured step time.

A dozen or so distinct forced configurations of MODEL (data parallelism, ZeRO 1-3, tensor and
sequence parallelism, pipelines with each schedule, recompute levels; those the model and mesh
allow) and the planner's own plan are each trained for a few steps on real gloo ranks
(`autopar.compile` + `autopar.launch`). Each configuration's step time (the slowest rank's, the
median over the timed steps) and peak resident memory growth are set against what the estimator
predicts for the plan that configuration runs as (`autopar.cost.estimate_plan` of
`autopar.plan_from_config`: the per-op placements the runtime applies), with a calibration file
when given (`autopar calibrate --mesh`), with which the planner also plans. Printed: every row, Kendall's tau between predicted and measured times, the median
|error|, and whether the estimator's and the planner's choices are the fastest measured; drawn:
a scatter PNG when matplotlib is installed.
"""

from __future__ import annotations

import statistics
from pathlib import Path

from rich.console import Console

from autopar.plans.vocabulary import Recompute, Schedule

SEED = 0


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a preset or spec, e.g. gpt:layers=4,hidden=128,heads=4,"
                                      "seq=64,vocab=512")
    parser.add_argument("--mesh", required=True, help="a CPU mesh of gloo ranks, e.g. 4:cpu")
    parser.add_argument("--global-batch", type=int, required=True, help="sequences per step")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--steps", type=int, default=3, help="timed steps per configuration")
    parser.add_argument("--warmup", type=int, default=3,
                        help="untimed steps first (a rank's first steps fault in its memory and "
                             "run slower: here 1.2-1.4x the later ones)")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="a file from `autopar calibrate --mesh` (default: published figures)")
    parser.add_argument("--png", type=Path, default=None, help="draw predicted vs measured here")
    parser.add_argument("--no-plan", action="store_true", help="skip the planner's own plan")


def run(args) -> int:
    import torch._dynamo  # noqa: F401  (imported before forking: saves seconds per rank)

    from autopar.commands.estimate import capture_training_step
    from autopar.cost.mesh import Mesh
    from autopar.errors import AutoparError

    mesh = Mesh.parse(args.mesh)
    if mesh.device.name != "cpu":
        raise AutoparError(f"--mesh {mesh}: validation trains on this machine's gloo ranks; give "
                           f"a CPU mesh such as 4:cpu")
    if args.steps < 1:
        raise AutoparError(f"--steps {args.steps}: time at least one step")
    if args.warmup < 1:
        raise AutoparError(f"--warmup {args.warmup}: take at least one untimed step (the first "
                           f"builds the runtime's state)")
    console = Console()
    priced = capture_training_step(args.model, batch=args.micro_batch)
    rows = []
    for config in candidate_configs(args.model, mesh.world_size, args.global_batch, args.micro_batch):
        try:
            predicted = price_config(priced, mesh, config, args.calibration)
        except AutoparError as err:
            rows.append({"name": describe(config), "config": config, "predicted_s": None,
                         "predicted_mib": None, "error": str(err).split(";")[0][:120]})
            continue
        rows.append({"name": describe(config), "config": config,
                     "predicted_s": predicted.step_time_s,
                     "predicted_mib": predicted.memory_per_gpu_bytes / 2**20})
    if not args.no_plan:
        rows.append({"name": "planner's plan", "config": None, "predicted_s": None,
                     "predicted_mib": None})
    with console.status("") as status:
        for row in rows:
            status.update(f"training {row['name']} on {mesh.world_size} gloo ranks")
            measure(row, args, mesh)
    show(console, rows)
    if args.png:
        draw(rows, args.png, console)
    return 0


def price_config(graph, mesh, config, calibration):
    """The estimate of `config` as it runs: the plan `autopar.compile` makes of it (the ILP's
    placements on its tensor axis), priced with `calibration`."""
    from autopar.api import plan_from_config
    from autopar.cost.plan_estimate import estimate_plan

    return estimate_plan(graph, plan_from_config(graph, mesh, config, calibration=calibration),
                         calibration=calibration)


def candidate_configs(spec: str, world: int, global_batch: int, micro_batch: int) -> list:
    """The forced configurations this model, mesh and batch allow, one of each parallel form."""
    from autopar.cost.config import Config
    from autopar.errors import AutoparError
    from autopar.models import parse_spec

    model = parse_spec(spec)
    layers = getattr(model, "layers", 1)
    heads = getattr(model, "kv_heads", 0) or getattr(model, "heads", 1)
    half = world // 2
    full, selective = Recompute.FULL, Recompute.SELECTIVE
    forms = [dict(dp=world), dict(dp=world, zero=1), dict(dp=world, zero=2), dict(dp=world, zero=3),
             dict(dp=world, recompute=full), dict(dp=world, zero=3, recompute=full),
             dict(tp=2, dp=half), dict(tp=2, dp=half, sequence_parallel=True),
             dict(tp=world), dict(tp=world, recompute=selective),
             dict(pp=2, dp=half), dict(pp=2, dp=half, schedule=Schedule.GPIPE),
             dict(pp=2, tp=half), dict(pp=world), dict(pp=world, schedule=Schedule.ZERO_BUBBLE),
             dict(pp=2, dp=half, virtual=2, schedule=Schedule.INTERLEAVED_1F1B),
             dict(pp=world, recompute=full)]
    configs = []
    for form in forms:
        tp, pp, virtual = form.get("tp", 1), form.get("pp", 1), form.get("virtual", 1)
        if tp * pp * form.get("dp", 1) != world or heads % tp or pp * virtual > layers:
            continue
        try:
            config = Config(global_batch=global_batch, micro_batch=micro_batch,
                            **{"dp": 1, **form})
        except AutoparError:
            continue
        if virtual > 1 and config.micro_batches % pp:
            continue
        if config not in configs:
            configs.append(config)
    return configs


def describe(config) -> str:
    parts = [f"{name}{getattr(config, name)}" for name in ("dp", "tp", "pp")
             if getattr(config, name) > 1]
    if config.zero:
        parts.append(f"zero{config.zero}")
    if config.sequence_parallel:
        parts.append("sp")
    if config.recompute != Recompute.NONE:
        parts.append(f"rc-{config.recompute}")
    if config.pp > 1:
        parts.append(config.schedule + (f" v{config.virtual}" if config.virtual > 1 else ""))
    return " ".join(parts) or "one device"


def measure(row: dict, args, mesh) -> None:
    """Train row's configuration (or, with none, the planner's plan) and record the slowest
    rank's median step time, its peak memory growth, and a failure's message."""
    import autopar
    from autopar.runtime.launch import LaunchError

    try:
        results = autopar.launch(train_rank, mesh.world_size, args.model, str(mesh),
                                 row["config"], args.global_batch, args.micro_batch, args.steps,
                                 args.calibration, args.warmup, timeout=900, pg_timeout=300)
    except LaunchError as err:
        row["error"] = str(err).splitlines()[0][:120]
        return
    steps = [max(r["times"][k] for r in results) for k in range(args.steps)]
    row["measured_s"] = statistics.median(steps)
    row["measured_mib"] = max(r["peak_mib"] for r in results)
    if row["config"] is None:
        row["name"] = f"planner: {results[0]['plan']}"
        # planned with the calibration, so priced with it: its own stages and placements
        row["predicted_s"] = results[0]["predicted_s"]


def train_rank(spec: str, mesh: str, config, global_batch: int, micro_batch: int,
               steps: int, calibration=None, warmup: int = 3) -> dict:
    """One gloo rank: compile `spec` under `config` (the planner's plan when None, planned with
    `calibration`), `warmup` untimed steps, then `steps` timed ones, each between barriers so
    that the slowest rank sets it."""
    import resource
    import time

    import torch
    import torch.distributed as dist

    import autopar
    from autopar.models import build_model, lm_loss, parse_spec

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    model, example_inputs = build_model(spec, device="cpu", batch=micro_batch, seed=SEED)
    compiled = autopar.compile(model, mesh, example_inputs=example_inputs, loss_fn=lm_loss,
                               optimizer=lambda params: torch.optim.SGD(params, lr=1e-3),
                               plan=config, global_batch=global_batch, calibration=calibration)
    generator = torch.Generator().manual_seed(SEED)
    vocab, seq = parse_spec(spec).vocab, example_inputs[0].shape[1]
    ids = torch.randint(0, vocab, (global_batch, seq + 1), generator=generator)
    inputs, targets = ids[:, :-1], ids[:, 1:]
    for _ in range(warmup):
        compiled.step(inputs, targets)
    times = []
    for _ in range(steps):
        dist.barrier()
        start = time.perf_counter()
        compiled.step(inputs, targets)
        dist.barrier()
        times.append(time.perf_counter() - start)
    peak = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) / 1024
    plan = compiled.plan if config is None else None
    return {"times": times, "peak_mib": peak, "plan": _plan_summary(plan) if plan else "",
            "predicted_s": plan.predicted.get("step_time_s") if plan else None}


def _plan_summary(plan) -> str:
    """The plan named as the forced rows are (`describe`), from its first stage's choices: which
    schedule and degrees the planner chose is what a reader compares with them; "rc-mixed" where
    its stages recompute differently."""
    from types import SimpleNamespace

    stage = plan.stages[0]
    recompute = {s.recompute for s in plan.stages}
    return describe(SimpleNamespace(dp=stage.dp, tp=stage.tp, pp=plan.pp, zero=stage.zero,
                                    sequence_parallel=stage.sequence_parallel,
                                    recompute=stage.recompute if len(recompute) == 1 else "mixed",
                                    schedule=plan.schedule,
                                    virtual=plan.virtual))


def kendall_tau(xs: list[float], ys: list[float]) -> float:
    """Kendall's tau-b of two equally long lists (ties in either count as neither)."""
    concordant = discordant = ties_x = ties_y = 0
    for i in range(len(xs)):
        for j in range(i + 1, len(xs)):
            dx, dy = xs[i] - xs[j], ys[i] - ys[j]
            if dx == 0 and dy == 0:
                continue
            if dx == 0:
                ties_x += 1
            elif dy == 0:
                ties_y += 1
            elif (dx > 0) == (dy > 0):
                concordant += 1
            else:
                discordant += 1
    denominator = ((concordant + discordant + ties_x) * (concordant + discordant + ties_y)) ** 0.5
    return (concordant - discordant) / denominator if denominator else 0.0


def show(console: Console, rows: list[dict]) -> None:
    from autopar.commands.output import table as fitted_table

    numbers = ("predicted ms", "measured ms", "error", "predicted MiB", "peak RSS growth MiB")
    table = fitted_table("predicted vs measured step time on gloo ranks", ["configuration", *numbers],
                         right=numbers, wrap=numbers)
    for row in rows:
        measured, predicted = row.get("measured_s"), row.get("predicted_s")
        error = f"{predicted / measured - 1:+.0%}" if measured and predicted else row.get("error", "")
        table.add_row(row["name"], _ms(predicted), _ms(measured), error,
                      _number(row.get("predicted_mib")), _number(row.get("measured_mib")))
    console.print(table)
    done = [r for r in rows if r.get("measured_s") and r.get("predicted_s") and r["config"]]
    if len(done) < 2:
        console.print("fewer than two configurations ran: no correlation to report")
        return
    predicted = [r["predicted_s"] for r in done]
    measured = [r["measured_s"] for r in done]
    errors = [abs(p / m - 1) for p, m in zip(predicted, measured)]
    console.print(f"{len(done)} configurations: Kendall tau {kendall_tau(predicted, measured):+.2f}, "
                  f"median |error| {statistics.median(errors):.0%}, worst {max(errors):.0%}")
    # the estimator's pick among the forced configurations, against the fastest of them; the
    # planner's plan (its own micro-batch size) against everything measured
    forced_fastest = min(measured)
    chosen = min(done, key=lambda r: r["predicted_s"])
    console.print(f"the estimator's fastest configuration, {chosen['name']}, measures "
                  f"{chosen['measured_s'] / forced_fastest:.2f}x the fastest configuration measured")
    fastest = min(r["measured_s"] for r in rows if r.get("measured_s"))
    planned = next((r for r in rows if r["config"] is None and r.get("measured_s")), None)
    if planned:
        console.print(f"{planned['name']} measures {planned['measured_s'] / fastest:.2f}x the "
                      f"fastest measured")


def draw(rows: list[dict], path: Path, console: Console) -> None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        console.print("matplotlib is not installed: no picture drawn")
        return
    done = [r for r in rows if r.get("measured_s") and r.get("predicted_s")]
    figure, axes = plt.subplots(figsize=(6, 6))
    xs, ys = [r["measured_s"] * 1e3 for r in done], [r["predicted_s"] * 1e3 for r in done]
    axes.scatter(xs, ys)
    for row, x, y in zip(done, xs, ys):
        axes.annotate(row["name"], (x, y), fontsize=7)
    low, top = min(xs + ys) / 1.5, max(xs + ys) * 1.5
    axes.plot([low, top], [low, top], color="grey", linewidth=0.8)
    axes.set(xlabel="measured ms per step", ylabel="predicted ms per step", xscale="log",
             yscale="log", xlim=(low, top), ylim=(low, top), title="autopar validate")
    figure.savefig(path, dpi=120, bbox_inches="tight")
    console.print(f"scatter written to {path}")


def _ms(seconds) -> str:
    return f"{seconds * 1e3:.1f}" if seconds else ""


def _number(value) -> str:
    return f"{value:.1f}" if value is not None else ""
