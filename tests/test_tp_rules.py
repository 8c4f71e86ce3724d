"""Inside a tensor-parallel stage, ops run as autopar's strategies say, or replicated.

A convolution's DTensor support is a halo exchange for an input split on its width, with the
weight whole; autopar's rules split the output channels (with the bias) or the input channels (a
partial sum), so the runtime runs convolutions by those rules on local shards (RunByStrategy),
checked here on 2 ranks against the plain op, values and gradients, for every strategy. A value
written in place (a key assembled into a `new_empty` buffer, as DeepSeek-V3's latent attention
does) keeps DTensor's placement: a redistribution inserted at it would copy the buffer before the
write and lose the written value's gradient (`written_nodes`). An op that autopar has no rule for
runs replicated, as the planner priced it, even where DTensor has a rule of its own: that rule
may fail inside (adaptive_avg_pool1d decomposes into an in-place squeeze DTensor cannot run).
"""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork)
from torch import fx

import autopar
from autopar.cost.strategies import OpView, axis_strategies, placement_str
from autopar.testing.equivalence import ATOL, RTOL
from autopar.passes.tensor_parallel import written_nodes

X, W, B = (4, 4, 8, 8), (6, 4, 3, 3), (6,)


def _conv_strategies(with_bias: bool):
    shapes = (X, W, B) if with_bias else (X, W)
    view = OpView(target="aten.conv2d.default", args=(None, None, None, [1, 1], [1, 1]),
                  input_shapes=shapes, output_shape=(4, 6, 8, 8))
    return axis_strategies(view)


def _conv_by_each_strategy() -> dict:
    """On every rank of a 2-rank mesh: conv2d (padding 1) by each strategy, with and without a
    bias, its output and its inputs' gradients against the plain op's."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, distribute_tensor

    from autopar.passes.dtensor_rules import RunByStrategy

    mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
    generator = torch.Generator().manual_seed(0)
    whole = [torch.randn(shape, generator=generator) for shape in (X, W, B)]
    upstream = torch.randn(4, 6, 8, 8, generator=generator)
    op = torch.ops.aten.conv2d.default
    found = {}
    for with_bias in (True, False):
        inputs = whole if with_bias else whole[:2]
        reference = [t.clone().requires_grad_() for t in inputs]
        expected = op(*reference, *([] if with_bias else [None]), [1, 1], [1, 1])
        (expected * upstream).sum().backward()
        for strategy in _conv_strategies(with_bias):
            placed = [distribute_tensor(t, mesh, [Replicate()]).requires_grad_() for t in inputs]
            run = RunByStrategy(op, mesh, strategy.inputs, strategy.output)
            out = run(*placed, *([] if with_bias else [None]), [1, 1], [1, 1])
            (out.full_tensor() * upstream).sum().backward()
            pairs = [(out.full_tensor(), expected)]
            pairs += [(p.grad.full_tensor(), r.grad) for p, r in zip(placed, reference)]
            # beyond the equivalence tests' floor: |d| <= 1e-6 + 1e-5 * the tensor's scale
            excess = [(got - want).abs().max().item() / (ATOL + RTOL * want.abs().max().item())
                      for got, want in pairs]
            key = (with_bias, placement_str(strategy.output), tuple(map(placement_str, strategy.inputs)))
            found[key] = excess
    return found


@pytest.mark.multiprocess
def test_convolutions_run_by_every_strategy_like_the_plain_op():
    found = autopar.launch(_conv_by_each_strategy, 2, timeout=240)[0]
    # replicated, batch, output channels with the bias, input channels into a partial sum
    assert len(found) == 8
    assert ("P", ("S(1)", "S(1)", "P")) in {key[1:] for key in found}
    assert {key: excess for key, excess in found.items() if max(excess) > 1} == {}


def test_values_written_in_place_and_their_views_keep_dtensors_placement():
    """As DeepSeek-V3 assembles its keys: a buffer from new_empty, two slices copied into."""
    def assemble(k_pass, k_rot):
        buffer = k_pass.new_empty(2, 4, 8, 12)
        buffer[..., :8].copy_(k_pass)
        buffer[..., 8:].copy_(k_rot.expand(-1, 4, -1, -1))
        return torch.nn.functional.scaled_dot_product_attention(buffer, buffer, buffer)

    program = torch.export.export(_Module(assemble), (torch.randn(2, 4, 8, 8), torch.randn(2, 1, 8, 4)))
    graph = program.graph_module.graph
    written = {node.name for node in written_nodes(graph)}
    by_target = {str(node.target): node.name for node in graph.nodes if node.op == "call_function"}
    assert by_target["aten.new_empty.default"] in written
    assert {name for name in written if name.startswith("slice")} == {
        node.name for node in graph.nodes if node.target == torch.ops.aten.slice.Tensor}
    # what is copied in, and what reads the buffer, are not written
    assert not {"k_pass", "k_rot", by_target["aten.expand.default"],
                by_target["aten.scaled_dot_product_attention.default"]} & written
    assert all(isinstance(node, fx.Node) for node in written_nodes(graph))


class _Module(torch.nn.Module):
    def __init__(self, fn):
        super().__init__()
        self.fn = fn

    def forward(self, *args):
        return self.fn(*args)


class PooledClassifier(torch.nn.Module):
    """Tokens projected, averaged over the sequence by adaptive_avg_pool1d, classified. DTensor
    has a rule for that pooling, but runs it as a decomposition with an in-place squeeze that it
    has no rule for (as Swin's classifier pools): autopar has none, so it runs replicated."""

    def __init__(self):
        super().__init__()
        self.proj, self.head = torch.nn.Linear(16, 32), torch.nn.Linear(32, 4)

    def forward(self, tokens):
        hidden = self.proj(tokens).relu().transpose(1, 2)
        return self.head(torch.nn.functional.adaptive_avg_pool1d(hidden, 1).flatten(1))


def _pooled_classifier_under_tp() -> list[str]:
    from autopar.testing.equivalence import mismatches, train_single_process

    generator = torch.Generator().manual_seed(0)
    data = [(torch.randn(8, 6, 16, generator=generator), torch.randn(8, 4, generator=generator))
            for _ in range(3)]

    def make():
        torch.manual_seed(0)
        return PooledClassifier()

    def loss_fn(out, target):
        return torch.nn.functional.mse_loss(out, target)

    def sgd(params):
        return torch.optim.SGD(params, lr=0.1)

    cm = autopar.compile(make(), "2:cpu", example_inputs=(data[0][0],), loss_fn=loss_fn,
                         optimizer=sgd, plan=autopar.Config(tp=2, global_batch=8, micro_batch=8))
    losses = [cm.step(*batch) for batch in data]
    sharded = sum(not placements[1] == "R" for placements in cm.plan.parameters.values())
    found = mismatches(train_single_process(make(), data, loss_fn, sgd), losses, cm.full_state_dict())
    return found + ([] if sharded else ["the plan shards no parameter over tp"])


@pytest.mark.multiprocess
def test_an_op_whose_dtensor_rule_fails_inside_runs_replicated():
    assert autopar.launch(_pooled_classifier_under_tp, 2, timeout=240)[0] == []
