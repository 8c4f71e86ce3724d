"""What a simulated rank holds: the bytes of every live tensor storage, and their peak.

Under fake tensors nothing is allocated, but every storage keeps its size. A dispatch mode sees
each op's outputs (a DTensor's local shard, as FSDP2's and tensor parallelism's tensors are)
and counts each new storage once, until torch frees it (a weak reference's callback), as torch's
own MemTracker does for one pass of each module; this one also follows a pipeline schedule,
which runs a stage's modules once per micro-batch. FSDP2 allocates and frees its gathered
weights by resizing a storage in place, which no op shows: the sizes are read again at every
collective, since FSDP2 resizes a storage up just before gathering into it. The peak is that of allocations, as CUDA's
caching allocator reports `max_memory_allocated`: without fragmentation or the allocator's
rounding (blocks of 512 bytes), and without the CUDA context or library workspaces. Only the
simulation's own fake tensors count: the runtime's exports and shape probes run on fake tensors
of their own modes, which allocate nothing in a real run either.
"""

from __future__ import annotations

import weakref

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autopar.simulate.collectives import NAMESPACES


class MemoryRecorder(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while active."""

    def __init__(self, mode: FakeTensorMode):
        super().__init__()
        self.mode = mode        # the simulation's: tensors of other fake modes are fake in a run too
        self.live = 0
        self.peak = 0
        self._token: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # storage -> token
        self._sizes: dict[int, int] = {}                                          # token -> bytes
        self._next = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.track(tensor)
        if func.namespace in NAMESPACES:
            self.resync()
        return out

    def track(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage if it is new (a DTensor: its local shard's)."""
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        if isinstance(tensor, FakeTensor) and tensor.fake_mode is not self.mode:
            return      # an export's or a shape probe's, which allocate nothing in a run either
        if tensor.device.type == "meta":
            return      # shapes the runtime keeps on meta (a stage's example outputs) hold nothing
        storage = tensor.untyped_storage()
        if storage in self._token:
            return
        token, self._next = self._next, self._next + 1
        self._token[storage] = token
        self._sizes[token] = storage.nbytes()
        self._add(self._sizes[token])
        weakref.finalize(storage, self._free, token)

    def resync(self) -> None:
        """Read every live storage's size again (module docstring: FSDP2's resizes)."""
        for storage, token in list(self._token.items()):
            self._sizes[token] = storage.nbytes()
        self.live = 0
        self._add(sum(self._sizes.values()))

    def _add(self, size: int) -> None:
        self.live += size
        self.peak = max(self.peak, self.live)

    def _free(self, token: int) -> None:
        self.live -= self._sizes.pop(token, 0)
