"""Activations that skip a pipeline stage: the planner and the runtime's split see the same ones
(autopar.plans.stage_flow), and the planner never emits zero-bubble for cuts that relay one
(torch's split backward trains them wrong; the runtime refuses such a plan).

Tier 1: a small encoder-decoder whose encoder output every decoder block reads, and T5, cut in
every way into two and three stages: the planner's prediction of relayed activations equals what
the split relays; the planner's search prices no zero-bubble candidate with relays; a forced
zero-bubble Config over such cuts is refused at plan time. Tier 2: T5's free plan on 2x4:cpu
under the memory limit that makes it pipeline trains like one process.
"""

import time
from itertools import combinations, pairwise

import pytest
import torch
# Imported before the ranks fork, so that they inherit it (each would import it on its own).
import torch._dynamo  # noqa: F401
from torch import nn

import autopar
from autopar.cost.config import Config
from autopar.errors import AutoparError
from autopar.passes.program import export_for_pipeline
from autopar.passes.stage_split import split_stages
from autopar.solver.candidates import Candidate, Shape
from autopar.solver.planner import new_search, plan_config, plan_graph, search_pipeline


class Block(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(width), nn.Linear(width, width)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


class CrossBlock(nn.Module):
    """A decoder block that reads the encoder's output (T5's cross-attention, reduced)."""

    def __init__(self, width: int):
        super().__init__()
        self.norm, self.mix = nn.LayerNorm(width), nn.Linear(2 * width, width)

    def forward(self, y, memory):
        return y + self.mix(torch.cat([self.norm(y), memory], dim=-1))


class EncoderDecoder(nn.Module):
    def __init__(self, vocab: int = 64, width: int = 32, layers: int = 3):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.encoder = nn.ModuleList(Block(width) for _ in range(layers))
        self.decoder = nn.ModuleList(CrossBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        memory = self.embed(ids)
        for block in self.encoder:
            memory = block(memory)
        y = memory
        for block in self.decoder:
            y = block(y, memory)
        return self.head(y)


def _model_and_graph():
    torch.manual_seed(0)
    model = EncoderDecoder()
    ids = torch.randint(0, 64, (2, 8))
    return model, (ids,), autopar.capture(model, example_inputs=(ids,))


def _every_cut(units: int, stages: int):
    for inner in combinations(range(1, units), stages - 1):
        yield (0, *inner, units)


def _zero_bubble(cuts: tuple) -> Candidate:
    chunks = len(cuts) - 1
    return Candidate(Shape(tp=1, pp=chunks, dp=1, micro_batch=1, schedule="zero-bubble"), cuts,
                     ("none",) * chunks, (0,) * chunks)


def _agreement(model, inputs, graph, cut_sets) -> list[str]:
    """Cuts where the planner's prediction (zero-bubble refused for relays) and the split's
    relayed values disagree."""
    search = new_search(graph, autopar.Mesh.parse("4:cpu"), 8, float("inf"), time.monotonic() + 60)
    units = search.units
    disagreements = []
    for cuts in cut_sets:
        layers = [[layer for unit in units[a:b] for layer in unit.layers] for a, b in pairwise(cuts)]
        relayed = split_stages(export_for_pipeline(model, inputs, graph.program), layers)[0].relayed
        predicted = search.relay_error(_zero_bubble(cuts)) is not None
        if predicted != bool(relayed):
            disagreements.append(f"cuts {cuts}: planner {predicted}, split relays {relayed}")
    return disagreements


def test_planner_and_split_agree_on_relayed_values():
    model, inputs, graph = _model_and_graph()
    units = new_search(graph, autopar.Mesh.parse("4:cpu"), 8, float("inf"), time.monotonic() + 60).units
    # the first decoder block reads the encoder's output twice, so it is no repeat of the others
    # and runs with the unit before it
    assert [u.name for u in units] == ["embedding", "encoder.0", "encoder.1", "encoder.2",
                                       "decoder.1", "decoder.2", "head"]
    cut_sets = [*_every_cut(len(units), 2), *_every_cut(len(units), 3)]
    assert _agreement(model, inputs, graph, cut_sets) == []
    # the encoder's output, read by every decoder block, skips a stage when a decoder block runs
    # two stages after it; with two stages nothing does
    search = new_search(graph, autopar.Mesh.parse("4:cpu"), 8, float("inf"), time.monotonic() + 60)
    relayed = [cuts for cuts in cut_sets if search.relay_error(_zero_bubble(cuts))]
    assert (0, 4, 5, 7) in relayed and (0, 4, 6, 7) not in relayed
    assert all(len(cuts) == 4 for cuts in relayed)


def test_forced_zero_bubble_over_relaying_cuts_is_refused_at_plan_time():
    _, _, graph = _model_and_graph()
    mesh = autopar.Mesh.parse("4:cpu")
    with pytest.raises(AutoparError, match="zero-bubble.*skips a stage"):
        plan_config(graph, mesh, Config(pp=4, global_batch=8, micro_batch=1, schedule="zero-bubble"))
    # the same stages with 1F1B plan
    assert plan_config(graph, mesh, Config(pp=4, global_batch=8, micro_batch=1,
                                           schedule="1f1b")).schedule == "1f1b"


transformers = pytest.importorskip("transformers")
from autopar.models.hf_zoo import ARCHITECTURES, resolve  # noqa: E402
from autopar.testing.conformance import (GLOBAL_BATCH, MEMORY_FRACTIONS, batches,  # noqa: E402
                                         run_case)

T5 = resolve(["t5"])["t5"]      # before the ranks fork


def _t5(batch: int = GLOBAL_BATCH):
    model = ARCHITECTURES["t5"].build(T5)
    example = tuple(x[:batch] for x in batches("t5")[0][:-1])
    return model, example, autopar.capture(model, example_inputs=example)


@pytest.mark.slow
def test_t5_split_and_planner_agree_on_relayed_values():
    model, micro, graph = _t5(batch=2)
    units = new_search(graph, autopar.Mesh.parse("4:cpu"), 8, float("inf"), time.monotonic() + 60).units
    cut_sets = [*_every_cut(len(units), 2), (0, 2, 5, len(units)), (0, 4, 6, len(units))]
    assert _agreement(model, micro, graph, cut_sets) == []


@pytest.mark.slow
def test_t5_memory_limited_plan_is_no_zero_bubble_over_relays():
    """The plan that the runtime refused before the planner knew of relays: zero-bubble over cuts
    that relay the encoder's output (read by the model's outputs and every decoder stage). The
    search for the largest memory limit that makes the planner pipeline (as the conformance
    form asks) prices no zero-bubble candidate whose cuts relay an activation."""
    _, _, graph = _t5()
    mesh = autopar.Mesh.parse("2x4:cpu")
    needed = plan_graph(graph, mesh, global_batch=GLOBAL_BATCH,
                        time_limit=30).predicted["memory_per_gpu_bytes"]
    for fraction in MEMORY_FRACTIONS:
        try:
            search = search_pipeline(graph, mesh, global_batch=GLOBAL_BATCH,
                                     memory_limit=int(needed * fraction),
                                     deadline=time.monotonic() + 30)
        except AutoparError:
            continue
        if search.best.candidate.shape.pp > 1:
            break
    assert search.best.candidate.shape.pp > 1
    assert search.relay_error(search.best.candidate) is None, search.best.candidate
    assert [p.candidate for p in search.candidates()
            if search.relay_error(p.candidate) is not None] == []


@pytest.mark.multiprocess
@pytest.mark.slow       # the conformance slice trains T5 through a pipeline in CI
def test_t5_free_plan_under_memory_limit_trains_like_one_process():
    result = run_case("t5", "plan 2x4 memory-limited", timeout=600)
    assert result.status == "pass", f"{result.status}: {result.detail}"
