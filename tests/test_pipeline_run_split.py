"""Cutting a model into pipeline stages and placing them on ranks, without processes."""

import pytest
import torch
from torch import nn

from autopar.errors import AutoparError, PlanMismatchError
from autopar.models import build_model
from autopar.plans import Plan, Stage
from autopar.runtime.build import check_layers
from autopar.runtime.rank_grid import pipeline_layout
from autopar.passes.program import export_for_pipeline, model_outputs
from autopar.passes.recompute import recompute_blocks
from autopar.passes.stage_split import split_stages

GPT = "gpt:layers=4,hidden=32,heads=4,seq=16,vocab=64"
GPT_STAGES = [["tok_emb", "pos_emb", "emb_dropout", "layers.0"], ["layers.1", "layers.2"],
              ["layers.3", "norm_f", "lm_head"]]


def run_stages(programs, *inputs):
    """The stages one after another, as a pipeline runs them: each takes the previous one's
    outputs positionally; the last one's flat outputs rebuilt into the model's output."""
    values = inputs
    for program in programs:
        output = program.module(*values)
        values = output if isinstance(output, tuple) else (output,)
    return model_outputs(output, programs[-1].out_spec)


@pytest.mark.parametrize("recompute", ["none", "full"])
def test_stages_in_sequence_compute_the_model(recompute):
    model, (ids,) = build_model(GPT, device="cpu", batch=2)
    programs = [recompute_blocks(program, recompute)
                for program in split_stages(export_for_pipeline(model, (ids,)), GPT_STAGES)]
    torch.testing.assert_close(run_stages(programs, ids), model(ids), rtol=0, atol=0)


class NoGradRegions(nn.Module):
    """Layers that compute part of their forward under torch.no_grad(), which the export keeps as
    regions whose bodies it names submod_1, submod_3, ... (HuggingFace routers and rotary tables
    do this); a layer without nodes comes first."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.nothing = nn.Identity()
        self.layers = nn.ModuleList(nn.Linear(8, 8) for _ in range(3))

    def forward(self, ids):
        x = self.nothing(self.embed(ids))
        for layer in self.layers:
            with torch.no_grad():
                keep = x > x.mean()
            x = layer(x) * keep
        return x


@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_layers_with_no_grad_regions_split_and_recompute(recompute):
    model = NoGradRegions()
    ids = torch.randint(0, 16, (2, 4))
    stages = [["embed", "nothing", "layers.0", "layers.1"], ["layers.2"]]
    programs = [recompute_blocks(program, recompute)
                for program in split_stages(export_for_pipeline(model, (ids,)), stages)]
    torch.testing.assert_close(run_stages(programs, ids), model(ids), rtol=0, atol=0)


def test_each_stage_owns_exactly_its_layers_parameters():
    model, (ids,) = build_model(GPT, device="cpu", batch=2)
    programs = split_stages(export_for_pipeline(model, (ids,)), GPT_STAGES)
    for program, layers in zip(programs, GPT_STAGES):
        expected = {name for name, _ in model.named_parameters()
                    if any(name.startswith(layer + ".") for layer in layers)}
        assert set(program.param_names.values()) == expected


def test_root_buffers_are_copied_into_every_stage_that_reads_them():
    model, (ids,) = build_model("llama:layers=3,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64",
                                device="cpu", batch=2)
    stages = [["tok_emb", "layers.0"], ["layers.1"], ["layers.2", "norm", "lm_head"]]
    programs = split_stages(export_for_pipeline(model, (ids,)), stages)
    torch.testing.assert_close(run_stages(programs, ids), model(ids), rtol=0, atol=0)


class TiedHead(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(16, 8)
        self.mid = nn.Linear(8, 8)
        self.head = nn.Linear(8, 16, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, ids):
        return self.head(self.mid(self.embed(ids)))


def test_weights_tied_across_stages_get_a_copy_in_each_stage():
    model = TiedHead()
    ids = torch.zeros(2, 4, dtype=torch.long)
    programs = split_stages(export_for_pipeline(model, (ids,)), [["embed", "mid"], ["head"]])
    (tied,) = programs[0].tied      # the export names the shared weight by one of its names
    assert tied in ("embed.weight", "head.weight")
    assert [sorted(p.param_names.values()) for p in programs] == [
        sorted([tied, "mid.bias", "mid.weight"]), [tied]]
    assert all(p.tied == {tied: (0, 1)} for p in programs)
    torch.testing.assert_close(run_stages(programs, ids), model(ids), rtol=0, atol=0)


def test_tied_weights_in_one_stage_are_held_once():
    model = TiedHead()
    ids = torch.zeros(2, 4, dtype=torch.long)
    programs = split_stages(export_for_pipeline(model, (ids,)), [["embed", "mid", "head"]])
    assert len(programs[0].param_names) == 3 and programs[0].tied == {}


class InputToTheEnd(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(4, 4)
        self.mid = nn.Linear(4, 4)
        self.last = nn.Linear(4, 4)

    def forward(self, x, y):
        h = self.first(x)
        return self.last(self.mid(h)) + h * y, h


def test_a_model_input_read_by_a_later_stage_is_passed_along():
    x, y = torch.randn(2, 4), torch.randn(2, 4)
    model = InputToTheEnd()
    programs = split_stages(export_for_pipeline(model, (x, y)), [["first"], ["mid"], ["last"]])
    # y and h go through the middle stage, which computes nothing with them
    torch.testing.assert_close(run_stages(programs, x, y), model(x, y), rtol=0, atol=0)


def plan_of(stage_ranks: list[list[int]], dp: int = 1, tp: int = 1) -> Plan:
    stages = [Stage(index=i, layers=[f"layers.{i}"], ranks=ranks, dp=dp, tp=tp)
              for i, ranks in enumerate(stage_ranks)]
    return Plan(fingerprint="", mesh={}, axes=[["dp", dp], ["tp", tp]], stages=stages,
                global_batch=8 * dp, micro_batches=4, micro_batch_size=2)


def test_layout_puts_stages_with_the_same_ranks_on_one_pipeline_rank():
    layout = pipeline_layout(plan_of([[0, 1, 2, 3], [4, 5, 6, 7], [0, 1, 2, 3], [4, 5, 6, 7]], dp=2, tp=2))
    assert layout.stage_rank == [0, 1, 0, 1]
    assert layout.grid == [[[0, 1], [2, 3]], [[4, 5], [6, 7]]]
    assert layout.coordinates(6) == (1, 1, 0)


def test_layout_refuses_stages_of_different_shapes():
    plan = plan_of([[0, 1], [2, 3]], dp=2)
    plan.stages[1].dp, plan.stages[1].tp = 1, 2
    with pytest.raises(AutoparError, match="one sub-mesh shape for all stages"):
        pipeline_layout(plan)


def test_layers_that_are_not_modules_of_the_model_are_named():
    model, _ = build_model(GPT)
    plan = plan_of([[0], [1]])
    plan.stages[0].layers = ["embed", "layers.0"]
    with pytest.raises(PlanMismatchError, match=r"\['embed'\] are not modules of this GPT"):
        check_layers(model, plan)


class _Embed(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb, self.proj = nn.Embedding(64, 32), nn.Linear(32, 64)

    def forward(self, ids):
        return self.proj(torch.relu(self.emb(ids)))


def test_stage_examples_run_on_the_ranks_device():
    """A GPU rank's stages hold CUDA weights: their example run makes its inputs on that device,
    not on the CPU (where an embedding of CPU ids into CUDA weights fails). Stood in for here by
    fake CUDA tensors, which need no GPU."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from autopar.passes.program import TensorRef
    from autopar.passes.stage_interfaces import interface_examples

    ids = torch.randint(0, 64, (2, 16))
    stages = [p.module for p in split_stages(export_for_pipeline(_Embed(), (ids,)), [["emb"], ["proj"]])]
    with FakeTensorMode(allow_non_fake_inputs=True):
        for ref in (m for stage in stages for m in stage.modules() if isinstance(m, TensorRef)):
            # frozen: autograd on CUDA tensors needs a CUDA build
            ref.value = nn.Parameter(torch.empty_like(ref.value, device="cuda"), requires_grad=False)
    examples = interface_examples(stages, [ids], device=torch.device("cuda"))
    assert [tuple(x.shape) for x in examples[-1][1]] == [(2, 16, 64)]


class SideBySide(nn.Module):
    """A layer whose two branches read the same norm, as Falcon's and GPT-J's attention and MLP
    do; the second branch's first layer reads nothing of the first branch."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(8)
        self.attn = nn.Linear(8, 8)
        self.up = nn.Linear(8, 32)
        self.down = nn.Linear(32, 8)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h) + self.down(torch.relu(self.up(h)))


def test_a_stage_calls_its_layers_in_the_models_order_where_branches_run_side_by_side():
    """The planner prices, and FSDP2 prefetches by, the model's order of layers; torch's
    split_module would call the second branch first."""
    model, x = SideBySide(), torch.randn(2, 4, 8)
    [program] = split_stages(export_for_pipeline(model, (x,)), [["norm", "attn", "up", "down"]])
    called = [node.target for node in program.module.graph.nodes if node.op == "call_module"]
    assert called == sorted(called, key=lambda name: int(name.rpartition("_")[2])) and len(called) == 4
    torch.testing.assert_close(run_stages([program], x), model(x), rtol=0, atol=0)
