"""Tiny HuggingFace models of many architectures, built the same way everywhere they are needed.

    from autopar.models.hf_zoo import ARCHITECTURES, resolve
    arch = ARCHITECTURES["llama"]
    classes = resolve(["llama"])          # before forking: transformers imports models lazily
    model = arch.build(classes["llama"])  # seeded, in eval mode (dropout off), no KV cache
    *inputs, targets = arch.batch(batch=8, generator=torch.Generator().manual_seed(1))

Every model has 4 layers, hidden size 64, 4 heads, a vocabulary of 128 and sequences of 16, and
covers one kind the conformance matrix needs: learned, rotary or ALiBi positions; multi-head,
grouped-query, multi-query or multi-head latent attention; tied or untied embeddings; decoder-only,
encoder-only (masked LM) or encoder-decoder; dense or mixture-of-experts MLPs; and one image
classifier (a ViT: 32x32 images in 8x8 patches, 10 classes). `config.use_cache=False` makes the
models return logits alone, so no extra keyword is needed to call them. Needs `transformers`.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch

from autopar.errors import AutoparError

LAYERS, HIDDEN, HEADS, VOCAB, SEQ, FFN = 4, 64, 4, 128, 16, 128
CHANNELS, IMAGE, PATCH, CLASSES = 3, 32, 8, 10          # the image classifier's inputs
# every model gets these; token ids inside the vocabulary
COMMON = dict(vocab_size=VOCAB, use_cache=False, bos_token_id=0, eos_token_id=1, pad_token_id=2,
              tie_word_embeddings=None)


@dataclass(frozen=True, slots=True)
class Architecture:
    name: str
    model_class: str              # attribute of the transformers package
    config_class: str
    kind: str                     # what it covers, for the conformance table
    config: dict                  # keyword arguments of the config, beyond COMMON
    encoder_decoder: bool = False
    images: bool = False          # takes pixel_values and class labels instead of token ids
    moe: bool = False             # a mixture of experts: expert parallelism applies

    @property
    def sliding_window(self) -> bool:
        """Whether some layer attends over a window shorter than the sequence."""
        return (self.config.get("sliding_window") or SEQ) < SEQ

    def build(self, model_class=None) -> torch.nn.Module:
        """The model from seed 0, in eval mode. `model_class` from `resolve` saves the import."""
        import transformers

        model_class = model_class or getattr(transformers, self.model_class)
        options = {key: value for key, value in {**COMMON, **self.config}.items() if value is not None}
        config = getattr(transformers, self.config_class)(**options)
        torch.manual_seed(0)
        return model_class(config).eval()

    def batch(self, batch: int, generator: torch.Generator, seq: int | None = None) -> tuple[torch.Tensor, ...]:
        """(*inputs, targets) for one step: token ids and next-token (or masked-token) targets,
        sequences of `seq` (default SEQ).
        An encoder-decoder takes (input_ids, attention_mask, decoder_input_ids), its forward's
        positional order."""
        if self.images:
            pixels = torch.randn(batch, CHANNELS, IMAGE, IMAGE, generator=generator)
            return pixels, torch.randint(0, CLASSES, (batch,), generator=generator)
        ids = torch.randint(3, VOCAB, (batch, seq or SEQ), generator=generator)
        targets = torch.randint(3, VOCAB, (batch, seq or SEQ), generator=generator)
        if not self.encoder_decoder:
            return ids, targets
        decoder_ids = torch.randint(3, VOCAB, (batch, seq or SEQ), generator=generator)
        return ids, torch.ones(batch, seq or SEQ, dtype=torch.long), decoder_ids, targets


def loss_fn(outputs, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of every position's logits against its target (of each image's logits
    against its class)."""
    return torch.nn.functional.cross_entropy(outputs.logits.flatten(0, -2), targets.flatten())


def _decoder(**extra) -> dict:
    return dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                intermediate_size=FFN, max_position_embeddings=SEQ, **extra)


_ARCHS = [
    Architecture("gpt2", "GPT2LMHeadModel", "GPT2Config", "learned positions, MHA, tied, Conv1D",
                 dict(n_layer=LAYERS, n_embd=HIDDEN, n_head=HEADS, n_positions=SEQ, n_inner=FFN)),
    Architecture("llama", "LlamaForCausalLM", "LlamaConfig", "RoPE, GQA, untied",
                 _decoder(num_key_value_heads=2)),
    Architecture("opt", "OPTForCausalLM", "OPTConfig", "learned positions (offset 2), MHA, tied",
                 dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      ffn_dim=FFN, word_embed_proj_dim=HIDDEN, max_position_embeddings=SEQ)),
    Architecture("qwen2", "Qwen2ForCausalLM", "Qwen2Config", "RoPE, GQA, qkv bias",
                 _decoder(num_key_value_heads=2)),
    Architecture("mistral", "MistralForCausalLM", "MistralConfig", "RoPE, GQA, sliding window",
                 _decoder(num_key_value_heads=2, sliding_window=8)),
    Architecture("gpt-neox", "GPTNeoXForCausalLM", "GPTNeoXConfig",
                 "partial RoPE, fused qkv, parallel residual",
                 _decoder(rotary_pct=0.5)),
    Architecture("phi", "PhiForCausalLM", "PhiConfig", "partial RoPE, parallel attention/MLP",
                 _decoder(partial_rotary_factor=0.5)),
    Architecture("falcon", "FalconForCausalLM", "FalconConfig", "RoPE, MQA, tied, x @ W.T linears",
                 dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      multi_query=True, alibi=False, max_position_embeddings=SEQ)),
    Architecture("bloom", "BloomForCausalLM", "BloomConfig", "ALiBi, fused qkv, tied",
                 dict(n_layer=LAYERS, hidden_size=HIDDEN, n_head=HEADS)),
    Architecture("gemma", "GemmaForCausalLM", "GemmaConfig", "RoPE, MQA, tied, GeGLU",
                 _decoder(num_key_value_heads=1, head_dim=16)),
    Architecture("gemma2", "Gemma2ForCausalLM", "Gemma2Config",
                 "soft-capped attention scores and logits, sliding/full layers, GQA",
                 _decoder(num_key_value_heads=2, head_dim=16, sliding_window=8,
                          query_pre_attn_scalar=1, attn_logit_softcapping=0.1,
                          final_logit_softcapping=5.0)),
    Architecture("bert-mlm", "BertForMaskedLM", "BertConfig", "encoder-only masked LM, tied",
                 dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      intermediate_size=FFN, max_position_embeddings=SEQ)),
    Architecture("t5", "T5ForConditionalGeneration", "T5Config",
                 "encoder-decoder, relative position bias",
                 # 4 layers a stack: T5's first block (which holds the position bias) differs from
                 # the rest, and blocks are found by repetition
                 dict(num_layers=LAYERS, num_decoder_layers=LAYERS, d_model=HIDDEN,
                      d_kv=HIDDEN // HEADS, d_ff=FFN, num_heads=HEADS, decoder_start_token_id=0),
                 encoder_decoder=True),
    Architecture("mixtral", "MixtralForCausalLM", "MixtralConfig", "MoE (4 experts, top 2), GQA",
                 _decoder(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
                 moe=True),
    Architecture("qwen2-moe", "Qwen2MoeForCausalLM", "Qwen2MoeConfig",
                 "MoE (4 experts, top 2) with a shared expert",
                 _decoder(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=FFN // 2, shared_expert_intermediate_size=FFN),
                 moe=True),
    Architecture("olmoe", "OlmoeForCausalLM", "OlmoeConfig", "MoE (4 experts, top 2), q/k RMSNorm",
                 _decoder(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2),
                 moe=True),
    Architecture("qwen3-moe", "Qwen3MoeForCausalLM", "Qwen3MoeConfig",
                 "MoE (4 experts, top 2), per-head q/k norm",
                 _decoder(num_key_value_heads=2, num_experts=4, num_experts_per_tok=2,
                          moe_intermediate_size=FFN // 2, head_dim=HIDDEN // HEADS),
                 moe=True),
    Architecture("gpt-oss", "GptOssForCausalLM", "GptOssConfig",
                 "MoE (4 experts, top 2) with biases, attention sinks, sliding/full layers",
                 _decoder(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
                          head_dim=HIDDEN // HEADS, sliding_window=8,
                          layer_types=["sliding_attention", "full_attention"] * (LAYERS // 2),
                          rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
                 moe=True),
    Architecture("deepseek-v3", "DeepseekV3ForCausalLM", "DeepseekV3Config",
                 "MoE (4 routed experts, top 2, a shared one), MLA attention, a dense first layer",
                 _decoder(num_key_value_heads=HEADS, n_routed_experts=4, num_experts_per_tok=2,
                          n_shared_experts=1, moe_intermediate_size=FFN // 2, first_k_dense_replace=1,
                          n_group=1, topk_group=1, q_lora_rank=32, kv_lora_rank=16,
                          qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=16),
                 moe=True),
    Architecture("phimoe", "PhimoeForCausalLM", "PhimoeConfig",
                 "MoE (4 experts, top 2) picked one at a time (sparsemixer), no-grad routing",
                 _decoder(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2),
                 moe=True),
    Architecture("llama4", "Llama4ForCausalLM", "Llama4TextConfig",
                 "MoE (4 experts, top 1, a shared one) run on every token, layers without RoPE",
                 _decoder(num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=1,
                          intermediate_size_mlp=FFN, head_dim=HIDDEN // HEADS,
                          interleave_moe_layer_step=1, no_rope_layers=[1, 1, 1, 0]),
                 moe=True),
    Architecture("olmo2", "Olmo2ForCausalLM", "Olmo2Config",
                 "RoPE, q/k RMSNorm over the whole projection, norms after attention and MLP",
                 _decoder(num_key_value_heads=2)),
    Architecture("vit", "ViTForImageClassification", "ViTConfig",
                 "image classifier: Conv2d patch embedding, class token, learned positions",
                 dict(num_hidden_layers=LAYERS, hidden_size=HIDDEN, num_attention_heads=HEADS,
                      intermediate_size=FFN, image_size=IMAGE, patch_size=PATCH,
                      num_channels=CHANNELS, num_labels=CLASSES),
                 images=True),
]
ARCHITECTURES: dict[str, Architecture] = {arch.name: arch for arch in _ARCHS}


def resolve(names) -> dict[str, Callable]:
    """The transformers model class of each architecture. Call it before forking ranks: each lazy
    import of a model's module costs seconds in every rank that does it on its own."""
    import transformers

    unknown = [name for name in names if name not in ARCHITECTURES]
    if unknown:
        raise AutoparError(f"unknown architecture(s) {unknown}; known: {sorted(ARCHITECTURES)}")
    return {name: getattr(transformers, ARCHITECTURES[name].model_class) for name in names}
