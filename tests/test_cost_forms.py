"""Expert parallelism, context parallelism and offload in the cost model: FLOPs, memory and
traffic against hand-computed values, and the errors a bad configuration gets."""

import math

import pytest

from autopar.commands.estimate import capture_training_step
from autopar.cost.collectives import Group
from autopar.cost.config import Config
from autopar.cost.estimator import estimate
from autopar.cost.expert_layers import expert_layers, routers
from autopar.cost.experts import exchange_time
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError

# 4 layers, 8 experts of width 64, top-2, hidden 64, sequence 64
MOE = "moe:layers=4,hidden=64,heads=4,kv_heads=2,seq=64,vocab=128,experts=8,top_k=2,expert_ffn=64"


@pytest.fixture(scope="module")
def moe_graph():
    return capture_training_step(MOE)


@pytest.fixture(scope="module")
def llama_graph():
    return capture_training_step("llama:layers=4,hidden=64,heads=4,kv_heads=2,seq=64,vocab=128")


@pytest.mark.parametrize("kwargs, message", [
    (dict(dp=4, ep=3), "ep=3 does not divide the tp x cp x dp"),
    (dict(dp=4, zero=1, offload=True), "needs ZeRO-3; set zero=3"),
    (dict(dp=2, cp=2, cp_kind="ulysses"), "cp_kind='ulysses'"),
    (dict(dp=4, routing_imbalance=0.5), "must be at least 1.0"),
    (dict(dp=2, cp=0), "cp=0 must be at least 1"),
])
def test_config_refuses_bad_forms_naming_the_fix(kwargs, message):
    with pytest.raises(AutoparError, match=message):
        Config(global_batch=8, **kwargs)


def test_config_world_counts_context_parallel_ranks():
    assert Config(tp=2, cp=2, dp=2, pp=2, global_batch=8).world_size == 16


def test_moe_flops_count_the_experts_a_token_uses(moe_graph):
    layers = expert_layers(moe_graph)
    assert len(layers) == 4 and all(layer.experts == 8 and layer.top_k == 2 for layer in layers)
    tokens, top_k, hidden, width = 64, 2, 64, 64
    # per layer: gate, up and down grouped matmuls over tokens x top_k rows (not x 8 experts)
    expected = 3 * 2 * tokens * top_k * hidden * width
    for layer in layers:
        counted = sum(moe_graph.node(name).flops for name in layer.matmuls)
        assert counted == expected
    assert len(routers(moe_graph)) == 4


def test_expert_weights_and_their_states_at_one_over_ep(moe_graph):
    mesh = Mesh.parse("8:a100-80g")
    expert_elements = sum(math.prod(moe_graph.node(w).shape)
                          for layer in expert_layers(moe_graph) for w in layer.weights)
    whole = estimate(moe_graph, mesh, Config(dp=8, global_batch=8))
    split = estimate(moe_graph, mesh, Config(dp=8, ep=4, global_batch=8))
    # fp32 master weights and Adam's moments (12 bytes) of the 3/4 of the experts a rank drops
    saved = whole.memory_breakdown["optimizer"] - split.memory_breakdown["optimizer"]
    assert saved == pytest.approx(12 * expert_elements * 3 / 4)
    # ZeRO-1 shards the experts' state over the 8 / 4 = 2 ranks holding the same experts: each
    # rank steps E/4/2 = E/8 of them, what ZeRO-1 over dp = 8 gives without expert parallelism
    zero_whole = estimate(moe_graph, mesh, Config(dp=8, global_batch=8, zero=1))
    zero_split = estimate(moe_graph, mesh, Config(dp=8, ep=4, global_batch=8, zero=1))
    assert zero_split.memory_breakdown["optimizer"] == pytest.approx(
        zero_whole.memory_breakdown["optimizer"])


def test_dispatch_inside_a_node_is_faster_than_across_nodes():
    one_node, two_nodes = Mesh.parse("16:h100-80g"), Mesh.parse("2x8:h100-80g")
    inside = Group.strided(one_node, 16, 1)
    across = Group.strided(two_nodes, 16, 1)
    nbytes = 64e6
    assert [len(g.levels) for g in (inside, across)] == [1, 2]
    fast = exchange_time(inside, nbytes, top_k=8, experts=128)
    slow = exchange_time(across, nbytes, top_k=8, experts=128)
    nvlink, ib = one_node.device.intra_node, two_nodes.device.inter_node
    # a latency per peer of each level (cost.collectives.Group.all_to_all)
    assert fast == pytest.approx(15 * nvlink.latency + nbytes * 15 / 16 / nvlink.effective_bandwidth)
    assert slow == pytest.approx(7 * nvlink.latency + nbytes * 7 / 16 / nvlink.effective_bandwidth
                                 + ib.latency + nbytes * 8 / 16 / ib.effective_bandwidth)
    # a deduplicating dispatcher sends a token to the other node once, not once per expert there
    dedup = exchange_time(across, nbytes, top_k=8, experts=128, deduplicated=True)
    assert dedup < slow


def test_ep_all_to_alls_show_in_the_estimate_and_grow_with_imbalance(moe_graph):
    mesh = Mesh.parse("2x4:h100-80g")
    balanced = estimate(moe_graph, mesh, Config(dp=8, ep=8, global_batch=8))
    skewed = estimate(moe_graph, mesh, Config(dp=8, ep=8, global_batch=8, routing_imbalance=1.5))
    assert balanced.comm_breakdown["expert"] > 0
    assert skewed.comm_breakdown["expert"] == pytest.approx(1.5 * balanced.comm_breakdown["expert"])
    assert skewed.step_time_s > balanced.step_time_s


def test_bad_expert_parallelism_names_the_problem(moe_graph, llama_graph):
    mesh = Mesh.parse("8:a100-80g")
    with pytest.raises(AutoparError, match="no mixture-of-experts layer"):
        estimate(llama_graph, mesh, Config(dp=8, ep=2, global_batch=8))
    with pytest.raises(AutoparError, match="ep=16 does not divide the 8 experts"):
        estimate(moe_graph, Mesh.parse("16:a100-80g"), Config(dp=16, ep=16, global_batch=16))


def test_context_parallel_activations_at_one_over_cp(llama_graph):
    mesh = Mesh.parse("8:a100-80g")
    plain = estimate(llama_graph, mesh, Config(dp=8, global_batch=8))
    split = estimate(llama_graph, mesh, Config(dp=2, cp=4, global_batch=2))
    assert split.memory_breakdown["activations"] == pytest.approx(
        plain.memory_breakdown["activations"] / 4)
    with pytest.raises(AutoparError, match="does not split into 2 x cp = 128"):
        estimate(llama_graph, Mesh.parse("64:a100-80g"), Config(dp=1, cp=64, global_batch=1))


def test_ring_attention_overlaps_only_as_far_as_compute_lasts(llama_graph):
    from autopar.cost.context import context_parallel_time

    mesh = Mesh.parse("2x8:h100-80g")
    group = Group.strided(mesh, 2, 8)           # two ranks, one hop across nodes
    step = lambda nbytes: mesh.device.inter_node.latency + nbytes / mesh.device.inter_node.effective_bandwidth
    # compute longer than a block's transfer: nothing shows
    assert context_parallel_time("ring", group, (0, 1e6, 0), 1, 1.0, 2.0) == (0.0, 0.0)
    # transfer longer: per step the excess, K/V twice in the backward (their gradients too)
    forward, backward = context_parallel_time("ring", group, (0, 1e9, 0), 1, 1e-3, 2e-3)
    assert forward == pytest.approx(step(1e9) - 0.5e-3)
    assert backward == pytest.approx(2 * step(1e9) - 1e-3)


def test_offload_moves_model_states_to_the_host(llama_graph):
    mesh = Mesh.parse("1:rtx4090-24g")
    on_device = estimate(llama_graph, mesh, Config(global_batch=4, zero=3))
    offloaded = estimate(llama_graph, mesh, Config(global_batch=4, zero=3, offload=True))
    assert offloaded.memory_breakdown["optimizer"] == 0 < on_device.memory_breakdown["optimizer"]
    assert offloaded.memory_per_gpu_bytes < on_device.memory_per_gpu_bytes
    params = llama_graph.param_count
    # fp32 parameters and gradients, Adam's two moments
    assert offloaded.host_memory_bytes == pytest.approx(16 * params)
    assert offloaded.breakdown["offload"] >= 0 and offloaded.breakdown["optimizer"] > 0
