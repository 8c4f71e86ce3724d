"""Context parallelism and offload as search dimensions: the free plan uses them where memory
needs them (rediscovery), and what it plans the runtime runs exactly."""

import pytest
import torch

import autopar
from autopar.api import plan_graph
from autopar.cli import main
from autopar.errors import InfeasibleError
from autopar.models import build_model
from autopar.plans import Plan

SPEC = "llama:layers=2,hidden=32,heads=4,kv_heads=2,seq=64,vocab=64"
BATCH = 4


@pytest.fixture(scope="module")
def graph():
    model, (ids,) = build_model(SPEC, device="cpu", batch=BATCH)
    return autopar.capture(model, (ids[:1],))


def tight_plans(graph) -> tuple[Plan, Plan]:
    """Plans under half the memory the unconstrained plan (zero-bubble) needs on 4 CPU ranks (at
    60% a 1F1B pipeline with full recompute still fits; below about 44% only tensor parallelism
    over 2 ranks with full recompute does), and under the least memory any plan needs, as the
    planner's refusal of less reports it."""
    free = plan_graph(graph, "4:cpu", global_batch=BATCH)
    need = free.predicted["memory_per_gpu_bytes"]
    assert free.cp == 1 and not free.offload       # where memory is loose, neither is used
    with pytest.raises(InfeasibleError, match="offloaded") as refused:
        plan_graph(graph, "4:cpu", global_batch=BATCH, memory_limit=1024)
    return tuple(plan_graph(graph, "4:cpu", global_batch=BATCH, memory_limit=int(limit))
                 for limit in (need * 0.5, refused.value.least_memory_bytes))


def test_tight_memory_finds_context_parallelism_then_offload(graph):
    split, offloaded = tight_plans(graph)
    # activations of 64 tokens dominate this model: splitting the sequence fits first ...
    assert split.cp == 2 and split.axes[1] == ["cp", 2]
    # ... and where nothing on the device fits, ZeRO-3 keeps the states on the host
    assert offloaded.offload and all(stage.zero == 3 for stage in offloaded.stages)
    for plan in (split, offloaded):
        assert Plan.from_dict(plan.to_dict()) == plan


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def run_plans(plans):
    from autopar.models.gpt import lm_loss
    from autopar.testing.equivalence import mismatches, train_single_process

    def make():
        return build_model(SPEC, device="cpu")[0]
    generator = torch.Generator().manual_seed(1)
    data = [(torch.randint(0, 64, (BATCH, 64), generator=generator),
             torch.randint(0, 64, (BATCH, 64), generator=generator)) for _ in range(3)]
    reference = train_single_process(make(), data, lm_loss, sgd)
    found = []
    for plan in plans:
        cm = autopar.compile(make(), "4:cpu", loss_fn=lm_loss, optimizer=sgd,
                             example_inputs=(data[0][0][:1],), plan=plan)
        losses = [cm.step(ids, targets) for ids, targets in data]
        found.append(mismatches(reference, losses, cm.full_state_dict()))
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_what_the_planner_picks_trains_like_one_process(graph):
    import torch._dynamo  # noqa: F401  (before the ranks fork)

    for rank, found in enumerate(autopar.launch(run_plans, 4, tight_plans(graph), timeout=600)):
        assert found == [[], []], f"rank {rank}: {found}"


@pytest.mark.slow
def test_llama_70b_at_128k_tokens_splits_the_sequence(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "llama-70b:seq=131072", "--mesh", "16x8:h100-80g", "--global-batch", "64",
                 "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.cp > 1 and plan.predicted["fits"]


@pytest.mark.slow
def test_llama_13b_on_one_consumer_card_offloads(tmp_path, capsys):
    out = tmp_path / "plan.json"
    assert main(["plan", "llama-13b", "--mesh", "1x1:rtx4090-24g", "--global-batch", "16",
                 "--out", str(out)]) == 0
    plan = Plan.load(out)
    assert plan.offload and plan.predicted["fits"] and plan.predicted["host_memory_bytes"] > 0
    # a desktop's 256 GB (the most its platform takes) holds the 208 GB of states; 128 GB does not
    assert plan.predicted["host_memory_bytes"] <= plan.predicted["host_memory_limit_bytes"] == 256e9
    assert main(["plan", "llama-13b", "--mesh", "1x1:rtx4090-24g,host=128g", "--global-batch", "16"]) != 0
    assert "need 193.95 GiB of host memory for the host's 1 device(s), more than the 119.21 GiB " \
           "the host has; if your hosts have more, say so in the mesh spec (e.g. " \
           "'1x1:rtx4090-24g,host=209g')" in capsys.readouterr().err


def test_offloaded_states_must_fit_the_hosts_memory():
    model, inputs = build_model("gpt-tiny")
    graph = autopar.capture(model, inputs)
    config = autopar.Config(dp=2, zero=3, offload=True, global_batch=4)
    roomy = autopar.estimate(graph, autopar.Mesh.parse("2:rtx4090-24g"), config)
    assert roomy.fits and 0 < roomy.host_memory_bytes < roomy.host_memory_limit_bytes == 256e9
    small = autopar.estimate(graph, autopar.Mesh.parse("2:rtx4090-24g,host=0.001g"), config)
    assert small.host_memory_limit_bytes == 1e6 < small.host_memory_bytes and not small.fits


def test_all_to_all_needs_cp_to_divide_the_query_heads():
    """HuggingFace's grouped-query attention hands scaled_dot_product_attention fewer key/value
    heads than query heads (enable_gqa): the all-to-all splits the query heads, and key/value
    heads that do not divide go repeated the fewest times that do, priced so (2 of 4 heads go
    twice at cp=4, once at cp=2; 3 of 6 go twice at cp=2; 1 of 8 goes cp times); query heads
    that do not divide by cp are refused with the way out."""
    pytest.importorskip("transformers")
    from autopar.cost.context import AttentionBytes, exchanged_kv
    from autopar.errors import AutoparError
    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import ARCHITECTURES

    arch = ARCHITECTURES["llama"]        # 4 query heads, 2 key/value heads
    ids, _ = arch.batch(8, torch.Generator().manual_seed(1))
    graph = autopar.capture(causal_sdpa(arch.build()), (ids,))
    gqa, mqa = AttentionBytes(0, 1.0, 0, heads=4, kv_heads=2), AttentionBytes(0, 1.0, 0, 8, 1)
    assert (exchanged_kv(gqa, 2), exchanged_kv(gqa, 4)) == (1.0, 2.0)
    assert exchanged_kv(AttentionBytes(0, 1.0, 0, 6, 3), 2) == 2.0
    assert (exchanged_kv(mqa, 2), exchanged_kv(mqa, 4), exchanged_kv(mqa, 8)) == (2.0, 4.0, 8.0)
    mesh = autopar.Mesh.parse("4:cpu")
    autopar.estimate(graph, mesh, autopar.Config(cp=2, dp=2, cp_kind="all-to-all", global_batch=8))
    autopar.estimate(graph, mesh, autopar.Config(cp=4, cp_kind="all-to-all", global_batch=8))
    with pytest.raises(AutoparError, match="4 heads per rank do not divide by cp=8: use "
                                           "cp_kind='ring'"):
        autopar.estimate(graph, autopar.Mesh.parse("8:cpu"),
                         autopar.Config(cp=8, cp_kind="all-to-all", global_batch=8))


def _attention_seconds(kv_heads: int, tp: int) -> tuple[float, float]:
    """The forward and backward seconds priced for one sequence's attention, 8 query heads,
    on A100s under tp x cp2."""
    from autopar.cost.chunk_price import Pricing, node_prices
    from autopar.cost.compute import Efficiencies
    from autopar.cost.context import attention_bytes
    from autopar.cost.megatron import megatron_placements
    from autopar.cost.price_cache import PriceCache
    from autopar.cost.stages import uniform_stages

    model, (ids,) = build_model(f"llama:layers=1,hidden=512,heads=8,kv_heads={kv_heads},"
                                f"seq=2048,vocab=64", batch=1)
    graph = autopar.capture(model, (ids,))
    mesh = autopar.Mesh.parse(f"{2 * tp}:a100-80g")
    spec = uniform_stages(graph, autopar.Config(tp=tp, cp=2, global_batch=2),
                          megatron_placements(graph, tp))[0]
    efficiencies = Efficiencies.for_device(mesh.device.name)
    layout = PriceCache.of(None, graph, mesh, efficiencies).layout(spec)
    prices = node_prices(layout, spec, mesh, 1, efficiencies, "flash",
                         Pricing(attention_bytes=attention_bytes(graph, layout)))
    [attention] = [prices[n.name][:2] for n in layout.nodes if n.family == "attention"]
    return attention


def test_heads_attended_whole_on_each_tensor_parallel_rank_are_priced_whole():
    """One key/value head does not split over tp2: every tp rank attends all 8 query heads
    (`_local_heads`), the work of tp1; two key/value heads split, and each rank does half."""
    whole = _attention_seconds(1, tp=1)
    assert _attention_seconds(1, tp=2) == pytest.approx(whole)
    assert _attention_seconds(2, tp=2) == pytest.approx((whole[0] / 2, whole[1] / 2), rel=0.2)
    assert _attention_seconds(2, tp=2)[0] < 0.6 * whole[0]


def test_sliding_windows_keep_their_mask_and_plan_a_split():
    """causal_sdpa computes what Mistral's own attention does over its window (8 of 16 tokens),
    through autopar's window mask, which the planner knows it can split; a model whose class
    declares no SDPA support for another reason than soft-capped scores or sinks (GPT-Neo) is
    refused by name."""
    pytest.importorskip("transformers")
    from autopar.errors import AutoparError
    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import ARCHITECTURES

    arch = ARCHITECTURES["mistral"]
    ids, _ = arch.batch(4, torch.Generator().manual_seed(1))
    windowed = causal_sdpa(arch.build())
    assert torch.equal(windowed(ids).logits, arch.build()(ids).logits)
    whole = arch.build()
    whole.config.sliding_window = None
    assert not torch.allclose(causal_sdpa(whole)(ids).logits, windowed(ids).logits)
    graph = autopar.capture(windowed, (ids,))
    assert any(node.target == "autopar.sliding_window_mask.default" for node in graph.nodes)
    autopar.estimate(graph, autopar.Mesh.parse("4:cpu"), autopar.Config(cp=4, global_batch=4))
    import transformers

    neo = transformers.GPTNeoConfig(vocab_size=64, hidden_size=32, num_layers=2, num_heads=4,
                                    attention_types=[[["global", "local"], 1]], bos_token_id=0,
                                    eos_token_id=1, max_position_embeddings=16)
    with pytest.raises(AutoparError, match="its class declares no SDPA support.*use cp=1"):
        causal_sdpa(transformers.GPTNeoForCausalLM(neo))


def test_capped_scores_and_sinks_run_as_one_op_the_planner_splits():
    """Gemma 2 soft-caps its attention scores and GPT-OSS adds sinks to the softmax, which
    scaled_dot_product_attention cannot compute: causal_sdpa runs them as autopar::attention,
    which computes what the models' own attention does (with padding too), keeps its
    sliding-window mask, and plans under context parallelism as attention (its sinks, a
    parameter, are no mask) and under tensor parallelism split on the heads, not replicated."""
    pytest.importorskip("transformers")
    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import ARCHITECTURES

    for name in ("gemma2", "gpt-oss"):
        arch = ARCHITECTURES[name]
        ids, _ = arch.batch(4, torch.Generator().manual_seed(1))
        keep = torch.ones_like(ids)
        keep[0, 11:], keep[1, :3] = 0, 0
        theirs, mine = arch.build(), causal_sdpa(arch.build())
        theirs.set_attn_implementation("eager")
        for given in ((ids,), (ids, keep)):
            real = given[-1].bool() if len(given) > 1 else torch.ones_like(ids, dtype=torch.bool)
            assert torch.allclose(mine(*given).logits[real], theirs(*given).logits[real],
                                  atol=1e-5), name
        graph = autopar.capture(mine, (ids,))
        assert sum(node.target == "autopar.attention.default" for node in graph.nodes) == 4
        mesh = autopar.Mesh.parse("4:cpu")
        autopar.estimate(graph, mesh, autopar.Config(cp=4, global_batch=4))
        plan = autopar.plan_from_config(graph, mesh, autopar.Config(tp=2, dp=2, global_batch=4))
        assert "autopar.attention.default" not in plan.replicated_ops


def test_padding_keeps_its_mask_and_plans_a_split():
    """Given an attention_mask, causal_sdpa computes what transformers' own SDPA attention does
    (padding at the end, the start and inside), through autopar's padding mask, which the
    planner can split; a 4-D mask of the caller's own is refused with the way out."""
    pytest.importorskip("transformers")
    from autopar.errors import AutoparError
    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import ARCHITECTURES

    for name in ("llama", "mistral", "bert-mlm"):
        arch = ARCHITECTURES[name]
        ids, _ = arch.batch(3, torch.Generator().manual_seed(1))
        keep = torch.ones_like(ids)
        keep[0, 11:], keep[1, :3], keep[2, 5:9] = 0, 0, 0
        theirs = arch.build()
        theirs.set_attn_implementation("sdpa")
        mine = causal_sdpa(arch.build())
        assert torch.equal(mine(ids, keep).logits, theirs(ids, keep).logits), name
    graph = autopar.capture(mine, (ids, keep))
    assert any(node.target == "autopar.padding_mask.default" for node in graph.nodes)
    autopar.estimate(graph, autopar.Mesh.parse("4:cpu"), autopar.Config(cp=2, dp=2, global_batch=6))
    with pytest.raises(AutoparError, match="4-D mask"):
        mine(ids, torch.zeros(3, 1, 16, 16))


def test_keys_beyond_the_tokens_are_refused_not_dropped():
    """DeepSeek-V4 appends compressed keys to its tokens' and masks them with a bias of its own:
    attention over the tokens alone would compute something else, so causal_sdpa refuses it
    when the model runs, naming the layer, rather than drop the keys' mask."""
    pytest.importorskip("transformers")
    from autopar.errors import AutoparError
    from autopar.models.hf_attention import _attention

    layer = torch.nn.Module()
    layer.is_causal = True
    query, keys = torch.randn(1, 2, 4, 8), torch.randn(1, 2, 6, 8)
    with pytest.raises(AutoparError, match="Module attends over 6 keys for 4 queries.*use cp=1"):
        _attention(layer, query, keys, keys, None, s_aux=torch.zeros(2))
    layer.is_causal = False        # cross-attention: every key, as the model computes it
    assert _attention(layer, query, keys, keys, None)[0].shape == (1, 4, 2, 8)


LONG = 256     # tokens: enough for activations to outweigh these models' weights


def _long_model(name: str, model_class):
    """A zoo architecture taking LONG tokens, with causal SDPA (which the ring splits)."""
    from dataclasses import replace

    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import ARCHITECTURES

    arch = ARCHITECTURES[name]
    return causal_sdpa(replace(arch, config={**arch.config, "max_position_embeddings": LONG}).build(model_class))


def _plan_that_splits_the_sequence(graph) -> Plan:
    """The free plan under the largest memory limit (a fraction of the unconstrained plan's)
    under which the planner picks cp > 1."""
    need = plan_graph(graph, "4x1:cpu", global_batch=BATCH).predicted["memory_per_gpu_bytes"]
    for fraction in (0.6, 0.5, 0.45, 0.4, 0.35, 0.3, 0.25, 0.2):
        try:
            plan = plan_graph(graph, "4x1:cpu", global_batch=BATCH, memory_limit=int(need * fraction))
        except autopar.AutoparError:
            continue
        if plan.cp > 1:
            return plan
    raise AssertionError("no memory limit down to 20% makes the planner split the sequence")


def run_free_context_plans(names: list[str], classes: dict, plans: dict) -> dict:
    from autopar.models.hf_zoo import loss_fn
    from autopar.testing.conformance import adamw
    from autopar.testing.equivalence import mismatches, train_single_process

    generator = torch.Generator().manual_seed(1)
    data = [(ids, torch.roll(ids, -1, 1))
            for ids in (torch.randint(0, 64, (BATCH, LONG), generator=generator) for _ in range(3))]
    found = {}
    for name in names:
        reference = train_single_process(_long_model(name, classes[name]), data, loss_fn, adamw)
        cm = autopar.compile(_long_model(name, classes[name]), "4x1:cpu", loss_fn=loss_fn,
                             optimizer=adamw, plan=Plan.from_dict(plans[name]),
                             example_inputs=(data[0][0][:1],))
        losses = [cm.step(*batch) for batch in data]
        found[name] = mismatches(reference, losses, cm.full_state_dict())
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_huggingface_free_plans_that_split_the_sequence_train_like_one_process():
    """GPT-OSS (sinks, sliding windows, experts) and Mistral at 256 tokens: under a tight memory
    limit the planner splits the sequence (with pipelining, data parallelism or ZeRO as it
    prices them), and what it picks trains like one process."""
    pytest.importorskip("transformers")
    import torch._dynamo  # noqa: F401  (before the ranks fork)

    from autopar.models.hf_zoo import resolve

    names = ["gpt-oss", "mistral"]
    classes = resolve(names)
    plans = {}
    for name in names:
        graph = autopar.capture(_long_model(name, classes[name]),
                                example_inputs=(torch.zeros(1, LONG, dtype=torch.long),))
        plans[name] = _plan_that_splits_the_sequence(graph).to_dict()
    for rank in autopar.launch(run_free_context_plans, 4, names, classes, plans, timeout=900):
        assert rank == {name: [] for name in names}, rank
