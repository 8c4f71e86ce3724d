"""HuggingFace models whose attention context parallelism can split.

transformers builds an explicit attention mask whenever torch.export traces a model, even for
plain causal attention (it skips the mask, and lets scaled_dot_product_attention apply
`is_causal=True`, only when it is not tracing and there is no padding). A mask built for a rank's
own tokens is not the mask of the whole sequence, so autopar refuses context parallelism on it.
`causal_sdpa(model)` gives the model what transformers runs eagerly for unpadded causal language
modelling: scaled_dot_product_attention with `is_causal=True` and no mask, under an attention
implementation of its own name. The model then computes exactly what it computed before for
inputs without an attention_mask (no padding, no packed sequences). A layer that attends over a
sliding window (Mistral's, Qwen2's, Gemma 3's local layers: transformers hands the window to the
attention call) gets its mask from `sliding_window_mask`, an op of autopar's own that the trace
keeps whole, so that context parallelism knows the window and splits it (every rank's queries
against every rank's keys, by their true positions) rather than a mask of one rank's tokens.
An encoder's attention modules are not causal (BERT's): there the same implementation attends
over the whole sequence both ways, what the encoder computes for inputs without padding.
Attention that scaled_dot_product_attention cannot compute (GPT-OSS's sinks) is refused.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.errors import AutoparError

IMPLEMENTATION = "autopar_causal_sdpa"


@torch.library.custom_op("autopar::sliding_window_mask", mutates_args=())
def sliding_window_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """[queries, keys] bool, True where a query attends a key: the queries are the last `queries`
    of `keys` positions, and each sees itself and the `window` - 1 keys before it (transformers'
    sliding window: key > query - window)."""
    query = torch.arange(keys - queries, keys, device=device).unsqueeze(1)
    key = torch.arange(keys, device=device).unsqueeze(0)
    return (key <= query) & (key > query - window)


@sliding_window_mask.register_fake
def _sliding_window_mask_shape(queries, keys, window, device):
    return torch.empty(queries, keys, dtype=torch.bool, device=device)


def causal_sdpa(model: nn.Module) -> nn.Module:
    """`model` (a transformers PreTrainedModel) with causal scaled_dot_product_attention and no
    traced mask but its sliding windows' (module docstring); returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface

    AttentionInterface.register(IMPLEMENTATION, _attention)
    # no mask: sdpa_attention_forward then calls the kernel with is_causal=True
    AttentionMaskInterface.register(IMPLEMENTATION, lambda *args, **kwargs: None)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise AutoparError(f"{type(model).__name__} is not a transformers model with a choice of "
                           f"attention implementation; causal_sdpa applies to those only")
    if getattr(model, "_supports_sdpa", True) is False:
        raise AutoparError(f"{type(model).__name__} does not run its attention as "
                           f"scaled_dot_product_attention in transformers (GPT-OSS's sinks, for "
                           f"one), so autopar cannot split it over the sequence; use cp=1")
    setter(IMPLEMENTATION)
    if getattr(model.config, "_attn_implementation", None) != IMPLEMENTATION:
        raise AutoparError(f"{type(model).__name__} does not take its attention from transformers' "
                           f"AttentionInterface, so its traced mask cannot be left out; use cp=1")
    return model


def _attention(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
    """transformers' scaled_dot_product_attention call, without the traced mask: causal (or both
    ways in an encoder), over the layer's sliding window where it has one."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    where = type(module).__name__
    if kwargs.get("s_aux") is not None:
        raise AutoparError(f"{where} adds attention sinks to the softmax, which "
                           f"scaled_dot_product_attention does not compute, so causal_sdpa would "
                           f"change what the model computes; train it with cp=1 and its own "
                           f"attention implementation")
    if sliding_window is None:
        return sdpa_attention_forward(module, query, key, value, None, **kwargs)
    if not getattr(module, "is_causal", True):
        raise AutoparError(f"{where} attends both ways over a sliding window, which causal_sdpa "
                           f"does not split; use cp=1 and the model's own attention implementation")
    mask = sliding_window_mask(query.shape[2], key.shape[2], int(sliding_window), query.device)
    return sdpa_attention_forward(module, query, key, value, mask, **kwargs)
