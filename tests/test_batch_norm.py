"""BatchNorm and models without repeated blocks train as torch's references do, on real gloo ranks.

- Data parallelism follows DDP: every replica starts from the first rank's values (the models are
  built from a different seed on each rank here) and normalizes over its own samples, keeping its
  own running statistics; compared with torch's DDP on the same ranks and shards (its rank 0's
  state, which `full_state_dict` holds).
- `sync_batchnorm=True` normalizes over all replicas' samples: exact against one process on the
  global batch, running statistics included.
- BatchNorm in eval mode (num_batches_tracked, which no op reads, is in `full_state_dict`), in
  bf16 under data parallelism (its parameters follow its fp32 statistics).
- A plain MLP is cut into pipeline stages between its modules.
- Without processes: the units of models without repeated blocks, the planner's one micro-batch
  per replica for BatchNorm in training mode, the buffer writes the stages keep.
fp32 comparisons at autopar.testing.equivalence's tolerance (1e-5 relative, 1e-6 absolute).
"""

from dataclasses import replace

import pytest
import torch
# Imported before the ranks fork, so that they inherit it (each rank would import it for seconds)
import torch._dynamo  # noqa: F401
import torch.distributed as dist
from torch import nn

import autopar
from autopar.api import plan_graph
from autopar.cost.config import Config
from autopar.testing.equivalence import mismatches, train_single_process
from autopar.plans.stage_flow import constants, dead
from autopar.cost.units import pipeline_units

transformers = pytest.importorskip("transformers")
# Resolved before the ranks fork: transformers imports a model's module on first use.
RESNET, REGNET = transformers.ResNetForImageClassification, transformers.RegNetForImageClassification
CONVNEXT = transformers.ConvNextForImageClassification

GLOBAL_BATCH, CLASSES = 8, 4
DP2 = Config(dp=2, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH // 2)
# BatchNorm in training mode through a pipeline: one micro-batch, which only GPipe runs
PIPELINE = Config(pp=2, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH, schedule="gpipe")


def resnet(seed: int = 0, train: bool = True) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.ResNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                       depths=[1, 1], layer_type="basic", num_labels=CLASSES)
    return RESNET(config).train(train)


def mlp(seed: int = 0, norm: bool = False) -> nn.Module:
    """Three linear layers; with `norm`, a BatchNorm1d in training mode after the first."""
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 32), *([nn.BatchNorm1d(32)] if norm else []), nn.ReLU(),
                         nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, CLASSES))


def images(steps: int = 3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 3, 16, 16, generator=generator),
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator)) for _ in range(steps)]


def vectors(steps: int = 3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randn(GLOBAL_BATCH, 8, generator=generator),
             torch.randint(0, CLASSES, (GLOBAL_BATCH,), generator=generator)) for _ in range(steps)]


def image_loss(outputs, labels):
    return nn.functional.cross_entropy(outputs.logits, labels)


def vector_loss(outputs, labels):
    return nn.functional.cross_entropy(outputs, labels)


def sgd(params):
    return torch.optim.SGD(params, lr=0.1)


def ddp_reference(make, batches, loss_fn) -> tuple[list[float], dict]:
    """torch's DDP on these ranks, each model built from the rank's own seed (DDP broadcasts
    rank 0's): losses averaged over the ranks, and rank 0's state (parameters and buffers)."""
    model = nn.parallel.DistributedDataParallel(make(seed=dist.get_rank()))
    optimizer = sgd(model.parameters())
    share = GLOBAL_BATCH // dist.get_world_size()
    rows = slice(dist.get_rank() * share, (dist.get_rank() + 1) * share)
    losses = []
    for inputs, labels in batches:
        loss = loss_fn(model(inputs[rows]), labels[rows])
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        losses.append(mean.item() / dist.get_world_size())
    state = [{k: v.detach().clone() for k, v in model.module.state_dict().items()}]
    dist.broadcast_object_list(state, src=0)
    return losses, state[0]


def autocast_reference(make, batches, loss_fn, dtype):
    """One process with the forward and the loss under torch.autocast, fp32 weights."""
    def call(model, inputs):
        with torch.autocast("cpu", dtype=dtype):
            return model(*inputs)

    def loss(outputs, labels):
        with torch.autocast("cpu", dtype=dtype):
            return loss_fn(outputs, labels)
    return train_single_process(make(), batches, loss, sgd, call=call)


def compiled(make, example, loss_fn, plan, **options):
    # one micro-batch's inputs: the capture is then the export the runtime cuts (one export)
    rows = plan.micro_batch if isinstance(plan, Config) else 2
    return autopar.compile(make(), f"{dist.get_world_size()}:cpu", example_inputs=(example[:rows],),
                           loss_fn=loss_fn, optimizer=sgd, plan=plan, global_batch=GLOBAL_BATCH,
                           **options)


def trained(make, batches, loss_fn, plan, **options) -> tuple[list[float], dict, object]:
    cm = compiled(make, batches[0][0], loss_fn, plan, **options)
    losses = [cm.step(*batch) for batch in batches]
    return losses, cm.full_state_dict(), cm


def default_checks() -> dict:
    """On every rank: each case's mismatches against its reference (bf16: loss differences)."""
    data, found = images(), {}
    reference = ddp_reference(lambda seed: resnet(seed), data, image_loss)
    losses, state, _ = trained(lambda: resnet(seed=dist.get_rank()), data, image_loss, DP2)
    found["dp, per replica"] = mismatches(reference, losses, state)
    one = train_single_process(resnet(), data, image_loss, sgd)
    losses, state, _ = trained(resnet, data, image_loss, DP2, sync_batchnorm=True)
    found["dp, sync_batchnorm"] = mismatches(one, losses, state)
    evaluating = train_single_process(resnet(train=False), data, image_loss, sgd)
    losses, state, _ = trained(lambda: resnet(train=False), data, image_loss, DP2)
    found["dp, eval mode"] = mismatches(evaluating, losses, state)
    autocast = autocast_reference(lambda: resnet(train=False), data, image_loss, torch.bfloat16)
    losses, _, _ = trained(lambda: resnet(train=False), data, image_loss, DP2, precision="bf16")
    found["dp, bf16"] = [abs(a - b) for a, b in zip(losses, autocast[0])]
    mlp_data = vectors()
    losses, state, cm = trained(mlp, mlp_data, vector_loss,
                                Config(pp=2, global_batch=GLOBAL_BATCH, micro_batch=2))
    found["pp, plain MLP"] = mismatches(train_single_process(mlp(), mlp_data, vector_loss, sgd),
                                        losses, state)
    found["pp, plain MLP stages"] = [stage.layers for stage in cm.plan.stages]
    return found


@pytest.mark.multiprocess
def test_batch_norm_and_module_pipelines_train_as_torch_does():
    ranks = autopar.launch(default_checks, 2, timeout=400)
    found = ranks[0]
    for case in ("dp, per replica", "dp, sync_batchnorm", "dp, eval mode", "pp, plain MLP"):
        assert found[case] == [], (case, found[case])
    # bf16 against one process under autocast: measured differences 6e-8, 7e-4, 3e-4 over the
    # three steps (FSDP2 rounds the weights once, BatchNorm's too, where autocast rounds the
    # convolutions' weights on each use), and fp32 is 1.4e-3 from that reference. A skipped
    # update changes the loss by the steps' own 1e-1, statistics of the batch instead of the
    # running ones by 6e-2.
    assert max(found["dp, bf16"]) < 3e-3, found["dp, bf16"]
    # the MLP's linear layers are its modules: one stage ends where another starts
    stages = found["pp, plain MLP stages"]
    assert len(stages) == 2 and [*stages[0], *stages[1]] == ["0", "1", "2", "3", "4"], stages


def regnet(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    config = transformers.RegNetConfig(num_channels=3, embedding_size=8, hidden_sizes=[8, 16],
                                       depths=[1, 2], groups_width=4, num_labels=CLASSES)
    return REGNET(config).train()


def convnext(seed: int = 0) -> nn.Module:
    """A CNN with LayerNorm, no BatchNorm: it takes micro-batches."""
    torch.manual_seed(seed)
    config = transformers.ConvNextConfig(num_channels=3, hidden_sizes=[8, 16], depths=[1, 2],
                                         num_stages=2, num_labels=CLASSES)
    return CONVNEXT(config).train()


def slow_checks(directory: str) -> dict:
    """On every rank: more models and forms against their references (see the test)."""
    data, rank, found = images(), dist.get_rank(), {}
    per_replica = ddp_reference(resnet, data, image_loss)
    one = train_single_process(resnet(), data, image_loss, sgd)
    losses, state, cm = trained(resnet, data, image_loss, None)
    found["free plan"] = mismatches(per_replica if cm.plan.stages[0].dp > 1 else one, losses, state)
    found["free plan micro-batches"] = cm.plan.micro_batches
    losses, state, _ = trained(lambda: resnet(seed=rank), data, image_loss, replace(DP2, recompute="full"))
    found["dp, per replica, recompute"] = mismatches(per_replica, losses, state)
    losses, state, _ = trained(resnet, data, image_loss, PIPELINE)
    found["pp, one micro-batch"] = mismatches(one, losses, state)
    mlp_data = vectors()
    mlp_one = train_single_process(mlp(norm=True), mlp_data, vector_loss, sgd)
    for name, plan, options in (("BatchNorm1d MLP, pp", PIPELINE, {}),
                                ("BatchNorm1d MLP, sync", DP2, {"sync_batchnorm": True}),
                                ("BatchNorm1d MLP, tp", Config(tp=2, global_batch=GLOBAL_BATCH,
                                                               micro_batch=GLOBAL_BATCH), {})):
        losses, state, _ = trained(lambda: mlp(norm=True), mlp_data, vector_loss, plan, **options)
        found[name] = mismatches(mlp_one, losses, state)
    losses, state, _ = trained(regnet, data, image_loss, replace(DP2, recompute="full"),
                               sync_batchnorm=True)
    found["RegNet, sync, recompute"] = mismatches(train_single_process(regnet(), data, image_loss, sgd),
                                                  losses, state)
    losses, state, _ = trained(convnext, data, image_loss,
                               Config(pp=2, global_batch=GLOBAL_BATCH, micro_batch=2))
    found["ConvNext, pp"] = mismatches(train_single_process(convnext(), data, image_loss, sgd),
                                       losses, state)
    _, saved, cm = trained(lambda: resnet(train=False), data, image_loss, DP2)
    cm.save(f"{directory}/eval")
    resumed = compiled(lambda: resnet(seed=1, train=False), data[0][0], image_loss,
                       Config(pp=2, global_batch=GLOBAL_BATCH, micro_batch=2))
    resumed.load(f"{directory}/eval")
    found["eval mode, checkpoint"] = mismatches(([], saved), [], resumed.full_state_dict(), rtol=0, atol=0)
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_more_batch_norm_models_and_forms(tmp_path):
    """The free plan trains a ResNet (one micro-batch per replica); recompute writes the running
    statistics once (DDP is the reference); BatchNorm through a pipeline of one micro-batch, and
    under tensor parallelism (run on whole tensors); a BatchNorm1d MLP and a RegNet with sync
    statistics and recompute against one process; a ConvNext (LayerNorm) pipelined between its
    modules with micro-batches; an eval-mode checkpoint (num_batches_tracked included) loaded
    under another plan."""
    found = autopar.launch(slow_checks, 2, str(tmp_path), timeout=900)[0]
    assert found.pop("free plan micro-batches") == 1
    assert {case: problems for case, problems in found.items() if problems} == {}


class SharedActivation(nn.Module):
    """One ReLU module called after each linear layer: it runs at two places of the graph."""

    def __init__(self):
        super().__init__()
        self.first, self.act, self.second = nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, CLASSES)

    def forward(self, x):
        return self.act(self.second(self.act(self.first(x))))


@pytest.fixture(scope="module")
def resnet_graph():
    return autopar.capture(resnet(), (images()[0][0][:2],))


def test_models_without_repeated_blocks_are_cut_between_their_modules(resnet_graph):
    """An MLP's units are its modules; a ResNet's, modules down to where a unit weighs at most
    an eighth of the model; a module called at two places stands as no unit of its own."""
    inputs = vectors()[0][0][:2]
    units = pipeline_units(autopar.capture(mlp(), (inputs,)))
    assert [unit.layers for unit in units] == [("0",), ("1",), ("2",), ("3",), ("4",)]
    assert units[0].start == 0 and all(a.stop == b.start for a, b in zip(units, units[1:]))
    layers = [layer for unit in pipeline_units(resnet_graph) for layer in unit.layers]
    assert layers[0].startswith("resnet.embedder") and layers[-1] == "classifier"
    assert "resnet.encoder.stages.1.layers.0.shortcut" in layers
    shared = pipeline_units(autopar.capture(SharedActivation(), (inputs,)))
    assert [unit.layers for unit in shared] == [("first", "act", "second")]


def test_the_planner_gives_batch_norm_one_micro_batch_per_replica(resnet_graph):
    """A free plan never cuts a replica's batch (the runtime refuses it, see
    test_runtime_checks); a forced configuration that does is refused with the micro-batch
    that runs; one micro-batch through a pipeline is planned, cut between modules."""
    graph = resnet_graph
    assert "batch norms in training mode" in graph.batch_coupling()
    plan = plan_graph(graph, "4:cpu", global_batch=16)
    assert plan.micro_batches == 1 and plan.micro_batch_size * plan.stages[0].dp == 16
    with pytest.raises(autopar.AutoparError, match=r"normalize over the samples of each micro-batch "
                                                   r".*runs its 8 samples as one micro-batch, not 4 of 2"):
        autopar.plan_from_config(graph, "2:cpu", Config(pp=2, global_batch=8, micro_batch=2))
    piped = autopar.plan_from_config(graph, "2:cpu", Config(pp=2, global_batch=8, micro_batch=8,
                                                            schedule="gpipe"))
    assert len(piped.stages) == 2 and piped.stages[1].layers[-1] == "classifier"
    assert autopar.capture(resnet(train=False), (images()[0][0][:2],)).batch_coupling() is None


def test_buffer_writes_are_recorded_and_no_stage_drops_them():
    """BatchNorm's running statistics are written by its op, num_batches_tracked by an add_ that
    no op reads: the planner's and the runtime's flow keep it, as a write, not a constant."""
    graph = autopar.capture(mlp(norm=True), (vectors()[0][0][:2],))
    written = {graph.node(name).param_fqn for node in graph.nodes for name in node.writes}
    assert written == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    flow = graph.flow_nodes()
    counter = next(node.name for node in graph.nodes if node.target == "aten.add_.Tensor")
    assert counter not in dead(flow) and counter not in constants(flow)
