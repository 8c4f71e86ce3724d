"""Every parallel form of autopar's small GPT trains exactly like one process: real gloo ranks,
fp32, loss at each of 3 SGD steps and the final full parameters (autopar.testing.equivalence)."""


import pytest
import torch
# Imported here, before the ranks fork, so that they inherit it: each rank's first optimizer step
# or export would otherwise import it on its own (4 s each, 4 ranks sharing 2 cores).
import torch._dynamo  # noqa: F401

import autopar
from autopar.cost.config import Config
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.testing.equivalence import mismatches, train_forms_against_one_process, train_single_process

pytestmark = pytest.mark.multiprocess

SPEC = "gpt:layers=2,hidden=32,heads=4,seq=8,vocab=64"
GLOBAL_BATCH = 8
FORMS_ON_4 = {
    "dp": Config(dp=4, global_batch=GLOBAL_BATCH, micro_batch=2),
    "dp x tp": Config(dp=2, tp=2, global_batch=GLOBAL_BATCH, micro_batch=4),
    "zero-1": Config(dp=4, zero=1, global_batch=GLOBAL_BATCH, micro_batch=2),
    # 2 micro-batches: gradients reduce-scattered after each and accumulated as shards
    "zero-2": Config(dp=4, zero=2, global_batch=GLOBAL_BATCH, micro_batch=1),
    "zero-3": Config(dp=4, zero=3, global_batch=GLOBAL_BATCH, micro_batch=2),
    "dp x tp + sp, zero-3": Config(dp=2, tp=2, zero=3, sequence_parallel=True, global_batch=GLOBAL_BATCH,
                                   micro_batch=4),
}
FORMS_ON_2 = {
    "tp": Config(tp=2, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH),
    "tp + sequence parallel": Config(tp=2, sequence_parallel=True, global_batch=GLOBAL_BATCH,
                                     micro_batch=GLOBAL_BATCH),
    "dp with 2 micro-batches": Config(dp=2, global_batch=GLOBAL_BATCH, micro_batch=2),
    # gradients reduce-scattered after each micro-batch and accumulated as shards
    "zero-2 with 2 micro-batches": Config(dp=2, zero=2, global_batch=GLOBAL_BATCH, micro_batch=2),
    "zero-3 with 2 micro-batches": Config(dp=2, zero=3, global_batch=GLOBAL_BATCH, micro_batch=2),
}
RECOMPUTE = ("none", "full", "selective")


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def batches(steps=3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=generator),
             torch.randint(0, 64, (GLOBAL_BATCH, 8), generator=generator)) for _ in range(steps)]


def new_model():
    return build_model(SPEC, device="cpu")[0]


# The default tier trains every form without recompute, and every recompute level on the form
# with the most collectives; the slow tier trains the other pairs.
FULLEST = "dp x tp + sp, zero-3"
DEFAULT_CASES = [(form, "none") for form in FORMS_ON_4] + [(FULLEST, r) for r in RECOMPUTE if r != "none"]
SLOW_CASES = [(form, r) for form in FORMS_ON_4 for r in RECOMPUTE if (form, r) not in DEFAULT_CASES]


def train_forms(forms: dict, cases: list | None = None) -> dict:
    """On every rank: each (form, recompute) of `cases` (every form at every level by default)
    against one process's training."""
    data = batches()
    cases = cases or [(form, r) for form in forms for r in RECOMPUTE]
    results = {}
    for form in dict.fromkeys(form for form, _ in cases):
        levels = [r for name, r in cases if name == form]
        results.update(train_forms_against_one_process(new_model, data, lm_loss, sgd,
                                                       {form: forms[form]}, levels))
    # The check can fail: a run with another learning rate disagrees with the reference.
    other = train_single_process(new_model(), data, lm_loss, lambda p: torch.optim.SGD(p, lr=0.21, momentum=0.9))
    results["control"] = mismatches(other, *train_single_process(new_model(), data, lm_loss, sgd))
    return results


@pytest.fixture(scope="module")
def on_4_ranks():
    return autopar.launch(train_forms, 4, FORMS_ON_4, DEFAULT_CASES, timeout=240)


@pytest.fixture(scope="module")
def on_4_ranks_slow():
    return autopar.launch(train_forms, 4, FORMS_ON_4, SLOW_CASES, timeout=240)


@pytest.fixture(scope="module")
def on_2_ranks():
    return autopar.launch(train_forms, 2, FORMS_ON_2, timeout=240)


@pytest.mark.parametrize("form, recompute", DEFAULT_CASES)
def test_forms_on_4_ranks(on_4_ranks, form, recompute, form_problems):
    assert form_problems(on_4_ranks, (form, recompute)) == []


@pytest.mark.slow
@pytest.mark.parametrize("form, recompute", SLOW_CASES)
def test_more_forms_on_4_ranks(on_4_ranks_slow, form, recompute, form_problems):
    assert form_problems(on_4_ranks_slow, (form, recompute)) == []


# slow tier: tensor and sequence parallelism run in the default tier on 4 ranks (dp x tp + sp,
# test_pipeline_run's tensor-parallel stages), micro-batched ZeRO-2 in the 4-rank forms
@pytest.mark.slow
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("form", FORMS_ON_2)
def test_forms_on_2_ranks(on_2_ranks, form, recompute, form_problems):
    assert form_problems(on_2_ranks, (form, recompute)) == []


def test_comparison_detects_a_different_run(on_4_ranks):
    assert on_4_ranks[0]["control"], "a run with another learning rate passed the comparison"


def test_form_problems_names_each_fault(form_problems):
    """The forms' check finds a mismatch, ranks that disagree and missing recompute regions."""
    good = {("dp", "full"): ([1.0, 0.5], [], 2)}
    assert form_problems([good, good], ("dp", "full")) == []
    mismatched = {("dp", "full"): ([1.0, 0.5], ["w: max diff 1e-3"], 2)}
    other_losses = {("dp", "full"): ([1.0, 0.6], [], 2)}
    no_regions = {("dp", "full"): ([1.0, 0.5], [], 0)}
    problems = form_problems([good, mismatched, other_losses, no_regions], ("dp", "full"))
    assert len(problems) == 3
    assert "rank 1" in problems[0] and "rank 2 returned losses" in problems[1]
    assert "rank 3: 0 recomputed regions" in problems[2]
