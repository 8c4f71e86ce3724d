"""Placements on one mesh axis, as torch's DTensor defines them, and their text form.

`Shard(d)` prints as "S(d)", `Replicate()` as "R", `Partial()` as "P": the form plans and the
torch-free `Problem` use. Strategies work with torch's placement objects; everything that leaves
this package (problems, solutions, plans) carries the strings.
"""

from __future__ import annotations

import re

from torch.distributed.tensor import Partial, Placement, Replicate, Shard

from autopar.errors import AutoparError

R = Replicate()
P = Partial()


def S(dim: int) -> Shard:
    return Shard(dim)


def placement_str(placement: Placement) -> str:
    if isinstance(placement, Shard):
        return f"S({placement.dim})"
    if isinstance(placement, Replicate):
        return "R"
    if isinstance(placement, Partial):
        return "P"
    raise AutoparError(f"placement {placement!r} is not Shard, Replicate or Partial")


def parse_placement(text: str) -> Placement:
    if text == "R":
        return R
    if text == "P":
        return P
    match = re.fullmatch(r"S\((\d+)\)", text)
    if not match:
        raise AutoparError(f"placement {text!r} is malformed: expected 'R', 'P' or 'S(dim)'")
    return Shard(int(match.group(1)))


def is_shard(placement: Placement) -> bool:
    return isinstance(placement, Shard)
