"""Expert parallelism: MoE layers found by structure, their experts split over ep ranks, rows
dispatched and combined with all-to-all, dropless; trained on real gloo ranks, it equals one
process (loss at every step and final parameters, fp32, AdamW with a large eps), and each rank
holds 1/ep of every expert weight. Bad plans are refused before any collective."""

import math
from dataclasses import replace

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: each would import it again)
from torch import nn

import autopar
from autopar.cost.config import Config
from autopar.cost.mesh import Mesh
from autopar.errors import PlanMismatchError
from autopar.models import build_model, lm_loss
from autopar.passes.expert_dispatch import ExpertParallel
from autopar.passes.expert_parallel import check_expert_parallelism, rewrite_experts
from autopar.passes.experts import ExpertStructureError, find_expert_layers
from autopar.passes.program import export_for_pipeline
from autopar.plans import Plan
from autopar.testing.equivalence import mismatches, train_single_process

VOCAB, SEQ, BATCH = 64, 8, 8
MOE = f"moe:layers=2,hidden=32,heads=4,kv_heads=2,seq={SEQ},vocab={VOCAB},experts=4,top_k=2,expert_ffn=16"
DENSE = f"gpt:layers=2,hidden=32,heads=4,seq={SEQ},vocab={VOCAB}"
DEFAULT_FORMS = {"ep4": Config(dp=4, ep=4, global_batch=BATCH, micro_batch=2),
                 "dp2 x ep2": Config(dp=4, ep=2, global_batch=BATCH, micro_batch=2)}


def make(spec: str = MOE) -> nn.Module:
    torch.manual_seed(0)
    return build_model(spec, device="cpu", batch=2)[0]


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def batches(steps: int = 3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(steps)]


def expert_shards(cm) -> list[tuple[int, int, int]]:
    """(ep of the call, experts, rows of each expert weight this rank holds) per MoE layer."""
    found = []
    for module in cm.stages.modules():
        if isinstance(module, ExpertParallel):
            for holder in module.experts:
                value = holder.value
                local = value.to_local() if hasattr(value, "to_local") else value
                # FSDP2 over the replicas may shard the rank's experts further (ZeRO)
                found.append((module.ep, module.num_experts, local.shape[0]))
    return found


def train_forms(forms: dict, spec: str = MOE, precision: str | None = None) -> dict:
    """On every rank: each form trained on `batches()` against one process: {name: (losses,
    mismatches, expert_shards)}."""
    data = batches()
    reference = train_single_process(make(spec), data, lm_loss, adamw)
    results = {}
    for name, config in forms.items():
        cm = autopar.compile(make(spec), f"{config.world_size}:cpu", loss_fn=lm_loss, optimizer=adamw,
                             example_inputs=(data[0][0][:config.micro_batch],), plan=config,
                             precision=precision)
        losses = [cm.step(ids, targets) for ids, targets in data]
        results[name] = (losses, mismatches(reference, losses, cm.full_state_dict()), expert_shards(cm))
    return results


@pytest.mark.multiprocess
def test_expert_parallel_trains_like_one_process():
    """ep4: every rank one expert of each layer; dp2 x ep2: two replicas of each expert, whose
    gradients are reduced over the replicas alone."""
    ranks = autopar.launch(train_forms, 4, DEFAULT_FORMS, timeout=300)
    for rank in ranks:
        for name, config in DEFAULT_FORMS.items():
            losses, problems, shards = rank[name]
            assert problems == [], (name, problems)
            # two MoE layers of three expert weights each, 1/ep of the 4 experts on this rank
            assert shards == [(config.ep, 4, 4 // config.ep)] * 6, (name, shards)


def held_elements(forms: dict, spec: str) -> dict:
    """On every rank: each form's (mismatches, elements of each split expert weight it holds)."""
    results = train_forms(forms, spec)
    elements = {}
    for name, config in forms.items():
        cm = autopar.compile(make(spec), f"{config.world_size}:cpu", loss_fn=lm_loss,
                             optimizer=adamw, example_inputs=(batches()[0][0][:2],), plan=config)
        elements[name] = [holder.value.to_local().numel() for module in cm.stages.modules()
                          if isinstance(module, ExpertParallel) for holder in module.experts]
    return {name: (results[name][1], elements[name]) for name in forms}


def test_zero_3_shards_each_expert_when_its_ranks_outnumber_their_experts():
    """2 experts over ep=2 leave one expert a rank and 2 ranks holding it (4 ranks): ZeRO-3
    shards each expert's rows over those 2 (FSDP2 on dim 0 would leave one of them the whole
    expert and the other padding), and training is still exact."""
    spec = MOE.replace("experts=4", "experts=2")
    forms = {"dp4 x ep2 zero-3": Config(dp=4, ep=2, zero=3, global_batch=BATCH, micro_batch=2)}
    whole = [32 * 16, 32 * 16, 16 * 32] * 2        # one expert's w1, w3, w2 in each of 2 layers
    for rank in autopar.launch(held_elements, 4, forms, spec, timeout=300):
        problems, elements = rank["dp4 x ep2 zero-3"]
        assert problems == []
        assert elements == [size // 2 for size in whole]


def test_moe_layers_are_found_by_structure_and_rewritten_exactly():
    model = make()
    ids = torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))
    program = export_for_pipeline(model, (ids,))
    want = program(ids)
    layers = find_expert_layers(program)
    assert [(layer.num_experts, len(layer.holders), layer.where) for layer in layers] == [
        (4, 3, "module layers.0.ffn.experts"), (4, 3, "module layers.1.ffn.experts")]
    modules = rewrite_experts(program)
    assert [module.ep for module in modules] == [1, 1]     # no group bound: every expert here
    assert torch.equal(program(ids), want)


class FixedTokenCount(nn.Module):
    """A MoE layer whose experts' output is viewed to the traced number of tokens: it cannot run
    on the rows a rank receives."""

    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(8, 4)
        self.weight = nn.Parameter(torch.randn(4, 8, 8))

    def forward(self, x):
        tokens = x.flatten(0, 1)
        scores = self.gate(tokens).softmax(-1)
        top, ids = scores.topk(1, dim=-1)
        out = torch.bmm(tokens.unsqueeze(1), self.weight[ids.view(-1)]).view(16, 8)
        return (out * top).view(x.shape).sum()


def _with_ep(plan: Plan, ep: int) -> Plan:
    return Plan.from_dict({**plan.to_dict(), "stages": [{**s, "ep": ep} for s in plan.to_dict()["stages"]]})


def test_a_router_the_runtime_cannot_split_is_refused_by_name():
    program = export_for_pipeline(FixedTokenCount(), (torch.randn(2, 8, 8),))
    stage = autopar.plans.Stage(index=0, layers=[], ranks=[0, 1], dp=2, ep=2)
    plan = replace(_plan_shell(), stages=[stage])
    with pytest.raises(ExpertStructureError, match="cannot run on another number of tokens.*ep=1"):
        check_expert_parallelism(program, plan)


def _plan_shell() -> Plan:
    """A plan whose stages a test sets (check_expert_parallelism reads only those)."""
    from autopar.cost.mesh import Mesh

    return Plan(fingerprint="", mesh=Mesh.parse("2:cpu").to_dict(), axes=[["dp", 2], ["tp", 1]],
                stages=[], global_batch=2, micro_batches=1, micro_batch_size=1)


def refusals(plans: dict) -> dict:
    """On every rank: each (spec, plan) compiled, the error it raised; then one collective of
    every rank, which completes only if no rank entered a collective before refusing."""
    found = {}
    for name, (spec, plan) in plans.items():
        ids = torch.zeros(2, SEQ, dtype=torch.long)
        try:
            autopar.compile(make(spec), "2:cpu", loss_fn=lm_loss, optimizer=adamw,
                            example_inputs=(ids[:1],), plan=plan)
            found[name] = None
        except PlanMismatchError as err:
            found[name] = str(err)
    flag = torch.ones(())
    torch.distributed.all_reduce(flag)
    return found | {"everyone": flag.item()}


@pytest.mark.multiprocess
def test_bad_expert_plans_are_refused_on_every_rank_before_any_collective():
    import autopar.api

    dense_spec = DENSE
    odd_spec = MOE.replace("experts=4", "experts=3")
    ids = torch.zeros(2, SEQ, dtype=torch.long)
    plans = {}
    for name, spec in (("dense", dense_spec), ("three experts", odd_spec)):
        graph = autopar.capture(make(spec), (ids[:1],))
        plan = autopar.api.plan_from_config(graph, "2:cpu", Config(dp=2, global_batch=2))
        plans[name] = (spec, _with_ep(plan, 2))
    ranks = autopar.launch(refusals, 2, plans, timeout=300)
    for rank in ranks:
        assert rank["everyone"] == 2
        assert "no mixture-of-experts layer" in rank["dense"] and "ep=1" in rank["dense"]
        assert "ep=2 does not divide the 3 experts" in rank["three experts"]


def found_alike(name: str) -> None:
    """The cost model and the runtime find the same MoE layers in an architecture of the zoo (the
    planner proposes ep only where the runtime splits experts), and its expert matmuls' FLOPs
    count the experts the tokens use: 2 x rows x in x out each."""
    from autopar.cost.expert_layers import expert_layers
    from autopar.models.hf_zoo import ARCHITECTURES

    arch = ARCHITECTURES[name]
    model = arch.build()
    ids, _ = arch.batch(2, torch.Generator().manual_seed(0))
    graph = autopar.capture(model, (ids,))
    priced = expert_layers(graph)
    run = find_expert_layers(export_for_pipeline(model, (), graph.program))
    assert [layer.experts for layer in priced] == [layer.num_experts for layer in run] != []
    by_name = {node.name: node for node in graph.nodes}
    for layer, found in zip(priced, run):
        # a batched layer (Llama 4) runs every expert on every token
        assert layer.top_k == (layer.experts if found.batched else 2)
        for matmul in layer.matmuls:
            rows = by_name[by_name[matmul].inputs[0]].shape
            assert by_name[matmul].flops == 2 * math.prod(rows) * by_name[matmul].shape[-1] > 0


def test_huggingface_experts_are_found_alike_by_the_cost_model_and_the_runtime():
    """Phi-3.5-MoE's router picks its 2 experts one at a time, each a max over the scores the
    pick before masked, inside a no-grad region of the graph."""
    pytest.importorskip("transformers")
    found_alike("phimoe")


@pytest.mark.slow
@pytest.mark.parametrize("name", ["mixtral", "qwen2-moe", "olmoe", "qwen3-moe", "gpt-oss",
                                  "deepseek-v3", "llama4"])
def test_every_huggingface_moe_architecture_is_found_alike(name):
    pytest.importorskip("transformers")
    found_alike(name)


SLOW_FORMS_ON_4 = {
    "dp2 x tp2 x ep2": Config(dp=2, tp=2, ep=2, global_batch=BATCH, micro_batch=2),
    "tp4 x ep2": Config(tp=4, ep=2, global_batch=BATCH, micro_batch=4),
    "pp2 x dp2 x ep2 1f1b": Config(pp=2, dp=2, ep=2, global_batch=BATCH, micro_batch=2),
    "ep2 zero-1": Config(dp=4, ep=2, zero=1, global_batch=BATCH, micro_batch=2),
    "ep2 zero-2": Config(dp=4, ep=2, zero=2, global_batch=BATCH, micro_batch=1),
    "ep4 zero-3": Config(dp=4, ep=4, zero=3, global_batch=BATCH, micro_batch=1),
    "dp2 x ep2 full recompute": Config(dp=4, ep=2, recompute="full", global_batch=BATCH, micro_batch=2),
}
# four layers, for two chunks on each of two pipeline ranks
INTERLEAVED = {"pp2 x dp2 x ep2 interleaved": Config(pp=2, dp=2, ep=2, virtual=2, schedule="interleaved-1f1b",
                                                     global_batch=BATCH, micro_batch=2)}


# Megatron-Core's folding: the experts' ranks are carved out of the dp x cp x tp ranks of a stage
WITH_CONTEXT_ON_4 = {
    "dp2 x cp2 x ep2": Config(dp=2, cp=2, ep=2, global_batch=BATCH, micro_batch=2),
    "cp2 x ep4 zero-3": Config(dp=2, cp=2, ep=4, zero=3, global_batch=BATCH, micro_batch=2),
    "tp2 x cp2 x ep2": Config(tp=2, cp=2, ep=2, global_batch=BATCH, micro_batch=4),
    "pp2 x cp2 x ep2 1f1b": Config(pp=2, cp=2, ep=2, global_batch=BATCH, micro_batch=2),
    "dp4 x ep2 zero-3 offload": Config(dp=4, ep=2, zero=3, offload=True, global_batch=BATCH,
                                       micro_batch=2),
}


def experts_offloaded(forms: dict) -> tuple[dict, bool]:
    """`train_forms`, and whether every FSDP2 group of the last form's split experts offloads."""
    from torch.distributed.fsdp import CPUOffloadPolicy

    results = train_forms(forms)
    config = list(forms.values())[-1]
    cm = autopar.compile(make(), f"{config.world_size}:cpu", loss_fn=lm_loss, optimizer=adamw,
                         example_inputs=(batches()[0][0][:config.micro_batch],), plan=config)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in cm.stages.modules()
              if isinstance(m, ExpertParallel)]
    return results, bool(groups) and all(isinstance(g.offload_policy, CPUOffloadPolicy) for g in groups)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallelism_with_context_parallelism_and_offload():
    """Each cp rank dispatches its own chunks' tokens: dp x cp x tp / ep ranks hold the same
    experts, whose gradients are the mean over dp x cp; offload moves the experts' states too."""
    ranks = autopar.launch(experts_offloaded, 4, WITH_CONTEXT_ON_4, timeout=900)
    for rank, offloads in ranks:
        assert offloads, "an expert group of the offloaded form keeps its states on the device"
        for name, config in WITH_CONTEXT_ON_4.items():
            losses, problems, shards = rank[name]
            assert problems == [], (name, problems)
            assert shards and all(ep == config.ep for ep, _, _ in shards), (name, shards)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallelism_composes_with_every_form():
    ranks = autopar.launch(train_forms, 4, SLOW_FORMS_ON_4, timeout=900)
    interleaved = autopar.launch(train_forms, 4, INTERLEAVED, MOE.replace("layers=2", "layers=4"),
                                 timeout=900)
    for rank in (a | b for a, b in zip(ranks, interleaved)):
        for name, config in (SLOW_FORMS_ON_4 | INTERLEAVED).items():
            losses, problems, shards = rank[name]
            assert problems == [], (name, problems)
            assert shards and all(ep == config.ep for ep, _, _ in shards), (name, shards)


# ep=1: the experts' weights split over tp, their grouped matmul run on them whole and its
# weights gathered again for the backward (passes.dtensor_rules.RunReplicated), recomputed or not
SPLIT_BY_TENSOR_PARALLELISM = {
    "dp2 x tp2, ep1": Config(dp=2, tp=2, global_batch=BATCH, micro_batch=2),
    "dp2 x tp2, ep1, full recompute": Config(dp=2, tp=2, recompute="full", global_batch=BATCH,
                                             micro_batch=2),
}


@pytest.mark.slow
@pytest.mark.multiprocess
def test_experts_split_by_tensor_parallelism_train_like_one_process():
    ranks = autopar.launch(train_forms, 4, SPLIT_BY_TENSOR_PARALLELISM, timeout=600)
    for name in SPLIT_BY_TENSOR_PARALLELISM:
        losses, problems, _ = ranks[0][name]
        assert problems == [], (name, problems)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_autopar_moe_preset_under_ep4():
    forms = {"ep4": Config(dp=4, ep=4, global_batch=BATCH, micro_batch=2)}
    spec = "moe-tiny"
    ranks = autopar.launch(train_forms, 4, forms, spec, timeout=600)
    assert all(rank["ep4"][1] == [] for rank in ranks), ranks[0]["ep4"][1]


def train_huggingface(names: list[str], classes: dict, config: Config) -> dict:
    """On every rank: each zoo architecture under `config` against one process."""
    from autopar.models.hf_zoo import ARCHITECTURES, loss_fn

    found = {}
    for name in names:
        arch = ARCHITECTURES[name]
        generator = torch.Generator().manual_seed(1)
        data = [arch.batch(BATCH, generator) for _ in range(3)]
        reference = train_single_process(arch.build(classes[name]), data, loss_fn, adamw)
        cm = autopar.compile(arch.build(classes[name]), f"{config.world_size}:cpu", loss_fn=loss_fn,
                             optimizer=adamw, plan=config, example_inputs=(data[0][0][:config.micro_batch],))
        losses = [cm.step(*batch) for batch in data]
        found[name] = (mismatches(reference, losses, cm.full_state_dict()), expert_shards(cm))
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_huggingface_moe_architectures_under_expert_parallelism():
    pytest.importorskip("transformers")
    from autopar.models.hf_zoo import resolve

    names = ["mixtral", "qwen2-moe", "olmoe", "qwen3-moe", "gpt-oss", "deepseek-v3", "phimoe",
             "llama4"]
    config = Config(dp=2, ep=2, global_batch=BATCH, micro_batch=4)
    ranks = autopar.launch(train_huggingface, 2, names, resolve(names), config, timeout=1200)
    for name in names:
        problems, shards = ranks[0][name]
        assert problems == [], (name, problems)
        assert shards and all(ep == 2 and local * 2 == experts for ep, experts, local in shards), shards


def train_huggingface_context(names: list[str], classes: dict, config: Config) -> dict:
    """`train_huggingface` with causal attention without a mask (autopar.models.hf_attention),
    which context parallelism splits."""
    from autopar.models.hf_attention import causal_sdpa

    return train_huggingface(names, {name: _causal(cls, causal_sdpa) for name, cls in classes.items()},
                             config)


def _causal(cls, causal_sdpa):
    """A stand-in for `cls` whose instances run causal SDPA without a mask."""
    return lambda *args, **kwargs: causal_sdpa(cls(*args, **kwargs))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_huggingface_moe_architectures_under_context_and_expert_parallelism():
    """HuggingFace's dispatch (an inverse permutation by index_put of an arange over the rows)
    runs on a rank's chunks as on the whole sequence."""
    pytest.importorskip("transformers")
    from autopar.models.hf_zoo import resolve

    names = ["mixtral", "qwen2-moe", "olmoe", "qwen3-moe", "deepseek-v3", "llama4"]
    config = Config(cp=2, ep=2, global_batch=BATCH, micro_batch=4)
    ranks = autopar.launch(train_huggingface_context, 2, names, resolve(names), config, timeout=1200)
    for name in names:
        problems, shards = ranks[0][name]
        assert problems == [], (name, problems)
        assert shards and all(ep == 2 and local * 2 == experts for ep, experts, local in shards), shards


def save_and_load(path: str) -> dict:
    """On every rank: trained a step under dp2 x ep2 and saved; loaded under ep1 (dp4) and under
    tp2 x ep2: the same parameters, and a next step (optimizer state included) the same as the
    saving plan's."""
    data = batches(2)
    example = (data[0][0][:2],)
    saving = autopar.compile(make(), "4:cpu", loss_fn=lm_loss, optimizer=adamw, example_inputs=example,
                             plan=Config(dp=4, ep=2, global_batch=BATCH, micro_batch=2))
    saving.step(*data[0])
    saving.save(path)
    state = saving.full_state_dict()
    expected = ([saving.step(*data[1])], saving.full_state_dict())
    found = {}
    for name, config in {"ep1": Config(dp=4, global_batch=BATCH, micro_batch=2),
                         "tp2 x ep2": Config(dp=2, tp=2, ep=2, global_batch=BATCH, micro_batch=2)}.items():
        cm = autopar.compile(make(), "4:cpu", loss_fn=lm_loss, optimizer=adamw, example_inputs=example,
                             plan=config)
        cm.load(path)
        loaded = mismatches(([], state), [], cm.full_state_dict(), rtol=0, atol=0)
        found[name] = (loaded, mismatches(expected, [cm.step(*data[1])], cm.full_state_dict()))
    return found


@pytest.mark.slow
@pytest.mark.multiprocess
def test_a_checkpoint_saved_under_expert_parallelism_loads_under_other_plans(tmp_path):
    ranks = autopar.launch(save_and_load, 4, str(tmp_path / "ckpt"), timeout=600)
    for rank in ranks:
        assert rank == {"ep1": ([], []), "tp2 x ep2": ([], [])}


def train_bf16() -> tuple:
    """On every rank: dp2 x ep2 under precision="bf16" against one process under autocast: the
    first loss's difference, the distance of the parameters over the reference's own movement."""
    from autopar.models.hf_zoo import loss_fn  # noqa: F401  (the same mean cross-entropy)

    data = batches()

    def autocast(function):
        def run(*args):
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return function(*args)
        return run

    start = make().state_dict()
    reference = train_single_process(make(), data, autocast(lm_loss), adamw,
                                     call=lambda model, inputs: autocast(model)(*inputs))
    config = Config(dp=4, ep=2, zero=3, global_batch=BATCH, micro_batch=2)
    cm = autopar.compile(make(), "4:cpu", loss_fn=lm_loss, optimizer=adamw, plan=config,
                         precision="bf16", example_inputs=(data[0][0][:2],))
    losses = [cm.step(*batch) for batch in data]

    def distance(a, b):
        return sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a).sqrt().item()
    return (abs(losses[0] - reference[0][0]),
            distance(cm.full_state_dict(), reference[1]) / distance(reference[1], start),
            {p.dtype for p in cm.stages.parameters()})


@pytest.mark.slow
@pytest.mark.multiprocess
def test_expert_parallelism_under_bf16_tracks_one_process_under_autocast():
    for first_loss, apart, dtypes in autopar.launch(train_bf16, 4, timeout=600):
        assert first_loss < 2e-3 and apart < 0.3 and dtypes == {torch.float32}, (first_loss, apart)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_huggingface_moe_on_meta_loads_only_its_experts_and_trains_exactly(tmp_path):
    """Built on meta and filled from a safetensors file of the model's state_dict (transformers'
    save_pretrained stores each expert apart, which autopar refuses to merge): each rank reads
    only the slices of the expert weights it holds."""
    pytest.importorskip("transformers")
    from safetensors.torch import save_file

    from autopar.models.hf_zoo import ARCHITECTURES, resolve

    names = ["mixtral", "deepseek-v3", "llama4"]
    classes = resolve(names)
    for name in names:
        state = ARCHITECTURES[name].build(classes[name]).state_dict()
        save_file({key: value.contiguous() for key, value in state.items()},
                  str(tmp_path / f"{name}.safetensors"))
    config = Config(dp=4, ep=2, zero=3, global_batch=BATCH, micro_batch=2)
    ranks = autopar.launch(train_meta_models, 4, tmp_path, names, classes, config, timeout=600)
    assert all(rank == {name: [] for name in names} for rank in ranks), ranks[0]


def train_meta_models(tmp_path, names: list[str], classes: dict, config: Config) -> dict:
    """On every rank: each model built on meta, filled from its directory and trained, against
    one process training the model built normally."""
    from autopar.models.hf_zoo import ARCHITECTURES, loss_fn

    found = {}
    for name in names:
        arch = ARCHITECTURES[name]
        generator = torch.Generator().manual_seed(1)
        data = [arch.batch(BATCH, generator) for _ in range(2)]
        reference = train_single_process(arch.build(classes[name]), data, loss_fn, adamw)
        with torch.device("meta"):
            model = classes[name](arch.build(classes[name]).config).eval()
        cm = autopar.compile(model, f"{config.world_size}:cpu", loss_fn=loss_fn, optimizer=adamw,
                             plan=config, example_inputs=(data[0][0][:config.micro_batch],),
                             load_from=tmp_path / f"{name}.safetensors")
        losses = [cm.step(*batch) for batch in data]
        found[name] = mismatches(reference, losses, cm.full_state_dict())
    return found


def free_plan_under_a_limit(limit: int) -> tuple:
    """On every rank: the free plan of `make()` on 4 CPU ranks, one a node (no tensor
    parallelism, which would split the experts too), under `limit` bytes per device, trained
    against one process."""
    data = batches()
    reference = train_single_process(make(), data, lm_loss, adamw)
    cm = autopar.compile(make(), "4x1:cpu", loss_fn=lm_loss, optimizer=adamw, global_batch=BATCH,
                         memory_limit=limit, example_inputs=(data[0][0][:2],))
    losses = [cm.step(*batch) for batch in data]
    return cm.plan.ep, mismatches(reference, losses, cm.full_state_dict())


@pytest.mark.slow
@pytest.mark.multiprocess
def test_the_free_plan_under_a_limit_that_needs_expert_parallelism_runs_exactly():
    """The limit between the least memory the search finds without EP and the least with it."""
    from autopar.solver.planner import plan_and_search

    graph = autopar.capture(make(), (batches(1)[0][0][:2],))
    _, search = plan_and_search(graph, Mesh.parse("4x1:cpu"), global_batch=BATCH, time_limit=120)
    least = {}
    for priced in search.candidates():
        split = priced.candidate.shape.ep > 1
        least[split] = min(least.get(split, float("inf")), priced.memory_bytes)
    assert least[True] < least[False]
    limit = int((least[True] + least[False]) / 2)
    for ep, problems in autopar.launch(free_plan_under_a_limit, 4, limit, timeout=600):
        assert ep > 1 and problems == [], (ep, problems)


@pytest.mark.slow
@pytest.mark.multiprocess
def test_huggingface_experts_run_whole_on_a_recomputed_tensor_parallel_stage():
    """Without ep, a tp2 stage runs HuggingFace's experts replicated (their weights gathered
    whole, passes.dtensor_rules.RunReplicated), under full recompute: what they save goes to the
    checkpoint as any op's does (held through the forward, it was a layer's experts' inputs and
    activations a micro-batch) and the training still equals one process."""
    pytest.importorskip("transformers")
    from autopar.models.hf_zoo import resolve

    names = ["mixtral", "olmoe"]
    config = Config(tp=2, recompute="full", global_batch=BATCH, micro_batch=4)
    ranks = autopar.launch(train_huggingface, 2, names, resolve(names), config, timeout=1200)
    for name in names:
        problems, _ = ranks[0][name]
        assert problems == [], (name, problems)
