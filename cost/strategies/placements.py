"""Placements on one mesh axis as torch's DTensor objects, and their text form.

`Shard(d)` prints as "S(d)", `Replicate()` as "R", `Partial()` as "P": the form plans and the
torch-free `Problem` use, which autopar.plans.placements parses and prints (the one parser).
Strategies work with torch's placement objects; everything that leaves this package (problems,
solutions, plans) carries the strings.
"""

from __future__ import annotations

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.errors import AutoparError
from autopar.plans import placements as text

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def placement_str(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return str(text.shard(placement.dim))
    if isinstance(placement, Replicate):
        return str(text.REPLICATE)
    if isinstance(placement, Partial):
        return str(text.PARTIAL)
    raise AutoparError(f"placement {placement!r} is not Shard, Replicate or Partial")


def parse_placement(written: str) -> Placement:
    parsed = text.parse_placement(written)
    if parsed.is_shard:
        return Shard(parsed.dim)
    return R if parsed == text.REPLICATE else P


def is_shard(placement: Placement) -> bool:
    return isinstance(placement, Shard)
