"""Tiny HuggingFace models of many architectures, for the pipeline tests: 4 layers, hidden 64,
4 heads, vocabulary 128, random weights from one seed, `.eval()` so dropout is off.

Decoder-only models with rotary, ALiBi or learned positions, multi-query and grouped-query
attention, tied and untied embeddings, an encoder-only masked LM, an encoder-decoder and a
mixture of experts. Each is called as `model(*inputs)` with `use_cache=False` where the model has a
cache; the encoder-decoder takes (input_ids, decoder_input_ids) positionally through `Seq2Seq`.
"""

from __future__ import annotations

import torch
from torch import nn

VOCAB, HIDDEN, HEADS, LAYERS, SEQ = 128, 64, 4, 4, 16


def _configs(transformers) -> dict:
    """name -> (model class, config, whether the model takes use_cache)."""
    t = transformers
    common = dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS,
                  num_hidden_layers=LAYERS, intermediate_size=2 * HIDDEN,
                  max_position_embeddings=64, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    return {
        "gpt2": (t.GPT2LMHeadModel, t.GPT2Config(
            n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, vocab_size=VOCAB, n_positions=64,
            bos_token_id=0, eos_token_id=0), True),
        "llama": (t.LlamaForCausalLM, t.LlamaConfig(num_key_value_heads=2, **common), True),
        "opt": (t.OPTForCausalLM, t.OPTConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
            ffn_dim=2 * HIDDEN, max_position_embeddings=64, word_embed_proj_dim=HIDDEN,
            bos_token_id=0, eos_token_id=0, pad_token_id=0), True),
        "qwen2": (t.Qwen2ForCausalLM, t.Qwen2Config(num_key_value_heads=2, **common), True),
        "mistral": (t.MistralForCausalLM, t.MistralConfig(num_key_value_heads=2, **common), True),
        "gpt-neox": (t.GPTNeoXForCausalLM, t.GPTNeoXConfig(**common), True),
        "phi": (t.PhiForCausalLM, t.PhiConfig(**common), True),
        "falcon": (t.FalconForCausalLM, t.FalconConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
            bos_token_id=0, eos_token_id=0), True),
        "bloom": (t.BloomForCausalLM, t.BloomConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, n_head=HEADS, n_layer=LAYERS,
            bos_token_id=0, eos_token_id=0, pad_token_id=0), True),
        "gemma": (t.GemmaForCausalLM, t.GemmaConfig(num_key_value_heads=1, head_dim=16, **common), True),
        "bert-mlm": (t.BertForMaskedLM, t.BertConfig(
            vocab_size=VOCAB, hidden_size=HIDDEN, num_attention_heads=HEADS, num_hidden_layers=LAYERS,
            intermediate_size=2 * HIDDEN, max_position_embeddings=64, pad_token_id=0), False),
        "t5": (t.T5ForConditionalGeneration, t.T5Config(
            vocab_size=VOCAB, d_model=HIDDEN, d_kv=HIDDEN // HEADS, d_ff=2 * HIDDEN, num_heads=HEADS,
            num_layers=LAYERS, decoder_start_token_id=0,
            pad_token_id=0, eos_token_id=1), True),
        "mixtral": (t.MixtralForCausalLM, t.MixtralConfig(
            num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, **common), True),
    }


ARCHITECTURES = ("gpt2", "llama", "opt", "qwen2", "mistral", "gpt-neox", "phi", "falcon", "bloom",
                 "gemma", "bert-mlm", "t5", "mixtral")


class Seq2Seq(nn.Module):
    """An encoder-decoder called with (input_ids, decoder_input_ids) positionally."""

    def __init__(self, model: nn.Module):
        super().__init__()
        self.model = model

    def forward(self, input_ids, decoder_input_ids):
        return self.model(input_ids=input_ids, decoder_input_ids=decoder_input_ids, use_cache=False)


def model_classes(transformers) -> dict:
    """Resolve every class now (transformers imports a model's module on first use: do it once,
    before forking ranks)."""
    return {name: _configs(transformers)[name] for name in ARCHITECTURES}


def build(name: str, classes: dict, seed: int = 0) -> tuple[nn.Module, dict]:
    """The model (eval mode, same weights for the same seed) and the keyword arguments to call it with."""
    cls, config, cached = classes[name]
    torch.manual_seed(seed)
    model = cls(config).eval()
    if name == "t5":
        return Seq2Seq(model).eval(), {}
    return model, ({"use_cache": False} if cached else {})


def inputs(name: str, batch: int, seed: int = 1) -> tuple[torch.Tensor, ...]:
    """(model inputs..., targets) for one batch."""
    generator = torch.Generator().manual_seed(seed)
    draws = 3 if name == "t5" else 2
    return tuple(torch.randint(1, VOCAB, (batch, SEQ), generator=generator) for _ in range(draws))


def loss_fn(outputs, targets):
    return nn.functional.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())
