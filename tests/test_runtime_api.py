"""CompiledModel's API on real gloo ranks: plan from a file, plan=None (rank 0 plans, every rank
gets the same plan), the sampler with local batches (step(local=True)), full_state_dict's names
and shapes."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the fork: see test_parallel_gpt.py)
from torch.distributed.fsdp import FSDPModule
from torch.utils.data import DataLoader, TensorDataset

import autopar
from autopar.cost.config import Config
from autopar.cost.mesh import Mesh
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.testing.equivalence import mismatches, train_single_process

pytestmark = pytest.mark.multiprocess

SPEC = "gpt:layers=2,hidden=16,heads=2,seq=8,vocab=32"


def sgd(params):
    return torch.optim.SGD(params, lr=0.2)


def data(steps=3, batch=4):
    generator = torch.Generator().manual_seed(2)
    return [(torch.randint(0, 32, (batch, 8), generator=generator),
             torch.randint(0, 32, (batch, 8), generator=generator)) for _ in range(steps)]


def new_model():
    return build_model(SPEC, device="cpu")[0]


def api_checks(plan_path) -> dict:
    batches = data()
    reference = train_single_process(new_model(), batches, lm_loss, sgd)
    example = (batches[0][0][:2],)
    results = {}

    cm = autopar.compile(new_model(), "2:cpu", example_inputs=example, loss_fn=lm_loss, optimizer=sgd,
                         plan=plan_path)
    losses = [cm.step(ids, targets) for ids, targets in batches]
    state = cm.full_state_dict()
    results["from file"] = mismatches(reference, losses, state)
    results["state shapes"] = {k: tuple(v.shape) for k, v in state.items()} == \
        {k: tuple(v.shape) for k, v in new_model().state_dict().items()}

    cm = autopar.compile(new_model(), "2:cpu", example_inputs=example, loss_fn=lm_loss, optimizer=sgd,
                         global_batch=4, time_limit=10)
    results["solved plan"] = cm.plan.to_dict()
    losses = [cm.step(ids, targets) for ids, targets in batches]
    results["solved"] = mismatches(reference, losses, cm.full_state_dict())

    cm = autopar.compile(new_model(), "2:cpu", example_inputs=example, loss_fn=lm_loss, optimizer=sgd,
                         plan=Config(dp=2, global_batch=4, micro_batch=2))
    # one FSDP group per layer with parameters (embeddings, 2 blocks, final norm, head) and the stage
    groups = [m for m in cm.stages.modules() if isinstance(m, FSDPModule)]
    results["data-parallel groups"] = len(groups)
    cm = autopar.compile(new_model(), "2:cpu", example_inputs=example, loss_fn=lm_loss, optimizer=sgd,
                         plan=Config(dp=2, global_batch=4, micro_batch=2))
    dataset = TensorDataset(torch.cat([ids for ids, _ in batches]), torch.cat([t for _, t in batches]))
    sampler = cm.sampler(dataset, shuffle=False)
    # Without shuffling the sampler strides: the two ranks' i-th local batches are together the
    # rows of global batch i, so training on them is training on the reference's batches.
    loader = DataLoader(dataset, batch_size=2, sampler=sampler)
    local_losses = [cm.step(ids, targets, local=True) for ids, targets in loader]
    results["sampler rows"] = [int(i) for i in sampler]
    results["local"] = mismatches(reference, local_losses, cm.full_state_dict())
    return results


@pytest.fixture(scope="module")
def results_by_rank(tmp_path_factory):
    model, (ids,) = build_model(SPEC, device="cpu", batch=2)
    path = tmp_path_factory.mktemp("plan") / "plan.json"
    autopar.plan_from_config(autopar.capture(model, (ids,)), Mesh.parse("2:cpu"),
                             Config(dp=2, zero=2, global_batch=4, micro_batch=2)).save(path)
    return autopar.launch(api_checks, 2, str(path), timeout=180)


def test_plan_from_a_file_trains_like_one_process(results_by_rank):
    for results in results_by_rank:
        assert results["from file"] == []


def test_full_state_dict_has_the_models_names_and_shapes(results_by_rank):
    assert all(results["state shapes"] for results in results_by_rank)


def test_rank_0_plans_and_every_rank_runs_that_plan(results_by_rank):
    plans = [results["solved plan"] for results in results_by_rank]
    assert plans[0] == plans[1]
    assert results_by_rank[0]["solved"] == []


def test_data_parallel_gradients_reduce_per_layer(results_by_rank):
    """Each layer is its own FSDP group, so its gradients are reduced as soon as its backward is
    done, while earlier layers still compute."""
    # tok_emb, pos_emb, layers.0, layers.1, norm_f, lm_head, and the stage itself
    expected = 7
    assert all(results["data-parallel groups"] == expected for results in results_by_rank)


def test_sampler_splits_the_dataset_over_data_parallel_ranks(results_by_rank):
    rows = [results["sampler rows"] for results in results_by_rank]
    assert sorted(rows[0] + rows[1]) == list(range(12)) and not set(rows[0]) & set(rows[1])
    for results in results_by_rank:
        assert results["local"] == []


ONE_RANK = """
import torch, autopar
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.testing.equivalence import mismatches, train_single_process
model, (ids,) = build_model("{spec}", device="cpu", batch=4)
data = [(ids, ids.roll(-1, 1))] * 2
sgd = lambda params: torch.optim.SGD(params, lr=0.2)
reference = train_single_process(build_model("{spec}", device="cpu")[0], data, lm_loss, sgd)
cm = autopar.compile(model, "1:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=sgd)
losses = [cm.step(*batch) for batch in data]
print(torch.distributed.get_world_size(), mismatches(reference, losses, cm.full_state_dict()))
"""


def test_compile_in_a_plain_process_runs_a_world_of_one_rank():
    """No torchrun, no autopar.launch: a mesh of one device trains in the process itself (a
    larger mesh is refused with how to start its ranks: test_bad_input's compile-no-launcher)."""
    import os
    import subprocess
    import sys

    environment = {k: v for k, v in os.environ.items()
                   if k not in ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-c", ONE_RANK.format(spec=SPEC)], env=environment,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip().splitlines()[-1] == "1 []"
