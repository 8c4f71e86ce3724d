"""Placements on one mesh axis as plans write them, the one parser and printer of that text.

"R" replicated, "P" partial sums (each rank holds a part of the sum), "S(d)" sharded on dim d:
torch DTensor's `Replicate()`, `Partial()` and `Shard(d)` as torch prints them. Plans, the
torch-free `Problem` of the solver and the cost model carry these strings; the strategies map
them onto torch's objects (autopar.cost.strategies.placements).
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from autopar.errors import AutoparError

# Dims beyond any tensor's rank: a placement past this is a corrupt or crafted file, refused
# even where the plan cannot see the tensor it places.
MAX_DIM = 64
_TEXT = re.compile(r"R|P|S\((0|[1-9]\d*)\)")


@dataclass(frozen=True, slots=True)
class Placement:
    kind: str                   # "R", "P" or "S"
    dim: int | None = None      # the sharded dim of "S"

    def __str__(self) -> str:
        return f"S({self.dim})" if self.kind == "S" else self.kind

    @property
    def is_shard(self) -> bool:
        return self.kind == "S"


REPLICATE = Placement("R")
PARTIAL = Placement("P")


def shard(dim: int) -> Placement:
    return Placement("S", dim)


def parse_placement(text: str) -> Placement:
    """The placement `text` writes; AutoparError naming it when it is not R, P or S(dim)."""
    match = _TEXT.fullmatch(text) if isinstance(text, str) else None
    if match is None:
        raise AutoparError(f"placement {text!r} is malformed: expected 'R', 'P' or 'S(dim)'")
    if match.group(1) is None:
        return REPLICATE if text == "R" else PARTIAL
    dim = int(match.group(1))
    if dim >= MAX_DIM:
        raise AutoparError(f"placement {text!r} shards dim {dim}, beyond any tensor's rank "
                           f"(fewer than {MAX_DIM} dims)")
    return shard(dim)


def shard_dim(text: str) -> int | None:
    """The dim a placement's text shards, or None for R and P."""
    return parse_placement(text).dim


def is_shard(text: str) -> bool:
    return text.startswith("S")
