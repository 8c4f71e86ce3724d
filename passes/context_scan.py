"""A running sum along a sequence split over context-parallel ranks.

HuggingFace models count positions from the attention mask (OPT's and RoBERTa's: the number of
real tokens up to each position, `cumsum(mask, dim=1)`). On a rank of the split it sees its own 2
chunks only, chunk r and chunk 2cp-1-r of 2cp (context_attention.py), so each chunk's running
sum misses what the chunks before it hold. `SequenceCumsum` adds it: every rank's 2 chunk totals
are all-gathered over the cp group (2 values per row of the dims kept: a few bytes a sequence),
and each chunk's running sum is offset by the totals of the chunks before it in the sequence.
That is the cumulative sum of the whole sequence at this rank's positions, exactly.

Values that take no gradient only (counts of tokens: integers, booleans, or a float mask made
from constants). A running sum of values that do (a float scan of activations) would need the
backward's reverse sum across the ranks too; the split refuses it.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard

from autopar.errors import AutoparError


def counted(value: torch.Tensor) -> bool:
    """Whether `value` holds counts (integers or booleans), which take no gradient."""
    return not (value.dtype.is_floating_point or value.dtype.is_complex)


class SequenceCumsum(nn.Module):
    """cumsum(x, dim) of the whole sequence at this rank's 2 chunks (module docstring)."""

    def __init__(self, group, rank: int, cp: int):
        super().__init__()
        self.group, self.rank, self.cp = group, rank, cp

    def forward(self, x: torch.Tensor, dim: int, dtype: torch.dtype | None = None) -> torch.Tensor:
        if isinstance(x, DTensor):
            if any(isinstance(p, Shard) and p.dim % x.dim() == dim % x.dim() for p in x.placements):
                raise AutoparError("context parallelism: a running sum along a sequence dim "
                                   "that tensor parallelism also splits; use cp=1 or tp=1")
            local = self.forward(x.to_local(), dim, dtype)
            return DTensor.from_local(local, x.device_mesh, x.placements, run_check=False)
        dim = dim % x.dim()
        first, second = torch.cumsum(x, dim, dtype=dtype).chunk(2, dim)
        second = second - first.narrow(dim, first.shape[dim] - 1, 1)   # chunk 2cp-1-r on its own
        totals = torch.cat([first.narrow(dim, first.shape[dim] - 1, 1),
                            second.narrow(dim, second.shape[dim] - 1, 1)], dim)
        gathered = [torch.empty_like(totals) for _ in range(self.cp)]
        dist.all_gather(gathered, totals.contiguous(), group=self.group)
        by_chunk = self._in_sequence_order(gathered, dim)
        before = torch.cumsum(by_chunk, dim) - by_chunk                 # totals of earlier chunks
        late = 2 * self.cp - 1 - self.rank
        return torch.cat([first + before.narrow(dim, self.rank, 1),
                          second + before.narrow(dim, late, 1)], dim)

    def _in_sequence_order(self, gathered: list[torch.Tensor], dim: int) -> torch.Tensor:
        """The 2cp chunk totals in sequence order: rank j holds chunks j and 2cp-1-j."""
        early = [totals.narrow(dim, 0, 1) for totals in gathered]
        late = [totals.narrow(dim, 1, 1) for totals in reversed(gathered)]
        return torch.cat(early + late, dim)
