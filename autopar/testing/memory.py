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
from torch.utils.weak import WeakIdKeyDictionary


class LiveBytes(TorchDispatchMode):
    """Peak bytes of tensor storage alive on this rank while active: the storages of `tensors`
    (parameters, optimizer state) plus every storage an op creates, until it is freed.
    MemTracker's accounting, without its per-module tracking, which refuses a module called more
    than once a step (several micro-batches). Storages are followed by identity and their
    `resize_` is watched, as MemTracker does: FSDP frees and re-allocates the unsharded
    parameters by resizing their storages, which no dispatch mode sees."""

    def __init__(self, tensors):
        super().__init__()
        self.live = WeakIdKeyDictionary()      # storage -> [bytes counted]
        self.current = self.peak = 0
        self._resize = torch.UntypedStorage.resize_
        for tensor in tensors:
            self._add(tensor)

    def _add(self, tensor) -> None:
        if is_traceable_wrapper_subclass(tensor):   # DTensor, a collective's async result
            for name in tensor.__tensor_flatten__()[0]:
                self._add(getattr(tensor, name))
            return
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return
        self._track(tensor.untyped_storage())

    def _track(self, storage) -> None:
        """Count `storage` at its current size (first seen, or resized since)."""
        counted = self.live.get(storage)
        if counted is None:
            counted = self.live[storage] = [0]
            weakref.finalize(storage, self._free, counted)
        if counted[0] == storage.nbytes():
            return
        self.current += storage.nbytes() - counted[0]
        counted[0] = storage.nbytes()
        self.peak = max(self.peak, self.current)

    def _free(self, counted: list) -> None:
        self.current -= counted[0]
        counted[0] = 0

    def __enter__(self):
        original = self._resize

        def resize_(storage, size):
            result = original(storage, size)
            self._track(storage)
            return result
        torch.UntypedStorage.resize_ = resize_
        return super().__enter__()

    def __exit__(self, *args):
        torch.UntypedStorage.resize_ = self._resize
        return super().__exit__(*args)

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
