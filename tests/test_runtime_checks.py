"""autopar.runtime.checks: training semantics refused with the reason, without processes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import AutoparError
from autopar.runtime.checks import (check_buffers, check_loss, check_loss_reduction, check_optimizer,
                                    check_step_inputs, loss_reduction, updated_buffers)


def _lm_outputs(batch=4, seq=8, vocab=16):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(batch, seq, vocab, generator=generator, requires_grad=True)
    targets = torch.randint(0, vocab, (batch, seq), generator=generator)
    return logits, targets


def _lm_loss(reduction):
    return lambda logits, targets: F.cross_entropy(logits.flatten(0, 1), targets.flatten(),
                                                   reduction=reduction)


def test_optimizer_factory_results():
    params = [nn.Parameter(torch.ones(2))]
    assert check_optimizer(torch.optim.SGD(params, lr=0.1)).param_groups
    with pytest.raises(AutoparError, match="returned None"):
        check_optimizer(None)
    with pytest.raises(AutoparError, match="returned a list, not a torch.optim.Optimizer"):
        check_optimizer(params)


@pytest.mark.parametrize("loss, words", [
    (torch.ones(3, requires_grad=True), r"shape \[3\], not a scalar"),
    (1.5, "returned a float, not a tensor"),
    (torch.tensor(2), "int64 tensor"),
    (torch.tensor(2.0), "does not depend on the model's outputs"),
])
def test_bad_losses(loss, words):
    with pytest.raises(AutoparError, match=words):
        check_loss(loss)


def test_scalar_loss_passes():
    loss = (torch.ones(2, requires_grad=True) * 3).mean()
    assert check_loss(loss) is loss


@pytest.mark.parametrize("batch", [4, 5])
def test_loss_reduction_is_told_apart(batch):
    logits, targets = _lm_outputs(batch=batch)
    assert loss_reduction(_lm_loss("mean"), logits, targets) == "mean"
    assert loss_reduction(_lm_loss("sum"), logits, targets) == "sum"
    # a loss that is neither: the mean squared, say
    assert loss_reduction(lambda o, t: _lm_loss("mean")(o, t) ** 2, logits, targets) == "other"


def test_sum_reduced_loss_is_refused_mean_passes():
    logits, targets = _lm_outputs()
    check_loss_reduction(_lm_loss("mean"), logits, targets)
    with pytest.raises(AutoparError, match="sums over the batch.*reduction='mean'"):
        check_loss_reduction(_lm_loss("sum"), logits, targets)


def test_loss_of_a_batch_of_one_cannot_tell_and_passes():
    logits, targets = _lm_outputs(batch=1)
    assert loss_reduction(_lm_loss("sum"), logits, targets) == "mean"


class _WithBatchNorm(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x):
        return self.bn(self.fc(x))


def _program(model):
    return torch.export.export(model, (torch.randn(3, 4),), strict=False)


def test_buffers_updated_in_forward_are_found_and_refused_under_dp():
    program = _program(_WithBatchNorm().train())
    assert updated_buffers(program) == ["bn.num_batches_tracked", "bn.running_mean", "bn.running_var"]
    check_buffers(program, dp=1)
    with pytest.raises(AutoparError, match=r"updates buffers in forward \(bn.num_batches_tracked.*"
                                           r"2 data-parallel ranks.*LayerNorm"):
        check_buffers(program, dp=2)


@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),
                                   _WithBatchNorm().eval()], ids=["layernorm", "batchnorm-eval"])
def test_model_without_updated_statistics_passes(model):
    program = _program(model)
    assert updated_buffers(program) == []
    check_buffers(program, dp=8)


def test_step_keyword_inputs():
    example = {"attention_mask": torch.ones(2, 8), "use_cache": False}
    mask = torch.zeros(6, 8)
    assert check_step_inputs(example, {"attention_mask": mask, "use_cache": False}, 6) == {"attention_mask": mask}
    assert check_step_inputs(example, {"attention_mask": mask}, 6) == {"attention_mask": mask}
    with pytest.raises(AutoparError, match=r"keyword input\(s\) \['mask'\], which were not captured"):
        check_step_inputs(example, {"mask": torch.ones(2, 8), "attention_mask": mask}, 6)
    with pytest.raises(AutoparError, match=r"missing the keyword input\(s\) \['attention_mask'\]"):
        check_step_inputs(example, {"use_cache": False}, 6)
    with pytest.raises(AutoparError, match=r"'attention_mask' has shape \[2, 9\].*only the batch"):
        check_step_inputs(example, {"attention_mask": torch.ones(2, 9), "use_cache": False}, 2)
    with pytest.raises(AutoparError, match=r"'attention_mask' has a batch dimension of 2 but the inputs need 6"):
        check_step_inputs(example, {"attention_mask": torch.ones(2, 8)}, 6)
    with pytest.raises(AutoparError, match=r"'attention_mask' is torch.int64, but torch.float32"):
        check_step_inputs(example, {"attention_mask": torch.ones(6, 8, dtype=torch.long)}, 6)
    with pytest.raises(AutoparError, match="'use_cache' is True, but False was captured"):
        check_step_inputs(example, {"attention_mask": mask, "use_cache": True}, 6)
    with pytest.raises(AutoparError, match="'attention_mask' is a list"):
        check_step_inputs(example, {"attention_mask": [1, 1], "use_cache": False}, 6)
