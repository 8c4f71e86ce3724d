"""`CompiledModel.sampler`: this data-parallel replica's rows of each global batch, resumed at
the sample a checkpoint stopped at, under any number of replicas.

An epoch is a permutation of the dataset (torch's DistributedSampler's: `randperm` seeded with
seed + epoch, or the dataset's order) cut into whole global batches; the rows left over (fewer
than a global batch) are not trained in that epoch, since every step takes a whole global batch.
Replica r of R takes rows r, r + R, r + 2R, ... of each global batch, as DistributedSampler
strides, so a loader of `cm.local_batch` rows per batch gives `step(..., local=True)` this
replica's share of global batch after global batch.

Where an iteration starts is the model's data position, `CompiledModel.samples` (samples trained,
saved in every checkpoint), not a count of what a loader fetched (a loader's workers prefetch ahead
of training). The order of an epoch does not depend on the number of replicas, so a checkpoint
saved by 4 replicas and loaded by 2 (a job restarted on fewer nodes) resumes at the first sample
that was not trained: none lost, none repeated, as long as the global batch is kept.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator

import torch
from torch.utils.data import Sampler

from autopar.errors import AutoparError


class GlobalBatchSampler(Sampler[int]):
    """Indices of this replica's rows of the global batches that remain in the current epoch."""

    def __init__(self, size: int, *, global_batch: int, replicas: int, replica: int,
                 position: Callable[[], int], shuffle: bool = True, seed: int = 0):
        if not isinstance(shuffle, bool) or not isinstance(seed, int) or isinstance(seed, bool):
            raise AutoparError(f"sampler(shuffle={shuffle!r}, seed={seed!r}): shuffle is True or "
                               f"False and seed an integer")
        if size < global_batch:
            raise AutoparError(f"the dataset has {size} samples, fewer than one global batch of "
                               f"{global_batch}: every step takes a whole global batch")
        self.size = size
        self.global_batch = global_batch
        self.replicas = replicas
        self.replica = replica
        self.position = position
        self.shuffle = shuffle
        self.seed = seed
        self.batches_per_epoch = size // global_batch

    @property
    def samples_per_epoch(self) -> int:
        return self.batches_per_epoch * self.global_batch

    @property
    def epoch(self) -> int:
        """The epoch the data position is in (the next iteration's)."""
        return self._start()[0]

    def _start(self) -> tuple[int, int]:
        """(epoch, samples of it already trained) at the model's data position."""
        epoch, offset = divmod(self.position(), self.samples_per_epoch)
        if offset % self.global_batch:
            raise AutoparError(
                f"the data position, sample {offset} of epoch {epoch}, is not the start of a global "
                f"batch of {self.global_batch}: the run that saved it trained another global batch. "
                f"Compile with the global batch of that run (global_batch=...) to resume its data")
        return epoch, offset

    def order(self, epoch: int) -> torch.Tensor:
        """The dataset's indices in epoch `epoch`'s order, every replica's rows."""
        if not self.shuffle:
            return torch.arange(self.size)
        generator = torch.Generator()
        generator.manual_seed(self.seed + epoch)
        return torch.randperm(self.size, generator=generator)

    def __iter__(self) -> Iterator[int]:
        epoch, offset = self._start()
        rows = self.order(epoch)[offset + self.replica:self.samples_per_epoch:self.replicas]
        return iter(rows.tolist())

    def __len__(self) -> int:
        _, offset = self._start()
        return (self.samples_per_epoch - offset) // self.replicas
