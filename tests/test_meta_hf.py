"""HuggingFace models built on the meta device and filled from a HuggingFace directory
(`save_pretrained`), with no `init=`: what the checkpoint lacks is computed as `from_pretrained`
computes it (non-persistent buffers by the model's `_init_weights`, stored names renamed by
transformers' rules), constants created in forward keep their values, and the run trains exactly
like one process built normally. Tensors still without values are refused by name."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork: each would import it again)
from torch import nn

import autopar
from autopar.cost.config import Config
from autopar.errors import AutoparError
from autopar.models.hf_zoo import ARCHITECTURES, loss_fn, resolve
from autopar.runtime import materialize
from autopar.testing.equivalence import mismatches, train_single_process
from autopar.runtime.hf_checkpoint import own_initializer, stored_names
from autopar.passes.program import TensorRef

pytest.importorskip("transformers")
BATCH = 8
# What each covers: a rotary `inv_freq` buffer, `x.to(inv_freq.device)` and constants created in
# forward (Falcon's index tensors); partial rotary and a checkpoint that stores `lm_head.weight`
# as `embed_out.weight` (GPT-NeoX); integer buffers (BERT's position and token type ids); learned
# positions and no buffer at all (OPT); a full rotary with GQA (Llama).
DEFAULT = ["falcon"]
SLOW = ["llama", "gpt-neox", "bert-mlm", "opt"]


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def save_directories(tmp_path, names: list[str], classes: dict) -> None:
    for name in names:
        ARCHITECTURES[name].build(classes[name]).save_pretrained(str(tmp_path / name))


def train_meta_models(tmp_path, names: list[str], classes: dict, config: Config) -> dict:
    """On every rank: each model built on meta, loaded from its directory and trained, against one
    process training the model built normally."""
    results = {}
    for name in names:
        arch = ARCHITECTURES[name]
        generator = torch.Generator().manual_seed(1)
        data = [arch.batch(BATCH, generator) for _ in range(2)]
        reference = train_single_process(arch.build(classes[name]), data, loss_fn, sgd)
        with torch.device("meta"):
            model = classes[name](arch.build(classes[name]).config).eval()
        cm = autopar.compile(model, f"{config.world_size}:cpu", loss_fn=loss_fn, optimizer=sgd,
                             plan=config, example_inputs=tuple(x[:config.micro_batch] for x in data[0][:-1]),
                             load_from=tmp_path / name)
        losses = [cm.step(*batch) for batch in data]
        results[name] = mismatches(reference, losses, cm.full_state_dict())
    return results


def check_meta_models(tmp_path, names: list[str], config: Config) -> None:
    classes = resolve(names)
    save_directories(tmp_path, names, classes)
    ranks = autopar.launch(train_meta_models, config.world_size, tmp_path, names, classes, config,
                           timeout=600)
    for rank, results in enumerate(ranks):
        assert results == {name: [] for name in names}, (rank, results)


@pytest.mark.multiprocess
def test_hf_model_on_meta_loads_its_directory_and_trains_exactly(tmp_path):
    check_meta_models(tmp_path, DEFAULT, Config(dp=2, zero=3, global_batch=BATCH, micro_batch=4))


@pytest.mark.slow
@pytest.mark.multiprocess
def test_hf_models_on_meta_under_zero3_on_4_ranks(tmp_path):
    check_meta_models(tmp_path, SLOW, Config(dp=4, zero=3, global_batch=BATCH, micro_batch=2))


def refs_of(model: nn.Module) -> nn.ModuleList:
    """One stage holding every tensor of `model` on meta, as the runtime's stages hold them."""
    tensors = [*model.named_parameters(), *model.named_buffers()]   # non-persistent buffers too
    return nn.ModuleList(TensorRef(name, torch.empty_like(tensor, device="meta")) for name, tensor in tensors)


def test_tensors_without_values_are_named_with_the_fix(tmp_path):
    from safetensors.torch import save_file

    from autopar.models import build_model

    # autopar's own Llama keeps its rotary tables in non-persistent buffers and has no
    # HuggingFace _init_weights: a checkpoint cannot hold them, init= must
    model = build_model("llama:layers=1,hidden=32,heads=4,seq=8,vocab=64", device="cpu")[0]
    saved = {k: v for k, v in model.state_dict().items() if not k.startswith("rope_")}
    save_file(saved, str(tmp_path / "weights.safetensors"))
    with torch.device("meta"):
        meta = type(model)(model.config)
    with pytest.raises(AutoparError, match=r"\['rope_cos', 'rope_sin'\].*non-persistent buffers.*pass init="):
        materialize.fill_stages([refs_of(meta)], meta, torch.device("cpu"),
                                load_from=tmp_path / "weights.safetensors")
    # an init that leaves tensors as they were does not count as setting them (their storage is
    # garbage): norms are left alone here
    linear_only = lambda module: isinstance(module, nn.Linear) and module.reset_parameters()
    with pytest.raises(AutoparError, match=r"attn_norm.weight.*left unset by init="):
        materialize.fill_stages([refs_of(meta)], meta, torch.device("cpu"), init=linear_only)
    # a checkpoint lacking a weight names it
    del saved["lm_head.weight"]
    save_file(saved, str(tmp_path / "partial.safetensors"))
    with pytest.raises(AutoparError, match=r"\['lm_head.weight'\].*not in .*partial.safetensors"):
        materialize.fill_stages([refs_of(meta)], meta, torch.device("cpu"),
                                load_from=tmp_path / "partial.safetensors", init=model_init_of(model))


def model_init_of(model):
    """An init computing the rotary tables, so that only the missing weight is left."""
    def init(module):
        if module is not None and hasattr(module, "rope_cos"):
            module.rope_cos.copy_(model.rope_cos)
            module.rope_sin.copy_(model.rope_sin)
    return init


def test_huggingface_names_and_initializers_come_from_transformers():
    classes = resolve(["gpt-neox", "llama"])
    with torch.device("meta"):
        neox = classes["gpt-neox"](ARCHITECTURES["gpt-neox"].build(classes["gpt-neox"]).config)
        llama = classes["llama"](ARCHITECTURES["llama"].build(classes["llama"]).config)
    renamed, converted = stored_names(neox, ["embed_out.weight", "gpt_neox.embed_in.weight"],
                                      set(neox.state_dict()))
    assert renamed == {"lm_head.weight": "embed_out.weight"} and converted == {}
    assert stored_names(nn.Linear(2, 2), ["w"], {"weight"}) == ({}, {})   # not HuggingFace's
    # the innermost HuggingFace model: LlamaModel inside LlamaForCausalLM
    assert own_initializer(llama, "model.rotary_emb") == llama.model._init_weights
    assert own_initializer(nn.Sequential(nn.Linear(2, 2)), "0") is None
