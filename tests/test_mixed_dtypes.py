"""What a 16-bit stage holds in fp32, and that the estimator prices those values at 4 bytes.

A model's own casts (an RMSNorm's variance in fp32), autocast's fp32 ops (a GPU's layer_norm) and
the promotions that follow keep values in fp32 under bf16 mixed precision; a cast to the dtype of
the weight that reads it follows the weight into 16 bits (autopar.mixed_dtypes)."""

from __future__ import annotations

import torch
from torch import nn

from autopar.cost.layout import infer_layout
from autopar.mixed_dtypes import mixed_dtypes, wide_values
from autopar.tracer import capture


class _Norms(nn.Module):
    """An RMSNorm that returns fp32 unless a weight reads it, then a layer norm: one module, so
    that no unit boundary casts what crosses it."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(8))
        self.inner = nn.Parameter(torch.randn(8, 8))
        self.outer = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        wide = x.to(torch.float32)
        wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + 1e-6)
        # read with the scale: follows it into 16 bits; the residual keeps it in fp32
        normed = self.scale * wide.to(torch.float32)
        hidden = nn.functional.linear(normed, self.inner) + wide
        return nn.functional.linear(nn.functional.layer_norm(hidden, (8,)), self.outer)


class _Handed(nn.Module):
    """A value made in fp32 in one module and read only by another, which FSDP2 wraps."""

    def __init__(self):
        super().__init__()
        self.first = nn.Linear(8, 8)
        self.second = nn.Linear(8, 8)

    def forward(self, x):
        return self.second(self.first(x).float() * 2)


def _named(graph, wide: dict) -> dict[str, str]:
    """target -> dtype of the activations kept wide, by their op."""
    return {node.target: wide[node.name] for node in graph.nodes if node.name in wide
            and node.role.value == "activation"}


def test_values_a_stage_keeps_in_fp32_follow_the_devices_autocast():
    graph = capture(_Norms(), (torch.randn(2, 4, 8),))
    cpu, cuda = (_named(graph, wide_values(graph, device)) for device in ("cpu", "cuda"))
    # the model's own fp32 values, and the sum of one with a 16-bit linear's output
    for found in (cpu, cuda):
        assert found["aten.rsqrt.default"] == "float32"
        assert found["aten.add.Tensor"] == "float32"
        assert "aten.linear.default" not in found
    # the cast read with the scale follows the scale's 16 bits: so does the product
    names = {node.name: node for node in graph.nodes}
    product = next(n for n in graph.nodes if n.target == "aten.mul.Tensor"
                   and any(names[i].role.value == "parameter" for i in n.inputs))
    assert product.name not in wide_values(graph, "cpu")
    # a GPU's autocast keeps layer_norm in fp32, a CPU's computes it in 16 bits (no GPU needed)
    assert cuda["aten.layer_norm.default"] == "float32"
    assert "aten.layer_norm.default" not in cpu


def test_the_layout_holds_a_wide_value_at_four_bytes():
    graph = capture(_Norms(), (torch.randn(2, 4, 8),))
    narrow = infer_layout(graph, 1, compute_dtype="bfloat16")
    held = infer_layout(graph, 1, compute_dtype="bfloat16", wide=mixed_dtypes(graph, "cuda"))
    norm = next(n.name for n in graph.nodes if n.target == "aten.layer_norm.default")
    assert held.storage_bytes[norm] == 2 * narrow.storage_bytes[norm]
    linear = next(n.name for n in graph.nodes if n.target == "aten.linear.default")
    assert held.storage_bytes[linear] == narrow.storage_bytes[linear]


def test_a_value_handed_to_a_wrapped_unit_is_held_in_sixteen_bits():
    """FSDP2 casts what a unit it wraps is handed to 16 bits: the fp32 product made in `first`
    is held, and gathered, as the 16-bit copy `second` reads."""
    graph = capture(_Handed(), (torch.randn(2, 4, 8),))
    wide = wide_values(graph, "cpu")
    cast = next(n for n in graph.nodes if n.target == "aten.to.dtype")
    product = next(n for n in graph.nodes if n.target == "aten.mul.Tensor")
    assert wide[cast.name] == "float32"     # read where it is made
    assert product.name not in wide


def test_a_head_tied_to_the_embedding_is_wrapped_alone_in_a_pipeline_stage():
    """In one stage a tied head shares its weight with the embedding and FSDP2 wraps neither; in a
    pipeline they never meet and each is wrapped alone: the last stage hands its head the final
    norm's fp32 output in 16 bits. The head takes its view of that output again and places it
    there, so the view's gradient is reduced in 16 bits too, not at the fp32 original."""
    import pytest

    from autopar.mixed_dtypes import fsdp_units, ties_apart_matter
    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import Architecture

    pytest.importorskip("transformers")
    architecture = Architecture(name="gemma3", model_class="Gemma3ForCausalLM", config_class="Gemma3TextConfig",
                                kind="held out", config=dict(
                                    num_hidden_layers=2, hidden_size=64, num_attention_heads=2,
                                    num_key_value_heads=1, head_dim=32, intermediate_size=128,
                                    max_position_embeddings=64, vocab_size=512))
    ids, _ = architecture.batch(1, torch.Generator().manual_seed(1), 16)
    graph = capture(causal_sdpa(architecture.build()), example_inputs=(ids,))
    assert ties_apart_matter(graph)
    together, apart = fsdp_units(graph)[1], fsdp_units(graph, ties_apart=True)[1]
    assert together < apart and len(apart - together) == 2       # the embedding and the head
    read = next(node for node in graph.nodes if node.target == "aten.linear.default"
                and "p_lm_head_weight" in node.inputs).inputs[0]
    (held, made, _), (held_apart, made_apart, _) = (mixed_dtypes(graph, "cpu", ties_apart=flag) for flag in (False, True))
    assert held[read] == made[read] == "float32"
    assert read not in held_apart and read not in made_apart


class _TwoReaders(nn.Module):
    """A layer norm's output read by two projections, as q and k read one (a GPU's autocast keeps
    layer_norm in fp32)."""

    def __init__(self):
        super().__init__()
        self.first = nn.Parameter(torch.randn(8, 8))
        self.second = nn.Parameter(torch.randn(8, 8))

    def forward(self, x):
        normed = nn.functional.layer_norm(x, (8,))
        return nn.functional.linear(normed, self.first) * nn.functional.linear(normed, self.second)


def test_each_op_autocast_runs_in_sixteen_bits_keeps_its_own_copy_of_a_wide_input():
    """Autocast casts a wide input for each op it runs in 16 bits (it caches the casts of weights
    only), and the op keeps that copy for its backward, not the fp32 value: two projections of
    one fp32 layer_norm output keep two 16-bit copies (2 x 2 bytes an element, not 4)."""
    graph = capture(_TwoReaders(), (torch.randn(2, 4, 8),))
    layout = infer_layout(graph, 1, compute_dtype="bfloat16", wide=mixed_dtypes(graph, "cuda"))
    norm = next(n.name for n in graph.nodes if n.target == "aten.layer_norm.default")
    linears = [n for n in layout.nodes if n.name.startswith("linear")]
    copies = [key for node in linears for key in node.saved]
    assert copies == [f"{norm}:16:{node.name}" for node in linears]
    assert all(layout.storage_bytes[key] == layout.storage_bytes[norm] / 2 for key in copies)
    assert all(norm not in node.saved for node in layout.nodes)
