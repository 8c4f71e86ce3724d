"""autopar.runtime.checks: training semantics refused with the reason, without processes."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.plans import Plan, Stage
from autopar.runtime.checks import (check_loss, check_loss_reduction, check_micro_batching,
                                    check_optimizer, check_step_inputs, loss_reduction)
from autopar.tracer import program_nodes


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


def _plan(micro_batches: int, dp: int = 1):
    stage = Stage(index=0, layers=["fc", "bn"], ranks=list(range(dp)), dp=dp)
    return Plan(fingerprint="", mesh={}, axes=[["dp", dp], ["tp", 1]], stages=[stage],
                global_batch=3 * micro_batches * dp, micro_batches=micro_batches, micro_batch_size=3,
                schedule="1f1b")


def test_batch_statistics_and_buffer_writes_refuse_micro_batches_only():
    """Data parallelism keeps statistics per replica, as DDP does: not refused. Micro-batches
    would normalize over fewer samples than one process and write the statistics once per
    micro-batch: refused, naming the norm, the buffers and the micro-batch size that runs."""
    program = _program(_WithBatchNorm().train())
    reason = Graph(nodes=program_nodes(program), blocks=[]).batch_coupling()
    assert "(bn)" in reason and "(bn.num_batches_tracked, bn.running_mean, bn.running_var)" in reason
    check_micro_batching(program, _plan(micro_batches=1, dp=8))
    with pytest.raises(AutoparError, match=r"each replica's 6 samples into 2 micro-batches of 3, "
                                           r"but batch norms in training mode .*micro_batch=6"):
        check_micro_batching(program, _plan(micro_batches=2, dp=4))


@pytest.mark.parametrize("model", [nn.Sequential(nn.Linear(4, 4), nn.LayerNorm(4)),
                                   _WithBatchNorm().eval()], ids=["layernorm", "batchnorm-eval"])
def test_model_without_batch_statistics_takes_micro_batches(model):
    program = _program(model)
    assert Graph(nodes=program_nodes(program), blocks=[]).batch_coupling() is None
    check_micro_batching(program, _plan(micro_batches=4, dp=8))
