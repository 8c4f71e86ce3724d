"""ZeRO's shards as FSDP2 makes them: split on a dim that divides among the ranks where one does
(autopar.runtime.data_parallel), padded where none does, and that padding gathered, reduced and
priced (cost/padding.py)."""

from __future__ import annotations

import torch
from torch.distributed.tensor import Shard

from autopar.cost.config import Config
from autopar.runtime.data_parallel import _even_shards
from autopar.testing.simulated import assert_holds_as_predicted, assert_sent_as_priced, simulated


def test_a_parameter_is_split_on_a_dim_that_divides():
    """Experts [4, 64, 64] over 8 ranks: on each expert's rows, not padded to [8, 64, 64].
    Matrices and vectors keep FSDP2's split of their first dim, padded where it does not divide."""
    place = _even_shards(8)
    assert place(torch.empty(4, 64, 64, device="meta")) == Shard(1)
    assert place(torch.empty(16, 3, device="meta")) is None        # the first dim divides
    assert place(torch.empty(5, 3, device="meta")) is None         # none does: padded
    assert place(torch.empty(5, 8, device="meta")) is None         # a matrix keeps dim 0: padded
    assert place(torch.empty((), device="meta")) is None


def test_padded_shards_are_sent_and_held_as_priced():
    """hidden 72 and ffn 200 over 16 ranks: no dim of the projections or norms divides, so FSDP2
    pads them; the priced gathers and reductions left the padding out (7% fewer bytes than sent)."""
    _, [report] = simulated("llama:layers=2,hidden=72,heads=4,kv_heads=2,ffn=200,seq=32,vocab=256",
                            "2x8:h100-80g", Config(dp=16, zero=3, global_batch=32, micro_batch=1))
    assert_sent_as_priced(report)
    assert_holds_as_predicted(report)
