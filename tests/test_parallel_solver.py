"""The sharding solver's own placements, run on 4 real gloo ranks, train exactly like one process:
autopar's GPT and Llama, HuggingFace GPT2 and Llama, with the ILP choosing every op's placement on a
tensor-parallel axis of 2 beside a data axis of 2, on one node of 4 and on two nodes of 2. autopar's
GPT and Llama have their embedding split on the vocabulary (as the ILP chose it for llama-tiny): a
lookup whose partial sums several ops read."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the fork: see test_parallel_gpt.py)
import torch.distributed as dist

import autopar
from autopar.cost.mesh import Mesh
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.cost.config import Config
from autopar.plans import Plan
from autopar.testing.equivalence import mismatches, train_single_process

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.multiprocess
# Resolved here, before the ranks fork: transformers imports each model's module on first use.
GPT2, LLAMA = transformers.GPT2LMHeadModel, transformers.LlamaForCausalLM

VOCAB, SEQ, BATCH = 64, 8, 32
# the default tier runs the two-node mesh (its tensor axis inside a node); one node of 4 is slow
MESHES = ("2x2:cpu",)
SLOW_MESHES = ("4:cpu",)


def autopar_gpt():
    return build_model(f"gpt:layers=2,hidden=32,heads=4,seq={SEQ},vocab={VOCAB}", device="cpu")[0]


def autopar_llama():
    return build_model(f"llama:layers=2,hidden=32,heads=4,kv_heads=2,seq={SEQ},vocab={VOCAB}",
                       device="cpu")[0]


def gpt2():
    torch.manual_seed(0)
    return GPT2(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ, resid_pdrop=0.0,
        embd_pdrop=0.0, attn_pdrop=0.0, bos_token_id=0, eos_token_id=0)).eval()


def llama():
    torch.manual_seed(0)
    return LLAMA(transformers.LlamaConfig(
        num_hidden_layers=2, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=VOCAB, max_position_embeddings=SEQ, bos_token_id=0,
        eos_token_id=0)).eval()


def logits_loss(outputs, targets):
    logits = outputs if isinstance(outputs, torch.Tensor) else outputs.logits
    return lm_loss(logits, targets)


MODELS = {"gpt": (autopar_gpt, {}), "llama-autopar": (autopar_llama, {}), "gpt2": (gpt2, {"use_cache": False}), "llama": (llama, {"use_cache": False})}


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def batches(steps=3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator),
             torch.randint(0, VOCAB, (BATCH, SEQ), generator=generator)) for _ in range(steps)]


def solver_plan(graph, mesh: Mesh) -> Plan:
    """One stage over the whole mesh, dp=2 x tp=2, every op's placement on tp chosen by the ILP."""
    from autopar.api import plan_from_config

    config = Config(tp=2, dp=2, global_batch=BATCH, micro_batch=BATCH // 2)
    plan = plan_from_config(graph, mesh, config, time_limit=20)
    if "tok_emb.weight" in plan.parameters:     # autopar's models: the vocabulary-split lookup
        tp_axis = [axis for axis, _ in plan.axes].index("tp")
        plan.parameters["tok_emb.weight"][tp_axis] = "S(0)"
    return plan


def train_solver_plans(meshes) -> dict:
    """On every rank: rank 0 solves each model and mesh, every rank trains with that plan."""
    data, results = batches(), {}
    for name, (make, kwargs) in MODELS.items():
        reference = train_single_process(make(), data, logits_loss, adamw,
                                         call=lambda model, inputs: model(*inputs, **kwargs))
        graph = autopar.capture(make(), (data[0][0],), kwargs)
        for spec in meshes:
            plan = [solver_plan(graph, Mesh.parse(spec)).to_dict() if dist.get_rank() == 0 else None]
            dist.broadcast_object_list(plan, src=0)
            cm = autopar.compile(make(), spec, example_inputs=(data[0][0],), example_kwargs=kwargs,
                                 loss_fn=logits_loss, optimizer=adamw, graph=graph,
                                 plan=Plan.from_dict(plan[0]))
            losses = [cm.step(ids, targets) for ids, targets in data]
            placements = [*cm.plan.parameters.values(), *cm.plan.nodes.values()]
            tp_axis = [axis for axis, _ in cm.plan.axes].index("tp")
            sharded = sum(places[tp_axis] != "R" for places in placements)
            results[(name, spec)] = (losses, mismatches(reference, losses, cm.full_state_dict()), sharded)
    return results


@pytest.fixture(scope="module")
def results_by_rank():
    return autopar.launch(train_solver_plans, 4, MESHES, timeout=300)


@pytest.mark.parametrize("mesh", MESHES)
@pytest.mark.parametrize("model", MODELS)
def test_solver_plan_trains_like_one_process(results_by_rank, model, mesh):
    check_solver_plan(results_by_rank, model, mesh)


@pytest.mark.slow
def test_solver_plans_on_one_node_train_like_one_process():
    results_by_rank = autopar.launch(train_solver_plans, 4, SLOW_MESHES, timeout=300)
    for model in MODELS:
        for mesh in SLOW_MESHES:
            check_solver_plan(results_by_rank, model, mesh)


def check_solver_plan(results_by_rank, model, mesh):
    for rank, results in enumerate(results_by_rank):
        losses, found, sharded = results[(model, mesh)]
        assert found == [], f"rank {rank}: {found}"
        assert losses == results_by_rank[0][(model, mesh)][0], "ranks returned different losses"
        assert sharded > 0, "the solver replicated everything: this test checks nothing"
