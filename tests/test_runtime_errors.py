"""Bad input to autopar.compile and CompiledModel.step: a clear error on every rank, before any
collective, and nothing hangs (a short process-group timeout would turn a hang into a failure)."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the fork: see test_parallel_gpt.py)

import autopar
from autopar.cost.config import Config
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError, MeshError, PlanMismatchError
from autopar.models import build_model
from autopar.models.gpt import lm_loss

pytestmark = pytest.mark.multiprocess

SPEC = "gpt:layers=1,hidden=16,heads=2,seq=8,vocab=32"


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def example(batch=2, spec=SPEC):
    return build_model(spec, device="cpu", batch=batch)


def error_of(call):
    """The error a call raises on this rank, as (type name, message); None when it succeeds."""
    try:
        call()
    except AutoparError as err:
        return type(err).__name__, str(err)
    return None


def bad_inputs():
    model, (ids,) = example()
    results = {}
    results["mesh"] = error_of(lambda: autopar.compile(
        model, "4:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=sgd,
        plan=Config(dp=4, global_batch=8, micro_batch=2)))
    other, (other_ids,) = example(spec="gpt:layers=1,hidden=24,heads=2,seq=8,vocab=32")
    foreign = autopar.plan_from_config(autopar.capture(other, (other_ids,)), Mesh.parse("2:cpu"),
                                       Config(dp=2, global_batch=4, micro_batch=2))
    results["model"] = error_of(lambda: autopar.compile(
        model, "2:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=sgd, plan=foreign))
    odd = autopar.plan_from_config(autopar.capture(model, (ids,)), Mesh.parse("2:cpu"),
                                   Config(dp=2, global_batch=4, micro_batch=2))
    odd.global_batch = 5
    results["plan batch"] = error_of(lambda: autopar.compile(
        model, "2:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=sgd, plan=odd))
    results["global batch"] = error_of(lambda: autopar.compile(
        model, "2:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=sgd, global_batch=6,
        plan=Config(dp=2, global_batch=4, micro_batch=2)))
    meta_model, _ = build_model(SPEC, device="meta")
    results["meta model"] = error_of(lambda: autopar.compile(
        meta_model, "2:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=sgd,
        plan=Config(dp=2, global_batch=4, micro_batch=2)))
    cm = autopar.compile(model, "2:cpu", example_inputs=(ids,), loss_fn=lm_loss, optimizer=sgd,
                         plan=Config(dp=2, global_batch=4, micro_batch=2))
    rows = torch.zeros(6, 8, dtype=torch.long)
    results["step batch"] = error_of(lambda: cm.step(rows, rows))
    results["step local"] = error_of(lambda: cm.step(rows, rows, local=True))
    ok = torch.zeros(4, 8, dtype=torch.long)
    results["step after errors"] = cm.step(ok, ok)      # the group is still usable: nobody hung
    return results


@pytest.fixture(scope="module")
def errors_by_rank():
    return autopar.launch(bad_inputs, 2, timeout=120, pg_timeout=20)


@pytest.mark.parametrize("case, kind, words", [
    ("mesh", MeshError, "4 devices but the process group has 2 ranks"),
    ("model", PlanMismatchError, "another model"),
    ("global batch", AutoparError, "global_batch=6 but the plan was made for 4"),
    ("plan batch", PlanMismatchError, "global_batch 5 is not dp x micro_batches x micro_batch_size"),
    ("step batch", AutoparError, "batch of 6 but the plan's global batch is 4"),
    ("step local", AutoparError, "share per data-parallel rank is 2"),
    ("meta model", AutoparError, "on the meta device"),
])
def test_error_on_every_rank(errors_by_rank, case, kind, words):
    for rank, results in enumerate(errors_by_rank):
        assert results[case] is not None, f"rank {rank}: {case} was accepted"
        name, message = results[case]
        assert name == kind.__name__ and words in message, f"rank {rank}: {name}: {message}"


def test_group_usable_after_errors(errors_by_rank):
    assert errors_by_rank[0]["step after errors"] == errors_by_rank[1]["step after errors"]


def test_config_rejects_batch_not_divisible_by_dp():
    with pytest.raises(AutoparError, match="not divisible by dp x micro_batch"):
        Config(dp=4, global_batch=6, micro_batch=1)
