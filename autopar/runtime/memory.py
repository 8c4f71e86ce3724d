"""Peak tensor memory of a rank, measured: what `benchmarks/memory_check.py` compares with the
plan's prediction and `benchmarks/meta_load.py` reports beside resident memory.

`LiveBytes` counts tensor storages from a dispatch mode, as torch's MemTracker
(`torch.distributed._tools.mem_tracker`) does, without MemTracker's per-module tracking, which
refuses a module called more than once per step (a plan with several micro-batches). On CPU
there is no allocator to ask (torch.cuda.max_memory_allocated's counterpart), and resident
memory also holds torch itself and freed heap the allocator keeps.
"""

from __future__ import annotations

import weakref

import torch
from torch.utils._python_dispatch import TorchDispatchMode, is_traceable_wrapper_subclass
from torch.utils._pytree import tree_map


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive on this rank while active: the storages of `tensors`
    (parameters, optimizer state) plus every storage an op creates, until it is freed.
    MemTracker's accounting, without its per-module tracking, which refuses a module called more
    than once a step (several micro-batches)."""

    def __init__(self, tensors):
        super().__init__()
        self.live: dict[int, int] = {}
        self.current = self.peak = 0
        for tensor in tensors:
            self._add(tensor)

    def _add(self, tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):   # DTensor, a collective's async result
            for name in tensor.__tensor_flatten__()[0]:
                self._add(getattr(tensor, name))
            return
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.live or storage.nbytes() == 0:
            return
        self.live[key] = storage.nbytes()
        self.current += storage.nbytes()
        self.peak = max(self.peak, self.current)
        weakref.finalize(storage, self._free, key)

    def _free(self, key: int) -> None:
        self.current -= self.live.pop(key, 0)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        tree_map(self._add, out)
        return out


def rank_tensors(cm) -> list:
    """What a step starts with: parameters, their gradients, the optimizer's state."""
    found = list(cm.stages.parameters()) + list(cm.stages.buffers())
    found += [p.grad for p in cm.stages.parameters() if p.grad is not None]
    found += [v for state in cm.optimizer.state.values() for v in state.values()]
    return found
