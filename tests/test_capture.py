"""Capture: nodes, roles, shapes against a real run, FLOPs, block detection, errors, HuggingFace."""

import json

import pytest
import torch
from torch import nn

import autopar
from autopar import CaptureError
from autopar.tracer import capture
from autopar.cli import main
from autopar.graph import Role
from autopar.models import PRESETS, build_model

SMALL = {"gpt": dict(layers=2, hidden=32, heads=4, seq=16, vocab=64),
         "llama": dict(layers=2, hidden=32, heads=4, kv_heads=2, ffn=48, seq=16, vocab=64),
         "mlp": dict(layers=2, hidden=16),
         "moe": dict(layers=2, hidden=32, heads=4, kv_heads=2, head_dim=0, ffn=48, seq=16, vocab=64,
                     experts=4, top_k=2, expert_ffn=16, dense_layers=0)}
# a latent-attention preset (DeepSeek-V3) keeps its form at a small size
SMALL_MLA = dict(kv_heads=4, q_lora=16, kv_lora=8, qk_nope=8, qk_rope=4, v_head=8)


def _small(name: str, **extra):
    family, sizes = PRESETS[name]
    small = {**SMALL[family], **(SMALL_MLA if sizes.get("kv_lora") else {})}
    return build_model(name, **{**small, **extra})


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_captures_at_a_small_size(name):
    model, inputs = _small(name)
    graph = capture(model, inputs)
    assert graph.param_count == sum(p.numel() for p in model.parameters())
    assert {n.param_fqn for n in graph.parameters} == {k for k, _ in model.named_parameters()}
    [kind] = graph.blocks
    assert [i.module_path for i in kind.instances] == ["layers.0", "layers.1"]
    assert graph.nodes[-1].role is Role.OUTPUT and graph.nodes[-1].target == "output"
    assert graph.forward_flops > 0


def _real_shapes(graph, inputs) -> dict[str, torch.Tensor]:
    """Run the exported program's nodes on the real weights and inputs; every tensor output."""
    outputs = {}

    class Recorder(torch.fx.Interpreter):
        def run_node(self, node):
            value = super().run_node(node)
            if isinstance(value, torch.Tensor):
                outputs[node.name] = value
            return value

    program, user = graph.program, iter(inputs)
    args = [next(user) if n.param_fqn is None
            else program.state_dict.get(n.param_fqn, program.constants.get(n.param_fqn))
            for n in graph.nodes if n.target == "placeholder"]
    Recorder(program.graph_module).run(*args)
    return outputs


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny", "mlp-tiny",
                                  "gpt:layers=1,hidden=32,heads=4,seq=8,vocab=64,fused_qkv=true"])
def test_node_shapes_equal_a_real_forward(spec):
    model, inputs = build_model(spec, device="cpu", batch=2)
    graph = capture(model, inputs)
    real = _real_shapes(graph, inputs)
    activations = [n for n in graph.nodes if n.role is Role.ACTIVATION and n.dtype]
    assert activations and {n.name for n in activations} <= set(real)
    for node in activations:
        value = real[node.name]
        assert node.shape == tuple(value.shape), node.name
        assert node.dtype == str(value.dtype).removeprefix("torch."), node.name
        assert node.bytes == value.numel() * value.element_size(), node.name
    logits = model(*inputs)
    assert graph.nodes[-1].shape == tuple(logits.shape)
    # The captured program computes what the model computes.
    torch.testing.assert_close(real[graph.nodes[-1].inputs[0]], logits)


def test_capture_of_real_weights_copies_nothing():
    model, inputs = build_model("gpt-tiny", device="cpu")
    graph = capture(model, inputs)
    state = graph.program.state_dict
    for name, param in model.named_parameters():
        assert state[name].data_ptr() == param.data_ptr()


def test_roles_fqns_module_paths_and_args():
    model, inputs = build_model("gpt-tiny")
    graph = capture(model, inputs)
    roles = {n.role for n in graph.nodes}
    assert roles == {Role.PARAMETER, Role.INPUT, Role.ACTIVATION, Role.OUTPUT}
    [ids] = [n for n in graph.nodes if n.role is Role.INPUT]
    assert ids.shape == (1, 32) and ids.dtype == "int64" and ids.param_fqn is None
    linears = [n for n in graph.nodes if n.target == "aten.linear.default"]
    assert linears[0].module_path == "layers.0.attn.wq" and linears[0].module_type == "Linear"
    assert linears[0].args == (None, None, None)
    assert graph.node(linears[0].inputs[1]).param_fqn == "layers.0.attn.wq.weight"
    views = [n for n in graph.nodes if n.target == "aten.view.default"]
    assert views[0].args == (None, (1, 32, 4, 16))
    assert set(n.name for n in graph.nodes) == set(n.name for n in graph.program.graph.nodes)


def test_matmul_flops_are_two_per_multiply_add():
    model, inputs = build_model("gpt-tiny", batch=3)
    graph = capture(model, inputs)
    tokens = 3 * model.config.seq
    weights = sum(m.weight.numel() for m in model.modules() if isinstance(m, nn.Linear))
    biases = sum(m.bias.numel() for m in model.modules()
                 if isinstance(m, nn.Linear) and m.bias is not None)
    linear = sum(n.flops for n in graph.nodes if n.target == "aten.linear.default")
    assert linear == 2 * tokens * weights + tokens * biases
    heads, seq, hidden = model.config.heads, model.config.seq, model.config.hidden
    attention = sum(n.flops for n in graph.nodes if "scaled_dot_product" in n.target)
    scores = 3 * heads * seq * seq
    assert attention == model.config.layers * (2 * scores * 2 * (hidden // heads) + 5 * scores)


@pytest.mark.parametrize("layers, expected", [(1, []), (2, [2]), (12, [12])])
def test_block_detection_by_layer_count(layers, expected):
    model, inputs = build_model("gpt:hidden=32,heads=4,seq=8,vocab=64", layers=layers)
    graph = capture(model, inputs)
    assert [kind.count for kind in graph.blocks] == expected
    for kind in graph.blocks:
        assert kind.module_type == "GPTBlock"
        for i, instance in enumerate(kind.instances):
            assert instance.module_path == f"layers.{i}"
            inside = graph.nodes[instance.start:instance.stop]
            assert all(n.module_path.startswith(f"layers.{i}") for n in inside)
            assert instance.stop - instance.start == kind.nodes_per_block


class Residual(nn.Module):
    def __init__(self, width: int, inner: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up = nn.Linear(width, inner)
        self.down = nn.Linear(inner, width)

    def forward(self, x):
        return x + self.down(torch.relu(self.up(self.norm(x))))


class Mixer(nn.Module):
    """A different block kind: self-attention over the sequence."""

    def __init__(self, width: int):
        super().__init__()
        self.qkv = nn.Linear(width, 3 * width)

    def forward(self, x):
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        return x + torch.nn.functional.scaled_dot_product_attention(q, k, v)


class Stack(nn.Module):
    def __init__(self, layers):
        super().__init__()
        self.layers = nn.ModuleList(layers)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class TwoTowers(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = Stack([Mixer(16) for _ in range(3)])
        self.decoder = Stack([Residual(16, 32) for _ in range(2)])

    def forward(self, x):
        return self.decoder(self.encoder(x))


def _kinds(model):
    graph = capture(model, (torch.randn(2, 8, 16, device="meta"),))
    return [(k.module_type, [i.module_path for i in k.instances]) for k in graph.blocks]


def test_two_block_kinds_alternating():
    model = Stack([Mixer(16) if i % 2 == 0 else Residual(16, 32) for i in range(6)]).to("meta")
    assert _kinds(model) == [("Mixer", ["layers.0", "layers.2", "layers.4"]),
                             ("Residual", ["layers.1", "layers.3", "layers.5"])]


def test_two_block_kinds_in_two_towers():
    assert _kinds(TwoTowers().to("meta")) == [
        ("Mixer", ["encoder.layers.0", "encoder.layers.1", "encoder.layers.2"]),
        ("Residual", ["decoder.layers.0", "decoder.layers.1"])]


def test_blocks_are_told_apart_by_structure_not_class():
    model = Stack([Residual(16, 32), Residual(16, 32), Residual(16, 64), Residual(16, 64)])
    kinds = _kinds(model.to("meta"))
    assert kinds == [("Residual", ["layers.0", "layers.1"]), ("Residual", ["layers.2", "layers.3"])]


class Branchy(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        if y.sum() > 0:  # the data-dependent branch
            y = y * 2
        return y


def test_data_dependent_branch_raises_capture_error_naming_the_line():
    with pytest.raises(CaptureError) as info:
        capture(Branchy(), (torch.randn(2, 8),))
    message = str(info.value)
    assert "data-dependent control flow" in message
    assert "test_capture.py" in message and "if y.sum() > 0:" in message
    assert "aten.item" in message and "torch.cond" in message and "torch.where" in message
    assert info.value.__cause__ is not None


class Selecting(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x):
        y = self.fc(x)
        return y[y > 0].sum()  # as many values as are positive


def test_a_size_the_values_decide_raises_capture_error_naming_the_line():
    """torch.export traces a boolean mask's selection to a tensor of unknown size; autopar
    sizes every op before the run, so capture refuses it, naming the op and the line."""
    with pytest.raises(CaptureError) as info:
        capture(Selecting(), (torch.randn(2, 8),))
    message = str(info.value)
    assert "depends on its input's values" in message and "aten.index.Tensor" in message
    assert "test_capture.py" in message and "return y[y > 0].sum()" in message


def test_capture_rejects_a_non_module():
    with pytest.raises(CaptureError, match="needs a torch.nn.Module"):
        capture(lambda x: x, (torch.randn(2),))


def test_autopar_capture_is_callable_in_any_import_order():
    model, inputs = build_model("mlp-tiny")
    assert autopar.capture(model, inputs).blocks[0].count == 2


def test_inspect_json(capsys):
    assert main(["inspect", "gpt:layers=3,hidden=32,heads=4,seq=8,vocab=64", "--batch", "2",
                 "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["params"] == sum(p.numel() for p in build_model("gpt:layers=3,hidden=32,heads=4,"
                                                                  "seq=8,vocab=64")[0].parameters())
    assert report["blocks"][0]["count"] == 3 and report["blocks"][0]["nodes_per_block"] > 10
    assert report["flops_per_step"] == 3 * report["forward_flops"] > 0
    assert report["nodes"] > 0 and report["largest_activations"]


def test_inspect_table_and_bad_model(capsys):
    assert main(["inspect", "mlp-tiny"]) == 0
    assert "MLPBlock" in capsys.readouterr().out
    assert main(["inspect", "nonsense"]) == 1
    assert "unknown model 'nonsense'" in capsys.readouterr().err


def test_huggingface_gpt2_and_llama_capture_with_blocks():
    transformers = pytest.importorskip("transformers")
    ids = torch.randint(0, 100, (2, 16))
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=2, n_embd=32, n_head=4, vocab_size=100, n_positions=32)).eval()
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=3, hidden_size=32, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=64, vocab_size=100, max_position_embeddings=32)).eval()
    for model, prefix, count in ((gpt2, "transformer.h", 2), (llama, "model.layers", 3)):
        distinct = {id(p): p.numel() for p in model.parameters()}
        graph = capture(model, (), {"input_ids": ids, "use_cache": False})
        [kind] = graph.blocks
        assert [i.module_path for i in kind.instances] == [f"{prefix}.{i}" for i in range(count)]
        assert graph.param_count == sum(distinct.values())
        logits = [n for n in graph.nodes if n.shape == (2, 16, 100)]
        assert logits, "the LM head's output is in the graph"


def test_tied_weights_are_counted_once():
    class Tied(nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = nn.Embedding(50, 8)
            self.head = nn.Linear(8, 50, bias=False)
            self.head.weight = self.emb.weight

        def forward(self, ids):
            return self.head(self.emb(ids))

    graph = capture(Tied(), (torch.randint(0, 50, (2, 4)),))
    assert graph.param_count == 50 * 8
    assert [n.tied_to for n in graph.parameters] == [None, "emb.weight"]


class Scaled(nn.Module):
    """Creates a constant inside forward: torch numbers such constants over the whole model."""

    def __init__(self):
        super().__init__()
        self.fc = nn.Linear(16, 16)

    def forward(self, x):
        return x + self.fc(x) * torch.tensor([0.5])


def test_constants_created_in_forward_do_not_split_a_block_kind():
    graph = capture(Stack([Scaled() for _ in range(3)]), (torch.randn(2, 16),))
    assert [kind.count for kind in graph.blocks] == [3]


def test_buffers_and_batch_norm_statistics():
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 2))
    graph = capture(model, (torch.randn(5, 4),))
    buffers = {n.param_fqn for n in graph.nodes if n.role is Role.BUFFER}
    assert buffers == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert graph.param_count == sum(p.numel() for p in model.parameters())


def test_huggingface_cache_output_names_use_cache():
    transformers = pytest.importorskip("transformers")
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=32, n_head=4, vocab_size=100, n_positions=32))
    with pytest.raises(CaptureError, match="use_cache=False"):
        capture(gpt2, (), {"input_ids": torch.randint(0, 100, (2, 8))})


class Ops(nn.Module):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv2d(3, 4, kernel_size=3, bias=True)
        self.weight = nn.Parameter(torch.randn(6, 5))

    def forward(self, images, a, b):
        return (self.conv(images).sum() + torch.bmm(a, b).sum()
                + torch.einsum("bij,bjk->bik", a, b).amax() + (a @ self.weight[:, :4]).sum())


def test_flops_of_convolution_bmm_and_matmul():
    images, a, b = torch.randn(2, 3, 8, 8), torch.randn(7, 5, 6), torch.randn(7, 6, 3)
    graph = capture(Ops(), (images, a, b))
    flops = {n.target.split(".")[1]: n.flops for n in graph.nodes if n.target.startswith("aten.")}
    conv_outputs = 2 * 4 * 6 * 6
    assert flops["conv2d"] == 2 * conv_outputs * 3 * 3 * 3 + conv_outputs
    assert flops["bmm"] == 2 * 7 * 5 * 3 * 6
    assert flops["matmul"] == 2 * 7 * 5 * 4 * 6
    assert flops["einsum"] == 2 * 7 * 5 * 6 * 3
    assert flops["sum"] == 7 * 5 * 4            # the last sum reads the matmul's 140 elements


@pytest.mark.parametrize("kinds, covered", [
    ("LLLL", "LLLL"), ("xLLLLy", ".LLLL."), ("ABABAB", "ABABAB"), ("ABABCCC", "ABABCCC"),
    ("aXbY", "...."), ("L", "."), ("AABAAB", "AABAAB"), ("xLLyLL", ".LL.LL")])
def test_periodic_runs_of_block_signatures(kinds, covered):
    from autopar.tracer import _periodic_cover
    positions = _periodic_cover(list(kinds))
    assert "".join(k if i in positions else "." for i, k in enumerate(kinds)) == covered


class SharedBlock(nn.Module):
    """One block applied three times (ALBERT-style weight sharing)."""

    def __init__(self):
        super().__init__()
        self.block = Residual(16, 32)

    def forward(self, x):
        for _ in range(3):
            x = self.block(x)
        return x


def test_a_shared_block_called_three_times_is_three_instances():
    graph = capture(SharedBlock(), (torch.randn(2, 16),))
    [kind] = graph.blocks
    assert [i.module_path for i in kind.instances] == ["block"] * 3
    assert [i.start for i in kind.instances] == sorted({i.start for i in kind.instances})


def test_a_meta_model_captures_from_inputs_on_another_device():
    """A meta model's capture takes its inputs' shapes only: token ids on the CPU capture the
    graph that meta ids do (some torch versions refuse an embedding of CPU ids into meta weights)."""
    model, (meta_ids,) = build_model("llama-tiny")
    cpu_ids = torch.zeros(meta_ids.shape, dtype=meta_ids.dtype)
    assert capture(model, (cpu_ids,)).fingerprint() == capture(model, (meta_ids,)).fingerprint()
