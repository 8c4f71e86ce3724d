"""What HuggingFace's `from_pretrained` does around a checkpoint, for a model autopar fills itself.

A model built on meta is filled tensor by tensor (materialize.py); two steps of HuggingFace's own
loading must then be done the way transformers does them, from the model's own code:

- names: a HuggingFace directory may store tensors under names the model no longer has (GPT-NeoX's
  `embed_out.weight` is the model's `lm_head.weight`; a base model's checkpoint lacks the
  `model.` prefix). transformers' own renaming rules (`get_model_conversion_mapping`,
  `rename_source_key`) map stored names to the model's. Tensors that transformers builds from
  several stored ones (per-expert weights merged into one) cannot be read slice by slice and are
  named in the error instead.
- non-persistent buffers (rotary `inv_freq`, BERT's `position_ids`) are never in a checkpoint:
  `from_pretrained` computes them with the model's `_init_weights` (transformers'
  `_initialize_missing_keys`), the innermost sub-model's for a composite model.

Models that are not HuggingFace's get neither: their names are their state_dict's, and their
non-persistent buffers come from `init=`.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn


def own_initializer(model: nn.Module, owner: str) -> Callable[[nn.Module], None] | None:
    """The model's own per-module initializer for its module at `owner`: the `_init_weights` of
    the innermost HuggingFace model holding it (as transformers' `initialize_weights` dispatches
    to sub-models), or None for a model without one."""
    found, module = getattr(model, "_init_weights", None), model
    for part in owner.split(".") if owner else []:
        module = getattr(module, part)
        found = getattr(module, "_init_weights", found)
    return found if callable(found) else None


def _is_huggingface(model: nn.Module) -> bool:
    try:
        from transformers import PreTrainedModel
    except ImportError:
        return False
    return isinstance(model, PreTrainedModel)


def stored_names(model: nn.Module, stored: list[str], wanted: set[str]) -> tuple[dict[str, str], dict[str, str]]:
    """({model name: stored name} for the stored tensors transformers would load into `wanted`
    names of the model under another name, {model name: stored name} for those it would build by
    converting several stored tensors). Empty for models that are not HuggingFace's."""
    if not _is_huggingface(model):
        return {}, {}
    try:
        from transformers.conversion_mapping import get_model_conversion_mapping
        from transformers.core_model_loading import WeightConverter, rename_source_key
    except ImportError:               # a transformers without renaming rules: names are the model's
        return {}, {}
    transforms = get_model_conversion_mapping(model)
    converters = [t for t in transforms if isinstance(t, WeightConverter)]
    renamings = [t for t in transforms if not isinstance(t, WeightConverter)]
    present = dict.fromkeys(wanted, True)      # rename_source_key's test for the base-model prefix
    renamed, converted = {}, {}
    for name in stored:
        if name in wanted:
            continue
        target, converter = rename_source_key(name, renamings, converters, model.base_model_prefix, present)
        if target in wanted:
            (renamed if converter is None else converted).setdefault(target, name)
    return renamed, converted
