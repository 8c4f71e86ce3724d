"""HuggingFace models whose attention context parallelism can split.

transformers builds an explicit attention mask whenever torch.export traces a model, even for
plain causal attention (it skips the mask, and lets scaled_dot_product_attention apply
`is_causal=True`, only when it is not tracing and there is no padding). A mask built for a rank's
own tokens is not the mask of the whole sequence, so autopar refuses context parallelism on it.
`causal_sdpa(model)` gives the model what transformers runs eagerly for unpadded causal language
modelling: scaled_dot_product_attention with `is_causal=True` and no mask, under an attention
implementation of its own name. The model then computes exactly what it computed before for
inputs without an attention_mask (no padding, no packed sequences), sliding windows aside: a model
configured with one (Mistral's) attends causally over the whole sequence instead. An encoder's
attention modules are not causal (BERT's): there the same implementation attends over the whole
sequence both ways, what the encoder computes for inputs without padding.
"""

from __future__ import annotations

from torch import nn

from autopar.errors import AutoparError

IMPLEMENTATION = "autopar_causal_sdpa"


def causal_sdpa(model: nn.Module) -> nn.Module:
    """`model` (a transformers PreTrainedModel) with causal scaled_dot_product_attention and no
    traced mask (module docstring); returns it."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    AttentionInterface.register(IMPLEMENTATION, sdpa_attention_forward)
    # no mask: sdpa_attention_forward then calls the kernel with is_causal=True
    AttentionMaskInterface.register(IMPLEMENTATION, lambda *args, **kwargs: None)
    setter = getattr(model, "set_attn_implementation", None)
    if setter is None:
        raise AutoparError(f"{type(model).__name__} is not a transformers model with a choice of "
                           f"attention implementation; causal_sdpa applies to those only")
    setter(IMPLEMENTATION)
    if getattr(model.config, "_attn_implementation", None) != IMPLEMENTATION:
        raise AutoparError(f"{type(model).__name__} does not take its attention from transformers' "
                           f"AttentionInterface, so its traced mask cannot be left out; use cp=1")
    return model
