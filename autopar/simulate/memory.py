"""What a simulated rank holds: the bytes of every live tensor storage, and their peak.

Under fake tensors nothing is allocated, but every storage keeps its size. A dispatch mode sees
each op's outputs (a DTensor's local shard, as FSDP2's and tensor parallelism's tensors are)
and counts each new storage once, until torch frees it (a weak reference's callback), as torch's
own MemTracker does for one pass of each module; this one also follows a pipeline schedule,
which runs a stage's modules once per micro-batch. FSDP2 allocates and frees its gathered
weights by resizing a storage in place, which no op shows: while the recorder is active, FSDP2's
two functions that resize (`alloc_storage`, `free_storage`) report each resize to it as it
happens (reading every storage again at every collective instead took a fifth of a large
rank's simulation). A functional collective's `wait_tensor` hands back the tensor it waited on
in a run, but a new one under fake tensors: its output counts as the same storage as its input
(else every tensor-parallel gather would count twice until the waited copy is freed). The peak
is that of allocations, as CUDA's
caching allocator reports `max_memory_allocated`: without fragmentation or the allocator's
rounding (blocks of 512 bytes), and without the CUDA context or library workspaces. A simulated
rank's tensors all live on the CPU, so an offloaded plan's host states are told apart by the
rank's simulation (`on_host`, `allocating_on_host`) and counted in a host total of their own,
with its own peak, as a GPU run's device and host memory are two. Only the
simulation's own fake tensors count: the runtime's exports and shape probes run on fake tensors
of their own modes, which allocate nothing in a real run either.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode
from torch.distributed.tensor import DTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode


# the modules that call FSDP2's storage resizes, by the names they call them under
_RESIZERS = ((_fsdp_param, "alloc_storage"), (_fsdp_param, "free_storage"),
             (_fsdp_param_group, "alloc_storage"))


class MemoryRecorder(TorchDispatchMode):
    """Live and peak bytes of the tensor storages created while active."""

    def __init__(self, mode: FakeTensorMode):
        super().__init__()
        self.mode = mode        # the simulation's: tensors of other fake modes are fake in a run too
        self.live = 0
        self.peak = 0
        self.host_live = 0      # offloaded states (module docstring)
        self.host_peak = 0
        self._host: set[int] = set()            # tokens of storages on the host
        self._allocating_on_host = False
        self._token: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()   # storage -> token
        self._sizes: dict[int, int] = {}                                          # token -> bytes
        self._holders: dict[int, int] = {}      # token -> storages standing for it (wait_tensor's)
        self._next = 0
        self._patched: list = []
        self._pending: tuple | None = None      # a gradients' sum (`_summing`): (peak, its terms)

    def __enter__(self):
        for module, name in _RESIZERS:
            original = getattr(module, name)
            self._patched.append((module, name, original))
            setattr(module, name, self._reporting(original))
        return super().__enter__()

    def __exit__(self, *exc):
        for module, name, original in reversed(self._patched):
            setattr(module, name, original)
        self._patched.clear()
        return super().__exit__(*exc)

    def _reporting(self, resize):
        def resized(tensor: torch.Tensor) -> None:
            resize(tensor)
            self.resized(tensor)
        return resized

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self._settle()
        out = func(*args, **(kwargs or {}))
        if func is torch.ops._c10d_functional.wait_tensor.default:
            self._alias(out, args[0])
            return out
        if func is torch.ops.aten.add.Tensor and _sums_gradients(args, kwargs, out):
            self._summing(out, args)
            return out
        for tensor in pytree.tree_leaves(out):
            if isinstance(tensor, torch.Tensor):
                self.track(tensor)
        if func is torch.ops.aten.resize_.default:
            self.resized(args[0])
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
        self._holders[token] = 1
        if self._allocating_on_host:
            self._host.add(token)
        self._add(token, self._sizes[token])
        weakref.finalize(storage, self._free, token)

    def on_host(self, tensor: torch.Tensor) -> None:
        """Count `tensor`'s storage as the host's from now on: an offloaded state, or a device
        buffer whose contents a GPU run copies to the host and then frees (FSDP2's reduced
        gradients), which the simulation keeps as the host's copy."""
        if isinstance(tensor, DTensor):
            tensor = tensor._local_tensor
        self.track(tensor)
        token = self._token.get(tensor.untyped_storage())
        if token is None or token in self._host:
            return
        self._add(token, -self._sizes[token])
        self._host.add(token)
        self._add(token, self._sizes[token])

    @contextlib.contextmanager
    def allocating_on_host(self):
        """Count the storages made meanwhile as the host's (an offloaded optimizer's step)."""
        self._allocating_on_host = True
        try:
            yield
        finally:
            self._allocating_on_host = False

    def _alias(self, out: torch.Tensor, waited: torch.Tensor) -> None:
        """Count `out`'s storage as `waited`'s: the bytes stay live while either storage is."""
        self.track(waited)
        token = self._token.get(waited.untyped_storage())
        storage = out.untyped_storage()
        if token is None or storage in self._token:
            self.track(out)
            return
        self._token[storage] = token
        self._holders[token] += 1
        weakref.finalize(storage, self._free, token)

    def resized(self, tensor: torch.Tensor) -> None:
        """Read the size of `tensor`'s storage again after it was resized in place."""
        storage = tensor.untyped_storage()
        token = self._token.get(storage)
        if token is None:
            self.track(tensor)
            return
        self._add(token, storage.nbytes() - self._sizes[token])
        self._sizes[token] = storage.nbytes()

    def reset_peak(self) -> int:
        """Start new peaks at what is live now; returns the device's peak until now."""
        self._settle()
        before, self.peak, self.host_peak = self.peak, self.live, self.host_live
        return before

    def peak_now(self) -> int:
        """The device's peak so far."""
        self._settle()
        return self.peak

    def _summing(self, out: torch.Tensor, summed: tuple) -> None:
        """Count autograd's sum of two gradients of one value as a run makes it. Under any
        dispatch mode (fake tensors are one) the engine adds them into a new tensor, but in a run
        it adds one into the other in place where nothing else holds it, which is so exactly
        when that one is freed as soon as the sum is made: until the next op or allocation the
        sum's bytes do not count toward the peak, and if one of the two is freed first they
        never do."""
        peak = self.peak
        self.track(out)
        pending, self.peak = self.peak, peak
        # a term broadcast from fewer elements (an expanded view) cannot take the sum in place
        tokens = {self._token.get(t.untyped_storage()) for t in summed
                  if t.untyped_storage().nbytes() == out.untyped_storage().nbytes()}
        self._pending = (pending, tokens - {None})

    def _settle(self) -> None:
        if self._pending is not None:
            self.peak = max(self.peak, self._pending[0])
            self._pending = None

    def _add(self, token: int, size: int) -> None:
        if token in self._host:
            self.host_live += size
            self.host_peak = max(self.host_peak, self.host_live)
        else:
            if size > 0:
                self._settle()
            self.live += size
            self.peak = max(self.peak, self.live)

    def _free(self, token: int) -> None:
        if self._pending is not None and token in self._pending[1]:
            self._pending = None        # summed in place in a run
        self._holders[token] -= 1
        if not self._holders[token]:
            del self._holders[token]
            self._add(token, -self._sizes.pop(token, 0))
            self._host.discard(token)


def _sums_gradients(args: tuple, kwargs: dict | None, out) -> bool:
    """Whether an add is autograd's engine summing two gradients of one value: run in a backward
    with grad mode off (a recomputed forward runs with it on), of two plain tensors of the sum's
    shape and type."""
    if kwargs or len(args) != 2 or torch.is_grad_enabled() or torch._C._current_autograd_node() is None:
        return False
    return all(isinstance(t, torch.Tensor) and not isinstance(t, DTensor) and t.shape == out.shape
               and t.dtype == out.dtype
               for t in (*args, out))
