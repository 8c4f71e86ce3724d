"""Data-parallel traffic and its overlap per runtime, and calibration files that carry measured
collectives."""

import json

import pytest

from autopar.cli import main
from autopar.calibrate.measure import fit_link
from autopar.cost.calibration import KINDS, figures, ring_terms, with_measured_links
from autopar.cost.collectives import Group
from autopar.cost.config import Config
from autopar.cost.estimator import estimate
from autopar.cost.megatron import megatron_placements
from autopar.cost.mesh import Mesh
from autopar.plans.zero import reduces_every_micro_batch
from autopar.cost.overlap import RUNTIMES, DeviceWork, exposed_data_parallel
from autopar.errors import AutoparError

MESH = Mesh.parse("4x8:a100-80g")


def megatron_estimate(graph, mesh, config, **options):
    """`estimate` on Megatron-LM's placements (cost.megatron)."""
    placements = megatron_placements(graph, config.tp, sequence_parallel=config.sequence_parallel)
    return estimate(graph, mesh, config, placements=placements, **options)


@pytest.fixture(scope="module")
def tiny_gpt():
    from autopar.commands.estimate import capture_training_step
    return capture_training_step("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1024")


def _work(**overrides):
    values = dict(params=1e9, tensors=100, blocks=9, forward_s=1.0, backward_s=2.0, drain_s=2.0,
                  recompute=True)
    return DeviceWork(**{**values, **overrides})


def test_gradient_reduction_hides_behind_the_last_backward_only_where_the_runtime_overlaps():
    group = Group.strided(MESH, 32, 1)
    whole = group.all_reduce(2e9)
    local = exposed_data_parallel(_work(), dp=32, tp=1, zero=0, micro_batches=4, mesh=MESH,
                                  runtime=RUNTIMES["megatron-local"])
    assert local == pytest.approx(whole)
    hidden = exposed_data_parallel(_work(drain_s=10 * whole), dp=32, tp=1, zero=0,
                                   micro_batches=4, mesh=MESH, runtime=RUNTIMES["torch"])
    assert hidden < 0.05 * whole        # only the last bucket waits
    partly = exposed_data_parallel(_work(drain_s=whole / 2), dp=32, tp=1, zero=0,
                                   micro_batches=4, mesh=MESH, runtime=RUNTIMES["torch"])
    assert partly == pytest.approx(whole / 2)


def test_nothing_overlaps_on_a_cpu_mesh_whose_cores_also_communicate():
    mesh = Mesh.parse("4:cpu")
    whole = Group.strided(mesh, 4, 1).all_reduce(4e9)      # fp32 gradients on a CPU
    exposed = exposed_data_parallel(_work(drain_s=1e6), dp=4, tp=1, zero=0, micro_batches=2,
                                    mesh=mesh, runtime=RUNTIMES["torch"])
    assert exposed == pytest.approx(whole)


def test_zero_1_adds_the_weights_all_gather_after_the_step():
    group = Group.strided(MESH, 32, 1)
    zero0 = exposed_data_parallel(_work(), dp=32, tp=1, zero=0, micro_batches=1, mesh=MESH,
                                  runtime=RUNTIMES["megatron-local"])
    zero1 = exposed_data_parallel(_work(), dp=32, tp=1, zero=1, micro_batches=1, mesh=MESH,
                                  runtime=RUNTIMES["megatron-local"])
    assert zero1 == pytest.approx(group.reduce_scatter(2e9) + group.all_gather(2e9))
    assert zero1 == pytest.approx(zero0, rel=0.01)    # a ring all-reduce is the same two halves


def test_zero_3_gathers_every_micro_batch_and_shows_what_compute_cannot_hide():
    group = Group.strided(MESH, 32, 1)
    per_block = group.all_gather(2e9 / 9)
    fsdp = RUNTIMES["torch"]
    slow = exposed_data_parallel(_work(forward_s=0.0, backward_s=0.0), dp=32, tp=1, zero=3,
                                 micro_batches=3, mesh=MESH, runtime=fsdp)
    # No compute to hide behind: two gathers and a reduce-scatter of every block, plus the
    # first gathers and the last reduce-scatter that wait in any case.
    assert slow == pytest.approx(3 * (9 * per_block * 3 + 3 * per_block))
    fast = exposed_data_parallel(_work(forward_s=100.0, backward_s=200.0), dp=32, tp=1, zero=3,
                                 micro_batches=3, mesh=MESH, runtime=fsdp)
    assert fast == pytest.approx(3 * 3 * per_block)
    # DeepSpeed's 2021 engine: per tensor, waited on, gathered again for the recomputation.
    deepspeed = exposed_data_parallel(_work(forward_s=100.0, backward_s=200.0), dp=32, tp=1,
                                      zero=3, micro_batches=3, mesh=MESH,
                                      runtime=RUNTIMES["deepspeed-2021"])
    assert deepspeed == pytest.approx(3 * 100 * 4 * group.all_gather(2e9 / 100))


def test_zero_3_on_many_nodes_is_slower_than_without_communication(tiny_gpt):
    mesh = Mesh.parse("4x8:a100-80g")
    config = Config(dp=32, global_batch=32, zero=3, recompute="full")
    fsdp = megatron_estimate(tiny_gpt, mesh, config, runtime="torch")
    deepspeed = megatron_estimate(tiny_gpt, mesh, config, runtime="deepspeed-2021")
    assert 0 < fsdp.comm_breakdown["data"] < deepspeed.comm_breakdown["data"]
    # autopar's runtime is FSDP2, one group per layer: less than DeepSpeed's per-tensor gathers
    autopar_data = megatron_estimate(tiny_gpt, mesh, config).comm_breakdown["data"]
    assert 0 < autopar_data < deepspeed.comm_breakdown["data"]
    with pytest.raises(AutoparError, match="runtime 'nccl' is unknown"):
        megatron_estimate(tiny_gpt, mesh, config, runtime="nccl")


@pytest.mark.parametrize("kind", KINDS)
def test_fit_recovers_alpha_and_bandwidth_of_each_collective(kind):
    alpha, bandwidth, ranks = 50e-6, 2e9, 4
    steps, factor = ring_terms(kind, ranks)
    points = [(n, steps * alpha + factor * n / bandwidth) for n in (4096, 2**20, 2**24)]
    fitted_alpha, fitted_bandwidth = fit_link(kind, ranks, points)
    assert fitted_alpha == pytest.approx(alpha) and fitted_bandwidth == pytest.approx(bandwidth)


def test_measured_links_replace_the_mesh_links_per_collective(tiny_gpt, tmp_path):
    mesh = Mesh.parse("4:cpu")
    fits = {"all_reduce": {"latency_s": 1e-3, "bandwidth": 1e8},
            "all_gather": {"latency_s": 2e-3, "bandwidth": 5e7}}
    measured = with_measured_links(mesh, fits)
    group = Group.of_axes(measured, ["gpu"])
    assert group.all_reduce(1e6) == pytest.approx(6 * 1e-3 + 1.5 * 1e6 / 1e8)
    assert group.all_gather(1e6) == pytest.approx(3 * 2e-3 + 0.75 * 1e6 / 5e7)
    path = tmp_path / "eff.json"
    path.write_text(json.dumps({"device": "cpu", "collectives": {"device": "cpu", "ranks": 4,
                                                                 "fits": fits}}))
    config = Config(dp=4, global_batch=8)
    default = megatron_estimate(tiny_gpt, mesh, config)
    calibrated = megatron_estimate(tiny_gpt, mesh, config, calibration=path)
    assert calibrated.comm_breakdown["data"] > default.comm_breakdown["data"]
    with pytest.raises(AutoparError, match="measured collectives on 'cpu'"):
        megatron_estimate(tiny_gpt, Mesh.parse("4:a100-80g"), config, calibration=path)


def test_each_group_size_is_priced_with_the_fit_measured_on_that_size():
    mesh = Mesh.parse("4:cpu")
    whole = {"all_reduce": {"latency_s": 1e-3, "bandwidth": 1e8}}
    pairs = {"all_reduce": {"latency_s": 3e-3, "bandwidth": 5e7}}
    measured = with_measured_links(mesh, whole, 4, {"2": pairs})
    four, two = Group.strided(measured, 4, 1), Group.strided(measured, 2, 2)
    assert four.all_reduce(1e6) == pytest.approx(6 * 1e-3 + 1.5 * 1e6 / 1e8)
    assert two.all_reduce(1e6) == pytest.approx(2 * 3e-3 + 1.0 * 1e6 / 5e7)
    # a kind measured on the whole mesh only (send/recv) is priced with that fit for any group
    link = with_measured_links(mesh, {**whole, "send_recv": {"latency_s": 2e-3, "bandwidth": 1e9}},
                               4, {"2": pairs}).device.intra_node
    assert link.alpha_beta("send_recv", 2) == (2e-3, 1e9)


def test_measured_rows_without_a_group_size_still_load():
    data = Mesh.parse("2:cpu").to_dict()
    data["device"]["intra_node"] = {"name": "gloo", "bandwidth": 1e9, "latency": 1e-5,
                                    "measured": [["all_reduce", 1e-3, 1e8]]}
    link = Mesh.from_dict(data).device.intra_node
    assert link.alpha_beta("all_reduce", 2) == (1e-3, 1e8)


def _distributed_op_latency() -> float:
    from autopar.calibrate.host_probes import distributed_op_latency
    return distributed_op_latency(0.01)


@pytest.mark.multiprocess
def test_the_distributed_op_probe_runs_on_4_ranks():
    """`autopar calibrate --mesh 4:cpu` failed in this probe's backward (a view of a gradient whose
    local is strided where its global is not), where 2 ranks did not."""
    import autopar
    assert all(seconds >= 0 for seconds in autopar.launch(_distributed_op_latency, 4, timeout=120))


@pytest.mark.slow
def test_calibrate_a_gloo_mesh_writes_collectives_that_estimate_uses(tmp_path, capsys):
    """Every figure measured in each of `--rounds` rounds (the median kept, the spread shown),
    the collectives fitted, and `estimate --calibration` pricing with the file."""
    out = tmp_path / "eff.json"
    assert main(["calibrate", "--mesh", "2:cpu", "--out", str(out), "--budget", "0.005",
                 "--rounds", "2"]) == 0
    data = json.loads(out.read_text())
    assert "spread" in capsys.readouterr().out
    assert data["collectives"]["rounds"] == 2
    assert all(len(m["rounds_seconds"]) == 2 for m in data["measurements"].values())
    # every figure's two rounds, named as `figures` names the file's values; the kept one is
    # one of them (the lower median of two)
    kept = figures(data)
    assert {"compute.matmul", "pipeline_action_latency_s", "all_reduce on 2 ranks: bandwidth",
            "send_recv on 2 ranks: latency_s"} <= set(data["rounds"])
    assert all(len(values) == 2 for values in data["rounds"].values())
    assert all(kept[name] == min(values) for name, values in data["rounds"].items() if " ranks: " not in name)
    assert data["host_cores"] >= 1 and data["split_backward_op_latency_s"] >= 0
    assert data["checkpoint_region_latency_s"] >= 0 and data["checkpoint_op_latency_s"] >= 0
    assert set(data["collectives"]["fits"]) == set(KINDS) and data["collectives"]["ranks"] == 2
    assert data["collectives"]["group_fits"] == {}   # two ranks: no smaller group
    assert all(fit["bandwidth"] > 0 and fit["latency_s"] >= 0
               for fit in data["collectives"]["fits"].values())
    assert data["kernel_latency_s"] > 0 and data["distributed_op_latency_s"] >= 0
    assert data["pipeline_action_latency_s"] >= 0 and data["data_parallel_group_latency_s"] >= 0
    assert data["collective_wait_s"] >= 0 and data["collective_wait_span_s"] > 0
    assert data["data_parallel_tensor_latency_s"] >= 0
    capsys.readouterr()
    assert main(["estimate", "gpt-tiny", "--mesh", "2:cpu", "--global-batch", "4",
                 "--calibration", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["step_time_s"] > 0
    assert main(["calibrate", "--mesh", "2:cpu", "--out", str(out), "--rounds", "0"]) == 1
    assert "--rounds 0" in capsys.readouterr().err


def test_ops_on_distributed_tensors_pay_the_measured_host_latency(tiny_gpt):
    """Tensor-parallel stages compute on DTensors; ZeRO-3 does not (FSDP2 gathers each group's
    weights into plain tensors before its forward and backward)."""
    from autopar.cost.compute import Efficiencies

    mesh = Mesh.parse("4:cpu")
    plain = Efficiencies(device="cpu")
    hosted = Efficiencies(device="cpu", distributed_op_latency_s=1e-3)
    for config, distributed in ((Config(dp=4, global_batch=8), False),
                                (Config(tp=2, dp=2, global_batch=8), True),
                                (Config(dp=4, zero=3, global_batch=8), False)):
        before = megatron_estimate(tiny_gpt, mesh, config, efficiencies=plain).breakdown["compute"]
        after = megatron_estimate(tiny_gpt, mesh, config, efficiencies=hosted).breakdown["compute"]
        assert (after > before) == distributed, config


def test_the_runtime_machinery_costs_each_action_and_each_group_per_micro_batch(tiny_gpt):
    """A pipeline schedule's actions (forward and backward, the backward split in two under
    zero-bubble) and FSDP2's hooks per group are charged per micro-batch at the calibrated host
    latency: on the slowest rank every micro-batch, and on the others in the bubble."""
    from autopar.cost.compute import Efficiencies

    mesh = Mesh.parse("4:cpu")
    plain = Efficiencies(device="cpu")
    action, group = 1e-3, 5e-4
    hosted = Efficiencies(device="cpu", pipeline_action_latency_s=action,
                          data_parallel_group_latency_s=group)

    def added(config):
        before = megatron_estimate(tiny_gpt, mesh, config, efficiencies=plain)
        after = megatron_estimate(tiny_gpt, mesh, config, efficiencies=hosted)
        return after.step_time_s - before.step_time_s, after

    single, _ = added(Config(tp=4, global_batch=8, micro_batch=2))
    assert single == 0.0                           # no schedule, no data parallelism
    for schedule, actions in (("1f1b", 2), ("gpipe", 2), ("zero-bubble", 3)):
        extra, result = added(Config(pp=4, global_batch=8, micro_batch=2, schedule=schedule))
        # the host's work is no weight gradient: zero-bubble cannot move it into the bubble
        slots = result.micro_batches + (4 - 1)
        assert extra == pytest.approx(slots * actions * action), schedule
    extra, result = added(Config(dp=4, global_batch=16, micro_batch=2))
    groups = round(extra / (result.micro_batches * group))
    assert groups >= 2 and extra == pytest.approx(result.micro_batches * groups * group)
    per_tensor = Efficiencies(device="cpu", data_parallel_tensor_latency_s=1e-4)
    config = Config(dp=4, global_batch=16, micro_batch=2)
    before = megatron_estimate(tiny_gpt, mesh, config, efficiencies=plain)
    after = megatron_estimate(tiny_gpt, mesh, config, efficiencies=per_tensor)
    tensors = (after.step_time_s - before.step_time_s) / (after.micro_batches * 1e-4)
    assert tensors == pytest.approx(round(tensors)) and round(tensors) > groups   # every tensor once


def test_zero_bubbles_split_backward_costs_the_host_per_op_of_each_stage(tiny_gpt):
    """torch splits a zero-bubble backward by walking the stage's autograd graph: charged per op
    and micro-batch under zero-bubble only, on the slowest rank and in the bubble."""
    from autopar.cost.compute import Efficiencies

    mesh, per_op = Mesh.parse("4:cpu"), 1e-5
    plain, walked = Efficiencies(device="cpu"), Efficiencies(device="cpu", split_backward_op_latency_s=per_op)
    for schedule in ("1f1b", "zero-bubble"):
        config = Config(pp=4, global_batch=8, micro_batch=2, schedule=schedule)
        before, after = (megatron_estimate(tiny_gpt, mesh, config, efficiencies=e) for e in (plain, walked))
        extra = after.step_time_s - before.step_time_s
        if schedule == "1f1b":
            assert extra == 0.0
            continue
        ops = extra / ((after.micro_batches + 4 - 1) * per_op)
        assert ops == pytest.approx(round(ops)) and round(ops) > 10


def test_each_recomputed_region_costs_the_host_its_checkpoint(tiny_gpt):
    """A checkpointed region costs the host a set-up and a cost per op it saves for, beyond the
    forward it reruns: one region per layer under full recompute, one per attention under
    selective, none without recompute."""
    from autopar.cost.compute import Efficiencies

    mesh, plain = Mesh.parse("4:cpu"), Efficiencies(device="cpu")
    per_region = Efficiencies(device="cpu", checkpoint_region_latency_s=1e-4)
    per_op = Efficiencies(device="cpu", checkpoint_op_latency_s=1e-5)

    def extra(recompute, eff, unit):
        config = Config(dp=4, global_batch=8, micro_batch=1, recompute=recompute)
        base, priced = (megatron_estimate(tiny_gpt, mesh, config, efficiencies=e) for e in (plain, eff))
        return (priced.step_time_s - base.step_time_s) / (priced.micro_batches * unit)

    assert extra("none", per_region, 1e-4) == 0.0 and extra("none", per_op, 1e-5) == 0.0
    for recompute in ("full", "selective"):
        assert extra(recompute, per_region, 1e-4) == pytest.approx(4)      # 4 layers, 4 attentions
    full_ops, selective_ops = extra("full", per_op, 1e-5), extra("selective", per_op, 1e-5)
    assert full_ops == pytest.approx(round(full_ops)) and full_ops > selective_ops > 4


def test_ranks_sharing_a_hosts_cores_lend_them_while_idle_in_the_bubble(tiny_gpt):
    """4 gloo ranks on 2 cores: a pipeline takes its average rank's work at the calibrated
    (everyone computing) prices, not the slowest rank's path through the bubble; ranks with
    cores of their own, and a plan without a pipeline, are priced as before."""
    from autopar.cost.compute import Efficiencies

    mesh = Mesh.parse("4:cpu")
    own, shared = Efficiencies(device="cpu", host_cores=4), Efficiencies(device="cpu", host_cores=2)
    pipeline = Config(pp=4, global_batch=8, micro_batch=1, schedule="1f1b")
    alone, lent = (megatron_estimate(tiny_gpt, mesh, pipeline, efficiencies=e) for e in (own, shared))
    assert "lent_cores" not in alone.breakdown
    assert alone.step_time_s == megatron_estimate(tiny_gpt, mesh, pipeline).step_time_s
    per_mb = [d["time_per_micro_batch_s"] for d in lent.devices]
    average = lent.micro_batches * sum(per_mb) / len(per_mb)
    pipeline_part = alone.breakdown["bubble"] + lent.breakdown["lent_cores"] + lent.micro_batches * max(per_mb)
    assert pipeline_part == pytest.approx(max(average, (lent.micro_batches * max(per_mb)
                                                        + alone.breakdown["bubble"]) / 2))
    assert lent.breakdown["lent_cores"] < 0
    assert lent.step_time_s == pytest.approx(sum(lent.breakdown.values()))
    flat = Config(dp=4, global_batch=8, micro_batch=1)
    assert megatron_estimate(tiny_gpt, mesh, flat, efficiencies=shared).step_time_s == \
        megatron_estimate(tiny_gpt, mesh, flat, efficiencies=own).step_time_s


def test_zero_bubble_fills_the_bubble_with_the_weight_halves_of_the_backward():
    """ZB-H1 leaves (F + B - W) / (F + B + W) of 1F1B's bubble: a third where forward, input and
    weight halves are equal, less where the weight half is longer (16-bit training casts and
    accumulates the gradients in it, cost/master_weights.py); a stage whose time is mostly
    transfers keeps more."""
    from autopar.commands.estimate import capture_training_step
    from autopar.cost.compute import Efficiencies

    def ratio(spec, mesh, efficiencies=None):
        graph = capture_training_step(spec)
        bubble = {s: megatron_estimate(graph, Mesh.parse(mesh), Config(pp=4, global_batch=8, micro_batch=1,
                                                              schedule=s), efficiencies=efficiencies)
                  .breakdown["bubble"] for s in ("1f1b", "zero-bubble")}
        return bubble["zero-bubble"] / bubble["1f1b"]

    compute_bound = ratio("gpt:layers=8,hidden=1024,heads=16,seq=1024,vocab=8192", "4:a100-80g")
    assert 0.25 <= compute_bound < 0.5
    transfer_bound = ratio("gpt:layers=4,hidden=64,heads=4,seq=32,vocab=128", "4:cpu",
                           Efficiencies(device="cpu"))
    assert compute_bound < transfer_bound < 1


def test_blocking_collectives_wait_for_the_last_rank_in_proportion_to_the_compute_before_them(tiny_gpt):
    """On a host whose cores the ranks share, each FSDP2 reduction (once per group, after that
    group's backward) and the step's loss all-reduce wait the calibrated time, scaled down for
    spans shorter than the one it was measured after; tensor and pipeline traffic does not."""
    from autopar.cost.compute import Efficiencies

    eff = Efficiencies(device="cpu", collective_wait_s=2e-3, collective_wait_span_s=1e-2)
    assert eff.wait_after(2e-2) == pytest.approx(2e-3) and eff.wait_after(5e-3) == pytest.approx(1e-3)
    assert eff.wait_after(0.0) == 0.0 and Efficiencies(device="cpu").wait_after(1.0) == 0.0
    mesh = Mesh.parse("4:cpu")
    plain = Efficiencies(device="cpu")
    # a long measured span: every wait is a share of 2 ms, as long as its compute against 1000 s
    slow = Efficiencies(device="cpu", collective_wait_s=2e-3, collective_wait_span_s=1e3)
    waited = Efficiencies(device="cpu", collective_wait_s=2e-3, collective_wait_span_s=1e-9)
    for config in (Config(tp=4, global_batch=8), Config(pp=4, global_batch=8, micro_batch=2)):
        before = megatron_estimate(tiny_gpt, mesh, config, efficiencies=plain)
        after = megatron_estimate(tiny_gpt, mesh, config, efficiencies=waited)
        assert after.step_time_s - before.step_time_s == pytest.approx(2e-3)   # the loss only
        assert after.comm_breakdown["loss"] - before.comm_breakdown["loss"] == pytest.approx(2e-3)
    config = Config(dp=4, global_batch=8)
    before = megatron_estimate(tiny_gpt, mesh, config, efficiencies=plain)
    after = megatron_estimate(tiny_gpt, mesh, config, efficiencies=waited)
    groups = round((after.comm_breakdown["data"] - before.comm_breakdown["data"]) / 2e-3)
    assert groups >= 2 and after.comm_breakdown["data"] - before.comm_breakdown["data"] == pytest.approx(groups * 2e-3)
    partly = megatron_estimate(tiny_gpt, mesh, config, efficiencies=slow)
    assert before.step_time_s < partly.step_time_s < after.step_time_s


def test_a_pipeline_transfer_holds_both_ends_where_the_cores_that_compute_move_the_data(tiny_gpt):
    """gloo's blocking send and receive: the stage after a boundary waits as long as the one
    before sends (activations forward, gradients back); a GPU's transfers run beside its compute
    and the sender's side stands for the pair."""
    from dataclasses import replace

    cpu = Mesh.parse("2:cpu")
    beside = Mesh(replace(cpu.device, overlaps_communication=True), cpu.axes)
    config = Config(pp=2, global_batch=8, micro_batch=2)
    blocking = megatron_estimate(tiny_gpt, cpu, config).devices
    overlapped = megatron_estimate(tiny_gpt, beside, config).devices
    sender = overlapped[0]["time_per_micro_batch_s"]
    assert blocking[0]["time_per_micro_batch_s"] == pytest.approx(sender)
    assert blocking[1]["time_per_micro_batch_s"] > overlapped[1]["time_per_micro_batch_s"]


def test_the_planner_prices_with_a_calibration_and_the_plan_records_that_price(tmp_path):
    """Where a pipeline action costs the host a lot (as measured), the planner plans without a
    pipeline; the plan names the file and records the price estimate_plan gives it with it."""
    from autopar.api import plan_graph
    from autopar.commands.estimate import capture_training_step
    from autopar.cost.plan_estimate import estimate_plan

    graph = capture_training_step("gpt-tiny", batch=2)
    path = tmp_path / "eff.json"
    path.write_text(json.dumps({"device": "cpu", "pipeline_action_latency_s": 1.0}))
    published = plan_graph(graph, "4:cpu", global_batch=8, time_limit=30)
    measured = plan_graph(graph, "4:cpu", global_batch=8, time_limit=30, calibration=path)
    assert len(published.stages) > 1 and "calibration" not in published.solver
    assert len(measured.stages) == 1 and measured.solver["calibration"] == str(path)
    again = estimate_plan(graph, measured, calibration=path)
    assert measured.predicted["step_time_s"] == pytest.approx(again.step_time_s)


def test_a_forced_configuration_is_placed_and_priced_with_the_calibration(tmp_path):
    """`validate` and `compile(plan=Config, calibration=...)` run the plan `plan_from_config`
    makes with the file: it names the file and records the price estimate_plan gives it."""
    from autopar.api import plan_from_config
    from autopar.commands.estimate import capture_training_step
    from autopar.cost.plan_estimate import estimate_plan

    graph = capture_training_step("gpt-tiny", batch=2)
    path = tmp_path / "eff.json"
    path.write_text(json.dumps({"device": "cpu", "pipeline_action_latency_s": 1.0}))
    config = Config(pp=2, tp=2, global_batch=8, micro_batch=2)
    published = plan_from_config(graph, "4:cpu", config)
    measured = plan_from_config(graph, "4:cpu", config, calibration=path)
    assert "calibration" not in published.solver and measured.solver["calibration"] == str(path)
    again = estimate_plan(graph, measured, calibration=path)
    assert measured.predicted["step_time_s"] == pytest.approx(again.step_time_s)
    # two actions per micro-batch on each of 2 stages' critical path, at least
    assert measured.predicted["step_time_s"] > published.predicted["step_time_s"] + 2 * 2


def test_autopar_fsdp2_gathers_as_often_as_it_frees_the_weights_and_reduces_as_its_zero_stage_says():
    """On a CPU mesh (nothing overlaps) the autopar runtime's FSDP2 issues each collective once per
    layer group; ZeRO-1/2 gather before every micro-batch on one stage, once per step under a
    pipeline schedule; ZeRO-3 gathers for every forward and backward (the forward's alone under
    zero-bubble, which keeps them); gradients are reduced on the last micro-batch under plain
    data parallelism and ZeRO-1, after every micro-batch under ZeRO-2/3 but for zero-bubble
    (reduces_every_micro_batch, the rule the runtime follows)."""
    mesh = Mesh.parse("4:cpu")
    group = Group.strided(mesh, 4, 1)
    autopar = RUNTIMES["autopar"]
    share = 4e6 / 6         # fp32 gradients of 1e6 parameters over 6 groups
    gather, scatter = 6 * group.all_gather(share), 6 * group.reduce_scatter(share)

    def exposed(zero, m, schedule="1f1b", **changes):
        work = _work(params=1e6, blocks=6, recompute=False, kept_gathered=schedule == "zero-bubble",
                     reduce_every=reduces_every_micro_batch(zero, schedule), **changes)
        return exposed_data_parallel(work, dp=4, tp=1, zero=zero, micro_batches=m, mesh=mesh,
                                     runtime=autopar)

    assert exposed(0, 8) == pytest.approx(6 * group.all_reduce(share))
    assert exposed(0, 8) > exposed_data_parallel(_work(params=1e6, blocks=1, recompute=False), dp=4,
                                                 tp=1, zero=0, micro_batches=8, mesh=mesh,
                                                 runtime=autopar)     # a latency per group
    assert exposed(1, 8) == pytest.approx(scatter + 8 * gather)
    assert exposed(2, 8) == pytest.approx(8 * scatter + 8 * gather)
    assert exposed(1, 8, pipelined=True) == pytest.approx(scatter + gather)
    assert exposed(2, 8, pipelined=True) == pytest.approx(8 * scatter + gather)
    assert exposed(3, 8) == pytest.approx(8 * scatter + 16 * gather)
    assert exposed(3, 8, "zero-bubble", pipelined=True) == pytest.approx(scatter + gather)


def test_each_fsdp2_reduction_costs_the_host_per_group_and_per_byte_of_gradients():
    """FSDP2 copies each group's gradients into a buffer of its own for every reduction and
    reduces into another, as large for replicate (plain data parallelism), a 1/dp share under
    ZeRO: once a step under plain data parallelism and ZeRO-1, every micro-batch under ZeRO-2/3.
    The calibrated cost per group and per byte of those buffers is added as often, and not at
    all without data parallelism."""
    mesh = Mesh.parse("4:cpu")
    autopar = RUNTIMES["autopar"]
    per_group, per_byte = 1e-3, 1e-9
    fp32_grads = 1e6 * 4

    def added(zero, m, dp=4):
        def exposed(**costs):
            work = _work(params=1e6, blocks=6, recompute=False,
                         reduce_every=reduces_every_micro_batch(zero, "1f1b"), **costs)
            return exposed_data_parallel(work, dp=dp, tp=1, zero=zero, micro_batches=m, mesh=mesh,
                                         runtime=autopar)
        return exposed(reduce_group_s=per_group, reduce_byte_s=per_byte) - exposed()

    replicate = 6 * per_group + 2 * fp32_grads * per_byte
    sharded = 6 * per_group + (1 + 1 / 4) * fp32_grads * per_byte
    assert added(0, 8) == pytest.approx(replicate)
    assert added(1, 8) == pytest.approx(sharded)
    assert added(2, 8) == pytest.approx(8 * sharded)
    assert added(3, 8) == pytest.approx(8 * sharded)
    assert added(0, 8, dp=1) == 0.0


def test_the_reduction_cost_reaches_the_step_from_a_calibration(tiny_gpt):
    """`Efficiencies.data_parallel_reduce_*` price a data-parallel step on a CPU mesh and leave a
    GPU mesh's (no host figures there) and a step without data parallelism alone."""
    from autopar.cost.compute import Efficiencies

    plain = Efficiencies(device="cpu")
    hosted = Efficiencies(device="cpu", data_parallel_reduce_group_s=1e-3,
                          data_parallel_reduce_byte_s=1e-9)
    step = lambda config, eff: megatron_estimate(tiny_gpt, Mesh.parse("4:cpu"), config,
                                        efficiencies=eff).step_time_s
    dp = Config(dp=4, global_batch=16, micro_batch=2)
    assert step(dp, hosted) > step(dp, plain)
    tp = Config(tp=4, global_batch=16, micro_batch=2)
    assert step(tp, hosted) == step(tp, plain)


def test_attention_is_priced_at_the_kernel_the_runtime_runs():
    """Transformer Engine (Megatron-Core) runs cuDNN's fused attention on Hopper, faster than the
    FlashAttention-2 torch's SDPA runs there; on an A100 both run at FlashAttention-2's figure."""
    from autopar.commands.estimate import capture_training_step
    long_context = capture_training_step("gpt:layers=1,hidden=256,heads=2,seq=4096,vocab=512")
    config = Config(dp=8, micro_batch=1, global_batch=8)
    times = {}
    for device in ("h100-80g", "a100-80g"):
        for runtime in ("torch", "megatron-core"):
            result = estimate(long_context, Mesh.parse(f"8:{device}"), config, runtime=runtime)
            times[device, runtime] = result.breakdown["compute"]
    assert times["h100-80g", "megatron-core"] < times["h100-80g", "torch"]
    assert times["a100-80g", "megatron-core"] == pytest.approx(times["a100-80g", "torch"])
