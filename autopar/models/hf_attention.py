"""HuggingFace models whose attention context parallelism can split.

transformers builds an explicit attention mask whenever torch.export traces a model, even for
plain causal attention (it skips the mask, and lets scaled_dot_product_attention apply
`is_causal=True`, only when it is not tracing and there is no padding). A mask built for a rank's
own tokens is not the mask of the whole sequence, so autopar refuses context parallelism on it.
`causal_sdpa(model)` gives the model what transformers runs eagerly for causal language
modelling: scaled_dot_product_attention with `is_causal=True` and no mask, under an attention
implementation of its own name, and masks of autopar's own ops where a layer needs one, which
the trace keeps whole so that context parallelism knows what they mean and computes them from
every token's true position rather than from one rank's tokens:
- `sliding_window_mask` for a layer that attends over a sliding window (Mistral's, Qwen2's,
  Gemma 3's local layers: transformers hands the window to the attention call);
- `padding_mask` where the model is given an attention_mask ([batch, tokens], 0 at padding):
  it is kept as given, an input that context parallelism splits as it splits the tokens, and
  each layer masks the padded keys with it (packed sequences, told by position ids, are not).
The model then computes what it computed with its own masks. An encoder's attention modules
are not causal (BERT's): there the same implementation attends both ways. Attention that
scaled_dot_product_attention cannot compute, soft-capped scores (Gemma 2) and sinks (GPT-OSS),
runs as autopar's own op (autopar.models.capped_attention), which context parallelism splits too.
"""

from __future__ import annotations

import torch
from torch import nn

from autopar.errors import AutoparError
from autopar.models.capped_attention import attention as capped_attention

IMPLEMENTATION = "autopar_causal_sdpa"
# the same, for models that soft-cap their scores or have sinks (autopar::attention)
CAPPED = "autopar_capped_attention"


def visible_keys(queries: torch.Tensor, keys: torch.Tensor, causal: bool, window: int | None,
                 keep: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys each query attends, from their positions ([q, 1] and [1, k]): the earlier ones
    (and itself) where `causal`, the `window` - 1 before it at most (transformers' sliding window:
    key > query - window), and those `keep` ([batch, k], or None) marks real ([batch, 1, q, k]).
    The one rule of these masks, for one process and for context parallelism's pieces."""
    mask = torch.ones(queries.shape[0], keys.shape[1], dtype=torch.bool, device=queries.device)
    if causal:
        mask = mask & (keys <= queries)
    if window is not None:
        mask = mask & (keys > queries - window)
    return mask if keep is None else mask & keep.bool()[:, None, None, :]


def _positions(queries: int, keys: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions of `queries` queries, the last of `keys` keys: [q, 1] and [1, k]."""
    return (torch.arange(keys - queries, keys, device=device).unsqueeze(1),
            torch.arange(keys, device=device).unsqueeze(0))


@torch.library.custom_op("autopar::sliding_window_mask", mutates_args=())
def sliding_window_mask(queries: int, keys: int, window: int, device: torch.device) -> torch.Tensor:
    """[queries, keys] bool, True where a query attends a key causally within `window`."""
    return visible_keys(*_positions(queries, keys, device), True, window)


@sliding_window_mask.register_fake
def _sliding_window_mask_shape(queries, keys, window, device):
    return torch.empty(queries, keys, dtype=torch.bool, device=device)


@torch.library.custom_op("autopar::padding_mask", mutates_args=())
def padding_mask(keep: torch.Tensor, queries: int, causal: bool, window: int | None) -> torch.Tensor:
    """[batch, 1, queries, keys] bool: which keys each query attends given `keep` ([batch, keys],
    nonzero at real tokens, 0 at padding: a transformers attention_mask), causally or both ways,
    over a sliding window where `window` is given (the queries are the last of the keys)."""
    return visible_keys(*_positions(queries, keep.shape[1], keep.device), causal, window, keep)


@padding_mask.register_fake
def _padding_mask_shape(keep, queries, causal, window):
    return keep.new_empty(keep.shape[0], 1, queries, keep.shape[1], dtype=torch.bool)


def causal_sdpa(model: nn.Module) -> nn.Module:
    """`model` (a transformers PreTrainedModel) with causal scaled_dot_product_attention and no
    traced mask but its sliding windows' (module docstring); returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface

    for name in (IMPLEMENTATION, CAPPED):
        AttentionInterface.register(name, _attention)
        # no mask (sdpa_attention_forward then calls the kernel with is_causal=True), or the
        # attention_mask as given: each layer makes its mask of it (padding_mask)
        AttentionMaskInterface.register(name, _padding_or_none)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise AutoparError(f"{type(model).__name__} is not a transformers model with a choice of "
                           f"attention implementation; causal_sdpa applies to those only")
    name = IMPLEMENTATION
    if getattr(model, "_supports_sdpa", True) is False:
        reason = _why_not_sdpa(model)
        if reason is not None:
            raise AutoparError(f"{type(model).__name__} does not run its attention as "
                               f"scaled_dot_product_attention in transformers ({reason}), so "
                               f"autopar cannot split it over the sequence; use cp=1")
        name = CAPPED       # transformers checks that a model takes SDPA by the name's "sdpa"
    setter(name)
    if getattr(model.config, "_attn_implementation", None) != name:
        raise AutoparError(f"{type(model).__name__} does not take its attention from transformers' "
                           f"AttentionInterface, so its traced mask cannot be left out; use cp=1")
    return model


def _why_not_sdpa(model: nn.Module) -> str | None:
    """What a transformers model that declares no SDPA support computes that neither SDPA nor
    autopar::attention does (None: autopar::attention computes it)."""
    config = model.config
    if getattr(config, "attn_logit_softcapping", None) or \
            any("sink" in name for name, _ in model.named_parameters()):
        return None     # soft-capped scores and sinks: autopar::attention computes them
    return "its class declares no SDPA support"


def _padding_or_none(*args, attention_mask=None, **kwargs):
    """The mask transformers hands every layer: the [batch, tokens] attention_mask (padding) as
    the model was given it, or None."""
    return attention_mask


def _attention(module, query, key, value, attention_mask, sliding_window=None, **kwargs):
    """transformers' scaled_dot_product_attention call, without the traced mask: causal (or both
    ways in an encoder), over the layer's sliding window where it has one, and past the padding
    of an attention_mask."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    where = type(module).__name__
    causal = getattr(module, "is_causal", True)
    if causal and key.shape[2] != query.shape[2]:
        raise AutoparError(f"{where} attends over {key.shape[2]} keys for {query.shape[2]} queries "
                           f"(keys the model adds beyond its tokens, with a mask of its own: "
                           f"DeepSeek-V4's compressed ones); causal_sdpa attends over the tokens "
                           f"alone, which would change what the model computes; use cp=1 and the "
                           f"model's own attention implementation")
    if sliding_window is not None and not causal:
        raise AutoparError(f"{where} attends both ways over a sliding window, which causal_sdpa "
                           f"does not split; use cp=1 and the model's own attention implementation")
    window = None if sliding_window is None else int(sliding_window)
    if attention_mask is not None:
        if attention_mask.dim() != 2 or attention_mask.shape[1] != key.shape[2]:
            raise AutoparError(f"{where} was given an attention mask of shape "
                               f"{list(attention_mask.shape)}; causal_sdpa takes the [batch, tokens] "
                               f"padding mask of the tokens it attends (a 4-D mask is the model's own: "
                               f"use cp=1)")
        mask = padding_mask(attention_mask, query.shape[2], causal, window)
    elif window is not None:
        mask = sliding_window_mask(query.shape[2], key.shape[2], window, query.device)
    else:
        mask = None
    sinks, softcap = kwargs.pop("s_aux", None), kwargs.pop("softcap", None)
    if sinks is None and not softcap:
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)
    return _capped(module, query, key, value, mask, causal, sinks, softcap or 0.0, **kwargs)


def _capped(module, query, key, value, mask, causal, sinks, softcap, *, dropout=0.0,
            scaling=None, **kwargs):
    """Soft-capped scores or sinks (Gemma 2, GPT-OSS) as one autopar::attention call, the keys and
    values of grouped-query attention repeated as transformers repeats them."""
    from transformers.integrations.sdpa_attention import repeat_kv

    if dropout:
        raise AutoparError(f"{type(module).__name__} drops attention weights (dropout={dropout}); "
                           f"autopar's attention with soft-capped scores or sinks has no dropout: "
                           f"set the model's attention_dropout to 0")
    group = query.shape[1] // key.shape[1]
    key, value = repeat_kv(key, group), repeat_kv(value, group)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    out = capped_attention(query, key, value, mask, 0.0, causal and mask is None and query.shape[2] > 1,
                           scale, softcap, sinks)
    return out.transpose(1, 2).contiguous(), None
