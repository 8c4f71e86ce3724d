"""Plans the solver emits for micro-batch counts that are not multiples of the pipeline depth run on
real gloo ranks and train exactly like one process: zero-bubble with 3 micro-batches on 2 ranks
and 5 on 4, and a free plan for an odd global batch under a memory limit."""

import pytest
import torch
# Imported before the ranks fork (see tests/test_parallel_hf.py).
import torch._dynamo  # noqa: F401

import autopar
from autopar.cost.config import Config
from autopar.cost.megatron import megatron_placements
from autopar.models import build_model, lm_loss
from autopar.testing.equivalence import mismatches, train_single_process
from autopar.solver.planner import plan_config, plan_graph
from autopar.plans.schedules import runs

pytestmark = pytest.mark.multiprocess

SPEC = "gpt:layers=4,hidden=32,heads=4,seq=16,vocab=64"
FORCED = [Config(pp=2, dp=2, global_batch=6, micro_batch=1, schedule="zero-bubble", zero=3),
          Config(pp=4, global_batch=10, micro_batch=2, schedule="zero-bubble")]


def _plans() -> list:
    """The solver's plans, made in the parent (each rank receives the same ones)."""
    model, inputs = build_model(SPEC, batch=2)
    graph = autopar.capture(model, example_inputs=inputs)
    mesh = autopar.Mesh.parse("4:cpu")
    plans = [plan_config(graph, mesh, config) for config in FORCED]
    # a limit that rules out plain data parallelism on 2 replicas (7 per replica, odd)
    replica = autopar.estimate(graph, mesh, Config(dp=2, tp=2, global_batch=14, micro_batch=1),
                               placements=megatron_placements(graph, 2))
    plans.append(plan_graph(graph, mesh, global_batch=14, time_limit=20,
                            memory_limit=0.55 * replica.memory_per_gpu_bytes))
    return plans


def _train(plans: list) -> list:
    reports = []
    for plan in plans:
        generator = torch.Generator().manual_seed(1)
        data = [(torch.randint(0, 64, (plan.global_batch, 16), generator=generator),
                 torch.randint(0, 64, (plan.global_batch, 16), generator=generator)) for _ in range(3)]

        def adamw(params):
            return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)

        model, inputs = build_model(SPEC, device="cpu", batch=2)
        cm = autopar.compile(model, "4:cpu", example_inputs=inputs, loss_fn=lm_loss, optimizer=adamw,
                             plan=plan)
        losses = [cm.step(x, y) for x, y in data]
        reference = train_single_process(build_model(SPEC, device="cpu")[0], data, lm_loss, adamw)
        reports.append(mismatches(reference, losses, cm.full_state_dict()))
    return reports


@pytest.mark.slow
def test_solver_plans_with_odd_micro_batch_counts_train_like_one_process():
    plans = _plans()
    for plan in plans:
        assert plan.pp == 1 or runs(plan.schedule, plan.pp, plan.micro_batches, plan.virtual)
    assert [p.micro_batches for p in plans[:2]] == [3, 5]
    for rank, reports in enumerate(autopar.launch(_train, 4, plans, timeout=400)):
        for plan, found in zip(plans, reports):
            assert found == [], f"rank {rank}, {plan.summary()}: {found}"
