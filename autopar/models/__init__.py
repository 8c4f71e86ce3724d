"""Model presets: a hand-written GPT, a Llama-style decoder, a mixture-of-experts decoder and a
residual MLP, and the spec language
(`build_model("gpt3-175b")`, `build_model("gpt:layers=2,hidden=64,heads=4,seq=32,vocab=256")`)."""

from autopar.models.gpt import GPT, GPTBlock, GPTConfig, lm_loss
from autopar.models.llama import Llama, LlamaBlock, LlamaConfig
from autopar.models.mlp import MLP, MLPBlock, MLPConfig
from autopar.models.moe import MoEBlock, MoEConfig, MoEModel
from autopar.models.presets import FAMILIES, PRESETS, build_model, example_inputs, parse_spec

__all__ = ["GPT", "GPTBlock", "GPTConfig", "lm_loss", "Llama", "LlamaBlock", "LlamaConfig", "MLP",
           "MLPBlock", "MLPConfig", "MoEBlock", "MoEConfig", "MoEModel", "FAMILIES", "PRESETS", "build_model", "example_inputs",
           "parse_spec"]
