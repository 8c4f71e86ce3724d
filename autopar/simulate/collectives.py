"""What a simulated rank communicates: every collective its program issues, as it issues it.

A dispatch mode sees the process-group ops torch runs, both c10d's (FSDP2's gathers and
reductions, the pipeline's sends) and the functional ones (DTensor's redistributions,
autopar's tensor-parallel and context-parallel collectives). Each is recorded with its group
(named by the rank-grid axes its ranks differ on: "dp", "tp", "pp", "dp+cp", ...), the payload
each rank contributes and the bytes this rank sends under the ring algorithms NCCL uses:
all-reduce 2(n-1)/n of the payload, all-gather and reduce-scatter (n-1)/n of the whole,
all-to-all (n-1)/n of its input, a send all of it, a receive nothing. A collective over a group
of one rank (FSDP2's reduction of a stage it wraps for one replica) moves nothing and is not
recorded. DTensor also redistributes inside an op's own dispatch, where no dispatch mode runs (a
copy of a partial sum reduces it first): `implicit_redistributions` records those too.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.distributed_c10d import _resolve_process_group
from torch.distributed.tensor._dispatch import OpDispatcher
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

# op name -> (kind, position of the input tensor(s), whose size is the payload): the functional
# ops take the input first; the c10d ops write into outputs given first, except the in-place ones
_OPS = {
    "allreduce_": ("all_reduce", 0), "allreduce_coalesced_": ("all_reduce", 0),
    "all_reduce": ("all_reduce", 0), "all_reduce_": ("all_reduce", 0),
    "all_reduce_coalesced": ("all_reduce", 0), "all_reduce_coalesced_": ("all_reduce", 0),
    "_allgather_base_": ("all_gather", 1), "allgather_": ("all_gather", 1),
    "allgather_into_tensor_coalesced_": ("all_gather", 1),
    "all_gather_into_tensor": ("all_gather", 0), "all_gather_into_tensor_out": ("all_gather", 0),
    "all_gather_into_tensor_coalesced": ("all_gather", 0),
    "_reduce_scatter_base_": ("reduce_scatter", 1), "reduce_scatter_": ("reduce_scatter", 1),
    "reduce_scatter_tensor_coalesced_": ("reduce_scatter", 1),
    "reduce_scatter_tensor": ("reduce_scatter", 0),
    "reduce_scatter_tensor_coalesced": ("reduce_scatter", 0),
    "alltoall_base_": ("all_to_all", 1), "alltoall_": ("all_to_all", 1),
    "all_to_all_single": ("all_to_all", 0), "shard_dim_alltoall": ("all_to_all", 0),
    "broadcast_": ("broadcast", 0), "broadcast": ("broadcast", 0),
    "send": ("send", 0), "recv_": ("recv", 0), "recv_any_source_": ("recv", 0),
}


# c10d's ops, the functional ones, the functional ones with autograd (expert dispatch) and
# DTensor's own all-to-all (a value's split moved from one dim to another)
NAMESPACES = ("c10d", "_c10d_functional", "_c10d_functional_autograd", "_dtensor")


@dataclass(frozen=True, slots=True)
class Collective:
    kind: str             # all_reduce, all_gather, reduce_scatter, all_to_all, broadcast, send, recv
    axis: str             # the rank-grid axes the group spans, e.g. "dp", "tp", "dp+cp", "pp"
    group_size: int
    payload_bytes: int    # all_gather: each rank's part; reduce_scatter: the whole input; else the tensor
    sent_bytes: int       # what this rank sends (module docstring)


def sent_bytes(kind: str, payload: int, n: int) -> int:
    """Bytes one rank of a group of `n` sends for a collective of `payload` (module docstring)."""
    if kind == "all_reduce":
        return 2 * (n - 1) * payload // n
    if kind == "all_gather":
        return (n - 1) * payload
    if kind in ("reduce_scatter", "all_to_all"):
        return (n - 1) * payload // n
    if kind in ("send", "broadcast"):
        return payload if n > 1 else 0
    return 0


class CollectiveRecorder(TorchDispatchMode):
    """Records every collective dispatched while active; `axis_of(ranks)` names a group."""

    def __init__(self, axis_of: Callable[[list[int]], str]):
        super().__init__()
        self.axis_of = axis_of
        self.collectives: list[Collective] = []
        self._axes: dict[tuple[int, ...], str] = {}
        self._times = 1      # how many iterations the code running now stands for (folding.py)

    @contextlib.contextmanager
    def repeated(self, times: int):
        """While active, each collective is recorded `times` times (nested: the product)."""
        saved, self._times = self._times, self._times * times
        try:
            yield
        finally:
            self._times = saved

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func.namespace in NAMESPACES and func._opname in _OPS:
            self._record(func._opname, args)
        return func(*args, **kwargs)

    @contextlib.contextmanager
    def implicit_redistributions(self):
        """While active, the collectives of DTensor's redistributions inside an op's dispatch are
        recorded too: torch runs an op's dispatch with the modes popped, so the recorder is
        pushed again for the redistribution of the op's inputs alone."""
        original = OpDispatcher.redistribute_local_args

        def recorded(*args, **kwargs):
            with self:
                return original(*args, **kwargs)

        OpDispatcher.redistribute_local_args = staticmethod(recorded)
        try:
            yield
        finally:
            OpDispatcher.redistribute_local_args = staticmethod(original)

    def _record(self, name: str, args: tuple) -> None:
        kind, position = _OPS[name]
        group = _group(args)
        ranks = dist.get_process_group_ranks(group)
        if len(ranks) < 2:
            return
        tensors = [t for t in pytree.tree_leaves(args[position]) if isinstance(t, torch.Tensor)]
        payload = sum(t.numel() * t.element_size() for t in tensors)
        key = (group.group_desc, tuple(ranks))
        if key not in self._axes:
            self._axes[key] = _NAMED_GROUPS.get(group.group_desc) or self.axis_of(list(ranks))
        n = len(ranks)
        record = Collective(kind, self._axes[key], n, payload, sent_bytes(kind, payload, n))
        self.collectives.extend([record] * self._times)


# Groups the runtime names for what they do, where ranks alone would not tell: a cp group and an
# ep group may hold the same ranks (autopar.runtime.rank_grid names them when it makes them)
_NAMED_GROUPS = {"cp": "cp", "mesh_ep": "ep", "mesh_edp": "edp"}


def _group(args: tuple) -> dist.ProcessGroup:
    """The op's process group: a c10d op passes the group itself, a functional op its registered
    name (its last string argument)."""
    for arg in args:
        if isinstance(arg, torch.ScriptObject):
            return dist.ProcessGroup.unbox(arg)
    name = [arg for arg in args if isinstance(arg, str)][-1]
    return _resolve_process_group(name)
