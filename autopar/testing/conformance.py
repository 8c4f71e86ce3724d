"""Does autopar train a HuggingFace architecture under a parallel form exactly like one process?

    from autopar.testing.conformance import FORMS, run_case
    result = run_case("llama", "dp2 x tp2", timeout=300)   # a CaseResult: pass, fail or refused

One case is one architecture of `autopar.models.hf_zoo` under one form below, on real gloo ranks
(`autopar.launch`): 3 steps of AdamW (eps=1e-2: see `adamw`),
compared with one process by `autopar.testing.equivalence`: the loss at every step and the final
parameters. An `AutoparError` before the first step is a refusal (autopar says what it cannot run
and why); any other error, or a difference, is a failure.

Free plans are made on rank 0 and sent to every rank, as `autopar.compile` does. The
"memory-limited" forms ask the planner for a plan under the largest of a few decreasing memory
limits (fractions of what its unconstrained plan needs per device) that makes it pipeline, or
split the experts of a mixture of experts (on nodes of one device, where tensor parallelism
cannot split them instead). Forms with expert parallelism run on the MoE architectures only
(`Form.experts`, `Architecture.moe`). Forms with context parallelism split every sequence of 16
tokens over the cp ranks (a ring, or all-to-alls of the heads); `dp4 zero3 offload` keeps ZeRO-3's
shards, gradients and optimizer state on the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from autopar.cost.config import Config
from autopar.errors import AutoparError, format_bytes
from autopar.models.hf_zoo import ARCHITECTURES, loss_fn, resolve
from autopar.testing.equivalence import mismatches, train_single_process

GLOBAL_BATCH, STEPS = 8, 3
# of the unconstrained plan's predicted memory per device: tried in turn until the plan pipelines
MEMORY_FRACTIONS = tuple(round(1.0 - 0.05 * k, 2) for k in range(16))      # 1.0 down to 0.25


@dataclass(frozen=True, slots=True)
class Form:
    mesh: str
    config: Config | None = None      # None: the planner's own plan
    pipeline_by_memory: bool = False  # plan under a memory limit that makes it pipeline
    experts_by_memory: bool = False   # plan under a memory limit that makes it split experts

    @property
    def experts(self) -> bool:
        """Whether the form splits experts: for mixtures of experts only."""
        return self.experts_by_memory or (self.config is not None and self.config.ep > 1)

    @property
    def world_size(self) -> int:
        nodes, _, per_node = self.mesh.split(":")[0].rpartition("x")
        return int(per_node) * int(nodes or 1)


def _config(**degrees) -> Config:
    return Config(global_batch=GLOBAL_BATCH, **degrees)


FORMS: dict[str, Form] = {
    "plan 4:cpu": Form("4:cpu"),
    "dp2 x tp2": Form("4:cpu", _config(dp=2, tp=2, micro_batch=4)),
    "pp2 x dp2 1f1b": Form("4:cpu", _config(pp=2, dp=2, micro_batch=2, schedule="1f1b")),
    "plan 2x4 memory-limited": Form("2x4:cpu", pipeline_by_memory=True),
    "tp2 x zero3 x dp2": Form("4:cpu", _config(tp=2, dp=2, zero=3, micro_batch=4)),
    "dp2 x tp2 x pp2": Form("8:cpu", _config(dp=2, tp=2, pp=2, micro_batch=2)),
    "pp2 interleaved 1f1b": Form("2:cpu", _config(pp=2, virtual=2, micro_batch=2,
                                                  schedule="interleaved-1f1b")),
    "tp2 x pp2 sp": Form("4:cpu", _config(tp=2, pp=2, micro_batch=2, sequence_parallel=True)),
    "ep4": Form("4:cpu", _config(dp=4, ep=4, micro_batch=2)),
    "dp2 x tp2 x ep2": Form("4:cpu", _config(dp=2, tp=2, ep=2, micro_batch=4)),
    "pp2 x dp2 x ep2 1f1b": Form("4:cpu", _config(pp=2, dp=2, ep=2, micro_batch=2, schedule="1f1b")),
    "plan 4x1 memory-limited ep": Form("4x1:cpu", experts_by_memory=True),
    # context parallelism: every sequence of 16 split into 2 x cp chunks (causal load balance)
    "cp4": Form("4:cpu", _config(cp=4, micro_batch=8)),
    "dp2 x cp2": Form("4:cpu", _config(dp=2, cp=2, micro_batch=4)),
    "tp2 x cp2": Form("4:cpu", _config(tp=2, cp=2, micro_batch=8)),
    "pp2 x cp2 1f1b": Form("4:cpu", _config(pp=2, cp=2, micro_batch=2, schedule="1f1b")),
    "dp2 x cp2 all-to-all": Form("4:cpu", _config(dp=2, cp=2, cp_kind="all-to-all", micro_batch=4)),
    "dp4 zero3 offload": Form("4:cpu", _config(dp=4, zero=3, offload=True, micro_batch=2)),
}


@dataclass(frozen=True, slots=True)
class CaseResult:
    arch: str
    form: str
    status: str                       # "pass" | "fail" | "refused"
    detail: str = ""                  # the error's first line, the first difference, or the plan
    seconds: float = 0.0


def adamw(params):
    """AdamW with an eps above most gradients of these tiny models, so that an update follows the
    gradient's size (a gradient off by a factor shows) and float noise stays noise. With eps=1e-3,
    fp32 rounding grew chaotically in T5 (ReLU feed-forward): one process accumulating the batch in
    4 micro-batches ended 3.5e-4 away from itself at the whole batch on an AVX2 CPU, while in
    float64 the two agree exactly."""
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-2)


def batches(arch_name: str) -> list[tuple[torch.Tensor, ...]]:
    generator = torch.Generator().manual_seed(1)
    return [ARCHITECTURES[arch_name].batch(GLOBAL_BATCH, generator) for _ in range(STEPS)]


def run_case(arch_name: str, form_name: str, timeout: float = 600.0) -> CaseResult:
    """One case on its own ranks. Call from a process that has not run torch compute yet, or
    whose ranks can still fork safely (import torch._dynamo first, as the tests do)."""
    import time

    from autopar.runtime.launch import LaunchError, launch

    form = FORMS[form_name]
    model_class = resolve([arch_name])[arch_name]    # before forking: see hf_zoo.resolve
    started = time.monotonic()
    try:
        outcome = launch(_train_case, form.world_size, arch_name, model_class, form,
                         timeout=timeout, pg_timeout=min(timeout, 120.0))[0]
        status, detail = outcome
    except LaunchError as err:
        status, detail = _classify(str(err))
    return CaseResult(arch_name, form_name, status, detail, time.monotonic() - started)


def _classify(message: str) -> tuple[str, str]:
    """A rank's failure: refused when compile raised an AutoparError, failed otherwise."""
    body = message.split(": ", 1)[1] if message.startswith("rank ") else message
    lines = [line.strip() for line in body.splitlines() if line.strip()]
    first = lines[0] if lines else message
    if first.endswith(":") and len(lines) > 1:      # "RuntimeError:" with its message below
        first = f"{first} {lines[1]}"
    if first.startswith("Refused: "):
        return "refused", first.removeprefix("Refused: ")
    return "fail", first


class Refused(Exception):
    """An AutoparError raised while planning or compiling: autopar declined the case."""


def _train_case(arch_name: str, model_class, form: Form) -> tuple[str, str]:
    """On every rank: plan, compile, train; rank 0 compares with one process."""
    import torch.distributed as dist

    import autopar

    arch = ARCHITECTURES[arch_name]
    data = batches(arch_name)
    example = tuple(data[0][:-1])
    try:
        if form.config is not None:
            micro = tuple(x[:form.config.micro_batch] for x in example)
            plan, example = form.config, micro
        else:
            plan = _free_plan(arch.build(model_class), form, example)
        cm = autopar.compile(_build(arch, model_class, form), form.mesh, example_inputs=example,
                             loss_fn=loss_fn, optimizer=adamw, plan=plan, global_batch=GLOBAL_BATCH)
    except AutoparError as err:
        raise Refused(f"{type(err).__name__}: {err}".replace("\n", " ")) from err
    losses = [cm.step(*batch) for batch in data]
    state = cm.full_state_dict()
    if dist.get_rank() != 0:
        return "pass", ""
    reference = train_single_process(_build(arch, model_class, form), data, loss_fn, adamw)
    found = mismatches(reference, losses, state)
    summary = _describe(cm)
    return ("fail", f"{len(found)} differences, first: {found[0]} ({summary})") if found \
        else ("pass", summary)


def _build(arch, model_class, form: Form):
    """The architecture's model; under context parallelism a language model runs attention
    without a traced mask (causal for a decoder, bidirectional for an encoder, over its sliding
    windows where it has them: autopar.models.hf_attention.causal_sdpa, what a user splitting
    its sequence does; it computes what the model computes without padding). Encoder-decoders
    and image models keep their masks, which autopar refuses to split: the table says so."""
    from autopar.models.hf_attention import causal_sdpa

    model = arch.build(model_class)
    split = form.config is not None and form.config.cp > 1
    plain = not (arch.encoder_decoder or arch.images)
    return causal_sdpa(model) if split and plain else model


def _describe(cm) -> str:
    plan = getattr(cm, "plan", None)
    return plan.summary() if plan is not None and hasattr(plan, "summary") else ""


def _free_plan(model, form: Form, example: tuple):
    """Rank 0 plans (under a memory limit that makes it pipeline, for that form) and every rank
    gets the same plan; a planning error is raised on every rank."""
    import torch.distributed as dist

    import autopar
    from autopar.api import plan_graph
    from autopar.plans import Plan

    message = [None]
    if dist.get_rank() == 0:
        try:
            graph = autopar.capture(model, example_inputs=example)
            plan = plan_graph(graph, form.mesh, global_batch=GLOBAL_BATCH, time_limit=30)
            if form.pipeline_by_memory or form.experts_by_memory:
                plan = _plan_under_memory(graph, form, plan)
            message[0] = ("plan", plan.to_dict())
        except AutoparError as err:
            message[0] = ("error", err)
    dist.broadcast_object_list(message, src=0)
    kind, payload = message[0]
    if kind == "error":
        raise payload
    return Plan.from_dict(payload)


def _plan_under_memory(graph, form: Form, unconstrained):
    """The plan under the largest memory limit (a fraction of the unconstrained plan's memory
    per device) under which the planner pipelines (or splits experts, as the form asks)."""
    from autopar.api import plan_graph

    wanted = "split experts" if form.experts_by_memory else "pipeline"
    needed = unconstrained.predicted["memory_per_gpu_bytes"]
    last_error = None
    for fraction in MEMORY_FRACTIONS:
        try:
            plan = plan_graph(graph, form.mesh, global_batch=GLOBAL_BATCH, time_limit=30,
                              memory_limit=int(needed * fraction))
        except AutoparError as err:
            last_error = err
            continue
        if (plan.ep > 1) if form.experts_by_memory else (len(plan.stages) > 1):
            return plan
    raise AutoparError(f"no memory limit down to {MEMORY_FRACTIONS[-1]:.0%} of the unconstrained "
                       f"plan's {format_bytes(needed)} per device makes the planner {wanted}"
                       + (f" (last: {last_error})" if last_error else ""))
