"""`autopar estimate MODEL --mesh NxG:DEVICE --tp T --pp P ...`: predict a Megatron-style
configuration's step time, throughput and memory per device without running it;
`autopar estimate MODEL --plan plan.json` prices a saved plan from its own stages.

The model is captured on the meta device as `autopar plan` and `autopar.compile` capture it, and a
configuration is priced on the placements `autopar.compile(plan=Config(...))` runs: the sharding
ILP's on its tensor-parallel axis (`autopar.plan_from_config`), so the two agree. dp is the world
size over tp x pp. (Published runs are priced on Megatron-LM's own layout: benchmarks/.)
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from autopar.plans.vocabulary import CONTEXT_PARALLEL, RECOMPUTE, SCHEDULES, Recompute, Schedule
from autopar.errors import AutoparError, MeshError


def add_arguments(parser) -> None:
    parser.add_argument("model", help="a preset (gpt3-175b, llama-7b, ...) or a spec such as "
                                      "gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200")
    parser.add_argument("--mesh",
                        help="NODESxGPUS:DEVICE (128x8:a100-80g), GPUS:DEVICE (8:h100-80g), "
                             "then ,host=SIZE and ,power=W where they differ from the device's, or a mesh "
                             "JSON/TOML file (required unless --plan)")
    parser.add_argument("--plan", type=Path, default=None,
                        help="price this plan (written by `autopar plan --out`) of MODEL instead "
                             "of a configuration: its mesh, stages and batch are the plan's")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel degree (default 1)")
    parser.add_argument("--pp", type=int, default=1, help="pipeline stages (default 1)")
    parser.add_argument("--virtual", type=int, default=1,
                        help="model chunks per pipeline rank; >1 means interleaved 1F1B (default 1)")
    parser.add_argument("--global-batch", type=int,
                        help="sequences per step (required unless --plan)")
    parser.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    parser.add_argument("--recompute", choices=RECOMPUTE, default=Recompute.NONE.value)
    parser.add_argument("--zero", type=int, choices=(0, 1, 2, 3), default=0)
    parser.add_argument("--sequence-parallel", action="store_true")
    parser.add_argument("--ep", type=int, default=1,
                        help="expert-parallel degree: each rank holds 1/ep of every MoE layer's "
                             "experts; divides the experts and tp x cp x dp (default 1)")
    parser.add_argument("--cp", type=int, default=1,
                        help="context-parallel degree: every sequence split over cp ranks "
                             "(default 1); both attention forms are priced")
    parser.add_argument("--cp-kind", choices=CONTEXT_PARALLEL, default=None,
                        help="context-parallel attention: K/V around a ring, or Ulysses' "
                             "all-to-alls (default: the cheaper)")
    parser.add_argument("--offload", action="store_true",
                        help="parameters, gradients and optimizer state on the host (needs "
                             "--zero 3)")
    parser.add_argument("--routing-imbalance", type=float, default=1.0,
                        help="the slowest rank's expert rows over the mean (default 1.0: "
                             "balanced routing)")
    parser.add_argument("--schedule", choices=SCHEDULES,
                        default=None, help="default 1f1b, or interleaved-1f1b when --virtual > 1")
    parser.add_argument("--attention", choices=("flash", "unfused"), default="flash",
                        help="attention kernels: FlashAttention, or matmuls around a softmax kernel")
    parser.add_argument("--calibration", type=Path, default=None,
                        help="efficiencies and collectives measured by `autopar calibrate` "
                             "(default: published figures)")
    parser.add_argument("--runtime", choices=("autopar", "torch", "megatron-core",
                                              "megatron-local", "deepspeed-2021"),
                        default="autopar", help="whose overlap of communication to assume: "
                                                "autopar's (default), PyTorch DDP/FSDP's, "
                                                "Megatron-Core's (2024-25), Megatron-LM's local "
                                                "DDP, DeepSpeed's 2021 ZeRO-3")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


class WithLoss(torch.nn.Module):
    """`model(ids)` followed by its loss against `targets`, so that the loss is priced too."""

    def __init__(self, model: torch.nn.Module, loss_fn):
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn

    def forward(self, ids, targets):
        return self.loss_fn(self.model(ids), targets)


def capture_training_step(spec: str, *, batch: int = 1, **overrides):
    """Capture `spec` on meta as one training step: a language model's forward plus its loss."""
    from autopar.tracer import capture
    from autopar.models import build_model, lm_loss

    model, inputs = build_model(spec, device="meta", batch=batch, **overrides)
    if inputs[0].dtype != torch.int64:
        return capture(model, inputs)
    ids = inputs[0]
    return capture(WithLoss(model, lm_loss), (ids, torch.empty_like(ids)))


def parse_mesh(text: str):
    from autopar.cost.mesh import Mesh

    if text.endswith((".json", ".toml")):
        if not Path(text).exists():
            raise MeshError(f"mesh file {text} does not exist")
        return Mesh.load(text)
    return Mesh.parse(text)


def build_config(args, mesh):
    from autopar.cost.config import Config

    per_replica = args.tp * args.pp * args.cp
    if per_replica < 1 or mesh.world_size % per_replica:
        raise AutoparError(f"tp x cp x pp = {args.tp} x {args.cp} x {args.pp} = {per_replica} does "
                           f"not divide the {mesh.world_size} devices of mesh {mesh}; choose "
                           f"degrees whose product divides {mesh.world_size}")
    if args.tp > mesh.gpus_per_node or mesh.gpus_per_node % args.tp:
        raise AutoparError(f"tp={args.tp} must divide the {mesh.gpus_per_node} devices of one node "
                           f"(tensor parallelism needs the fast links inside a node)")
    schedule = args.schedule or (Schedule.INTERLEAVED_1F1B if args.virtual > 1 else Schedule.ONE_F_ONE_B)
    return Config(tp=args.tp, pp=args.pp, dp=mesh.world_size // per_replica, virtual=args.virtual,
                  global_batch=args.global_batch, micro_batch=args.micro_batch,
                  recompute=args.recompute, zero=args.zero,
                  sequence_parallel=args.sequence_parallel, schedule=schedule, ep=args.ep,
                  cp=args.cp, cp_kind=args.cp_kind or "ring", offload=args.offload,
                  routing_imbalance=args.routing_imbalance)


def capture_model(spec: str):
    """`spec` captured on meta as `autopar plan` captures it (so that fingerprints match)."""
    from autopar.models import build_model
    from autopar.tracer import capture

    model, inputs = build_model(spec)
    return capture(model, example_inputs=inputs)


def run(args) -> int:
    from autopar.cost.compute import Efficiencies
    from autopar.cost.estimator import estimate

    from autopar.api import check_planning, plan_from_config
    from autopar.cost.plan_estimate import tensor_placements
    from autopar.models import parse_spec

    if args.plan is not None:
        return _run_plan(args)
    if args.mesh is None or args.global_batch is None:
        raise AutoparError("autopar estimate needs --mesh and --global-batch (or --plan plan.json)")
    mesh = parse_mesh(args.mesh)
    check_planning(args.global_batch, 1.0, None)   # the batch's bounds; estimate has no time limit
    parse_spec(args.model)
    config = build_config(args, mesh)
    efficiencies = Efficiencies.load(args.calibration) if args.calibration else None
    status = Console(stderr=True)
    if efficiencies and efficiencies.device and efficiencies.device != mesh.device.name:
        status.print(f"[yellow]warning:[/] {args.calibration} was measured on "
                     f"{efficiencies.device}, the mesh has {mesh.device.name}")
    with status.status(f"capturing {args.model} on the meta device"):
        graph = capture_model(args.model)
    placements = None
    if config.tp > 1:
        with status.status("placing each op on the tensor-parallel axis (sharding ILP)"):
            placements = tensor_placements(graph, plan_from_config(graph, mesh, config,
                                                                   calibration=args.calibration))
    price = lambda config: estimate(graph, mesh, config, attention=args.attention, runtime=args.runtime,
                                    calibration=args.calibration, placements=placements)
    config, result, forms = _context_parallel_forms(config, price, fixed=args.cp_kind is not None)
    report = {"model": args.model, "mesh": str(mesh), "config": config.to_dict(),
              "attention": args.attention, "runtime": args.runtime, "calibration": str(args.calibration or ""),
              **result.to_dict(), **({"context_parallel": forms} if forms else {})}
    config = report["config"]
    title = (f"{report['model']} on {report['mesh']}: tp={config['tp']} pp={config['pp']} "
             f"dp={config['dp']} v={config['virtual']} b={config['micro_batch']} "
             f"B={config['global_batch']} recompute={config['recompute']} zero={config['zero']}"
             + "".join(f" {name}={config[name]}" for name in ("ep", "cp") if config[name] > 1)
             + (f" ({config['cp_kind']})" if config["cp"] > 1 else "")
             + (" offload" if config["offload"] else ""))
    _output(args, report, title)
    return 0


def _context_parallel_forms(config, price, *, fixed: bool):
    """The configuration priced; under context parallelism both attention forms, each with its
    step time or why it cannot run, and unless one was asked for, the cheaper one's estimate."""
    if config.cp == 1:
        return config, price(config), {}
    forms, results = {}, {}
    for kind in CONTEXT_PARALLEL:
        try:
            results[kind] = price(dataclasses.replace(config, cp_kind=kind))
            forms[kind] = {"step_time_s": results[kind].step_time_s}
        except AutoparError as err:
            forms[kind] = {"refused": str(err)}
    if not results:
        raise AutoparError(forms[config.cp_kind]["refused"])
    cheaper = min(results, key=lambda kind: results[kind].step_time_s)
    forms["cheaper"] = cheaper
    chosen = config.cp_kind if fixed else cheaper
    if chosen not in results:
        raise AutoparError(forms[chosen]["refused"])
    return dataclasses.replace(config, cp_kind=chosen), results[chosen], forms


def _run_plan(args) -> int:
    """A saved plan priced from its own stages: `autopar.cost.estimate_plan`, the figures the
    plan records as `predicted` when the calibration and runtime are the planner's."""
    from autopar.cost.mesh import Mesh
    from autopar.cost.plan_estimate import estimate_plan
    from autopar.plans import Plan

    if args.mesh is not None or args.global_batch is not None:
        raise AutoparError("--plan takes its mesh and global batch from the plan; drop --mesh "
                           "and --global-batch")
    plan = Plan.load(args.plan)
    with Console(stderr=True).status(f"capturing {args.model} on the meta device"):
        graph = capture_model(args.model)
    result = estimate_plan(graph, plan, runtime=args.runtime, attention=args.attention,
                           calibration=args.calibration)
    mesh = Mesh.from_dict(plan.mesh)
    report = {"model": args.model, "mesh": str(mesh), "plan": str(args.plan),
              "summary": plan.summary(), "attention": args.attention, "runtime": args.runtime,
              "calibration": str(args.calibration or ""), **result.to_dict()}
    _output(args, report, f"{args.model} on {mesh}: {plan.summary()}")
    return 0


def _output(args, report: dict, title: str) -> None:
    if args.json:
        print(json.dumps(report, indent=2))
    else:
        _print(Console(), report, title)


def _print(console: Console, report: dict, title: str) -> None:
    summary = Table(title=title, show_header=False)
    summary.add_column("quantity")
    summary.add_column("value", justify="right")
    summary.add_row("step time", _seconds(report["step_time_s"]))
    summary.add_row("TFLOP/s per GPU (hardware)", f"{report['tflops_per_gpu']:.4g}")
    summary.add_row("TFLOP/s per GPU (model)", f"{report['model_tflops_per_gpu']:.4g}")
    summary.add_row("MFU", f"{report['mfu']:.1%}")
    summary.add_row("micro-batches per step", str(report["micro_batches"]))
    for kind, form in report.get("context_parallel", {}).items():
        if kind != "cheaper":
            price = _seconds(form["step_time_s"]) if "step_time_s" in form else "cannot run"
            mark = " (cheaper)" if kind == report["context_parallel"]["cheaper"] else ""
            summary.add_row(f"context parallel: {kind}{mark}", price)
    if report.get("host_memory_bytes"):
        limit = report.get("host_memory_limit_bytes")
        room = (f" of {_bytes(limit)} ({'fits' if report['host_memory_bytes'] <= limit else 'DOES NOT FIT'})"
                if limit else " (the host's memory is not stated)")
        summary.add_row("host memory per GPU (offloaded)", _bytes(report["host_memory_bytes"]) + room)
    summary.add_row("bubble fraction", f"{report['bubble_fraction']:.3f}")
    # the device's own memory (`fits` also counts the host's, shown above)
    fits = "fits" if report["memory_per_gpu_bytes"] <= report["memory_limit_bytes"] else "DOES NOT FIT"
    summary.add_row("memory per GPU", f"{_bytes(report['memory_per_gpu_bytes'])} of "
                                      f"{_bytes(report['memory_limit_bytes'])} ({fits})")
    console.print(summary)
    parts = Table(title="breakdown")
    parts.add_column("step time")
    parts.add_column("", justify="right")
    parts.add_column("memory per GPU")
    parts.add_column("", justify="right")
    times = list(report["breakdown"].items()) + [(f"  {k} comm", v) for k, v in
                                                report["comm_breakdown"].items()]
    memory = list(report["memory_breakdown"].items())
    for row in range(max(len(times), len(memory))):
        t = times[row] if row < len(times) else ("", None)
        m = memory[row] if row < len(memory) else ("", None)
        parts.add_row(t[0], "" if t[1] is None else _seconds(t[1]),
                      m[0], "" if m[1] is None else _bytes(m[1]))
    console.print(parts)


def _seconds(value: float) -> str:
    return f"{value:.3f} s" if abs(value) >= 1 else f"{value * 1e3:.3g} ms"


def _bytes(value: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if value >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"
