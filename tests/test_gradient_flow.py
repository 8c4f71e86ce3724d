"""What the estimator says a backward holds beyond the kept activations is what autograd's engine
holds: the gradients on their way (a residual's pending one, an RMS norm's input read twice),
the temporaries of pow and rsqrt's derivatives, less the activations freed as it goes."""

import sys
from pathlib import Path

import pytest
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode

import autopar
from autopar.cost.gradient_flow import first_keepers
from autopar.cost.gradient_flow import backward_peak
from autopar.cost.layout import infer_layout
from autopar.simulate.memory import MemoryRecorder

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_saved_activations import GatedExperts  # noqa: E402


class Residual(nn.Module):
    """GatedExperts on a residual stream: the stream's gradient waits while the branch runs."""

    def __init__(self):
        super().__init__()
        self.inner = GatedExperts()
        self.proj = nn.Linear(16, 16, bias=False)

    def forward(self, x):
        h = self.proj(x)
        return h + self.inner(h)


class MeanOf(nn.Module):
    """The mean of a body's output: the loss's gradient is made inside the backward, as a
    training step's is, not held by the caller."""

    def __init__(self, body: nn.Module):
        super().__init__()
        self.body = body

    def forward(self, x):
        return self.body(x).mean()


def held_by_backward(model: nn.Module, x: torch.Tensor) -> int:
    """Bytes the backward holds at its fullest beyond what the forward left alive (real
    tensors, counted as the simulator counts them)."""
    recorder = MemoryRecorder(FakeTensorMode())
    with recorder:
        loss = model(x)
        before = recorder.live
        recorder.reset_peak()
        loss.backward()
    return recorder.peak_now() - before


@pytest.mark.parametrize("body", [GatedExperts, Residual])
def test_the_backwards_fullest_moment_is_autograds(body):
    torch.manual_seed(0)
    model, x = MeanOf(body()), torch.randn(4, 256, 16)
    graph = autopar.capture(model, (x[:1],))
    layout = infer_layout(graph, 1, compute_dtype="float32")
    regions = [None] * len(graph.nodes)
    poly = backward_peak(graph, layout, layout.nodes, first_keepers(graph, layout, regions, layout.nodes))
    predicted = sum(poly.values()) * x.shape[0]
    weight_gradients = sum(p.numel() * 4 for p in model.parameters())   # priced apart
    assert abs(held_by_backward(model, x) - predicted) <= weight_gradients


def test_a_waited_collective_output_is_counted_once():
    """`wait_tensor` hands back the tensor it waited on, in a run; under fake tensors it makes
    a new one, which the simulator counts as the same storage: a tensor-parallel gather is held
    once, not twice until the waited copy goes."""
    import torch.distributed._functional_collectives  # noqa: F401  (registers the op)

    mode = FakeTensorMode()
    recorder = MemoryRecorder(mode)
    with mode, recorder:
        gathered = torch.empty(256, 64)
        waited = torch.ops._c10d_functional.wait_tensor(gathered)
        assert recorder.live == gathered.nbytes
        del gathered
        assert recorder.live == waited.nbytes
        del waited
    assert recorder.live == 0 and recorder.peak == 256 * 64 * 4


class ReadTwice(nn.Module):
    """A weight two ops read (as an LM head tied to its embedding is): its two gradients meet."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(1024, 64))

    def forward(self, x):
        return (x @ self.weight.t()).sum() + (self.weight * 3).sum()


def test_two_gradients_of_one_value_are_summed_in_place_as_in_a_run():
    """Under a dispatch mode autograd's engine sums a value's gradients into a new tensor; a run
    adds one into the other. The simulator counts the run's: the weight's two gradients at once,
    not a third tensor for their sum."""
    model, x = ReadTwice(), torch.randn(8, 64)
    weight = model.weight.nbytes
    held = held_by_backward(model, x)
    assert 2 * weight <= held <= 2 * weight + 16       # and the loss's own gradient, a scalar
