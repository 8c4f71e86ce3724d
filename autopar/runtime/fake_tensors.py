"""Whether this rank runs on fake tensors: `autopar simulate` builds a rank's program exactly as
`autopar.compile` does and steps it under torch's FakeTensorMode, on a fake process group, so
that memory and collectives of a cluster's rank can be measured on one CPU.

Fake tensors have shapes, dtypes and devices but no values and no storage. The runtime asks here
before the few things that need values or peers: a meta model's sources and filling its weights
(nothing to fill), comparing the loss of a batch with its halves (the run checks it), exchanging
layouts with the other ranks (one rank is simulated alone), and the loss it returns (NaN). FSDP2's
gradient reduction on a CPU mesh reduce-scatters there as NCCL does (a simulated rank stands for
a GPU's), not by gloo's all-reduce.
"""

from __future__ import annotations

import torch


def simulated() -> bool:
    """Whether a fake tensor mode is active on this thread."""
    return torch._C._get_dispatch_mode(torch._C._TorchDispatchModeKey.FAKE) is not None
