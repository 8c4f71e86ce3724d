"""Experts batched over their leading dim (each expert on rows [E, n, ...] of its own): the
layout of HuggingFace's Llama 4 (every token to every expert, scaled by a router score that is
zero outside its top-k) and of GShard's and Switch's einsum dispatch (tokens placed into [E,
capacity] queues by a one-hot mask). Found by structure alike by the cost model and the runtime,
rewritten exactly, and under expert parallelism each rank holds E/ep experts, the rows go to
them by all-to-all and back, and training equals one process."""

import sys
from pathlib import Path

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: each would import it again)
import torch.nn.functional as F
from torch import nn

import autopar
from autopar.cost.config import Config
from autopar.cost.expert_layers import expert_layers, per_expert_rows
from autopar.cost.mesh import Mesh
from autopar.models import lm_loss
from autopar.passes.expert_parallel import check_expert_parallelism, rewrite_experts
from autopar.passes.experts import ExpertStructureError, find_expert_layers
from autopar.passes.program import export_for_pipeline
from autopar.plans import Stage
from autopar.testing.equivalence import mismatches, train_single_process

from autopar.plans import Plan

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_expert_parallel import BATCH, VOCAB, adamw, batches, expert_shards  # noqa: E402

HIDDEN, EXPERTS, FFN = 16, 4, 24


class EveryExpertOnEveryToken(nn.Module):
    """Llama 4's layout: every token through every expert, scaled by sigmoid(top-1 logit) for
    its expert and sigmoid(-inf) = 0 for the others, by batched matmuls over all the experts."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, HIDDEN, 2 * FFN) / HIDDEN ** 0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, FFN, HIDDEN) / FFN ** 0.5)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def forward(self, ids):
        x = self.embed(ids)
        tokens = x.flatten(0, 1)
        gate, up = torch.bmm(self.routed_rows(tokens), self.gate_up).chunk(2, dim=-1)
        out = torch.bmm(up * F.silu(gate), self.down).view(EXPERTS, *tokens.shape).sum(0)
        return self.head(x + out.view_as(x))

    def routed_rows(self, tokens):
        """[E, tokens, hidden]: every token for every expert, times its score for that expert."""
        logits = self.router(tokens)
        top, chosen = logits.topk(1, dim=-1)
        scores = torch.full_like(logits, float("-inf")).scatter_(1, chosen, top).sigmoid()
        return (tokens.repeat(EXPERTS, 1) * scores.t().reshape(-1, 1)).view(EXPERTS, -1, HIDDEN)


class EinsumDispatch(nn.Module):
    """GShard's and Switch's layer: top-1 routing, each token placed in its expert's queue of
    `capacity` slots by a one-hot mask, the queues [E, capacity, hidden] through the experts as
    einsums, combined back by the mask times the gate. The capacity holds a whole batch, so no
    micro-batch drops a token and one process computes what the ranks do."""

    def __init__(self, capacity: int = 64):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.w_in = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / HIDDEN ** 0.5)
        self.w_out = nn.Parameter(torch.randn(EXPERTS, HIDDEN, FFN) / FFN ** 0.5)
        self.head = nn.Linear(HIDDEN, VOCAB)
        self.capacity = capacity

    def forward(self, ids):
        x = self.embed(ids)
        tokens = x.flatten(0, 1)
        gate, expert = self.router(tokens).softmax(-1).max(-1)
        chosen = F.one_hot(expert, EXPERTS).to(tokens.dtype)
        slot = ((chosen.cumsum(0) - 1) * chosen).sum(-1).long()
        dispatch = chosen.unsqueeze(-1) * F.one_hot(slot, self.capacity).to(tokens.dtype).unsqueeze(1)
        queues = torch.einsum("tec,td->ecd", dispatch, tokens)
        hidden = torch.einsum("ecd,edf->ecf", queues, self.w_in).relu()
        out = torch.einsum("ecf,edf->ecd", hidden, self.w_out)     # the weight read transposed
        combined = torch.einsum("tec,ecd->td", dispatch * gate[:, None, None], out)
        return self.head(x + combined.view_as(x))


class ExpertsViewedToTheirCount(EveryExpertOnEveryToken):
    """Between its batched matmuls the hidden rows are viewed to the traced number of experts:
    a rank holding fewer experts cannot run that view."""

    def forward(self, ids):
        x = self.embed(ids)
        tokens = x.flatten(0, 1)
        hidden = torch.bmm(self.routed_rows(tokens), self.gate_up).view(EXPERTS * tokens.shape[0], 2 * FFN)
        gate, up = hidden.view(EXPERTS, -1, 2 * FFN).chunk(2, dim=-1)
        out = torch.bmm(up * F.silu(gate), self.down).view(EXPERTS, *tokens.shape).sum(0)
        return self.head(x + out.view_as(x))


class RoutedAfterBatched(EveryExpertOnEveryToken):
    """A batched MoE layer, then one whose experts gather their weights by the routed ids."""

    def __init__(self):
        super().__init__()
        self.second_router = nn.Linear(HIDDEN, EXPERTS, bias=False)
        self.routed = nn.Parameter(torch.randn(EXPERTS, HIDDEN, HIDDEN) / HIDDEN ** 0.5)

    def forward(self, ids):
        logits = super().forward(ids)
        tokens = self.embed(ids).flatten(0, 1)
        top, chosen = self.second_router(tokens).softmax(-1).topk(1, dim=-1)
        out = torch.bmm(tokens.unsqueeze(1), self.routed[chosen.view(-1)]).squeeze(1) * top
        return logits + self.head(out).view_as(logits)


MODELS = {"every token": EveryExpertOnEveryToken, "einsum dispatch": EinsumDispatch}


def test_only_einsums_that_keep_each_experts_rows_apart_are_batched_matmuls():
    assert per_expert_rows("ecd,edf->ecf") and per_expert_rows("ecf,edf->ecd")
    assert not per_expert_rows("tec,td->ecd")         # the dispatch: sums over the tokens
    assert not per_expert_rows("ecd,ecf->edf")         # sums over the rows
    assert not per_expert_rows("ecd,cdf->ecf")         # a weight not per expert
    assert not per_expert_rows("...d,edf->...f")


@pytest.mark.parametrize("name", MODELS)
def test_batched_experts_are_found_alike_and_rewritten_exactly(name):
    model = MODELS[name]()
    ids = batches()[0][0][:2]
    graph = autopar.capture(model, (ids,))
    program = export_for_pipeline(model, (), graph.program)
    want = program(ids)
    found = find_expert_layers(program)
    priced = expert_layers(graph)
    assert [(len(layer.batched), layer.num_experts) for layer in found] == [(2, EXPERTS)]
    assert [(len(layer.matmuls), layer.experts) for layer in priced] == [(2, EXPERTS)]
    modules = rewrite_experts(program)
    assert [module.ep for module in modules] == [1]
    assert torch.equal(program(ids), want)
    # priced at ep=2: half the experts' weights a rank, their rows sent away and back
    mesh, config = Mesh.parse("2:cpu"), Config(dp=2, global_batch=4, micro_batch=2)
    plain = autopar.estimate(graph, mesh, config)
    split = autopar.estimate(graph, mesh, Config(dp=2, ep=2, global_batch=4, micro_batch=2))
    expert_bytes = sum(p.numel() * 4 for n, p in model.named_parameters() if p.dim() == 3)
    assert plain.memory_breakdown["weights"] - split.memory_breakdown["weights"] == \
        pytest.approx(expert_bytes / 2)


def test_batched_and_routed_layers_of_one_model_are_told_apart():
    model = RoutedAfterBatched()
    ids = batches()[0][0][:2]
    program = export_for_pipeline(model, (ids,))
    want = program(ids)
    found = find_expert_layers(program)
    assert [(len(layer.batched), layer.num_experts) for layer in found] == [(2, EXPERTS), (0, EXPERTS)]
    rewrite_experts(program)
    assert torch.equal(program(ids), want)


def test_batched_experts_tied_to_their_count_are_refused_before_any_process_group():
    program = export_for_pipeline(ExpertsViewedToTheirCount(), (batches()[0][0][:2],))
    plan = Plan(fingerprint="", mesh=Mesh.parse("2:cpu").to_dict(), axes=[["dp", 2], ["tp", 1]],
                stages=[Stage(index=0, layers=[], ranks=[0, 1], dp=2, ep=2)], global_batch=2,
                micro_batches=1, micro_batch_size=1)
    with pytest.raises(ExpertStructureError, match="ep=1"):
        check_expert_parallelism(program, plan)


def train(forms: dict, names: list[str]) -> dict:
    """On every rank: each model under each form against one process."""
    data = batches()
    found = {}
    for name in names:
        reference = train_single_process(MODELS[name](), data, lm_loss, adamw)
        for form, config in forms.items():
            cm = autopar.compile(MODELS[name](), f"{config.world_size}:cpu", loss_fn=lm_loss,
                                 optimizer=adamw, plan=config,
                                 example_inputs=(data[0][0][:config.micro_batch],))
            losses = [cm.step(ids, targets) for ids, targets in data]
            found[name, form] = (mismatches(reference, losses, cm.full_state_dict()), expert_shards(cm))
    return found


FORMS = {"dp2 x ep2": Config(dp=2, ep=2, global_batch=BATCH, micro_batch=2),
         "tp2 x ep2": Config(tp=2, ep=2, global_batch=BATCH, micro_batch=4)}


@pytest.mark.multiprocess
def test_batched_experts_split_over_ranks_train_like_one_process():
    ranks = autopar.launch(train, 2, FORMS, list(MODELS), timeout=600)
    for rank in ranks:
        for key, (problems, shards) in rank.items():
            assert problems == [], (key, problems)
            # both expert weights of the layer, 2 of the 4 experts on this rank
            assert shards == [(2, EXPERTS, EXPERTS // 2)] * 2, (key, shards)
