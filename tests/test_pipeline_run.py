"""Pipelines on real gloo processes train exactly like one process (fp32).

Each launch runs several plans one after another (a process group's first use costs seconds) and
checks, on rank 0, the loss of every step and the final parameters against single-process training
of the same model on the same batches: |d| <= 1e-6 + 1e-5 * scale, where scale is the reference
loss, or the largest magnitude of the reference parameter tensor.
"""

import os
import time

import pytest
import torch
import torch.distributed as dist

import autopar
from autopar.errors import PlanMismatchError
from autopar.models import build_model, lm_loss
from autopar.testing.equivalence import mismatches, train_single_process
from autopar.passes.recompute import Recomputed
from autopar.plans import Plan, Stage
from autopar.runtime.build import build_runtime
from autopar.passes.program import TensorRef

pytestmark = pytest.mark.multiprocess

SPEC = "gpt:layers=4,hidden=32,heads=4,seq=16,vocab=64"
UNITS = ["tok_emb", "pos_emb", "emb_dropout", "layers.0", "layers.1", "layers.2", "layers.3",
         "norm_f", "lm_head"]
STEPS = 3


def make_plan(chunks: list[list[str]], *, pp: int, schedule: str, dp: int = 1, tp: int = 1,
              micro_batches: int = 4, micro_batch_size: int = 2, recompute: str = "none",
              zero: int = 0, layout: tuple[dict, dict] = ({}, {})) -> Plan:
    """Stage i on pipeline rank i % pp (Megatron's interleaving), each on a dp x tp block of ranks;
    `layout` is (parameter placements, node placements)."""
    group = dp * tp
    stages = [Stage(index=i, layers=layers, ranks=list(range((i % pp) * group, (i % pp + 1) * group)),
                    dp=dp, tp=tp, recompute=recompute if i == 0 else "none", zero=zero)
              for i, layers in enumerate(chunks)]
    return Plan(fingerprint="", mesh={}, axes=[["dp", dp], ["tp", tp]], stages=stages,
                global_batch=dp * micro_batches * micro_batch_size, micro_batches=micro_batches,
                micro_batch_size=micro_batch_size, schedule=schedule,
                virtual=len(chunks) // pp, parameters=layout[0], nodes=layout[1])


def batches(global_batch: int, vocab: int = 64, seq: int = 16):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (global_batch, seq), generator=generator),
             torch.randint(0, vocab, (global_batch, seq), generator=generator)) for _ in range(STEPS)]


def sgd(params):
    return torch.optim.SGD(params, lr=0.5)


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def train_plans(plans: list[Plan], optimizer=sgd, mesh: str | None = None, spec: str = SPEC,
                local: tuple[bool, ...] = ()) -> list[dict]:
    """On every rank: train each plan (through autopar.compile when a mesh is given; feeding each
    replica only its rows where `local` says so); on rank 0 also one process, and report the
    differences."""
    reports = []
    for index, plan in enumerate(plans):
        model, example_inputs = build_model(spec, device="cpu", batch=2)   # as planned
        data = batches(plan.global_batch)
        if mesh is None:
            runner = build_runtime(model, plan, example_inputs=example_inputs, loss_fn=lm_loss,
                                    optimizer=optimizer)
        else:
            runner = autopar.compile(model, mesh, example_inputs=example_inputs, loss_fn=lm_loss,
                                     optimizer=optimizer, plan=plan)
        if index < len(local) and local[index]:
            share = slice(runner.dp_rank * plan.global_batch // runner.layout.dp,
                          (runner.dp_rank + 1) * plan.global_batch // runner.layout.dp)
            losses = [runner.step(x[share], y[share], local=True) for x, y in data]
        else:
            losses = [runner.step(inputs, targets) for inputs, targets in data]
        state = runner.full_state_dict()
        held = sorted(ref.fqn for program in runner.programs for ref in program.module.modules()
                      if isinstance(ref, TensorRef) and ref.value.requires_grad)
        # what each checkpointed region of this rank's stages holds: its parameters' names
        regions = [sorted(ref.fqn for ref in region.modules() if isinstance(ref, TensorRef))
                   for program in runner.programs for region in program.module.modules()
                   if isinstance(region, Recomputed)]
        report = {"losses": losses, "held": held, "regions": regions}
        if dist.get_rank() == 0:
            report.update(compare_with_one_process(losses, state, data, optimizer, spec))
        reports.append(report)
    return reports


def compare_with_one_process(losses, state, data, optimizer, spec) -> dict:
    reference, _ = build_model(spec, device="cpu")
    expected = train_single_process(reference, data, lm_loss, optimizer)
    return {"mismatches": mismatches(expected, losses, state)}


def assert_equal_to_one_process(report: dict) -> None:
    assert report["mismatches"] == [], f"differs from one process: {report['mismatches']}"


def test_two_stages_gpipe_and_1f1b():
    cut = [UNITS[:5], UNITS[5:]]
    plans = [make_plan(cut, pp=2, schedule="gpipe"),
             make_plan(cut, pp=2, schedule="1f1b", recompute="full")]
    results = autopar.launch(train_plans, 2, plans, adamw, timeout=120)
    for report in results[0]:
        assert_equal_to_one_process(report)
    assert results[1][0]["losses"] == results[0][0]["losses"]   # the same float on every rank
    model, _ = build_model(SPEC)
    for rank, layers in enumerate(cut):   # each rank holds its own stage's parameters, no others
        assert results[rank][0]["held"] == sorted(
            name for name, _ in model.named_parameters()
            if any(name.startswith(layer + ".") for layer in layers))


def test_selective_recompute_checkpoints_only_attention_in_every_stage():
    cut = [UNITS[:5], UNITS[5:]]
    plan = make_plan(cut, pp=2, schedule="1f1b", recompute="selective")
    for stage in plan.stages:
        stage.recompute = "selective"
    results = autopar.launch(train_plans, 2, [plan], adamw, timeout=120)
    assert_equal_to_one_process(results[0][0])
    for rank, layers in enumerate(cut):
        regions = results[rank][0]["regions"]
        blocks = [layer for layer in layers if layer.startswith("layers.")]
        # one region per attention block (not per layer), holding that attention's weights alone
        assert len(regions) == len(blocks) == 2, f"rank {rank}: {regions}"
        for block, names in zip(blocks, regions, strict=True):
            assert names and all(name.startswith(f"{block}.attn.") for name in names), names


def test_interleaved_and_zero_bubble_with_two_chunks_per_rank():
    chunks = [UNITS[:4], UNITS[4:5], UNITS[5:6], UNITS[6:]]
    plans = [make_plan(chunks, pp=2, schedule="interleaved-1f1b"),
             make_plan(chunks, pp=2, schedule="zero-bubble")]
    results = autopar.launch(train_plans, 2, plans, timeout=120)
    for report in results[0]:
        assert_equal_to_one_process(report)


def test_a_config_with_more_chunks_than_blocks_runs_the_embedding_and_head_as_chunks():
    """Megatron's accounting of the embedding and the loss as a layer each: 4 blocks on pp2 x
    virtual3 = 6 chunks, the embedding one and the head another (Qwen3-235B's 94 layers run on
    pp32 x vpp3 this way), compiled from the Config and trained like one process."""
    config = autopar.Config(pp=2, virtual=3, schedule="interleaved-1f1b", global_batch=8, micro_batch=2)
    results = autopar.launch(train_plans, 2, [config], adamw, "2:cpu", timeout=120)
    assert_equal_to_one_process(results[0][0])


@pytest.mark.slow
def test_four_chunks_per_rank_under_zero_keep_their_weights_gathered_and_train_exactly():
    """torch's action-list schedules gather at most 3 of a rank's chunks at a time; ZeRO-1/2
    chunks stay gathered through the step instead (autopar.runtime.schedule._gather_once)."""
    spec = "gpt:layers=6,hidden=32,heads=4,seq=16,vocab=64"
    units = ["tok_emb", "pos_emb", "emb_dropout", *(f"layers.{i}" for i in range(6)), "norm_f", "lm_head"]
    chunks = [units[:4], *([u] for u in units[4:9]), [units[9]], [units[10]]]
    plans = [make_plan(chunks, pp=2, dp=2, schedule=schedule, zero=zero, micro_batches=4)
             for schedule, zero in (("interleaved-1f1b", 1), ("zero-bubble", 2))]
    results = autopar.launch(train_plans, 4, plans, adamw, None, spec, timeout=180)
    for report in results[0]:
        assert_equal_to_one_process(report)


def test_llama_in_three_stages_copies_root_buffers_into_each_stage():
    spec = "llama:layers=4,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64"
    units = ["tok_emb", "layers.0", "layers.1", "layers.2", "layers.3", "norm", "lm_head"]
    plans = [make_plan([units[:2], units[2:4], units[4:]], pp=3, schedule="1f1b", recompute="full")]
    results = autopar.launch(train_plans, 3, plans, sgd, None, spec, timeout=120)
    assert_equal_to_one_process(results[0][0])


def test_data_parallel_pipelines_with_zero1_global_and_local_batches():
    cut = [UNITS[:5], UNITS[5:]]
    plans = [make_plan(cut, pp=2, dp=2, schedule="1f1b", micro_batches=2, zero=1) for _ in range(2)]
    results = autopar.launch(train_plans, 4, plans, adamw, None, SPEC, (False, True), timeout=120)
    for report in results[0]:
        assert_equal_to_one_process(report)


@pytest.mark.slow
def test_zero2_and_zero3_across_pipeline_replicas():
    cut = [UNITS[:5], UNITS[5:]]
    plans = [make_plan(cut, pp=2, dp=2, schedule=schedule, micro_batches=2, zero=zero)
             for schedule, zero in (("1f1b", 2), ("1f1b", 3), ("zero-bubble", 3))]
    results = autopar.launch(train_plans, 4, plans, adamw, timeout=120)
    for report in results[0]:
        assert_equal_to_one_process(report)


def megatron_layout(dp: int, sequence_parallel: bool = False) -> tuple[dict, dict]:
    """The planner's placements for Config(tp=2) on dp x 2 (what compile(plan=Config) runs):
    column-parallel q, k, v and fc1, row-parallel wo and fc2, the residual stream whole (or
    sequence-split) at every norm."""
    model, example_inputs = build_model(SPEC, batch=2)
    graph = autopar.capture(model, example_inputs=example_inputs)
    config = autopar.Config(tp=2, dp=dp, global_batch=2 * dp, micro_batch=2,
                            sequence_parallel=sequence_parallel)
    plan = autopar.plan_from_config(graph, f"{2 * dp}:cpu", config, time_limit=20)
    assert plan.stages[0].sequence_parallel == sequence_parallel
    return plan.parameters, plan.nodes


# sequence parallel stages in a pipeline are trained in the default tier by tests/test_conformance.py
@pytest.mark.parametrize("sp", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["tp", "tp-sp"])
def test_tensor_parallel_stages_2x2_with_and_without_sequence_parallelism(sp):
    cut = [UNITS[:5], UNITS[5:]]
    plans = [make_plan(cut, pp=2, tp=2, schedule="1f1b", layout=megatron_layout(1, sp))]
    results = autopar.launch(train_plans, 4, plans, adamw, timeout=120)
    for report in results[0]:
        assert_equal_to_one_process(report)


def replicated_before(layout: tuple[dict, dict], unit: str) -> tuple[dict, dict]:
    """`layout` with everything before `unit` in graph order replicated: a first stage the plan
    does not shard."""
    model, example_inputs = build_model(SPEC, batch=2)
    graph = autopar.capture(model, example_inputs=example_inputs)
    first = next(i for i, n in enumerate(graph.nodes) if n.module_path.startswith(unit + "."))
    mine = {n.name for n in graph.nodes[:first]}
    fqns = {n.param_fqn for n in graph.nodes[:first] if n.param_fqn}
    parameters, nodes = layout
    return ({k: v for k, v in parameters.items() if k not in fqns},
            {k: v for k, v in nodes.items() if k not in mine})


@pytest.mark.slow
def test_a_stage_the_plan_does_not_shard_sends_and_receives_chunks_too():
    """Stage 0 replicated on its 2 tensor-parallel ranks (plain tensors), stage 1 split: values
    still cross as halves, gathered by the receiver, their gradients by the sender."""
    cut = [UNITS[:5], UNITS[5:]]
    plans = [make_plan(cut, pp=2, tp=2, schedule="1f1b",
                       layout=replicated_before(megatron_layout(1, sp), cut[1][0])) for sp in (False, True)]
    results = autopar.launch(train_plans, 4, plans, adamw, timeout=120)
    for report in results[0]:
        assert_equal_to_one_process(report)


# ZeRO-1 in the slow tier: the default tier runs it in data-parallel pipelines below
@pytest.mark.parametrize("zero", [pytest.param(1, marks=pytest.mark.slow), 3])
def test_data_tensor_and_pipeline_parallel_2x2x2_with_zero1_and_zero3(zero):
    cut = [UNITS[:5], UNITS[5:]]
    plans = [make_plan(cut, pp=2, dp=2, tp=2, schedule="1f1b", micro_batches=2, zero=zero,
                       layout=megatron_layout(2))]
    results = autopar.launch(train_plans, 8, plans, adamw, timeout=180)
    for report in results[0]:
        assert_equal_to_one_process(report)


@pytest.mark.slow
def test_solver_plan_for_8_cpu_ranks_under_a_memory_limit():
    """A quarter of the memory plain data parallelism needs: the planner must shard the model."""
    from autopar.api import plan_graph

    model, example_inputs = build_model(SPEC, batch=2)
    graph = autopar.capture(model, example_inputs=example_inputs)
    mesh = autopar.Mesh.parse("8:cpu")
    replica = autopar.estimate(graph, mesh, autopar.Config(dp=8, global_batch=16, micro_batch=2))
    plan = plan_graph(graph, mesh, global_batch=16, memory_limit=replica.memory_per_gpu_bytes / 4,
                      time_limit=20)
    assert len(plan.stages) > 1, f"the memory limit should force pipelining: {plan.summary()}"
    results = autopar.launch(train_plans, 8, [plan], adamw, "8:cpu", timeout=240)
    assert_equal_to_one_process(results[0][0])


def test_global_batch_not_divisible_into_micro_batches_is_refused_before_launch():
    plan = make_plan([UNITS[:5], UNITS[5:]], pp=2, schedule="1f1b", micro_batches=4,
                     micro_batch_size=2)
    data = {**plan.to_dict(), "mesh": autopar.Mesh.parse("2:cpu").to_dict(), "global_batch": 10}
    with pytest.raises(PlanMismatchError, match=r"global_batch 10 is not .* = 1 x 4 x 2"):
        Plan.from_dict(data)


def _fail_in_step(how: str):
    model, _ = build_model(SPEC, device="cpu")
    plan = make_plan([UNITS[:5], UNITS[5:]], pp=2, schedule="1f1b")
    data = batches(plan.global_batch)

    def loss_fn(logits, targets):
        if how == "raise" and step[0] == 1:
            raise RuntimeError("loss blew up on purpose")
        if how == "die" and step[0] == 1:
            os._exit(3)
        if how == "stall" and step[0] == 1:
            time.sleep(60)
        return lm_loss(logits, targets)

    step = [0]
    runner = build_runtime(model, plan, example_inputs=(data[0][0],), loss_fn=loss_fn, optimizer=sgd)
    for step[0], (inputs, targets) in enumerate(data):
        runner.step(inputs, targets)


@pytest.mark.parametrize("how, message", [("raise", "RuntimeError: loss blew up on purpose"),
                                          ("die", "exited with code 3")])
def test_failed_last_stage_stops_the_pipeline_and_is_named(how, message):
    with pytest.raises(autopar.LaunchError, match=f"rank 1 failed: {message}"):
        autopar.launch(_fail_in_step, 2, how, timeout=60, pg_timeout=10)


def test_a_stalled_stage_is_named_when_its_peer_times_out():
    with pytest.raises(autopar.LaunchError, match=r"rank 1 stalled: .*rank 0 waited 3 s"):
        autopar.launch(_fail_in_step, 2, "stall", timeout=60, pg_timeout=3)


def _step_with_wrong_batch():
    model, _ = build_model(SPEC, device="cpu")
    plan = make_plan([UNITS[:5], UNITS[5:]], pp=2, schedule="1f1b")
    data = batches(plan.global_batch)
    runner = build_runtime(model, plan, example_inputs=(data[0][0],), loss_fn=lm_loss, optimizer=sgd)
    inputs, targets = data[0]
    runner.step(inputs[:6], targets[:6])


def test_wrong_batch_in_step_fails_on_every_rank_before_any_collective():
    with pytest.raises(autopar.LaunchError, match=r"batch of 6 but the plan.s global batch is 8"):
        autopar.launch(_step_with_wrong_batch, 2, timeout=60, pg_timeout=10)
