"""Named model sizes and the model spec language used wherever a model is named on the command line.

    gpt3-175b                                      a preset
    gpt:layers=48,hidden=8192,heads=64,seq=2048    a family with its config keys (others default)
    gpt3-1.3b:layers=2,seq=128                     a preset with some keys replaced
    llama:layers=2,hidden=256,heads=8,kv_heads=2   mlp:layers=4,hidden=512
    moe:layers=2,hidden=64,heads=4,experts=4,top_k=2,expert_ffn=32
    llama-70b:seq=131072                           a long-sequence variant of a preset

GPT-3 sizes follow the paper's table (Brown et al. 2020) with Megatron's vocabulary of 51200 and
sequence 2048; two rows of the paper are not realizable as printed and follow Megatron instead:
gpt3-1.3b uses 16 heads (2048 is not 24 x 128) and gpt3-13b hidden 5120 (the paper prints 5140).
Llama sizes are Llama 2's (sequence 4096, vocabulary 32000, grouped-query attention at 70B).
Mixture-of-experts presets follow the published HuggingFace configs (config.json) of
mistralai/Mixtral-8x7B-v0.1, mistral-community/Mixtral-8x22B-v0.1, Qwen/Qwen3-30B-A3B,
Qwen/Qwen3-235B-A22B and deepseek-ai/DeepSeek-V3 (its inference/configs/config_671B.json too),
with a training sequence of 4096 (their context windows are longer: `:seq=` sets it).
Qwen3's unused dense `intermediate_size` is not built; DeepSeek-V3's router is built as a
softmax router (its sigmoid scores, group-limited choice and bias differ in no shape or FLOP that
matters here) and its multi-token-prediction module is left out.
"""

from __future__ import annotations

import dataclasses

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.models.gpt import GPT, GPTConfig
from autopar.models.llama import Llama, LlamaConfig
from autopar.models.mlp import MLP, MLPConfig
from autopar.models.moe import MoEConfig, MoEModel
from autopar.models.sizes import MAX_SIZE

FAMILIES = {"gpt": (GPTConfig, GPT), "llama": (LlamaConfig, Llama), "mlp": (MLPConfig, MLP),
            "moe": (MoEConfig, MoEModel)}


def _gpt3(layers, hidden, heads):
    return ("gpt", {"layers": layers, "hidden": hidden, "heads": heads, "seq": 2048, "vocab": 51200})


PRESETS: dict[str, tuple[str, dict]] = {
    "gpt3-125m": _gpt3(12, 768, 12),
    "gpt3-350m": _gpt3(24, 1024, 16),
    "gpt3-760m": _gpt3(24, 1536, 16),
    "gpt3-1.3b": _gpt3(24, 2048, 16),
    "gpt3-2.7b": _gpt3(32, 2560, 32),
    "gpt3-6.7b": _gpt3(32, 4096, 32),
    "gpt3-13b": _gpt3(40, 5120, 40),
    "gpt3-175b": _gpt3(96, 12288, 96),
    "gpt-tiny": ("gpt", {"layers": 2, "hidden": 64, "heads": 4, "seq": 32, "vocab": 256}),
    "llama-7b": ("llama", {"layers": 32, "hidden": 4096, "heads": 32, "ffn": 11008}),
    "llama-13b": ("llama", {"layers": 40, "hidden": 5120, "heads": 40, "ffn": 13824}),
    "llama-70b": ("llama", {"layers": 80, "hidden": 8192, "heads": 64, "kv_heads": 8,
                            "ffn": 28672}),
    "llama-tiny": ("llama", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seq": 32,
                             "vocab": 256}),
    "mixtral-8x7b": ("moe", {"layers": 32, "hidden": 4096, "heads": 32, "kv_heads": 8,
                             "vocab": 32000, "experts": 8, "top_k": 2, "expert_ffn": 14336}),
    "mixtral-8x22b": ("moe", {"layers": 56, "hidden": 6144, "heads": 48, "kv_heads": 8,
                              "vocab": 32000, "experts": 8, "top_k": 2, "expert_ffn": 16384}),
    "qwen3-30b-a3b": ("moe", {"layers": 48, "hidden": 2048, "heads": 32, "kv_heads": 4,
                              "head_dim": 128, "vocab": 151936, "norm_eps": 1e-6, "qk_norm": True,
                              "experts": 128, "top_k": 8, "expert_ffn": 768}),
    "qwen3-235b-a22b": ("moe", {"layers": 94, "hidden": 4096, "heads": 64, "kv_heads": 4,
                                "head_dim": 128, "vocab": 151936, "norm_eps": 1e-6,
                                "qk_norm": True, "experts": 128, "top_k": 8, "expert_ffn": 1536}),
    "deepseek-v3": ("moe", {"layers": 61, "hidden": 7168, "heads": 128, "ffn": 18432,
                            "vocab": 129280, "rope_theta": 10000.0, "norm_eps": 1e-6,
                            "experts": 256, "top_k": 8, "expert_ffn": 2048, "shared_experts": 1,
                            "dense_layers": 3, "q_lora": 1536, "kv_lora": 512, "qk_nope": 128,
                            "qk_rope": 64, "v_head": 128}),
    "moe-tiny": ("moe", {"layers": 2, "hidden": 64, "heads": 4, "kv_heads": 2, "seq": 32,
                         "vocab": 256, "experts": 4, "top_k": 2, "expert_ffn": 32}),
    "mlp": ("mlp", {"layers": 4, "hidden": 1024}),
    "mlp-tiny": ("mlp", {"layers": 2, "hidden": 32}),
}


def parse_spec(spec: str, **overrides) -> GPTConfig | LlamaConfig | MLPConfig | MoEConfig:
    """The config a model spec names; keyword overrides win over the spec's keys."""
    name, _, keys = spec.strip().partition(":")
    if name in PRESETS:
        family, values = PRESETS[name]
        values = dict(values)
    elif name in FAMILIES:
        family, values = name, {}
    else:
        raise AutoparError(f"unknown model {name!r}: expected a preset ({', '.join(PRESETS)}) or a "
                           f"family with keys, e.g. 'gpt:layers=48,hidden=8192,heads=64,seq=2048'")
    config_cls = FAMILIES[family][0]
    fields = {f.name: f for f in dataclasses.fields(config_cls)}
    for item in filter(None, (part.strip() for part in keys.split(","))):
        key, eq, text = item.partition("=")
        if not eq:
            raise AutoparError(f"model spec {spec!r}: {item!r} is not key=value")
        values[key.strip()] = _parse_value(spec, key.strip(), text.strip(), fields)
    for key, value in overrides.items():
        _check_key(spec, key, fields)
        values[key] = value
    return config_cls(**values)


def _check_key(spec: str, key: str, fields: dict) -> None:
    if key not in fields:
        raise AutoparError(f"model spec {spec!r}: unknown key {key!r}; valid keys are "
                           f"{', '.join(fields)}")


def _parse_value(spec: str, key: str, text: str, fields: dict):
    _check_key(spec, key, fields)
    kind = fields[key].type
    try:
        if kind == "bool":
            if text.lower() not in ("true", "false", "1", "0"):
                raise ValueError(text)
            return text.lower() in ("true", "1")
        return float(text) if kind == "float" else int(text)
    except ValueError:
        expected = {"bool": "true or false", "float": "a number"}.get(kind, "an integer")
        raise AutoparError(f"model spec {spec!r}: {key}={text!r} is not {expected}") from None


def build_model(spec: str, *, device: str | torch.device = "meta", batch: int = 1, seed: int = 0,
                dtype: torch.dtype | None = None, **overrides) -> tuple[nn.Module, tuple]:
    """Build the model a spec names and example inputs for it.

    On "meta" (the default) nothing is allocated, so even gpt3-175b builds instantly; on a real
    device the weights are `torch.manual_seed(seed); model.init_weights()` (the global RNG is
    left untouched) and the example inputs are random but deterministic too. Keyword overrides
    replace config keys, e.g. `build_model("gpt3-175b", layers=2)`.
    """
    if not isinstance(batch, int) or not 1 <= batch <= MAX_SIZE:
        raise AutoparError(f"batch={batch!r} must be an integer from 1 to {MAX_SIZE}")
    config = parse_spec(spec, **overrides)
    model_cls = next(m for c, m in FAMILIES.values() if isinstance(config, c))
    device = torch.device(device)
    with torch.random.fork_rng(devices=[]):
        with device:
            model = model_cls(config)
        # Seeding right before init_weights makes the weights a function of the seed alone, so
        # a model built on meta, materialized with to_empty() and initialized the same way
        # (torch.manual_seed(seed); model.init_weights()) equals this one.
        torch.manual_seed(seed)
        model.init_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model, example_inputs(config, batch=batch, device=device, seed=seed,
                                 dtype=dtype or torch.float32)


def example_inputs(config, *, batch: int, device: torch.device, seed: int = 0,
                   dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor]:
    """Inputs of the model's forward: token ids for language models, features for the MLP."""
    if isinstance(config, MLPConfig):
        shape, make = (batch, config.hidden), dict(dtype=dtype)
    else:
        shape, make = (batch, config.seq), dict(dtype=torch.int64)
    if device.type == "meta":
        return (torch.empty(shape, device=device, **make),)
    generator = torch.Generator().manual_seed(seed)
    if isinstance(config, MLPConfig):
        values = torch.randn(shape, generator=generator, dtype=dtype)
    else:
        values = torch.randint(0, config.vocab, shape, generator=generator)
    return (values.to(device),)
