"""The cost model against hand-computed values: collectives, roofline, memory, the estimator."""

import json
import math

import pytest
import sympy

from autopar.cli import main
from autopar.cost.collectives import (Group, all_gather_time, all_reduce_time, all_to_all_time,
                                      reduce_scatter_time, send_recv_time)
from autopar.cost.stages import blocks_per_chunk, uniform_stages
from autopar.cost.compute import Efficiencies, compute_time, gemm_utilization, op_family
from autopar.cost.config import Config
from autopar.cost.capacity import max_batch, max_seq, memory_expression
from autopar.cost.estimator import StageSpec, estimate, estimate_stages
from autopar.cost.megatron import megatron_placements
from autopar.cost.memory import in_flight, model_state_bytes, pending_weight_backwards
from autopar.plans.zero import reduces_every_micro_batch
from autopar.cost.mesh import DEVICES, Mesh
from autopar.errors import AutoparError, MeshError
from autopar.graph import Graph, Node, Role

A100 = DEVICES["a100-80g"]


def megatron(graph, config):
    """Megatron-LM's placements for `config` (cost.megatron): the layout the figures these tests
    check by hand, and Megatron's formulas, are of."""
    return megatron_placements(graph, config.tp, sequence_parallel=config.sequence_parallel)


def megatron_estimate(graph, mesh, config, **options):
    """`estimate` on Megatron-LM's placements."""
    return estimate(graph, mesh, config, placements=megatron(graph, config), **options)
NVLINK_BW = 300e9 * 0.77
IB_BW = 25e9 * 0.90


def test_ring_all_reduce_matches_the_alpha_beta_formula():
    mesh = Mesh.parse("8:a100-80g")
    nbytes = 1e9
    expected = 2 * 7 / 8 * nbytes / NVLINK_BW + 2 * 7 * 5e-6
    assert all_reduce_time(nbytes, mesh, ["gpu"]) == pytest.approx(expected)
    assert all_gather_time(nbytes, mesh, ["gpu"]) == pytest.approx(7 / 8 * nbytes / NVLINK_BW + 7 * 5e-6)
    assert reduce_scatter_time(nbytes, mesh, ["gpu"]) == all_gather_time(nbytes, mesh, ["gpu"])
    assert all_to_all_time(nbytes, mesh, ["gpu"]) == pytest.approx(7 / 64 * nbytes / NVLINK_BW + 7 * 5e-6)
    assert send_recv_time(nbytes, A100.inter_node) == pytest.approx(10e-6 + nbytes / IB_BW)
    tree = Group.of_axes(mesh, ["gpu"]).all_reduce(nbytes, "tree")
    assert tree == pytest.approx(2 * 3 * 5e-6 + 2 * nbytes / NVLINK_BW)


def test_all_reduce_over_nodes_is_a_ring_through_every_device_or_a_tree_across_nodes():
    mesh = Mesh.parse("4x8:a100-80g")
    nbytes = 8e9
    group = Group.of_axes(mesh, ["node", "gpu"])
    assert all_reduce_time(nbytes, mesh, ["node", "gpu"]) == pytest.approx(
        group.reduce_scatter(nbytes) + group.all_gather(nbytes))
    inside = 7 / 8 * nbytes / NVLINK_BW + 7 * 5e-6
    across = 2 * (nbytes / 8) / IB_BW + 2 * 2 * 10e-6
    assert group.all_reduce(nbytes, "tree") == pytest.approx(2 * inside + across)
    assert group.all_reduce(nbytes, "auto") == min(group.all_reduce(nbytes, "tree"),
                                                   group.all_reduce(nbytes))
    # A group strided over nodes only (one GPU per node) runs a ring on InfiniBand.
    assert Group.strided(mesh, 4, 8).all_reduce(nbytes) == pytest.approx(
        all_reduce_time(nbytes, mesh, ["node"]))
    assert Group.strided(mesh, 16, 2).levels[0].size == 4


def test_all_gather_over_nodes_is_one_ring_through_every_device():
    """NCCL's all-gather over 4 nodes of 8 is one ring of 32: 28 NVLink hops and 3 InfiniBand
    hops of latency, and the bandwidth of the slower level, whose 8 NICs a node carry a ring
    each. A hierarchy (gather across, then inside) would pay 3 + 7 hops and both levels'
    bandwidths in turn."""
    mesh = Mesh.parse("4x8:a100-80g")
    nbytes = 8e9
    ring = 4 * 7 * 5e-6 + 3 * 10e-6 + 31 / 32 * nbytes * max(1 / NVLINK_BW, 1 / (8 * IB_BW))
    assert all_gather_time(nbytes, mesh, ["node", "gpu"]) == pytest.approx(ring)
    assert reduce_scatter_time(nbytes, mesh, ["node", "gpu"]) == pytest.approx(ring)
    # two GPUs of each node in the group (every fourth): two NICs a node carry its rings
    assert Group.strided(mesh, 8, 4).all_gather(nbytes) == pytest.approx(
        4 * 1 * 5e-6 + 3 * 10e-6 + 7 / 8 * nbytes / (2 * IB_BW))
    # small tensors over many devices: every hop's latency, not only those between nodes
    large = Mesh.parse("192x8:a100-80g")
    assert Group.strided(large, 1536, 1).all_gather(1e3) > 1535 * 5e-6


def test_more_parallelism_over_the_slow_axis_costs_more():
    mesh = Mesh.parse("2x8:a100-80g")
    assert all_reduce_time(1e8, mesh, ["node"]) > all_reduce_time(1e8, mesh, ["gpu"])
    assert Group.strided(mesh, 16, 1).all_reduce(1e8) > Group.strided(mesh, 8, 1).all_reduce(1e8)


def test_collective_errors_name_the_problem():
    mesh = Mesh.parse("2x8:a100-80g")
    with pytest.raises(MeshError, match="no axis 'rack'"):
        all_reduce_time(1e6, mesh, ["rack"])
    with pytest.raises(MeshError, match="does not fit"):
        Group.strided(mesh, 32, 1)


def test_mesh_specs_and_errors():
    assert Mesh.parse("128x8:a100-80g").world_size == 1024
    assert [a.name for a in Mesh.parse("4:cpu").axes] == ["gpu"]
    assert Mesh.parse("2x2:cpu").shape == (2, 2)
    with pytest.raises(MeshError, match="known devices: .*a100-40g"):
        Mesh.parse("8:mi300x")
    with pytest.raises(MeshError, match="expected NODESxGPUS:DEVICE"):
        Mesh.parse("8 gpus")


def test_a_mesh_spec_states_its_hosts_memory():
    """Offloaded states must fit the host: a known device's host has the memory its systems
    ship with, a spec may state its own, and a mesh file keeps it."""
    assert Mesh.parse("4x8:h100-80g").device.host_figures.memory_bytes == 2000e9
    mesh = Mesh.parse("2x1:rtx4090-24g,host=96g")
    assert mesh.device.host_figures.memory_bytes == 96e9 and mesh.world_size == 2
    assert Mesh.parse("1:l40s-48g,host=1.5tb").device.host_figures.memory_bytes == 1500e9
    assert Mesh.from_dict(mesh.to_dict()) == mesh
    with pytest.raises(MeshError, match="host memory must be more than 0"):
        Mesh.parse("1:rtx4090-24g,host=0g")
    with pytest.raises(MeshError, match="',host=SIZE'"):
        Mesh.parse("1:rtx4090-24g,host=lots")


def test_roofline_compute_and_memory_bound():
    eff = Efficiencies()
    flops = 2 * 8192 ** 3
    big = compute_time(flops, 3 * 8192 ** 2 * 2, A100, "matmul")
    assert big == pytest.approx(flops / (312e12 * eff.compute["matmul"]) + eff.kernel_latency_s)
    moved = 3 * 2 ** 30
    add = compute_time(2 ** 29, moved, A100, "elementwise")
    assert add == pytest.approx(moved / (A100.hbm_bandwidth * eff.memory["elementwise"])
                                + eff.kernel_latency_s)
    assert compute_time(0, 10 ** 9, A100, "view") == 0.0
    assert op_family("aten.linear.default") == "matmul"
    assert op_family("aten.scaled_dot_product_attention.default") == "attention"
    assert op_family("aten.layer_norm.default") == "norm"
    assert op_family("aten.transpose.int") == "view"
    assert op_family("aten.gelu.default") == "elementwise"


def test_efficiencies_reject_nonsense():
    with pytest.raises(AutoparError, match="fraction of the peak"):
        Efficiencies(compute={"matmul": 1.5})
    with pytest.raises(AutoparError, match="unknown"):
        Efficiencies(memory={"fft": 0.5})


def test_adam_mixed_precision_memory_per_zero_stage():
    params, dp = 1e9, 8
    # 16-bit weights, fp32 gradients (as the runtime keeps them), fp32 master weights and moments
    assert sum(model_state_bytes(params, zero=0, dp=dp).values()) == 18e9
    assert sum(model_state_bytes(params, zero=1, dp=dp).values()) == pytest.approx((2 + 4 + 12 / 8) * 1e9)
    assert sum(model_state_bytes(params, zero=2, dp=dp).values()) == pytest.approx((2 + 16 / 8) * 1e9)
    assert sum(model_state_bytes(params, zero=3, dp=dp).values()) == pytest.approx(18 / 8 * 1e9)


def test_in_flight_micro_batches_per_schedule():
    assert in_flight("1f1b", pp=4, micro_batches=16, stage=0) == 4
    assert in_flight("1f1b", pp=4, micro_batches=16, stage=3) == 1
    assert in_flight("1f1b", pp=4, micro_batches=2, stage=0) == 2
    assert in_flight("gpipe", pp=4, micro_batches=16, stage=0) == 16
    # Interleaved: (1 + (p-1)/(pv)) times 1F1B's first stage, in chunks: p*v + p - 1.
    assert in_flight("interleaved-1f1b", pp=4, micro_batches=16, virtual=2, stage=0) == 4 * 2 + 3


def _held_in_torch_order(actions) -> int:
    """The most (chunk, micro-batch) forwards whose activations a rank holds: from the forward
    to the full backward (B), or to the weight backward (W) where the backward is split."""
    held, most = set(), 0
    for action in actions:
        key = (action.stage, action.micro_batch)
        if action.kind == "F":
            held.add(key)
        elif action.kind in ("B", "W"):
            held.discard(key)
        most = max(most, len(held))
    return most


@pytest.mark.parametrize("schedule", ["1f1b", "gpipe", "interleaved-1f1b", "zero-bubble"])
def test_in_flight_is_what_torchs_order_of_actions_holds(schedule):
    from autopar.timeline import schedule_actions
    single = schedule in ("1f1b", "gpipe")
    for pp, virtual, m in [(2, 1, 2), (2, 1, 8), (3, 1, 6), (4, 1, 4), (4, 1, 16), (4, 2, 8),
                           (4, 3, 4), (8, 2, 48), (2, 4, 4), (8, 1, 4)]:
        if single and virtual > 1 or schedule == "1f1b" and m < pp:
            continue
        if schedule == "interleaved-1f1b" and m % pp:
            continue
        actions = schedule_actions(schedule, pp, m, virtual)
        for rank in range(pp):
            assert in_flight(schedule, pp=pp, micro_batches=m, virtual=virtual, stage=rank) == \
                _held_in_torch_order(actions[rank]), (schedule, pp, virtual, m, rank)


def test_pending_weight_backwards_are_what_torchs_zero_bubble_order_defers():
    """Between a micro-batch's input backward (I) and its weight backward (W) it keeps the
    gradients the weights' backward needs; at a rank's fullest (most forwards held) that many
    are pending. The model's first chunk (stage 0) has no input gradients to compute: its W is
    the whole backward, and nothing waits after its I."""
    from autopar.timeline import schedule_actions
    for pp, virtual, m in [(2, 1, 8), (4, 1, 4), (4, 1, 16), (4, 2, 8), (8, 4, 48), (3, 1, 6)]:
        actions = schedule_actions("zero-bubble", pp, m, virtual)
        for rank in range(pp):
            held, pending, fullest = set(), set(), (0, 0)
            for action in actions[rank]:
                key = (action.stage, action.micro_batch)
                if action.kind == "F":
                    held.add(key)
                elif action.kind == "I" and action.stage != 0:
                    pending.add(key)
                elif action.kind == "W":
                    held.discard(key)
                    pending.discard(key)
                fullest = max(fullest, (len(held), len(pending)))
            assert pending_weight_backwards("zero-bubble", pp=pp, micro_batches=m, virtual=virtual,
                                            stage=rank) == fullest[1], (pp, virtual, m, rank)
    assert pending_weight_backwards("1f1b", pp=4, micro_batches=8, stage=3) == 0




def test_one_ranks_interleaved_order_is_the_one_torchs_schedule_builds():
    from autopar.cost.interleaved_order import _order
    from autopar.timeline import schedule_actions
    for pp, virtual, m in [(2, 4, 8), (4, 2, 10), (4, 5, 8), (3, 6, 9), (8, 8, 64), (4, 1, 3)]:
        every = schedule_actions("interleaved-1f1b", pp, m, virtual)
        for rank in range(pp):
            assert _order(pp, m, virtual, rank) == [(a.kind, a.stage // pp) for a in every[rank]], (pp, virtual, m)

def test_chunks_gathered_whole_are_those_torchs_interleaved_runtime_gathers_ahead():
    """Under ZeRO-3 torch's schedule runtime gathers a chunk whole when it enters the next three
    chunks a rank computes and frees it when it leaves (its UNSHARD and RESHARD actions); a
    chunk's own compute frees it group by group. The walk of cost/interleaved_order.py sees the
    same chunks whole at every compute action."""
    from torch.distributed.pipelining import schedules as torch_schedules
    from autopar.cost.interleaved_order import moments
    from autopar.timeline import _StandInStage
    for pp, virtual, m in [(2, 4, 8), (2, 3, 4), (4, 2, 8), (4, 5, 8), (3, 6, 9), (2, 8, 16), (4, 1, 4)]:
        stages = [_StandInStage(chunk * pp, pp * virtual, pp, 0) for chunk in range(virtual)]
        order = torch_schedules.ScheduleInterleaved1F1B(stages, m).pipeline_order
        for rank in range(pp):
            whole, seen = set(), []
            for action in torch_schedules._add_unshard_reshard(order[rank]):
                kind, chunk = action.computation_type.value, action.stage_index // pp
                if kind in ("UNSHARD", "RESHARD"):
                    (whole.add if kind == "UNSHARD" else whole.discard)(chunk)
                    continue
                seen.append((chunk, chunk in whole, tuple(sorted(whole - {chunk}))))
                whole.discard(chunk)
            walked = [(mo.running, mo.whole, mo.waiting) for _, mo in moments(pp, m, virtual, rank)]
            assert walked == seen, (pp, virtual, m, rank)

def test_chunks_finished_are_those_torchs_interleaved_runtime_has_reduced():
    """After a chunk's last micro-batch's backward torch's schedule runtime reduces the chunk's
    gradients and reshards it (its REDUCE_GRAD action): from then on the chunk holds its reduced
    gradients alone. The walk of cost/interleaved_order.py sees the same chunks backed and
    finished at every compute action, with as many micro-batches as pipeline ranks (no steady
    state) and more."""
    from torch.distributed.pipelining import schedules as torch_schedules
    from autopar.cost.interleaved_order import moments
    from autopar.timeline import _StandInStage
    for pp, virtual, m in [(2, 4, 2), (2, 5, 4), (4, 2, 4), (4, 3, 8), (3, 6, 3), (2, 2, 6)]:
        stages = [_StandInStage(chunk * pp, pp * virtual, pp, 0) for chunk in range(virtual)]
        order = torch_schedules.ScheduleInterleaved1F1B(stages, m).pipeline_order
        for rank in range(pp):
            backed, reduced, held, seen = set(), set(), 0, []
            for action in torch_schedules._add_reduce_grad(order[rank], m):
                kind, chunk = action.computation_type.value, action.stage_index // pp
                if kind == "REDUCE_GRAD":
                    reduced.add(chunk)
                    continue
                held += kind == "F"
                seen.append((held, tuple(sorted(backed)), tuple(sorted(reduced))))
                held -= kind == "B"
                backed |= {chunk} if kind == "B" else set()
            walked = [(held, mo.backed, mo.finished) for held, mo in moments(pp, m, virtual, rank)]
            assert walked == seen, (pp, virtual, m, rank)


def test_the_backwards_priced_include_the_fullest_of_every_weighing():
    """The estimator prices only the backwards no other of the same chunk holds at least as much
    as (more activations, more chunks backed and gathered, fewer finished). Under any weights
    that grow with those, the fullest backward of each chunk is among them."""
    import random
    from autopar.cost.interleaved_order import moments, priced_moments
    rng = random.Random(0)
    for pp, virtual, m in [(2, 4, 2), (2, 5, 4), (4, 2, 8), (3, 6, 3), (4, 8, 12)]:
        for rank in range(pp):
            every = [mo for _, mo in moments(pp, m, virtual, rank) if mo.kind == "B"]
            priced = [mo for mo in priced_moments(pp, m, virtual, rank, True) if mo.kind == "B"]
            assert len(priced) <= len(every)
            for _ in range(20):
                per = [rng.random() for _ in range(4)]
                chunk = [rng.random() for _ in range(virtual)]
                weigh = lambda mo: (per[0] * sum(mo.pairs) + sum(chunk[c] * per[1] for c in mo.backed)
                                    - sum(chunk[c] * per[2] for c in mo.finished)
                                    + sum(chunk[c] * per[3] for c in mo.waiting) + mo.whole)
                for c in range(virtual):
                    fullest = max(weigh(mo) for mo in every if mo.running == c)
                    assert max(weigh(mo) for mo in priced if mo.running == c) == fullest, (pp, virtual, m)


def _mlp_graph(batch=4, hidden=1024):
    """x [batch, hidden] -> mm(w1) -> relu -> mm(w2): a hand-made graph."""
    f32 = 4

    def node(name, target, role, shape, inputs=(), flops=0):
        size = math.prod(shape) * f32
        return Node(name=name, target=target, role=role, shape=shape, dtype="float32", bytes=size,
                    inputs=inputs, flops=flops, param_fqn=name if role is Role.PARAMETER else None)
    nodes = [node("w1", "placeholder", Role.PARAMETER, (hidden, hidden)),
             node("w2", "placeholder", Role.PARAMETER, (hidden, hidden)),
             node("x", "placeholder", Role.INPUT, (batch, hidden)),
             node("mm1", "aten.mm.default", Role.ACTIVATION, (batch, hidden), ("x", "w1"),
                  2 * batch * hidden * hidden),
             node("relu", "aten.relu.default", Role.ACTIVATION, (batch, hidden), ("mm1",), batch * hidden),
             node("mm2", "aten.mm.default", Role.ACTIVATION, (batch, hidden), ("relu", "w2"),
                  2 * batch * hidden * hidden),
             Node(name="output", target="output", role=Role.OUTPUT, shape=(), dtype="", bytes=0,
                  inputs=("mm2",))]
    return Graph(nodes=nodes, blocks=[])


def test_estimate_of_a_hand_made_graph_matches_hand_computed_times():
    hidden, batch = 4096, 8192
    graph = _mlp_graph(batch, hidden)
    mesh = Mesh.parse("1:a100-80g")
    result = megatron_estimate(graph, mesh, Config(global_batch=batch, micro_batch=batch))
    eff = Efficiencies()
    bf16 = 2
    mm_flops = 2 * batch * hidden * hidden
    mm_bytes = 2 * batch * hidden * bf16 + hidden * hidden * bf16
    # 8192 x 4096 outputs are 1024 tiles of 256 x 128 on 108 multiprocessors: 10 waves, the
    # last one 48% full.
    use = gemm_utilization(batch, hidden, A100)
    assert use == pytest.approx(1024 / 1080)
    mm = compute_time(mm_flops, mm_bytes, A100, "matmul", utilization=use)
    mm_bwd = compute_time(2 * mm_flops, 2 * mm_bytes, A100, "matmul", utilization=use)
    relu_bytes = 2 * batch * hidden * bf16
    relu = compute_time(batch * hidden, relu_bytes, A100, "elementwise")
    relu_bwd = compute_time(batch * hidden, 1.5 * relu_bytes, A100, "elementwise")
    # one micro-batch on fp32 master weights: each weight cast to bf16 and its gradient back to
    # fp32, 6 bytes each a parameter (cost/master_weights.py)
    casts = 2 * compute_time(0, 2 * hidden * hidden * 6, A100, "elementwise")
    compute = 2 * mm + 2 * mm_bwd + relu + relu_bwd + casts
    assert result.breakdown["compute"] == pytest.approx(compute)
    # autopar's runtime steps torch's AdamW, foreach: 84 bytes a parameter (cost/memory.py)
    optimizer = 2 * hidden * hidden * 84 / (A100.hbm_bandwidth * eff.memory["elementwise"])
    assert result.step_time_s == pytest.approx(compute + optimizer + eff.kernel_latency_s)
    assert result.memory_breakdown["weights"] == 2 * hidden * hidden * 2
    # Kept for the backward: x (mm1) and relu's output (relu's own backward reads its result,
    # and mm2 its input), in bf16; nothing keeps mm1's output.
    assert result.memory_breakdown["activations"] == 2 * batch * hidden * bf16
    assert result.model_tflops_per_gpu == pytest.approx(
        3 * graph.forward_flops / result.step_time_s / 1e12)


@pytest.fixture(scope="module")
def tiny_gpt():
    from autopar.commands.estimate import capture_training_step
    return capture_training_step("gpt:layers=4,hidden=256,heads=4,seq=128,vocab=1024,dropout=0.1")


def test_tensor_parallelism_across_nodes_costs_more_than_inside_one(tiny_gpt):
    config = Config(tp=4, dp=1, global_batch=8, micro_batch=8)
    inside = megatron_estimate(tiny_gpt, Mesh.parse("4:a100-80g"), config)
    across = megatron_estimate(tiny_gpt, Mesh.parse("4x1:a100-80g"), config)
    assert across.breakdown["exposed_comm"] > inside.breakdown["exposed_comm"]
    assert across.step_time_s > inside.step_time_s


def test_recompute_zero_and_sequence_parallel_trade_time_for_memory(tiny_gpt):
    mesh = Mesh.parse("8:a100-80g")
    base = dict(tp=2, pp=2, dp=2, global_batch=32, micro_batch=4)
    plain = megatron_estimate(tiny_gpt, mesh, Config(**base))
    full = megatron_estimate(tiny_gpt, mesh, Config(**base, recompute="full"))
    assert full.memory_breakdown["activations"] < plain.memory_breakdown["activations"]
    assert full.step_time_s > plain.step_time_s
    assert full.tflops_per_gpu * full.step_time_s > plain.tflops_per_gpu * plain.step_time_s
    assert full.model_tflops_per_gpu * full.step_time_s == pytest.approx(
        plain.model_tflops_per_gpu * plain.step_time_s)
    sp = megatron_estimate(tiny_gpt, mesh, Config(**base, sequence_parallel=True))
    assert sp.memory_breakdown["activations"] < plain.memory_breakdown["activations"]
    zero = [megatron_estimate(tiny_gpt, mesh, Config(**base, zero=z)).memory_per_gpu_bytes for z in range(4)]
    assert zero == sorted(zero, reverse=True) and zero[3] < zero[0]


def test_bubble_fraction_is_p_minus_1_over_v_m_for_equal_stages():
    from autopar.commands.estimate import capture_training_step
    graph = capture_training_step("gpt:layers=8,hidden=128,heads=4,seq=64,vocab=128")
    mesh = Mesh.parse("4:a100-80g")
    one = megatron_estimate(graph, mesh, Config(pp=4, global_batch=16, micro_batch=1))
    # The first and last stages carry the embedding and the head: nearly, not exactly, equal.
    assert one.bubble_fraction == pytest.approx(3 / 16, rel=0.15)
    two = megatron_estimate(graph, mesh, Config(pp=4, virtual=2, schedule="interleaved-1f1b",
                                       global_batch=16, micro_batch=1))
    assert two.bubble_fraction == pytest.approx(3 / 32, rel=0.15)


def test_graph_activations_agree_with_the_megatron_formula():
    from autopar.commands.estimate import capture_training_step
    from autopar.cost.memory import megatron_activation_bytes
    seq, hidden, heads, batch = 512, 512, 8, 2
    spec = f"gpt:layers=4,hidden={hidden},heads={heads},seq={seq},vocab=512,dropout=0.1"
    graph = capture_training_step(spec)
    mesh = Mesh.parse("8:a100-80g")
    for tp in (1, 4):
        config = Config(tp=tp, dp=8 // tp, global_batch=batch * 8 // tp, micro_batch=batch)
        short = capture_training_step(spec.replace("layers=4", "layers=2"))
        # Megatron-LM holds the whole model in 16 bits (autopar's runtime keeps, under autocast,
        # a layer norm's output in fp32 on a GPU: autopar.mixed_dtypes)
        held = lambda g: megatron_estimate(g, mesh, config, attention="unfused",
                                           runtime="megatron-core").memory_breakdown["activations"]
        per_layer = (held(graph) - held(short)) / 2
        formula = megatron_activation_bytes(seq=seq, batch=batch, hidden=hidden, heads=heads, tp=tp)
        # The graph keeps FlashAttention-free attention's output besides the projection's input.
        assert per_layer == pytest.approx(formula, rel=0.1)


def test_max_batch_agrees_with_the_numeric_memory_model(tiny_gpt):
    mesh = Mesh.parse("2x4:a100-40g")
    config = Config(tp=2, pp=2, dp=2, global_batch=16, micro_batch=2, recompute="selective")
    limit = 3e9
    best = max_batch(tiny_gpt, mesh, config, limit, placements=megatron(tiny_gpt, config))
    assert best > 2
    def memory(b):
        c = Config(**{**config.to_dict(), "micro_batch": b,
                      "global_batch": b * config.dp * config.micro_batches})
        return megatron_estimate(tiny_gpt, mesh, c).memory_per_gpu_bytes
    assert memory(best) <= limit < memory(best + 1)
    b = sympy.Symbol("b", positive=True)
    expression = memory_expression(tiny_gpt, mesh, config, batch=b, placements=megatron(tiny_gpt, config))
    assert float(expression.subs(b, best)) == pytest.approx(memory(best))
    assert max_batch(tiny_gpt, mesh, config, 1e6, placements=megatron(tiny_gpt, config)) == 0


SEQ_MODELS = ["gpt:layers=2,hidden=64,heads=4,seq=64,vocab=128,dropout=0.1",
              "llama:layers=2,hidden=64,heads=4,kv_heads=2,seq=64,vocab=128"]


def capture_at_length(spec: str, seq: int):
    """One model (its position tables sized by the spec) captured on ids of length `seq`."""
    import torch
    from autopar.tracer import capture
    from autopar.commands.estimate import WithLoss
    from autopar.models import build_model, lm_loss
    model, _ = build_model(spec)
    ids = torch.empty(1, seq, dtype=torch.int64, device="meta")
    return capture(WithLoss(model, lm_loss), (ids, torch.empty_like(ids)))


@pytest.fixture(scope="module", params=SEQ_MODELS, ids=["gpt", "llama"])
def captured_16_and_32(request):
    # head_dim = 16 = the short length: dims equal to the sequence by chance must not scale.
    return capture_at_length(request.param, 16), capture_at_length(request.param, 32)


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("attention", ["flash", "unfused"])
def test_memory_expression_in_batch_and_sequence_matches_captures_at_each_length(
        captured_16_and_32, recompute, attention):
    short, long = captured_16_and_32
    mesh = Mesh.parse("2x2:a100-80g")
    config = Config(tp=2, pp=2, dp=1, global_batch=8, micro_batch=2, recompute=recompute)
    b, s = sympy.symbols("b s", positive=True)
    expression = memory_expression(short, mesh, config, batch=b, seq=s, attention=attention,
                                   placements=megatron(short, config))
    assert expression.free_symbols == {b, s}
    for graph, length in ((short, 16), (long, 32)):
        numeric = megatron_estimate(graph, mesh, config, attention=attention).memory_per_gpu_bytes
        assert float(expression.subs({b: 2, s: length})) == pytest.approx(numeric, rel=1e-12)
    # Without `seq` the expression is the batch-only one, at the captured length.
    batch_only = memory_expression(short, mesh, config, batch=b, attention=attention,
                                   placements=megatron(short, config))
    assert float(batch_only.subs(b, 2)) == pytest.approx(float(expression.subs({b: 2, s: 16})))


def test_unfused_attention_scores_grow_with_the_square_of_the_sequence(captured_16_and_32):
    short, _ = captured_16_and_32
    mesh = Mesh.parse("1:a100-80g")
    config = Config(global_batch=1, micro_batch=1)
    s = sympy.Symbol("s", positive=True)
    flash, unfused = (memory_expression(short, mesh, config, batch=1, seq=s, attention=kernel)
                      for kernel in ("flash", "unfused"))
    # doubling a long sequence doubles the first and quadruples the second (the expression holds
    # a max with the optimizer step's memory, so it is no polynomial)
    growth = lambda expression: float(expression.subs(s, 2e7) / expression.subs(s, 1e7))
    assert growth(flash) == pytest.approx(2, rel=1e-3) and growth(unfused) == pytest.approx(4, rel=1e-3)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_max_seq_agrees_with_the_numeric_memory_model(captured_16_and_32, recompute):
    short, long = captured_16_and_32
    mesh = Mesh.parse("2x2:a100-80g")
    config = Config(tp=2, pp=2, dp=1, global_batch=8, micro_batch=2, recompute=recompute)
    at_32 = megatron_estimate(long, mesh, config).memory_per_gpu_bytes
    placements = megatron(short, config)
    assert max_seq(short, mesh, config, at_32, placements=placements) == 32
    assert max_seq(short, mesh, config, at_32 - 1, placements=placements) == 31
    s = sympy.Symbol("s", positive=True)
    expression = memory_expression(short, mesh, config, batch=2, seq=s, placements=placements)
    best = max_seq(short, mesh, config, 1e8, placements=placements)
    assert float(expression.subs(s, best)) <= 1e8 < float(expression.subs(s, best + 1))
    assert max_seq(short, mesh, config, 1e3, placements=placements) == 0


def test_max_seq_needs_a_sequence():
    from autopar.commands.estimate import capture_training_step
    mlp = capture_training_step("mlp:layers=2,hidden=32")
    with pytest.raises(AutoparError, match="no sequence length"):
        max_seq(mlp, Mesh.parse("1:a100-80g"), Config(global_batch=1, micro_batch=1))


def test_estimate_stages_prices_non_uniform_stages(tiny_gpt):
    mesh = Mesh.parse("8:a100-80g")
    placements = megatron_placements(tiny_gpt, 2)
    stages = [StageSpec(layers=["model.layers.0"], tp=2, dp=2, recompute="full", placements=placements),
              StageSpec(layers=["model.layers.1", "model.layers.2", "model.layers.3"], tp=2, dp=2,
                        placements=placements)]
    result = estimate_stages(tiny_gpt, mesh, stages, global_batch=16, micro_batch=2)
    assert len(result.devices) == 2 and result.step_time_s > 0
    with pytest.raises(AutoparError, match="not a block"):
        estimate_stages(tiny_gpt, mesh, [StageSpec(layers=["layers.9"], tp=8)], global_batch=8,
                        micro_batch=1)


def test_estimate_rejects_a_bad_factorization(tiny_gpt):
    with pytest.raises(AutoparError, match="does not match the 8 devices"):
        megatron_estimate(tiny_gpt, Mesh.parse("8:a100-80g"), Config(tp=2, dp=2, global_batch=8))
    with pytest.raises(AutoparError, match="cannot fill .* at most 6"):
        megatron_estimate(tiny_gpt, Mesh.parse("7:a100-80g"), Config(pp=7, global_batch=7))


def test_uneven_pipelines_give_the_extra_blocks_to_the_middle_stages(tiny_gpt):
    # BLOOM-176B: 70 layers on 12 stages, 5 on the stages with the embedding and the head.
    assert blocks_per_chunk(70, 12) == [5] + [6] * 10 + [5]
    assert blocks_per_chunk(5, 2) == [3, 2] and blocks_per_chunk(4, 4) == [1] * 4
    stages = uniform_stages(tiny_gpt, Config(pp=3, global_batch=3))
    assert [len(s.layers) for s in stages] == [1, 2, 1]
    result = megatron_estimate(tiny_gpt, Mesh.parse("3:a100-80g"), Config(pp=3, global_batch=6))
    middle = result.devices[1]["time_per_micro_batch_s"]
    assert len(result.devices) == 3 and middle > result.devices[0]["time_per_micro_batch_s"]


def test_more_chunks_than_blocks_give_the_embedding_and_the_head_chunks_of_their_own(tiny_gpt):
    """Megatron's accounting of the embedding and the loss as a layer each: 4 blocks fill 5
    chunks (the embedding alone) or 6 (the head alone too), and the forced plan is cut and
    priced as the estimate is."""
    from autopar.api import plan_from_config

    blocks = [f"model.layers.{i}" for i in range(4)]
    for pp in (5, 6):
        config = Config(pp=pp, global_batch=2 * pp, micro_batch=1)
        stages = uniform_stages(tiny_gpt, config)
        assert [stage.layers for stage in stages[1:5]] == [[block] for block in blocks]
        assert stages[0].layers and not set(stages[0].layers) & set(blocks)
        assert len(stages) == pp and (pp == 5 or not set(stages[5].layers) & set(blocks))
        estimate = megatron_estimate(tiny_gpt, Mesh.parse(f"{pp}:a100-80g"), config)
        plan = plan_from_config(tiny_gpt, f"{pp}:a100-80g", config)
        assert [stage.layers[0] for stage in plan.stages[1:5]] == blocks
        assert plan.predicted["step_time_s"] == pytest.approx(estimate.step_time_s)


def test_cli_estimate_json_schema(capsys):
    code = main(["estimate", "gpt-tiny", "--mesh", "2x2:a100-80g", "--tp", "2", "--pp", "2",
                 "--global-batch", "8", "--micro-batch", "2", "--recompute", "full", "--json"])
    assert code == 0
    report = json.loads(capsys.readouterr().out)
    for key in ("step_time_s", "tflops_per_gpu", "model_tflops_per_gpu", "mfu",
                "memory_per_gpu_bytes", "bubble_fraction"):
        assert isinstance(report[key], float) and report[key] >= 0
    assert report["config"]["dp"] == 1
    assert set(report["breakdown"]) == {"compute", "exposed_comm", "bubble", "optimizer"}
    assert report["step_time_s"] == pytest.approx(sum(report["breakdown"].values()))


def test_cli_estimate_bad_factorization_is_a_clear_error(capsys):
    code = main(["estimate", "gpt-tiny", "--mesh", "4:cpu", "--tp", "3", "--global-batch", "8"])
    assert code == 1
    assert "does not divide the 4 devices" in capsys.readouterr().err


def test_calibrate_on_cpu_writes_a_file_estimate_reads(tmp_path, capsys):
    out = tmp_path / "cal.json"
    assert main(["calibrate", "--out", str(out), "--device", "cpu", "--budget", "0.01", "--rounds", "2"]) == 0
    data = json.loads(out.read_text())
    assert data["device"] == "cpu" and 0 < data["compute"]["matmul"] <= 1
    # the local device measures its efficiencies and an op's cost, in rounds; nothing of a mesh
    assert sorted(data["rounds"]) == ["compute.attention", "compute.matmul", "kernel_latency_s",
                                      "memory.elementwise", "memory.norm", "memory.reduction",
                                      "memory.softmax"]
    assert all(len(values) == 2 for values in data["rounds"].values())
    assert "spread" in capsys.readouterr().out
    assert "mm 1024x1024x1024" in data["measurements"]
    capsys.readouterr()
    assert main(["estimate", "gpt-tiny", "--mesh", "2:cpu", "--global-batch", "4",
                 "--calibration", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["calibration"] == str(out)


def test_a_mesh_calibration_keeps_each_figures_median_round():
    """One round's busy moment (a figure 4x its neighbours, or 0) does not become the figure."""
    from autopar.calibrate.measure import median_efficiencies, median_measurements
    rounds = [Efficiencies(compute={"matmul": m}, pipeline_action_latency_s=p, device="cpu")
              for m, p in ((0.3, 0.0), (0.5, 1e-3), (0.4, 4e-3))]
    merged = median_efficiencies(rounds)
    assert merged.compute["matmul"] == 0.4 and merged.pipeline_action_latency_s == 1e-3
    assert merged.memory == rounds[0].memory and merged.device == "cpu"
    records = [{"add": {"family": "elementwise", "seconds": s, "bandwidth_fraction": 1 / s}}
               for s in (3.0, 1.0, 2.0)]
    kept = median_measurements(records)["add"]
    assert kept["seconds"] == 2.0 and kept["bandwidth_fraction"] == 0.5
    assert kept["rounds_seconds"] == [3.0, 1.0, 2.0]


def test_a_calibrations_figures_are_named_and_their_spread_is_largest_over_smallest():
    """What benchmarks/calibration_repeat.py compares between two files, and calibrate reports
    per figure over its rounds."""
    from autopar.cost.calibration import figures, spread

    data = {**Efficiencies(compute={"matmul": 0.4}, kernel_latency_s=2e-5, device="cpu").to_dict(),
            "collectives": {"ranks": 4, "fits": {"all_reduce": {"latency_s": 1e-3, "bandwidth": 5e8}},
                            "group_fits": {"2": {"all_gather": {"latency_s": 2e-3, "bandwidth": 3e8}}}}}
    named = figures(data)
    assert named["compute.matmul"] == 0.4 and named["kernel_latency_s"] == 2e-5
    assert named["all_reduce on 4 ranks: bandwidth"] == 5e8
    assert named["all_gather on 2 ranks: latency_s"] == 2e-3
    assert spread([1.0, 1.2, 1.1]) == pytest.approx(1.2) and spread([3.0, 3.0]) == 1.0
    assert spread([0.0, 0.0]) == 1.0 and spread([0.0, 1e-3]) == float("inf")


def test_tensor_parallel_degree_must_divide_query_heads_not_key_value_heads():
    """As in Megatron: query heads are split over tp; fewer key/value heads than tp (grouped-query,
    multi-query attention) are kept whole on every rank, gathered from their projection."""
    from autopar.commands.estimate import capture_training_step
    gpt = capture_training_step("gpt:layers=2,hidden=96,heads=6,seq=32,vocab=128")
    with pytest.raises(AutoparError, match="tp=4 does not divide the 6 heads"):
        megatron_estimate(gpt, Mesh.parse("4:a100-80g"), Config(tp=4, global_batch=4))
    llama = capture_training_step("llama-tiny")      # 4 query heads, 2 key/value heads
    whole_kv = megatron_estimate(llama, Mesh.parse("4:a100-80g"), Config(tp=4, global_batch=4))
    split_kv = megatron_estimate(llama, Mesh.parse("4:a100-80g"), Config(tp=2, dp=2, global_batch=4))
    assert whole_kv.fits and split_kv.fits
    assert whole_kv.comm_breakdown["tensor"] > 0


def test_megatron_placements_are_column_then_row_and_split_the_stream_with_sequence_parallelism(tiny_gpt):
    """Megatron-LM's layout read off the graph: q/k/v and the MLP's first linear column-parallel
    (split output features), the attention output and the MLP's second linear row-parallel (split
    input features, partial sums out, reduced where the residual stream reads them), the
    embedding vocab-parallel; with sequence parallelism every norm reads the stream split on the
    sequence, and the partial sums are reduce-scattered onto it."""
    fqn = {n.name: n.param_fqn for n in tiny_gpt.parameters}
    by_name = {n.name: n for n in tiny_gpt.nodes}
    for sp in (False, True):
        placed = megatron_placements(tiny_gpt, 2, sequence_parallel=sp)
        weights = {fqn[name]: placement for name, placement in placed.parameters.items()}
        for module, expected in (("attn.wq", "S(0)"), ("attn.wv", "S(0)"), ("mlp.fc1", "S(0)"),
                                 ("attn.wo", "S(1)"), ("mlp.fc2", "S(1)")):
            assert weights[f"model.layers.1.{module}.weight"] == expected, (module, sp)
        assert weights["model.tok_emb.weight"] == "S(0)" and weights["model.layers.1.mlp.fc2.bias"] == "R"
        norms = {placed.nodes[norm] for norm, _, _ in tiny_gpt.norm_reads()}
        assert norms == ({"S(1)"} if sp else {"R"})
        rows = [name for name, node in by_name.items()
                if node.module_path.endswith("mlp.fc2") and node.target == "aten.linear.default"]
        assert {placed.nodes[name] for name in rows} == {"P"}
    assert megatron_placements(tiny_gpt, 1) is None


def test_a_reshape_to_its_own_shape_keeps_viewing_the_attention_output():
    """Attention kernels write their output heads-last; a reshape to the same shape (as a
    HuggingFace attention's output takes on its way out) still views it, and the transpose and
    reshape that merge the heads copy nothing: the projection after them keeps the attention's
    own output. The layout keeps the bytes autograd keeps."""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from autopar.cost.layout import infer_layout
    from autopar.tracer import capture

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out = nn.Linear(64, 192), nn.Linear(64, 64)

        def forward(self, x):
            q, k, v = (t.view(1, 16, 4, 16).transpose(1, 2) for t in self.qkv(x).chunk(3, dim=-1))
            heads = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            return self.out(heads.reshape(1, -1, 16, 16).transpose(1, 2).reshape(1, 16, 64))

    model, x = Attention(), torch.randn(1, 16, 64)
    layout = infer_layout(capture(model, example_inputs=(x,)), 1, compute_dtype="float32")
    kept = {key for node in layout.nodes for key in node.saved}
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(tensor):
        if tensor.untyped_storage().data_ptr() not in params:
            saved[tensor.untyped_storage().data_ptr()] = tensor.untyped_storage().nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        model(x)
    assert sum(layout.storage_bytes[key] for key in kept) == sum(saved.values())


def test_a_weight_used_through_a_view_is_still_tensor_parallel():
    """x @ w.t() shards like linear(x, w): column-parallel, the weight split over tp."""
    hidden, batch = 256, 64
    f32 = 4
    nodes = [Node(name="w", target="placeholder", role=Role.PARAMETER, shape=(hidden, hidden),
                  dtype="float32", bytes=hidden * hidden * f32, inputs=(), param_fqn="w"),
             Node(name="x", target="placeholder", role=Role.INPUT, shape=(batch, hidden),
                  dtype="float32", bytes=batch * hidden * f32, inputs=()),
             Node(name="wt", target="aten.t.default", role=Role.ACTIVATION, shape=(hidden, hidden),
                  dtype="float32", bytes=hidden * hidden * f32, inputs=("w",)),
             Node(name="mm", target="aten.mm.default", role=Role.ACTIVATION, shape=(batch, hidden),
                  dtype="float32", bytes=batch * hidden * f32, inputs=("x", "wt"),
                  flops=2 * batch * hidden * hidden),
             Node(name="output", target="output", role=Role.OUTPUT, shape=(), dtype="", bytes=0,
                  inputs=("mm",))]
    graph = Graph(nodes=nodes, blocks=[])
    result = megatron_estimate(graph, Mesh.parse("2:a100-80g"), Config(tp=2, global_batch=batch,
                                                              micro_batch=batch))
    assert result.memory_breakdown["weights"] == hidden * hidden * 2 / 2


def test_meshes_for_users_own_clusters_from_python_and_files(tmp_path):
    from autopar.cost.mesh import DeviceSpec, Link
    device = DeviceSpec("my-gpu", {"bfloat16": 400e12, "float32": 50e12}, 3e12, 96 * 2**30,
                        Link("my-nvlink", 400e9, 3e-6, 0.8), Link("my-ib", 50e9, 8e-6, 0.85))
    mesh = Mesh.build(device, gpus=4, nodes=16)
    assert mesh.world_size == 64 and mesh.axis("node").link.name == "my-ib"
    path = tmp_path / "mesh.json"
    path.write_text(json.dumps(mesh.to_dict()))
    assert Mesh.load(path) == mesh
    assert all_reduce_time(1e9, Mesh.load(path), ["node"]) == pytest.approx(
        2 * 15 / 16 * 1e9 / (50e9 * 0.85) + 2 * 15 * 8e-6)
    with pytest.raises(MeshError, match="efficiency"):
        Link("bad", 1e9, 1e-6, 1.5)


def test_selective_recompute_drops_what_the_attention_module_keeps(tiny_gpt):
    mesh = Mesh.parse("8:a100-80g")
    base = dict(tp=2, dp=4, global_batch=16, micro_batch=4)
    memory = {(kernel, mode): megatron_estimate(tiny_gpt, mesh, Config(**base, recompute=mode),
                                       attention=kernel).memory_breakdown["activations"]
              for kernel in ("flash", "unfused") for mode in ("none", "selective")}
    # Scores of 4 heads / 2 ranks x 128 x 128 per sample, kept as softmax output (2 bytes),
    # dropout mask (1) and dropout output (2), in each of the 4 layers.
    # Selective recompute reruns the whole attention module (as the runtime checkpoints it):
    # its projections' outputs go with either kernel, the scores too where they were kept.
    scores = 4 * 4 / 2 * 128 * 128 * 5 * 4
    dropped = {kernel: memory[kernel, "none"] - memory[kernel, "selective"] for kernel in ("flash", "unfused")}
    assert dropped["flash"] > 0
    assert dropped["unfused"] - dropped["flash"] == pytest.approx(scores, rel=0.02)


def test_gpipe_holds_every_micro_batch_and_1f1b_holds_p(tiny_gpt):
    mesh = Mesh.parse("4:a100-80g")
    kept = {schedule: megatron_estimate(tiny_gpt, mesh, Config(pp=4, global_batch=16, micro_batch=1,
                                                      schedule=schedule)).devices
            for schedule in ("gpipe", "1f1b")}
    per_stage = lambda s: [d["memory_bytes"] for d in kept[s]]
    assert all(g > o for g, o in zip(per_stage("gpipe"), per_stage("1f1b")))


def test_zero_2_and_3_accumulate_only_their_gradient_shard_between_micro_batches():
    """The runtime reduce-scatters ZeRO-2/3 gradients after every micro-batch (but under
    zero-bubble), so a rank holds its 1/dp share of them between micro-batches, and in a
    pipeline the last reduce-scatter's input (one group's gradients: FSDP2 keeps it until a
    step's last backward, which a single stage's loop makes every backward); plain data
    parallelism and ZeRO-1 accumulate them whole until the last."""
    from autopar.cost.memory import peak_bytes
    sizes = dict(params=1e6, gathered=1e5, group=5e4, weight=1e4, dp=8, precision="bf16", micro_batches=4,
                 held=1, activations=1e6, logits=0.0, flowing=0.0)

    def gradients(zero, schedule="1f1b", pipelined=False):
        return peak_bytes(**sizes, zero=zero, pipelined=pipelined,
                          reduce_every=reduces_every_micro_batch(zero, schedule))

    assert gradients(0)["gradients"] == gradients(1)["gradients"] == 4e6
    assert gradients(2)["gradients"] == gradients(3)["gradients"] == 4e6 / 8
    # the loss's backward the fullest (large logits): in a pipeline it also holds the group
    sizes["logits"] = 1e6
    assert gradients(3, pipelined=True)["gradients"] == 4e6 / 8 + 4 * 5e4
    assert gradients(3)["gradients"] == 4e6 / 8
    assert gradients(2, "zero-bubble")["gradients"] == 4e6
    assert [reduces_every_micro_batch(z, "1f1b") for z in range(4)] == [False, False, True, True]


def test_a_pipeline_stage_keeps_its_logits_through_the_backward():
    """torch's PipelineStage caches the last stage's output (the logits) until the micro-batch's
    backward on the stage ends: a block's backward there holds them beside its own transients."""
    from autopar.cost.memory import peak_bytes
    sizes = dict(params=1e5, gathered=0.0, weight=1e3, zero=0, dp=1, precision="bf16", micro_batches=4,
                 held=1, activations=1e6, logits=1e4, flowing=1e7)
    alone, piped = peak_bytes(**sizes, pipelined=False), peak_bytes(**sizes, pipelined=True)
    assert piped["buffers"] - alone["buffers"] == 2 * 1e4
