"""HuggingFace models of several kinds train through a pipeline exactly like one process.

Tier 1 (no processes): for many architectures, the stage split of the planner's pipeline plan
gives every graph node a stage, and the stages run one after another compute the model's output
exactly. Tier 2: a few architectures, including tied embeddings and an encoder-decoder, train on
4 gloo ranks under Config(pp=2, dp=2, micro_batch=2, schedule="1f1b") or its interleaved form
(two stages per pipeline rank), compared step by step with one process
(autopar.testing.equivalence, AdamW with eps=1e-3). Tier 1 also checks the estimator's pricing of
weights tied across pipeline ranks.
"""

import math
from itertools import pairwise
import pytest
import torch
# Imported before the ranks fork, so that they inherit it (each would import it on its own).
import torch._dynamo  # noqa: F401

import autopar
from autopar.testing.equivalence import mismatches, train_single_process
from autopar.passes.program import export_for_pipeline, model_outputs
from autopar.passes.recompute import recompute_blocks
from autopar.passes.stage_split import split_stages
from autopar.solver.candidates import pipeline_units

pytest.importorskip("transformers")
from autopar.models.hf_zoo import ARCHITECTURES, loss_fn, resolve  # noqa: E402

# Resolved before the ranks fork: transformers imports each model's module on first use.
CLASSES = resolve(ARCHITECTURES)
GLOBAL_BATCH, STEPS = 8, 3
PIPELINE = autopar.Config(pp=2, dp=2, micro_batch=2, schedule="1f1b", global_batch=GLOBAL_BATCH)


def build(name: str):
    return ARCHITECTURES[name].build(CLASSES[name])


def batches(name: str, batch: int, steps: int) -> list[tuple[torch.Tensor, ...]]:
    """(*inputs, targets) for each step, the same on every rank."""
    return [ARCHITECTURES[name].batch(batch, torch.Generator().manual_seed(step)) for step in range(steps)]


def capture(name: str, batch: int = 2):
    model = build(name)
    *inputs, _ = batches(name, batch, 1)[0]
    return model, tuple(inputs), autopar.capture(model, example_inputs=tuple(inputs))


# One decoder with rotary tables, an encoder-decoder, and a mixture of experts with latent
# attention in the default tier; every other architecture in the slow one.
SPLIT_DEFAULT = ("llama", "t5", "deepseek-v3")


@pytest.mark.parametrize("name", [name if name in SPLIT_DEFAULT else pytest.param(name, marks=pytest.mark.slow)
                                  for name in ARCHITECTURES])
def test_every_node_gets_a_stage_and_the_stages_compute_the_model(name):
    """Three stages of the planner's units, cut evenly: the middle stage passes values along."""
    model, inputs, graph = capture(name)
    units = pipeline_units(graph)
    cuts = [0, len(units) // 3, 2 * len(units) // 3, len(units)]
    layers = [[layer for unit in units[a:b] for layer in unit.layers] for a, b in pairwise(cuts)]
    programs = split_stages(export_for_pipeline(model, inputs, graph.program), layers)
    # every parameter that the model reads is held by some stage, and only tied ones by several
    # (an export lists a tied weight under each name, and reads it through one)
    read = {name for node in graph.nodes for name in node.inputs}
    held = [fqn for program in programs for fqn in set(program.param_names.values())]
    assert {n.param_fqn for n in graph.parameters if n.name in read} == set(held)
    assert sorted(programs[0].tied) == sorted({fqn for fqn in held if held.count(fqn) > 1})
    # no stage or unit returns a view that needs a gradient, but for the model's own outputs
    # (Phi's logits are a view inside aten.linear with a bias): FSDP2 hooks what the modules it
    # wraps return, and an in-place op on a returned view would lose the hook (torch warns of it)
    views = []
    for program in programs:
        for unit in [program.module, *program.module.children()]:
            unit.register_forward_hook(lambda module, args, output: views.extend(
                out for out in (output if isinstance(output, tuple) else (output,))
                if isinstance(out, torch.Tensor) and out.requires_grad and out._base is not None))
    values = inputs
    for program in programs:
        output = program.module(*values)
        values = output if isinstance(output, tuple) else (output,)
    got = model_outputs(output, programs[-1].out_spec)
    torch.testing.assert_close(got.logits, model(*inputs).logits, rtol=0, atol=0)
    assert [view.shape for view in views if not any(view is out for out in values)] == []
    # selective recompute splits each block again around its attention: values copied into a
    # block from the glue before it (masks, rotary tables) must not reorder that split
    recomputed = [recompute_blocks(program, "selective")
                  for program in split_stages(export_for_pipeline(model, inputs, graph.program), layers)]
    values = inputs
    for program in recomputed:
        output = program.module(*values)
        values = output if isinstance(output, tuple) else (output,)
    torch.testing.assert_close(model_outputs(output, recomputed[-1].out_spec).logits,
                               model(*inputs).logits, rtol=0, atol=0)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def train_pipelines(cases: list[tuple[str, autopar.Config]]) -> list[dict]:
    """On every rank: each (architecture, config) through autopar.compile; rank 0 also trains one
    process on the same batches and reports the differences."""
    reports = []
    for name, config in cases:
        data = batches(name, GLOBAL_BATCH, STEPS)
        model = build(name)
        example = tuple(x[:config.micro_batch] for x in data[0][:-1])
        cm = autopar.compile(model, f"{config.world_size}:cpu", example_inputs=example,
                             loss_fn=loss_fn, optimizer=adamw, plan=config)
        losses = [cm.step(*batch) for batch in data]
        state = cm.full_state_dict()
        report = {"losses": losses, "stages": len(cm.plan.stages)}
        if torch.distributed.get_rank() == 0:
            expected = train_single_process(build(name), data, loss_fn, adamw)
            report["mismatches"] = mismatches(expected, losses, state)
        reports.append(report)
    return reports


@pytest.mark.multiprocess
@pytest.mark.slow
def test_pipelined_hf_models_train_like_one_process():
    interleaved = autopar.Config(pp=2, dp=2, virtual=2, micro_batch=2, schedule="interleaved-1f1b",
                                 global_batch=GLOBAL_BATCH)
    # an encoder-decoder; tied embeddings with learned positions and with RoPE, two stages per
    # pipeline rank (the tied copies on different ranks)
    cases = [("t5", PIPELINE), ("gpt2", interleaved), ("gemma", interleaved)]
    results = autopar.launch(train_pipelines, 4, cases, timeout=300)
    for (name, config), report in zip(cases, results[0]):
        assert report["stages"] == config.pp * config.virtual
        assert report["mismatches"] == [], f"{name}, {config.schedule}: {report['mismatches']}"
    for rank in results[1:]:
        assert [r["losses"] for r in rank] == [r["losses"] for r in results[0]]


def test_estimator_prices_the_all_reduce_of_weights_tied_across_pipeline_ranks():
    """With dp=1 nothing else reduces gradients: the data-parallel communication of a two-stage
    pipeline is the tied weight's all-reduce, which only a model with tied embeddings pays."""
    config = autopar.Config(pp=2, dp=1, micro_batch=2, schedule="1f1b", global_batch=4)
    mesh = autopar.Mesh.parse("2:cpu")
    comm = {}
    for name in ("gpt2", "llama"):
        graph = capture(name)[2]
        comm[name] = autopar.estimate(graph, mesh, config).comm_breakdown["data"]
        one_stage = autopar.Config(dp=1, micro_batch=2, global_batch=4)
        assert autopar.estimate(graph, autopar.Mesh.parse("1:cpu"), one_stage).comm_breakdown["data"] == 0
    assert comm["gpt2"] > 0 and comm["llama"] == 0


def test_estimator_counts_a_tied_weight_once_in_one_stage():
    """An export lists the tied embedding under both names and reads one: held once."""
    graph = capture("gpt2")[2]
    one = autopar.estimate(graph, autopar.Mesh.parse("1:cpu"),
                           autopar.Config(dp=1, micro_batch=2, global_batch=4))
    elements = sum(math.prod(n.shape) for n in graph.parameters if n.tied_to is None)
    assert one.memory_breakdown["weights"] == 4 * elements      # fp32 weights: a CPU mesh trains in fp32


@pytest.mark.parametrize("name", ["llama", "phi"])
def test_rotary_tables_are_made_again_in_each_stage_and_priced_as_unsent(name):
    """The split copies what is computed from constants alone (rotary tables) into every layer
    that reads it; only the hidden states cross. Priced as crossing too, the first stage's sends
    were 1.5x (Llama) and 1.25x (Phi) what it sends."""
    from autopar.testing.simulated import assert_sent_as_priced, simulated_hf

    report = simulated_hf(name, autopar.Config(dp=2, pp=2, zero=2, global_batch=8, micro_batch=1),
                          num_hidden_layers=2, hidden_size=256, intermediate_size=512, vocab_size=4096,
                          max_position_embeddings=128)
    assert any(entry["kind"] == "send" for entry in report.collectives)
    assert_sent_as_priced(report)
