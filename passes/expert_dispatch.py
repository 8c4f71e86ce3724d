"""Expert parallelism inside a stage: rows dispatched to the ranks that hold their experts and
combined back, dropless, with all-to-all (torchtitan's and Megatron-Core's all-to-all dispatcher).

`ExpertParallel` replaces a MoE layer's experts in a stage's graph (passes/experts.py). It takes
the rows (one per routed token-expert pair), the routing value that says which expert each row
goes to, and the constants the experts read. On one rank (no process group bound) it runs the
experts' own program on every row. Bound to an expert-parallel group of `ep` ranks, each holding
E/ep consecutive experts as the local slice of a `Shard(0)` DTensor, it:
1. takes this rank's share of the rows when the ranks of a tensor-parallel group hold the same
   rows (replicated, or sequence-split and gathered by DTensor): each computes 1/tp of them;
2. sorts its rows by expert (so by destination rank), counts rows per expert and exchanges the
   counts with one all-to-all, so every rank knows how many rows it sends and receives;
3. sends the rows with `all_to_all_single` (autograd: the backward is the reverse all-to-all),
   regroups what it received by local expert and runs the experts' program on it with its local
   weights, offsets and ids;
4. sends the results back with the reverse all-to-all, restores the rows' order, and joins the
   tensor-parallel shares (an all-gather whose backward hands each rank its share's gradient).
Every row reaches every expert it was routed to; nothing is dropped or padded, so the layer
computes what one process computes, up to the order of floating-point sums inside a matmul.

A batched layer (experts on rows [E, n, ...] of their own, passes/expert_batches.py) has no
routing value: each rank sends slice e of dim 0 to the rank holding expert e with one all-to-all
(the row counts n exchanged first, as the per-expert counts are), runs its experts on
[E/ep, rows from every rank, ...] and sends the results back; tensor-parallel ranks sharing the
rows each take 1/tp of dim 1.

On fake tensors (`autopar simulate`) routing has no values to go by: with `balanced_routing`
set, each rank sends every expert an equal share of its rows (the estimator's assumption), and
the layer issues the collectives and allocates the tensors those counts make; otherwise a fake
or meta call only gives the output's shape (the stage split's record).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import fx, nn
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch._subclasses.fake_tensor import is_fake

from autopar.errors import AutoparError
from autopar.models.experts import aligned_for_grouped_gemm


@dataclass(frozen=True, slots=True)
class RouteInput:
    """What the routing value a layer passes says: "offsets" (cumulative rows per expert, rows
    sorted by expert) or "ids" (each row's expert), and its dtype."""
    role: str
    dtype: torch.dtype


class LocalProgram:
    """The experts' own computation (their body in the captured graph) as a program of (rows,
    expert weights, routing values, constants), run on the rows that reach a rank.

    Deliberately not a submodule of `ExpertParallel`: it computes on the rank's local tensors,
    outside DTensor, so the tensor-parallel rewrites that walk a stage's GraphModules (placements
    of the plan's nodes, ops without a sharding rule) must not see it, nor FSDP or recompute look
    for layers in it. It holds no tensors: the weights come in as arguments."""

    def __init__(self, module: fx.GraphModule, roles: tuple[str, ...],
                 route_dtypes: tuple[torch.dtype, ...]):
        self.module, self.roles, self.route_dtypes = module, roles, route_dtypes

    def run(self, rows, weights, ids, offsets, constants):
        routes = [(ids if role == "ids" else offsets).to(dtype)
                  for role, dtype in zip(self.roles, self.route_dtypes)]
        return self.module(rows, *weights, *routes, *constants)

    def __repr__(self) -> str:
        return f"LocalProgram({len(self.module.graph.nodes)} nodes)"


def grouped_mm(rows: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """rows [S, in] sorted by group @ weight [G, in, out], group g on rows offsets[g-1]:offsets[g].

    One grouped GEMM (`torch._grouped_mm`) where this torch has it for the device and dtype
    (CUDA bf16; CPU fp32 and bf16) and the operands are laid out as it needs (16-byte strides),
    else one matmul per group. In the autocast dtype under autocast (grouped GEMMs are 16-bit
    kernels; autocast does not reach them by itself), else in the weight's dtype."""
    device = rows.device.type
    autocast = device != "meta" and torch.is_autocast_enabled(device)
    dtype = torch.get_autocast_dtype(device) if autocast else weight.dtype
    rows, weight = rows.to(dtype), weight.to(dtype)
    if rows.is_meta or weight.is_meta or is_fake(rows):
        # no offsets to read: one expert's matmul stands for the groups', with the same output,
        # the same tensors saved for the backward and a gradient for the whole weight
        return rows @ weight[0]
    if _has_grouped_gemm(rows, weight):
        out = torch._grouped_mm(rows, weight, offs=offsets.to(torch.int32))
        if out.requires_grad:
            # its CPU backward refuses a gradient with a zero stride (a broadcast one)
            out.register_hook(torch.Tensor.contiguous)
        return out
    ends = offsets.tolist()
    # every group's matmul, empty ones too: each expert's weight gets a gradient, zero if unused
    pieces = [rows[start:end] @ weight[group]
              for group, (start, end) in enumerate(zip([0, *ends[:-1]], ends))]
    return torch.cat(pieces)


def _has_grouped_gemm(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    supported = {"cuda": (torch.bfloat16,), "cpu": (torch.float32, torch.bfloat16)}
    if rows.dtype not in supported.get(rows.device.type, ()) or not hasattr(torch, "_grouped_mm"):
        return False
    return all(aligned_for_grouped_gemm(t) for t in (rows, weight))


class ExpertParallel(nn.Module):
    """A MoE layer's experts, dispatched to the ranks that hold them (module doc)."""

    def __init__(self, *, program: LocalProgram, experts: list[nn.Module], num_experts: int,
                 route: RouteInput | None, output: torch.Tensor, where: str,
                 rows_follow_weights: bool = False):
        super().__init__()
        self.program = program
        # the model casts the rows to the experts' dtype: to their weights' as they run
        # (autopar.passes.expert_parallel._rows_cast_to_the_experts)
        self.rows_follow_weights = rows_follow_weights
        # the modules holding each expert weight, whole [E, ...] or this rank's slice of it
        self.experts = nn.ModuleList(experts)
        self.num_experts = num_experts
        self.route = route                  # None: a batched layer (module doc)
        self.output_shape, self.output_dtype = tuple(output.shape[1:]), output.dtype
        self.where = where
        self.group: dist.ProcessGroup | None = None    # expert-parallel ranks; None: all experts here
        self.token_mesh: DeviceMesh | None = None      # tensor-parallel ranks sharing these rows
        self.gradient_scale = 1.0
        self.balanced_routing = False                   # fake rows routed evenly (module doc)

    def bind(self, group: dist.ProcessGroup | None, token_mesh: DeviceMesh | None,
             gradient_scale: float = 1.0) -> None:
        """Run over `group` (its ranks hold the experts in order, E/ep each) and split the rows
        over `token_mesh`. The gradients of the local expert weights are multiplied by
        `gradient_scale` in the backward (the runtime's data parallelism then averages them)."""
        self.group, self.token_mesh, self.gradient_scale = group, token_mesh, gradient_scale

    @property
    def ep(self) -> int:
        return 1 if self.group is None else dist.get_world_size(self.group)

    def extra_repr(self) -> str:
        return f"num_experts={self.num_experts}, ep={self.ep}, where={self.where!r}"

    def forward(self, rows, route, *constants):
        batched = self.route is None
        if self.rows_follow_weights:
            rows = rows.to(_local(self.experts[0]()).dtype)
        if rows.is_meta or (is_fake(rows) and not self.balanced_routing):   # shapes only
            leading = rows.shape[:2] if batched else rows.shape[:1]
            return rows.new_empty((*leading, *self.output_shape[len(leading) - 1:]),
                                  dtype=self.output_dtype)
        constants = [_whole(value) for value in constants]
        if batched:
            def run(share, _):
                return self._exchange_batched(share, constants)
        else:
            def run(share, experts):
                return self._dispatch(share, experts, constants)
        experts = None if batched else self._row_experts(_whole(route), rows.shape[0])
        mesh = rows.device_mesh if isinstance(rows, DTensor) else self.token_mesh
        if mesh is None or mesh.size() == 1:
            out = run(_whole(rows), experts)
            return DTensor.from_local(out, mesh, [Replicate()], run_check=False) \
                if isinstance(rows, DTensor) else out
        dim = 1 if batched else 0      # the dim of the rows the tensor-parallel ranks share
        rows = _replicated(rows, mesh)
        if batched and rows.placements != (Replicate(),):
            # split over the experts (as tensor parallelism without ep splits a batched matmul):
            # gathered whole, then each rank takes its tokens
            rows = rows.redistribute(mesh, [Replicate()])
        share = rows.redistribute(mesh, [Shard(dim)]).to_local()
        mine = None if batched else _replicated(experts, mesh).redistribute(mesh, [Shard(0)]).to_local()
        out = run(share, mine)
        shape = (*rows.shape[:dim + 1], *out.shape[dim + 1:])
        whole = DTensor.from_local(out, mesh, [Shard(dim)], run_check=False, shape=shape,
                                   stride=_contiguous_strides(shape)).redistribute(mesh, [Replicate()])
        return whole if isinstance(rows, DTensor) else whole.to_local()

    def _row_experts(self, route: torch.Tensor, count: int) -> torch.Tensor:
        """Each row's expert, from per-row ids or from cumulative counts per expert."""
        if self.route.role == "ids":
            experts = route.long()
        elif self.balanced_routing:
            return torch.empty(count, dtype=torch.long, device=route.device)
        else:
            counts = torch.diff(route.long(), prepend=route.new_zeros(1, dtype=torch.long))
            experts = torch.repeat_interleave(torch.arange(self.num_experts, device=route.device),
                                              counts)
        if experts.numel() != count:
            raise AutoparError(
                f"the router of {self.where} sends {experts.numel()} of its {count} rows to experts "
                f"(a capacity limit or a dropped token); autopar's expert parallelism is dropless: "
                f"route every row, or train this model with ep=1")
        return experts

    def _local_weights(self) -> list[torch.Tensor]:
        return [_ScaleGradient.apply(_local(holder()), self.gradient_scale)
                if self.gradient_scale != 1.0 else _local(holder()) for holder in self.experts]

    def _dispatch(self, rows: torch.Tensor, experts: torch.Tensor, constants: list) -> torch.Tensor:
        """Steps 2 to 4 of the module doc on this rank's rows."""
        ep, local = self.ep, self.num_experts // self.ep
        weights = self._local_weights()
        rows = _in_autocast_dtype(rows)
        order = torch.argsort(experts, stable=True)
        counts = torch.empty(self.num_experts, dtype=torch.long, device=experts.device) \
            if self.balanced_routing else torch.bincount(experts, minlength=self.num_experts)
        if ep == 1:
            out = self.program.run(rows[order], weights, experts[order], torch.cumsum(counts, 0),
                                   constants)
            return out[_inverse(order)]
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        sent_rows, received_rows = self._row_splits(counts, received, rows.shape[0])
        arrived = all_to_all_single_autograd(rows[order], received_rows, sent_rows, self.group)
        # arrived in source-rank order, each source's rows by local expert: regroup by expert
        arrived_experts = torch.empty(sum(received_rows), dtype=torch.long, device=rows.device) \
            if self.balanced_routing else torch.repeat_interleave(
                torch.arange(local, device=counts.device).repeat(ep), received)
        regroup = torch.argsort(arrived_experts, stable=True)
        local_counts = received.view(ep, local).sum(0)
        # each step's rows (tokens x top_k of them, the layer's largest tensors) are let go as
        # soon as the next step has made its own: only those the experts save stay alive
        grouped = arrived[regroup]
        del arrived
        out = self.program.run(grouped, weights, arrived_experts[regroup],
                               torch.cumsum(local_counts, 0), constants)
        del grouped
        returning = out[_inverse(regroup)].contiguous()
        del out
        back = all_to_all_single_autograd(returning, sent_rows, received_rows, self.group)
        del returning
        return back[_inverse(order)]

    def _exchange_batched(self, rows: torch.Tensor, constants: list) -> torch.Tensor:
        """A batched layer's rows [E, n, ...] through the experts of the ranks that hold them."""
        weights, rows = self._local_weights(), _in_autocast_dtype(rows)
        if self.ep == 1:
            return self.program.run(rows, weights, None, None, constants)
        ep, local, count = self.ep, self.num_experts // self.ep, rows.shape[1]
        counts = torch.full((self.num_experts,), count, dtype=torch.long, device=rows.device)
        received = torch.empty_like(counts)
        dist.all_to_all_single(received, counts, group=self.group)
        # under fake tensors every rank is taken to hold as many rows as this one
        sources = [count] * ep if self.balanced_routing else received[::local].tolist()
        sent, got = [local * count] * ep, [local * source for source in sources]
        flat = rows.reshape(self.num_experts * count, *rows.shape[2:]).contiguous()
        arrived = all_to_all_single_autograd(flat, got, sent, self.group)
        grouped = torch.cat([piece.view(local, source, *piece.shape[1:])
                             for piece, source in zip(arrived.split(got), sources)], dim=1)
        out = self.program.run(grouped, weights, None, None, constants)
        back = torch.cat([piece.reshape(local * source, *piece.shape[2:])
                          for piece, source in zip(out.split(sources, dim=1), sources)])
        returned = all_to_all_single_autograd(back.contiguous(), sent, got, self.group)
        # a copy, not a view: FSDP2 drops its pre-backward hook from a view that is changed in place
        return returned.view(self.num_experts, count, *out.shape[2:]).clone()

    def _row_splits(self, counts: torch.Tensor, received: torch.Tensor,
                    rows: int) -> tuple[list[int], list[int]]:
        """The rows this rank sends to each expert-parallel rank and receives from each. Under
        balanced routing every rank gives each expert an equal share of its `rows` (the first
        rows % E experts one more), so it receives from every rank what it sends itself."""
        ep, local = self.ep, self.num_experts // self.ep
        if not self.balanced_routing:
            return counts.view(ep, local).sum(1).tolist(), received.view(ep, local).sum(1).tolist()
        per_expert = [rows // self.num_experts + (e < rows % self.num_experts)
                      for e in range(self.num_experts)]
        sent = [sum(per_expert[d * local:(d + 1) * local]) for d in range(ep)]
        return sent, [sent[dist.get_rank(self.group)]] * ep


class _ScaleGradient(torch.autograd.Function):
    """The identity, whose backward multiplies the gradient by `scale`."""

    @staticmethod
    def forward(ctx, value: torch.Tensor, scale: float):
        ctx.scale = scale
        return value.view_as(value)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def _in_autocast_dtype(rows: torch.Tensor) -> torch.Tensor:
    """Rows in the autocast dtype under autocast: dispatched in 16 bits."""
    device = rows.device.type
    if torch.is_autocast_enabled(device) and rows.is_floating_point():
        return rows.to(torch.get_autocast_dtype(device))
    return rows


def _inverse(permutation: torch.Tensor) -> torch.Tensor:
    inverse = torch.empty_like(permutation)
    inverse[permutation] = torch.arange(permutation.numel(), device=permutation.device)
    return inverse


def _whole(value):
    """A DTensor's whole value on every rank (a routing value or constant: no gradient)."""
    if isinstance(value, DTensor):
        return value.full_tensor()
    return value


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _replicated(value: torch.Tensor, mesh: DeviceMesh) -> DTensor:
    if isinstance(value, DTensor):
        return value
    return DTensor.from_local(value, mesh, [Replicate()], run_check=False)


def _contiguous_strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= max(size, 1)
    return tuple(reversed(strides))
