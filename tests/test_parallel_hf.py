"""HuggingFace GPT2 and Llama from tiny configs train exactly like one process under every
parallel form: real gloo ranks, fp32, AdamW with a large eps, loss at each of 3 steps and the
final full parameters (autopar.testing.equivalence)."""


import pytest
import torch
# Imported here, before the ranks fork, so that they inherit it: each rank's first optimizer step
# or export would otherwise import it on its own (4 s each, 4 ranks sharing 2 cores).
import torch._dynamo  # noqa: F401

import autopar
from autopar.cost.config import Config
from autopar.testing.equivalence import train_forms_against_one_process

transformers = pytest.importorskip("transformers")
# slow tier: the default tier trains HuggingFace models under these forms in test_conformance.py
pytestmark = [pytest.mark.multiprocess, pytest.mark.slow]
# Resolved here, before the ranks fork: transformers imports each model's module on first use.
GPT2, LLAMA = transformers.GPT2LMHeadModel, transformers.LlamaForCausalLM

VOCAB, SEQ, GLOBAL_BATCH = 64, 8, 8
FORMS_ON_4 = {
    "dp": Config(dp=4, global_batch=GLOBAL_BATCH, micro_batch=2),
    "dp x tp": Config(dp=2, tp=2, global_batch=GLOBAL_BATCH, micro_batch=4),
    "zero-1": Config(dp=4, zero=1, global_batch=GLOBAL_BATCH, micro_batch=2),
    # two micro-batches per replica: gradients reduce-scattered after each, accumulated as shards
    "zero-2": Config(dp=4, zero=2, global_batch=GLOBAL_BATCH, micro_batch=1),
    "zero-3": Config(dp=4, zero=3, global_batch=GLOBAL_BATCH, micro_batch=1),
}
FORMS_ON_2 = {
    "tp": Config(tp=2, global_batch=GLOBAL_BATCH, micro_batch=GLOBAL_BATCH),
    "tp + sequence parallel": Config(tp=2, sequence_parallel=True, global_batch=GLOBAL_BATCH,
                                     micro_batch=GLOBAL_BATCH),
}
RECOMPUTE = ("none", "full")


def gpt2():
    torch.manual_seed(0)
    config = transformers.GPT2Config(n_layer=2, n_embd=32, n_head=4, vocab_size=VOCAB, n_positions=SEQ,
                                     resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                     bos_token_id=0, eos_token_id=0)
    return GPT2(config).eval()


def llama():
    torch.manual_seed(0)
    config = transformers.LlamaConfig(num_hidden_layers=2, hidden_size=32, num_attention_heads=4,
                                      num_key_value_heads=2, intermediate_size=64, vocab_size=VOCAB,
                                      max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=0)
    return LLAMA(config).eval()


MODELS = {"gpt2": gpt2, "llama": llama}


def loss_fn(outputs, targets):
    return torch.nn.functional.cross_entropy(outputs.logits.flatten(0, 1), targets.flatten())


def adamw(params):
    return torch.optim.AdamW(params, lr=1e-2, eps=1e-3)


def batches(steps=3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator),
             torch.randint(0, VOCAB, (GLOBAL_BATCH, SEQ), generator=generator)) for _ in range(steps)]


def train_forms(model_name: str, forms: dict) -> dict:
    """On every rank: each form with and without recompute against one process's training."""
    return train_forms_against_one_process(MODELS[model_name], batches(), loss_fn, adamw, forms, RECOMPUTE,
                                           kwargs={"use_cache": False},
                                           call=lambda model, inputs: model(*inputs, use_cache=False))


# HF Llama's forms run in the slow tier: the default run trains it under dp x tp in the conformance
# slice (tests/test_conformance.py) and its tensor-parallel stages there too, and GPT2 here covers
# every form of an HF model, ZeRO and recompute included.
@pytest.fixture(scope="module", params=["gpt2", pytest.param("llama", marks=pytest.mark.slow)])
def model_name(request):
    return request.param


@pytest.fixture(scope="module")
def on_4_ranks(model_name):
    return autopar.launch(train_forms, 4, model_name, FORMS_ON_4, timeout=300)


@pytest.fixture(scope="module")
def on_2_ranks(model_name):
    return autopar.launch(train_forms, 2, model_name, FORMS_ON_2, timeout=300)


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("form", FORMS_ON_4)
def test_forms_on_4_ranks(on_4_ranks, form, recompute, form_problems):
    assert form_problems(on_4_ranks, (form, recompute)) == []


@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("form", FORMS_ON_2)
def test_forms_on_2_ranks(on_2_ranks, form, recompute, form_problems):
    assert form_problems(on_2_ranks, (form, recompute)) == []
