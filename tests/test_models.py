"""Model presets and the spec language: sizes, errors, deterministic real weights."""

import math

import pytest
import torch

from autopar import AutoparError
from autopar.models import PRESETS, GPTConfig, build_model, lm_loss, parse_spec


def _params(model) -> int:
    return sum(p.numel() for p in model.parameters())


PUBLISHED = {"gpt3-175b": 175.24e9, "llama-7b": 6_738_415_616, "llama-70b": 68_976_648_192}


@pytest.mark.parametrize("name", sorted(set(PRESETS) - set(PUBLISHED)))
def test_every_preset_builds_on_meta(name):
    model, (inputs,) = build_model(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert inputs.device.type == "meta"


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_preset_sizes_match_published_counts(name):
    # GPT-3 175B (plus a 51200-token untied head), Llama 2 7B and 70B, all on meta.
    model, (inputs,) = build_model(name)
    assert all(p.device.type == "meta" for p in model.parameters())
    assert inputs.device.type == "meta"
    assert math.isclose(_params(model), PUBLISHED[name], rel_tol=1e-3)


def test_gpt_spec_keys_and_overrides():
    config = parse_spec("gpt:layers=48,hidden=8192,heads=64,seq=2048,vocab=51200")
    assert (config.layers, config.hidden, config.heads, config.seq, config.vocab) == (
        48, 8192, 64, 2048, 51200)
    assert config.ffn == 4 * 8192
    assert parse_spec("gpt3-175b:layers=2", seq=64).layers == 2
    assert parse_spec("gpt3-175b", seq=64).seq == 64
    assert parse_spec("gpt:fused_qkv=true,dropout=0.1").fused_qkv is True
    assert parse_spec("llama:layers=2,hidden=64,heads=4,kv_heads=2").kv_heads == 2
    assert parse_spec("mlp:layers=3").layers == 3


@pytest.mark.parametrize("spec, message", [
    ("gpt5-10t", "unknown model 'gpt5-10t'"),
    ("gpt:layers=2,depth=3", "unknown key 'depth'"),
    ("gpt:layers=two", "is not an integer"),
    ("gpt:layers", "is not key=value"),
    ("gpt:hidden=100,heads=12", "not divisible by heads=12"),
    ("llama:heads=8,kv_heads=3,hidden=64", "not a multiple of kv_heads=3"),
])
def test_bad_specs_name_the_problem(spec, message):
    with pytest.raises(AutoparError, match=message):
        parse_spec(spec)


def test_unknown_override_is_rejected():
    with pytest.raises(AutoparError, match="unknown key 'width'"):
        build_model("gpt-tiny", width=3)


@pytest.mark.parametrize("spec", ["gpt-tiny", "llama-tiny", "mlp-tiny",
                                  "gpt:layers=1,hidden=32,heads=2,seq=8,vocab=64,fused_qkv=true"])
def test_real_weights_are_deterministic_and_leave_global_rng_alone(spec):
    state = torch.random.get_rng_state()
    first, (inputs,) = build_model(spec, device="cpu", batch=2, seed=3)
    second, (same_inputs,) = build_model(spec, device="cpu", batch=2, seed=3)
    other, _ = build_model(spec, device="cpu", batch=2, seed=4)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert torch.equal(inputs, same_inputs)
    for a, b, c in zip(first.parameters(), second.parameters(), other.parameters()):
        assert torch.equal(a, b)
    assert not all(torch.equal(a, c) for a, c in zip(first.parameters(), other.parameters()))
    with torch.no_grad():
        assert torch.equal(first(inputs), second(inputs))


def test_language_models_give_logits_and_a_sensible_initial_loss():
    for spec in ("gpt-tiny", "llama-tiny"):
        model, (ids,) = build_model(spec, device="cpu", batch=2)
        logits = model(ids)
        assert logits.shape == (2, model.config.seq, model.config.vocab)
        loss = lm_loss(logits[:, :-1], ids[:, 1:])
        # Small initial weights give nearly uniform predictions: loss close to ln(vocab).
        assert abs(loss.item() - math.log(model.config.vocab)) < 0.5
        loss.backward()


def test_meta_model_materialized_and_initialized_equals_a_cpu_build():
    for spec in ("gpt-tiny", "llama-tiny"):
        meta_model, _ = build_model(spec)
        real, _ = build_model(spec, device="cpu", seed=5)
        meta_model.to_empty(device="cpu")
        torch.manual_seed(5)
        meta_model.init_weights()
        for (name, a), b in zip(meta_model.state_dict().items(), real.state_dict().values()):
            assert torch.equal(a, b), name
        rope = getattr(real, "rope_cos", None)
        if rope is not None:
            assert torch.equal(meta_model.rope_cos, rope)


def test_gqa_llama_repeats_kv_heads():
    model, (ids,) = build_model("llama-tiny", device="cpu")
    assert model.layers[0].attn.wk.weight.shape == (2 * 16, 64)
    assert model(ids).shape == (1, 32, 256)


def test_dropout_defaults_to_zero():
    assert GPTConfig().dropout == 0.0


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the grouped GEMM runs on CUDA devices")
def test_experts_grouped_gemm_on_a_gpu_equals_a_matmul_per_expert():
    """On a GPU the experts' matmuls are one grouped GEMM, forward and backward: the same as one
    matmul per expert, an expert no row chose included (its weight's gradient is zero)."""
    from autopar.models.experts import _one_grouped_gemm, grouped_mm

    g = torch.Generator(device="cuda").manual_seed(0)
    rows = torch.randn(64, 128, device="cuda", dtype=torch.bfloat16, generator=g, requires_grad=True)
    weight = torch.randn(4, 128, 256, device="cuda", dtype=torch.bfloat16, generator=g,
                         requires_grad=True)
    ends = torch.tensor([10, 10, 40, 64], device="cuda")
    assert _one_grouped_gemm(rows, weight)
    grouped = grouped_mm(rows, weight, ends)
    grad = torch.randn(grouped.shape, device="cuda", dtype=torch.bfloat16, generator=g)
    grouped.backward(grad)
    expected_rows, expected_weight = rows.grad.clone(), weight.grad.clone()
    rows.grad = weight.grad = None
    spans = [(0, 10, 0), (10, 40, 2), (40, 64, 3)]
    looped = torch.cat([rows[a:b] @ weight[e] for a, b, e in spans])
    looped.backward(grad)
    assert torch.allclose(grouped.float(), looped.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(expected_rows.float(), rows.grad.float(), rtol=1e-2, atol=1e-2)
    assert torch.allclose(expected_weight.float(), weight.grad.float(), rtol=1e-2, atol=1e-1)
    assert not expected_weight[1].any()
