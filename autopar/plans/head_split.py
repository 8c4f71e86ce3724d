"""How many key/value heads the head split (all-to-all context parallelism, Ulysses) swaps.

Each of the cp ranks takes 1/cp of the query heads and must take the key/value heads they read.
Keys and values go as the model computes them, before grouped-query attention repeats their
heads, wherever those heads divide over the cp ranks; where they do not (multi-query attention,
or fewer key/value heads than cp), each is repeated the fewest times that make them divide, as
DeepSpeed-Ulysses does. The runtime (autopar.passes.context_attention.ulysses_attention) swaps
this many heads and the estimator prices the same.
"""

from __future__ import annotations

from autopar.errors import AutoparError


def kv_repeat(query_heads: int, kv_heads: int, cp: int) -> int:
    """How many times each of `kv_heads` key/value heads is repeated before the all-to-all over
    `cp` ranks: the least r dividing query_heads / kv_heads with kv_heads * r divisible by cp.
    `query_heads` must divide by cp (the plan's check, `cost.context.ulysses_error`)."""
    group = query_heads // kv_heads
    for repeat in range(1, group + 1):
        if group % repeat == 0 and (kv_heads * repeat) % cp == 0:
            return repeat
    raise AutoparError(f"all-to-all context parallelism splits heads over the cp ranks: "
                       f"{query_heads} query heads do not divide by cp={cp}: use cp_kind='ring', "
                       f"or a cp that divides them")
