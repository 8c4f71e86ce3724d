"""A simulated rank runs one iteration of each run of repeating ones (autopar/simulate/folding.py):
one micro-batch for the middle ones of a one-stage loop, one ring hop for each run of hops of one
kind. What it reports must be what running every iteration reports: the same peak, to the byte,
and the same collectives, as many of each."""

from collections import Counter

import pytest

from autopar.api import plan_from_config
from autopar.cost.config import Config
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.simulate import simulate_ranks
from autopar.simulate.folding import runs
from autopar.tracer import capture

LLAMA = "llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=64,vocab=256"
MOE = "moe:layers=2,hidden=64,heads=4,seq=32,vocab=256,moe_every=1,experts=8,top_k=2"


def test_runs_are_the_first_index_and_length_of_each_stretch_of_one_kind():
    assert runs([(True, False), (False, False), (False, False), (False, True)]) == [(0, 1), (1, 2), (3, 1)]
    assert runs(["own", "after", "after", "after"]) == [(0, 1), (1, 3)]
    assert runs([]) == []


def _folded_and_whole(spec: str, config: Config, ranks: list[int]):
    model, inputs = build_model(spec, device="meta")
    graph = capture(model, example_inputs=inputs)
    plan = plan_from_config(graph, "1x8:h100-80g", config)
    return [simulate_ranks(model, plan, ranks, example_inputs=inputs, targets=inputs[0],
                           loss_fn=lm_loss, graph=graph, fold=fold) for fold in (True, False)]


@pytest.mark.parametrize("spec, config", [
    (LLAMA, Config(dp=2, cp=4, zero=3, global_batch=12)),
    pytest.param(LLAMA, Config(dp=2, cp=4, zero=1, global_batch=10, recompute="full"),
                 marks=pytest.mark.slow),
    pytest.param(LLAMA, Config(dp=2, tp=2, cp=2, sequence_parallel=True, global_batch=8),
                 marks=pytest.mark.slow),
    pytest.param(LLAMA, Config(dp=2, cp=4, cp_kind="all-to-all", zero=3, global_batch=8),
                 marks=pytest.mark.slow),
    pytest.param(MOE, Config(dp=8, ep=4, zero=3, global_batch=32), marks=pytest.mark.slow),
])
def test_a_folded_rank_reports_what_the_whole_step_does(spec, config):
    """Rank 0 holds the first chunk pair of the ring (every other block is after it) and rank 5
    sits between (blocks before and after it): each runs hops of two kinds besides its own."""
    folded, whole = _folded_and_whole(spec, config, [0, 5])
    for short, full in zip(folded, whole):
        assert short.peak_memory_bytes == full.peak_memory_bytes, short.rank
        assert Counter(short.collectives) == Counter(full.collectives), short.rank
        assert len(short.collectives) == len(full.collectives) > 0
