"""A plan's ranks simulated beside what the plan predicts for them, and the two checks the
simulation tests make of each rank: it sends the bytes the estimator priced, and it holds what
was predicted within the band of a cluster plan (-5%..+3%: never under-predicted beyond 3%)."""

from __future__ import annotations

import dataclasses

import torch

from autopar.api import plan_from_config
from autopar.cost.config import Config
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.simulate import priced_as_simulated, rank_report, simulate_ranks
from autopar.tracer import capture

MEMORY_BAND = (-0.05, 0.03)


def simulated(spec: str, mesh: str, config: Config, ranks=(0,), precision: str | None = None):
    """The plan of `config` for `spec` on `mesh` (at `precision`, default the device's), and the
    reports of its simulated `ranks`."""
    model, inputs = build_model(spec, device="meta")
    graph = capture(model, example_inputs=inputs)
    plan = plan_from_config(graph, mesh, config, precision=precision)
    runs = simulate_ranks(model, plan, list(ranks), example_inputs=inputs, targets=inputs[0],
                          loss_fn=lm_loss, graph=graph)
    predicted = priced_as_simulated(graph, plan)
    return plan, [rank_report(plan, run, predicted) for run in runs]


def assert_sent_as_priced(report) -> None:
    for entry in report.collectives:
        assert entry["sent_bytes"] == entry["predicted_sent_bytes"], (report.rank, entry)


def assert_holds_as_predicted(report) -> None:
    low, high = MEMORY_BAND
    assert low <= report.memory_error <= high, (report.peak_memory_bytes, report.predicted_memory_bytes)


def simulated_hf(name, config: Config, *, rank: int = 0, seq: int | None = None, mesh: str = "4:cpu",
                 precision: str | None = None, **overrides):
    """`rank` of `config` on `mesh` (4 CPU ranks, or 4 GPUs whose collectives are the device's)
    for a HuggingFace model under causal_sdpa, simulated, beside what the estimator priced: a
    zoo model by name, or an `Architecture` of any other (its config changed by `overrides`), on
    sequences of `seq` (default the zoo's), in `precision` (default the device's). Needs
    transformers (the test extra): skipped without it."""
    import pytest

    pytest.importorskip("transformers")
    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import ARCHITECTURES, loss_fn, resolve

    if isinstance(name, str):
        resolve([name])
        name = ARCHITECTURES[name]
    arch = dataclasses.replace(name, config={**name.config, **overrides})
    ids, targets = arch.batch(1, torch.Generator().manual_seed(1), seq)
    model = causal_sdpa(arch.build())
    graph = capture(model, example_inputs=(ids,))
    plan = plan_from_config(graph, mesh, config, precision=precision)
    runs = simulate_ranks(model, plan, [rank], example_inputs=(ids,), targets=targets,
                          loss_fn=loss_fn, graph=graph)
    return rank_report(plan, runs[0], priced_as_simulated(graph, plan))
