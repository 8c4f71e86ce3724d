"""`autopar demo [--ranks 4|8] [--steps N]`: the whole compiler on this machine.

A small GPT is planned for a CPU mesh of gloo processes under a memory limit that a plain
data-parallel replica does not fit (a quarter of what data parallelism would need per device), so
the plan has to shard the model: pipeline stages, tensor parallelism or ZeRO. The plan is printed,
the ranks are started, and they train for N steps; then the same model trains in this process on
the same batches and the two loss curves are printed side by side and drawn in a PNG.

The batches are a learnable toy language: each sequence counts from a random start with a random
stride (mod the vocabulary), so the loss falls visibly within a few dozen steps.
"""

from __future__ import annotations

import torch
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

from autopar.errors import format_bytes

MODEL = "gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128"
MICRO_BATCH = 2
GLOBAL_BATCH = 16
SEED = 0
MAX_STEPS = 10_000


def add_arguments(parser):
    parser.add_argument("--ranks", type=int, choices=(4, 8), default=4,
                        help="gloo processes, one per CPU 'device' of the mesh (default 4)")
    parser.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    parser.add_argument("--memory-limit",
                        help="bytes per device for the planner (default: a quarter of what plain "
                             "data parallelism needs, so the plan must shard the model)")
    parser.add_argument("--png", default="autopar-demo-loss.png",
                        help="where to draw the loss curves (default autopar-demo-loss.png)")
    parser.add_argument("--time-limit", type=float, default=20.0, help="seconds for the planner")


def run(args) -> int:
    import autopar
    from autopar.api import check_planning
    from autopar.commands.explain import render
    from autopar.commands.output import PLOT_EXTRA, can_plot, check_output

    if not 1 <= args.steps <= MAX_STEPS:
        raise autopar.AutoparError(f"--steps {args.steps}: train from 1 to {MAX_STEPS} steps")
    check_planning(GLOBAL_BATCH, args.time_limit, args.memory_limit)
    console = Console()
    # checked before planning and training, so that a bad path costs nothing; without matplotlib
    # the demo still trains and compares, and says why there is no picture
    png = check_output(args.png, "--png") if can_plot() else None
    if png is None:
        console.print(f"the loss curves will not be drawn: that needs matplotlib ({PLOT_EXTRA})")
    mesh = autopar.Mesh.parse(f"{args.ranks}:cpu")
    graph, plan = make_plan(mesh, args.memory_limit, args.time_limit, console)
    render(plan, console)
    batches = counting_batches(args.steps, plan.global_batch)
    console.print(f"\nstarting {args.ranks} gloo processes, {args.steps} steps of "
                  f"{plan.global_batch} sequences")
    results = autopar.launch(train_rank, args.ranks, str(mesh), graph, plan, batches, timeout=600,
                             pg_timeout=120)
    parallel = results[0]
    with console.status("the same training in one process"):
        single = train_single(batches)
    show_curves(console, parallel, single, png)
    return 0


def make_plan(mesh, memory_limit, time_limit: float, console: Console):
    """The demo model's graph and plan; by default under a quarter of the memory a data-parallel
    replica needs (half still fits plain data parallelism with recompute and ZeRO-1, which shows
    less)."""
    import autopar
    from autopar.api import plan_graph
    from autopar.tracer import capture
    from autopar.models import build_model

    model, example_inputs = build_model(MODEL, batch=MICRO_BATCH)
    with console.status(f"planning {MODEL} for {mesh}"):
        graph = capture(model, example_inputs=example_inputs)
        if memory_limit is None:
            replica = autopar.estimate(graph, mesh, autopar.Config(
                dp=mesh.world_size, global_batch=GLOBAL_BATCH, micro_batch=MICRO_BATCH))
            memory_limit = int(replica.memory_per_gpu_bytes // 4)
            console.print(f"data parallelism would need {format_bytes(replica.memory_per_gpu_bytes)} "
                          f"per device; planning under {format_bytes(memory_limit)}")
        return graph, plan_graph(graph, mesh, global_batch=GLOBAL_BATCH, memory_limit=memory_limit,
                                 time_limit=time_limit)


def counting_batches(steps: int, batch: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(inputs, next-token targets) per step: sequences start + stride * i mod vocab."""
    from autopar.models import parse_spec

    config = parse_spec(MODEL)
    generator = torch.Generator().manual_seed(SEED)
    positions = torch.arange(config.seq + 1)
    result = []
    for _ in range(steps):
        start = torch.randint(0, config.vocab, (batch, 1), generator=generator)
        stride = torch.randint(1, 8, (batch, 1), generator=generator)
        tokens = (start + stride * positions) % config.vocab
        result.append((tokens[:, :-1], tokens[:, 1:]))
    return result


def make_optimizer(params):
    # eps well above float noise: Adam's default 1e-8 turns 1e-12 gradient noise into visible updates
    return torch.optim.AdamW(params, lr=3e-3, eps=1e-6)


def train_rank(mesh: str, graph, plan, batches) -> list[float]:
    """One gloo rank: compile the demo model under `plan` (reusing the parent's capture, `graph`)
    and train; rank 0 shows the progress."""
    import torch.distributed as dist

    import autopar
    from autopar.models import build_model, lm_loss

    model, example_inputs = build_model(MODEL, device="cpu", batch=MICRO_BATCH, seed=SEED)
    compiled = autopar.compile(model, mesh, example_inputs=example_inputs, loss_fn=lm_loss,
                               optimizer=make_optimizer, plan=plan, graph=graph)
    losses = []
    with Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.description}"),
                  TimeElapsedColumn(), disable=dist.get_rank() != 0) as progress:
        task = progress.add_task("", total=len(batches))
        for inputs, targets in batches:
            losses.append(compiled.step(inputs, targets))
            progress.update(task, advance=1, description=f"loss {losses[-1]:.4f}")
    return losses


def train_single(batches) -> list[float]:
    from autopar.models import build_model, lm_loss
    from autopar.testing.equivalence import train_single_process

    model, _ = build_model(MODEL, device="cpu", batch=MICRO_BATCH, seed=SEED)
    losses, _ = train_single_process(model, batches, lm_loss, make_optimizer)
    return losses


def show_curves(console: Console, parallel: list[float], single: list[float], png) -> None:
    from autopar.commands.output import plain
    from autopar.commands.output import table as new_table

    columns = ["step", "parallel", "one process", "|difference|"]
    table = new_table("loss: parallel run against one process", columns, right=tuple(columns))
    for step, (a, b) in enumerate(zip(parallel, single)):
        table.add_row(str(step + 1), f"{a:.6f}", f"{b:.6f}", f"{abs(a - b):.2e}")
    console.print(table)
    worst = max(range(len(single)), key=lambda i: abs(parallel[i] - single[i]))
    console.print(f"largest difference {abs(parallel[worst] - single[worst]):.2e} at step {worst + 1} "
                  f"(loss {single[0]:.3f} -> {single[-1]:.3f})")
    if png is not None:
        save_curves(parallel, single, png)
        console.print(plain(f"loss curves drawn in {png}"))


def save_curves(parallel: list[float], single: list[float], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = range(1, len(single) + 1)
    figure, axis = plt.subplots(figsize=(7, 4))
    axis.plot(steps, single, label="one process", linewidth=3, alpha=0.5)
    axis.plot(steps, parallel, label="autopar, gloo ranks", linestyle="--", marker=".")
    axis.set_xlabel("step")
    axis.set_ylabel("loss")
    axis.legend()
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)
