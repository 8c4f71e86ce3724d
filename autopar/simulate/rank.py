"""One rank of a plan, built and stepped on fake tensors over a fake process group.

`simulate_rank` does what `autopar.compile` does on that rank (`build_runtime`: the stage split,
the passes, DTensor placements, FSDP2, the schedule, the optimizer) and runs one training step
of the plan's schedule, in this process, with no devices and no peers: torch's fake process
group answers every collective at once, and FakeTensorMode gives every tensor a shape and no
storage. What it measures does not depend on a device: the bytes the rank's tensors hold at
their peak (memory.py) and every collective it issues (collectives.py).

The tensors live on the CPU device (a CPU build of torch has no CUDA streams for FSDP2 to use);
an offloaded plan's host states are told apart and counted apart (`_offloaded_states_on_host`).
FSDP2 on a CPU mesh would reduce-scatter by all-reduce (autopar.runtime.gloo_reduce); a
simulated rank stands for a GPU's and keeps NCCL's reduce-scatter.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import time
from unittest import mock
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.fsdp._fully_shard import _fsdp_param
from torch.distributed.pipelining import schedules
from torch.distributed.pipelining.stage import InferenceMode
from torch.distributed.tensor import placement_types
from torch.distributed._functional_collectives import _group_or_group_name, _resolve_group

from autopar.errors import AutoparError
from autopar.passes.expert_dispatch import ExpertParallel
from autopar.plans import Plan
from autopar.runtime.build import build_runtime
from autopar.runtime.fsdp_groups import fsdp_param_groups
from autopar.runtime.rank_grid import pipeline_layout
from autopar.simulate.collectives import CollectiveRecorder
from autopar.simulate.folding import folding_repeats
from autopar.simulate.groups import axis_namer
from autopar.simulate.kernels import for_gpus, kernels_as_the_device_runs
from autopar.simulate.memory import MemoryRecorder


@dataclass(kw_only=True, slots=True)
class RankRun:
    """What one simulated step of one rank held and sent."""
    rank: int
    stages: list[int]
    peak_memory_bytes: int                              # of the step, as a GPU run's reset peak
    host_peak_memory_bytes: int = 0                     # the offloaded states' (memory.py)
    collectives: list = field(default_factory=list)     # Collective records, in issue order
    build_peak_memory_bytes: int = 0                    # while the runtime was built
    seconds: float = 0.0


def simulate_rank(model: nn.Module, plan: Plan, rank: int, *, example_inputs: tuple,
                  targets: torch.Tensor, loss_fn, optimizer=None, graph=None,
                  fold: bool = True) -> RankRun:
    """Build `rank`'s program for `plan` from `model` (built on the meta device) and run one step
    on a global batch shaped like `example_inputs` and `targets` (one sequence each, repeated).
    `fold`: run one iteration of each run of repeating ones (folding.py)."""
    if not 0 <= rank < plan.world_size:
        raise AutoparError(f"rank {rank} is not in the plan, whose ranks are 0..{plan.world_size - 1}")
    if dist.is_initialized():
        raise AutoparError("a process group is already running in this process; simulate in a "
                           "process of its own (autopar simulate)")
    import torch.testing._internal.distributed.fake_pg  # noqa: F401  (registers the "fake" backend)

    started = time.monotonic()
    store = torch.testing._internal.distributed.fake_pg.FakeStore()
    dist.init_process_group("fake", rank=rank, world_size=plan.world_size, store=store)
    try:
        fake = FakeTensorMode(allow_non_fake_inputs=True)
        memory = MemoryRecorder(fake)
        sent = CollectiveRecorder(axis_namer(plan))
        with (fake, memory, _all_to_all_as_the_device_does(plan), kernels_as_the_device_runs(plan),
              _transfers_held_until_waited()):
            with _only_the_rank_s_shards_made():
                compiled = build_runtime(model, plan, example_inputs=example_inputs,
                                         loss_fn=loss_fn, optimizer=optimizer or _adamw(plan),
                                         graph=graph, device="cpu")
            _route_balanced(compiled)
            _agree_on_static_shapes(compiled.schedule)
            offloaded = _offloaded_states_on_host(compiled, memory)
            with memory.allocating_on_host() if offloaded else contextlib.nullcontext():
                _hold_optimizer_state(compiled.optimizer)
            # the step's own peak, as the collectives are the step's: building passes through
            # transients the step never holds (the starting state broadcast in buckets of
            # BROADCAST_BUCKET_BYTES), and a run on a GPU resets its peak before the step it measures
            build_peak = memory.reset_peak()
            batch = [_rows(x, plan.global_batch) for x in (*example_inputs, targets)]
            with sent, sent.implicit_redistributions(), \
                    (folding_repeats(compiled.schedule, sent) if fold else contextlib.nullcontext()):
                compiled.step(*batch)
        layout = pipeline_layout(plan)
        return RankRun(rank=rank, stages=list(layout.own_stages(rank)), peak_memory_bytes=memory.peak_now(),
                       host_peak_memory_bytes=memory.host_peak,
                       collectives=sent.collectives, seconds=time.monotonic() - started,
                       build_peak_memory_bytes=build_peak)
    finally:
        dist.destroy_process_group()


def simulate_ranks(model: nn.Module, plan: Plan, ranks: list[int], *, example_inputs: tuple,
                   targets: torch.Tensor, loss_fn, optimizer=None, graph=None, progress=None,
                   fold: bool = True) -> list[RankRun]:
    """`simulate_rank` for each of `ranks`, each in a forked process of its own: torch keeps
    process groups' names and device meshes in caches that outlive a process group, so a second
    world in the same process finds the first one's. `progress(rank, done, total)` before each."""
    runs = []
    context = multiprocessing.get_context("fork")
    for done, rank in enumerate(ranks):
        if progress is not None:
            progress(rank, done, len(ranks))
        receive, send = context.Pipe(duplex=False)
        child = context.Process(target=_simulate_in_child, args=(
            send, model, plan, rank, example_inputs, targets, loss_fn, optimizer, graph, fold))
        child.start()
        send.close()
        outcome = receive.recv() if receive.poll(None) else None
        child.join()
        if isinstance(outcome, BaseException):
            raise outcome
        if not isinstance(outcome, RankRun):
            raise AutoparError(f"simulating rank {rank} ended with exit code {child.exitcode} and no "
                               f"report (out of host memory?)")
        runs.append(outcome)
    return runs


def _simulate_in_child(send, model, plan, rank, example_inputs, targets, loss_fn, optimizer, graph,
                       fold):
    try:
        send.send(simulate_rank(model, plan, rank, example_inputs=example_inputs, targets=targets,
                                loss_fn=loss_fn, optimizer=optimizer, graph=graph, fold=fold))
    except Exception as error:     # handed to the parent, which raises it
        send.send(error)
    finally:
        send.close()


def _route_balanced(compiled) -> None:
    """Mixtures of experts route each token by its values, which fake tensors do not have: each
    rank's expert layers send every expert an equal share of their rows, as the estimator assumes
    (autopar.passes.expert_dispatch)."""
    for program in compiled.programs:
        for module in program.module.modules():
            if isinstance(module, ExpertParallel):
                module.balanced_routing = True


@contextlib.contextmanager
def _all_to_all_as_the_device_does(plan: Plan):
    """DTensor on a CPU process group moves a value from one dim's split to another's by an
    all-gather and a chunk (gloo has no all-to-all), where the GPUs the plan is for run one
    all-to-all, sending 1/n of the gather's bytes. A simulated rank of a GPU plan issues the
    all-to-all (the fake process group takes it), so its record is the device's."""
    if not for_gpus(plan):
        yield
        return

    def all_to_all(local, gather_dim, shard_dim, mesh, mesh_dim):
        group = _group_or_group_name(_resolve_group((mesh, mesh_dim)))
        return torch.ops._dtensor.shard_dim_alltoall(local, gather_dim, shard_dim, group)

    saved = placement_types.shard_dim_alltoall
    placement_types.shard_dim_alltoall = all_to_all
    try:
        yield
    finally:
        placement_types.shard_dim_alltoall = saved


class _Chunks:
    """`torch.chunk(tensor, n, dim)` padded with empty tensors to n (FSDP2's
    `_chunk_with_empty`), each chunk made when asked for: the same views, without the n - 1
    this rank never reads."""

    def __init__(self, tensor: torch.Tensor, n: int, dim: int):
        self.tensor, self.n, self.dim = tensor, n, dim
        self.size = -(-tensor.size(dim) // n) if tensor.size(dim) else 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        index, length = range(self.n)[index], self.tensor.size(self.dim)
        if not length:          # torch.chunk gives n empty views of an empty tensor
            return self.tensor.narrow(self.dim, 0, 0)
        start = index * self.size
        if start < length:
            return self.tensor.narrow(self.dim, start, min(self.size, length - start))
        return self[0].new_empty(0)


def _only_the_rank_s_shards_made():
    """FSDP2 shards a parameter by chunking it into a piece for every rank of its group and
    keeping its own (and the first's size): on a fake tensor of a 1024-rank group, 1024 fake
    tensors a parameter, two thirds of a DeepSeek-V3 rank's simulation. Here it is handed the
    chunks it reads, as views of the same offsets and sizes."""
    return mock.patch.object(_fsdp_param, "_chunk_with_empty", _Chunks)


class _HeldWork:
    """A peer-to-peer work that keeps its tensors until waited, as gloo's and NCCL's do."""

    def __init__(self, work, tensors: list):
        self.work, self.tensors = work, tensors

    def wait(self, *args, **kwargs):
        self.tensors = None
        return self.work.wait(*args, **kwargs)


def _transfers_held_until_waited():
    """A real process group's send and receive works hold their tensors until waited; the fake
    one's hold nothing. torch's schedules wait some sends only at the step's end (its schedule
    runtime, which runs the interleaved and zero-bubble schedules, keeps every micro-batch's
    sent activations and gradients until then), so the simulated rank's works hold theirs too."""
    batch_p2p = schedules._batch_p2p

    def holding(p2p_ops, desc=None):
        return [_HeldWork(work, [op.tensor for op in p2p_ops]) for work in batch_p2p(p2p_ops, desc=desc)]

    return mock.patch.object(schedules, "_batch_p2p", holding)


def _offloaded_states_on_host(compiled, memory: MemoryRecorder) -> bool:
    """Count what FSDP2's CPUOffloadPolicy keeps on the host as the host's: each offloaded
    parameter's shard, its gradient shard (the reduce-scatter's output, which a GPU run copies
    down and frees: here the copy is the output itself, moved when FSDP2 hands it to the
    parameter) and, when the optimizer steps only such parameters, what its step makes (Adam's
    state and temporaries: the host steps). Whether anything is offloaded."""
    offloaded = [param for program in compiled.programs for module in program.module.modules()
                 if isinstance(module, FSDPModule)
                 for group in fsdp_param_groups(module)
                 for param in group.fsdp_params if param.offload_to_cpu]
    for param in offloaded:
        memory.on_host(param._sharded_param_data)
        param.sharded_param.register_post_accumulate_grad_hook(lambda shard: memory.on_host(shard.grad))
    stepped = {id(p) for group in compiled.optimizer.param_groups for p in group["params"]}
    if offloaded and stepped <= {id(param.sharded_param) for param in offloaded}:
        step = compiled.optimizer.step

        def step_on_host(*args, **kwargs):
            with memory.allocating_on_host():
                return step(*args, **kwargs)
        compiled.optimizer.step = step_on_host
        return True
    return False


def _hold_optimizer_state(optimizer) -> None:
    """Give the optimizer its state, as it holds it at every step after the first: torch makes
    Adam's moments at the first `step`, so a first step's forwards and backwards run without
    them, and the peak the simulation reports would miss them. One step on zero gradients
    (fake tensors: no values change) makes them before the simulated step."""
    for group in optimizer.param_groups:
        for param in group["params"]:
            param.grad = torch.zeros_like(param)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _adamw(plan: Plan):
    """AdamW as it steps on the plan's devices: every tensor at once on GPUs (torch's foreach
    kernels), one at a time on CPUs, which torch picks by the device of the tensors, here CPU."""
    return lambda params: torch.optim.AdamW(params, lr=1e-4, foreach=for_gpus(plan))


def _rows(tensor: torch.Tensor, rows: int) -> torch.Tensor:
    """A global batch of `rows` shaped like `tensor`'s first row (values do not matter)."""
    return tensor[:1].expand(rows, *tensor.shape[1:]).contiguous()


def _agree_on_static_shapes(schedule) -> None:
    """torch's pipeline schedules vote once, peer to peer, on whether every stage's shapes are
    static, and read the vote's value. A simulated rank has no peers and fake values; autopar's
    stages are always static (each is built with its inputs' and outputs' shapes), which is what
    the vote finds when it runs, so the simulated rank is told so."""
    def static(stages, has_backward, p2p_done):
        for stage in stages:
            stage._inference_mode = InferenceMode.STATIC

    if hasattr(schedule, "_warmup_p2p"):
        schedule._warmup_p2p = static
