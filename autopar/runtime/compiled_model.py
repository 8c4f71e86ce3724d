"""A model trained under a plan on this rank: `CompiledModel`, what `autopar.compile` returns.

It holds this rank's stages as the passes and FSDP2 left them (build.py makes it), their schedule
and the optimizer on the local shards. `step` runs one optimizer step: the batch is checked and
cut to this data-parallel rank's rows (and, under context parallelism, to this rank's 2 chunks of
every sequence, inputs and targets alike), the schedule runs the micro-batches, gradients that tensor
parallelism left partial and those of weights tied across stages are reduced, and the optimizer
steps (under fp16, with the loss scaler). The loss of one step is the mean over micro-batches and
replicas, computed on the last stage and shared with every rank, so `step` returns the same float
everywhere.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autopar.errors import AutoparError
from autopar.passes.context_attention import chunk_positions
from autopar.passes.program import StageProgram, TensorRef
from autopar.plans import Plan
from autopar.runtime import checkpoint
from autopar.runtime import precision as mixed
from autopar.runtime.checks import check_step_inputs
from autopar.runtime.gradients import reduce_partial_gradients
from autopar.runtime.fake_tensors import simulated
from autopar.runtime.rank_grid import PipelineLayout
from autopar.runtime.sampler import GlobalBatchSampler
from autopar.runtime.tied import TiedWeights


class CompiledModel:
    """A model trained under a plan on this rank: its stages, its schedule and its optimizer."""

    def __init__(self, *, plan: Plan, layout: PipelineLayout, mesh: DeviceMesh,
                 programs: list[StageProgram], schedule, optimizer, device: torch.device,
                 state_aliases: dict[str, list[str]], tied: TiedWeights | None = None,
                 example_kwargs: dict | None = None, scaler: mixed.LossScaler | None = None,
                 sequence: int = 0):
        self.plan = plan
        self.sequence = sequence            # tokens per sequence, which cp ranks split
        self.scaler = scaler                # fp16's loss scaler (precision.py); None otherwise
        # the captured keyword inputs (tensors change per step, constants are in the graph) and
        # the order in which the first stage takes the tensor ones after the positional inputs
        self.example_kwargs = dict(example_kwargs or {})
        self.keywords = programs[0].keywords if programs else ()
        self.tied = tied
        self.state_aliases = state_aliases
        self.layout = layout
        self.mesh = mesh
        self.programs = programs
        self.schedule = schedule
        self.optimizer = optimizer
        self.device = device
        self.pp_rank, self.replica, self.tp_rank = layout.coordinates(dist.get_rank())
        self.dp_rank, self.cp_rank = layout.batch_and_context(self.replica)
        self.is_first = any(p.index == 0 for p in programs)
        self.is_last = any(p.index == len(plan.stages) - 1 for p in programs)
        self.steps = 0                      # steps taken; saved and restored by checkpoints
        # samples trained over all replicas: the data position `sampler` resumes at, saved in
        # checkpoints (it stays right when a relaunch changes the plan or the world)
        self.samples = 0
        self.skipped_steps = 0              # of those, updates fp16's scaler skipped (inf or NaN)

    @property
    def global_batch(self) -> int:
        return self.plan.global_batch

    @property
    def local_batch(self) -> int:
        """The rows of a global batch this data-parallel replica takes (`step(local=True)`)."""
        return self.global_batch // self.layout.dp

    @property
    def stages(self) -> nn.ModuleList:
        """The modules of this rank's stages, as they run (wrapped for TP, ZeRO, recompute)."""
        return nn.ModuleList(program.module for program in self.programs)

    def step(self, *batch: torch.Tensor, local: bool = False, **kwargs) -> float:
        """One optimizer step on `(*inputs, targets)`: the global batch, or with `local=True` this
        replica's share. Keyword inputs that were captured as tensors (`attention_mask=...`) are
        given at every step, batch-sized like the inputs: they are split across replicas and
        micro-batches as the inputs are. Returns the mean loss over micro-batches and replicas on
        every rank. Under fp16, a step whose gradients overflow on any rank updates nothing on
        every rank (`skipped_steps` counts it) and still returns its loss."""
        rows = self.local_batch if local else self.global_batch
        tensors = check_step_inputs(self.example_kwargs, kwargs, rows,
                                    "" if local else " (or local=True with this rank's share)")
        if len(batch) >= 2:
            # the first stage takes the tensor keywords after the positional inputs (autopar.passes.stage_split)
            batch = (*batch[:-1], *(tensors[name] for name in self.keywords), batch[-1])
        batch = self._tokens_of_this_rank(self._rows_of_this_rank(batch, local))
        *inputs, targets = (t.to(self.device) for t in batch)
        losses: list[torch.Tensor] = []
        args = tuple(inputs) if self.is_first else ()
        last = {"target": targets, "losses": losses} if self.is_last else {}
        # the scale the schedule's losses are multiplied by (a power of 2: dividing is exact)
        scale = 1.0 if self.scaler is None else self.scaler.get_scale()
        # only the losses are wanted: torch's last stage would otherwise keep every
        # micro-batch's outputs (logits) to the end of the step to return them merged
        self.schedule.step(*args, **last, return_outputs=False)
        reduce_partial_gradients([program.module for program in self.programs])
        if self.tied is not None:
            self.tied.reduce_gradients()   # tied weights' copies in several stages (tied.py)
        if self.scaler is None:
            self.optimizer.step()
        else:
            self.scaler.unscale_(self.optimizer)   # the inf check, agreed by every rank
            self.scaler.step(self.optimizer)       # skipped on every rank when any found inf
            self.scaler.update()
            # a skip is what lowers the scale (torch's backoff factor is below 1)
            self.skipped_steps += int(self.scaler.get_scale() < scale)
        self.optimizer.zero_grad(set_to_none=True)
        self.steps += 1
        self.samples += self.global_batch
        return self._shared_loss(losses) / scale

    def _rows_of_this_rank(self, batch: tuple, local: bool) -> tuple:
        """Check the batch size (before any collective) and keep this data-parallel rank's rows."""
        if len(batch) < 2:
            raise AutoparError("step(*inputs, targets): pass the model's inputs and the targets")
        share = self.local_batch
        expected = share if local else self.global_batch
        for tensor in batch:
            if not isinstance(tensor, torch.Tensor) or tensor.dim() == 0 or tensor.shape[0] != expected:
                got = f"a batch of {tensor.shape[0]}" if isinstance(tensor, torch.Tensor) and tensor.dim() \
                    else f"{type(tensor).__name__} {tuple(getattr(tensor, 'shape', ()))}"
                what = "share per data-parallel rank" if local else "global batch"
                hint = "" if local else " (or local=True with this rank's share)"
                raise AutoparError(f"step got {got} but the plan's {what} is {expected}; pass "
                                   f"{expected} rows{hint}")
        if local:
            return batch
        return tuple(t[self.dp_rank * share:(self.dp_rank + 1) * share] for t in batch)

    def _tokens_of_this_rank(self, batch: tuple) -> tuple:
        """Under context parallelism, this rank's 2 chunks of every sequence (chunk r and chunk
        2cp-1-r on dim 1, passes/context_parallel.py), checked before any collective."""
        cp = self.layout.cp
        if cp == 1:
            return batch
        for tensor in batch:
            if tensor.dim() < 2 or tensor.shape[1] != self.sequence:
                raise AutoparError(
                    f"step got a tensor of shape {list(tensor.shape)}, but under cp={cp} every input "
                    f"and the targets hold sequences of the {self.sequence} tokens the plan was made "
                    f"for on dim 1, which the cp ranks split into 2 x cp = {2 * cp} chunks; pass "
                    f"[rows, {self.sequence}, ...] tensors (targets one per token)")
        positions = chunk_positions(self.cp_rank, cp, self.sequence // (2 * cp))
        return tuple(tensor.index_select(1, positions.to(tensor.device)) for tensor in batch)

    def sampler(self, dataset, *, shuffle: bool = True, seed: int = 0) -> GlobalBatchSampler:
        """This replica's rows of each global batch of `dataset` (sampler.py): give a DataLoader
        of `local_batch` rows per batch to step(local=True). Each iteration is the rest of the
        epoch the data position (`samples`, restored by `load`) is in, so a run resumed from a
        checkpoint, under any plan and number of ranks, trains the samples that follow."""
        return GlobalBatchSampler(len(dataset), global_batch=self.global_batch, replicas=self.layout.dp,
                                  replica=self.dp_rank, position=lambda: self.samples, shuffle=shuffle,
                                  seed=seed)

    def _shared_loss(self, losses: list[torch.Tensor]) -> float:
        """Mean over micro-batches and replicas, the same on every rank."""
        value = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.is_last:
            value += torch.stack([loss.detach() for loss in losses]).double().mean()
        dist.all_reduce(value)
        if simulated():
            return float("nan")     # fake tensors hold no values (autopar simulate)
        # each cp rank's loss is the mean over its tokens, as many on every rank
        return (value / (self.layout.replicas * self.layout.tp)).item()

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Parameters and buffers under model.state_dict()'s names, gathered on every rank. A
        collective: call it on every rank."""
        mine = {}
        for program in self.programs:
            for ref in program.module.modules():
                if isinstance(ref, TensorRef):
                    # gathering a DTensor is a collective of its mesh: every rank takes part
                    value = ref.value.detach()
                    value = value.full_tensor() if isinstance(value, DTensor) else value
                    mine[ref.fqn] = value.cpu().clone()
        if (self.replica, self.tp_rank) != (0, 0):
            mine = {}
        gathered: list[dict] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, mine)
        found = {name: tensor for part in gathered for name, tensor in part.items()}
        state = {}
        for key, aliases in self.state_aliases.items():
            present = [alias for alias in aliases if alias in found]
            if not present:
                raise AutoparError(f"{key} is in the model's state_dict but no pipeline stage reads "
                                   f"it, so no rank holds it; read it from the model itself")
            state[key] = found[present[0]]
        return state

    # Checkpoints (checkpoint.py): DCP directories under the model's own names, any plan to any plan.
    def save(self, path, extra: dict | None = None):
        """Write a checkpoint (model, optimizer, step count, RNG states, plan, `extra`) to directory
        `path`, atomically. A collective: every rank calls it."""
        return checkpoint.save(self, path, extra)

    def load(self, path, strict: bool = True) -> dict | None:
        """Restore a checkpoint saved under any plan; returns the `extra` saved with it. A
        collective: every rank calls it. A checkpoint of another model (tensors missing or
        unexpected) is refused unless `strict=False` asks for a partial load."""
        return checkpoint.load(self, path, strict)


def state_aliases(model: nn.Module) -> dict[str, list[str]]:
    """Each state_dict key and every name of the same tensor (tied weights have several; the graph
    knows one of them)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return {key: names.get(id(tensor), [key])
            for key, tensor in model.state_dict(keep_vars=True).items()}
