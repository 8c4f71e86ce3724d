"""Context parallelism and ZeRO-3 offload train exactly like one process: real gloo ranks, fp32,
loss at each of 3 SGD steps and the final full parameters (autopar.testing.equivalence).

Default tier: the ring and all-to-all attentions against scaled_dot_product_attention (and
autopar::attention, with soft-capped scores and sinks), cp=2 on a
small Llama (rotary tables, grouped-query attention), and dp=4 ZeRO-3 with offload. Slow tier:
cp=4 (ring and all-to-all), dp2 x cp2 under ZeRO-3, tp2 x cp2, tp2 with sequence parallelism x
cp2 all-to-all, pp2 x cp2 under 1F1B, each with every recompute level, a GPT (learned positions)
and HuggingFace Llama-style models."""

import pytest
import torch
import torch.distributed as dist
# Imported before the ranks fork, so that they inherit it (4 s per rank otherwise).
import torch._dynamo  # noqa: F401

import autopar
from autopar.cost.config import Config
from autopar.models import build_model
from autopar.models.gpt import lm_loss
from autopar.testing.equivalence import train_forms_against_one_process

pytestmark = pytest.mark.multiprocess

LLAMA = "llama:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64"
LLAMA_4 = "llama:layers=4,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64"   # 2 blocks a pipeline stage
GPT = "gpt:layers=2,hidden=32,heads=4,seq=16,vocab=64"
BATCH = 4
RECOMPUTE = ("none", "full", "selective")
FORMS_ON_4 = {
    "cp4": Config(cp=4, global_batch=BATCH, micro_batch=2),
    "cp4 all-to-all": Config(cp=4, cp_kind="all-to-all", global_batch=BATCH, micro_batch=2),
    "dp2 x cp2, zero-3": Config(dp=2, cp=2, zero=3, global_batch=BATCH, micro_batch=1),
    "tp2 x cp2": Config(tp=2, cp=2, global_batch=BATCH, micro_batch=BATCH),
    "tp2 + sp x cp2 all-to-all": Config(tp=2, cp=2, cp_kind="all-to-all", sequence_parallel=True,
                                        global_batch=BATCH, micro_batch=BATCH),
}
PIPELINES_ON_4 = {"pp2 x cp2 1f1b": Config(pp=2, cp=2, global_batch=BATCH, micro_batch=1)}


def sgd(params):
    return torch.optim.SGD(params, lr=0.2, momentum=0.9)


def batches(vocab=64, seq=16, steps=3):
    generator = torch.Generator().manual_seed(1)
    return [(torch.randint(0, vocab, (BATCH, seq), generator=generator),
             torch.randint(0, vocab, (BATCH, seq), generator=generator)) for _ in range(steps)]


def model_of(spec):
    def make():
        return build_model(spec, device="cpu")[0]
    return make


def train(spec, forms, recompute=("none",)):
    """On every rank: {(form, recompute): (losses, mismatches against one process, regions)}."""
    return train_forms_against_one_process(model_of(spec), batches(), lm_loss, sgd, forms, recompute)


def attention_errors(world):
    """Max |difference| of the output and q, k, v gradients of each attention of this rank's
    tokens against scaled_dot_product_attention on the whole sequence (8 query heads, 4 kv)."""
    from autopar.passes.context_attention import chunk_positions, ring_attention, ulysses_attention

    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, heads, 16, 8, generator=generator) for heads in (8, 4, 4))
    grad = torch.randn(2, 8, 16, 8, generator=generator)
    mine = chunk_positions(dist.get_rank(), world, 16 // (2 * world))
    errors = {}
    # sliding windows shorter than a chunk, across chunks, and as long as the sequence; padding
    # at the end, at the start (queries that see no key) and inside
    padding = torch.ones(2, 16, dtype=torch.long)
    padding[0, 11:], padding[1, :3], padding[1, 6:9] = 0, 0, 0
    cases = [(True, None, None), (False, None, None), (True, 3, None), (True, 6, None),
             (True, 16, None), (True, None, padding), (False, None, padding), (True, 3, padding)]
    for attend in (ring_attention, ulysses_attention):
        for causal, window, keep in cases:
            whole = [t.clone().requires_grad_() for t in (q, k, v)]
            mask = visible(16, causal, window, keep)
            reference = torch.nn.functional.scaled_dot_product_attention(
                *whole, attn_mask=mask, is_causal=causal and mask is None, enable_gqa=True)
            reference.backward(grad)
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v)]
            out = attend(*local, dist.group.WORLD, causal=causal, window=window,
                         keep=None if keep is None else keep[:, mine])
            out.backward(grad[:, :, mine])
            differences = [(out - reference[:, :, mine]).abs().max()]
            differences += [(a.grad - b.grad[:, :, mine]).abs().max() for a, b in zip(local, whole)]
            # laid out as a kernel's output, which a model may view as [b, t, h * d] (AFMoE)
            differences.append(torch.tensor(0.0 if out.transpose(1, 2).is_contiguous() else 1.0))
            errors[(attend.__name__, causal, window, keep is not None)] = \
                max(d.item() for d in differences)
    # one key/value head (multi-query), fewer than the ranks: the all-to-all repeats it
    for attend in (ring_attention, ulysses_attention):
        whole = [t.clone().requires_grad_() for t in (q, k[:, :1], v[:, :1])]
        reference = torch.nn.functional.scaled_dot_product_attention(*whole, is_causal=True,
                                                                      enable_gqa=True)
        reference.backward(grad)
        local = [t[:, :, mine].detach().clone().requires_grad_() for t in whole]
        out = attend(*local, dist.group.WORLD, causal=True)
        out.backward(grad[:, :, mine])
        differences = [(out - reference[:, :, mine]).abs().max()]
        differences += [(a.grad - b.grad[:, :, mine]).abs().max() for a, b in zip(local, whole)]
        errors[(attend.__name__, "one key/value head")] = max(d.item() for d in differences)
    errors.update(capped_attention_errors(world, (q, k, v, grad), mine, padding))
    return errors


def capped_attention_errors(world, tensors, mine, padding):
    """The same for scores soft-capped at 0.5 and per-head sinks (Gemma 2's and GPT-OSS's
    attention) against autopar::attention on the whole sequence, the sinks' gradient summed over
    the ranks (each rank's is its own queries' under the ring, its own heads' under all-to-all)."""
    from autopar.models import capped_attention  # noqa: F401
    from autopar.passes.context_attention import ring_attention, ulysses_attention

    q, k, v, grad = tensors
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(3))
    # the last: values narrower than queries (MiMo's), which the CPU's flash kernel does not take
    cases = [(True, None, None, 0.5, False, 8), (True, None, None, 0.0, True, 8),
             (False, None, padding, 0.5, True, 8), (True, 3, padding, 0.5, True, 8),
             (True, None, None, 0.0, True, 4)]
    errors = {}
    for attend in (ring_attention, ulysses_attention):
        for causal, window, keep, softcap, sunk, width in cases:
            whole = [t.clone().requires_grad_() for t in (q, k, v[..., :width], sinks)]
            mask = visible(16, causal, window, keep)
            reference = torch.ops.autopar.attention(
                whole[0], *(t.repeat_interleave(2, dim=1) for t in whole[1:3]), mask, 0.0,
                causal and mask is None, 8 ** -0.5, softcap, whole[3] if sunk else None)
            reference.backward(grad[..., :width])
            local = [t[:, :, mine].clone().requires_grad_() for t in (q, k, v[..., :width])]
            local.append(sinks.clone().requires_grad_())
            out = attend(*local[:3], dist.group.WORLD, causal=causal, window=window,
                         keep=None if keep is None else keep[:, mine], softcap=softcap,
                         sinks=local[3] if sunk else None)
            out.backward(grad[:, :, mine, :width])
            differences = [(out - reference[:, :, mine]).abs().max()]
            differences += [(a.grad - b.grad[:, :, mine]).abs().max()
                            for a, b in zip(local[:3], whole[:3])]
            if sunk:
                dist.all_reduce(local[3].grad)
                differences.append((local[3].grad - whole[3].grad).abs().max())
            errors[(attend.__name__, causal, window, keep is not None, softcap, sunk, width)] = \
                max(d.item() for d in differences)
    return errors


def visible(length, causal, window, keep):
    """Which keys each query sees, written out: causally over the last `window` positions, and
    not the padding `keep` marks 0 (None: no window, no padding, no mask)."""
    if window is None and keep is None:
        return None
    distance = torch.arange(length).unsqueeze(1) - torch.arange(length).unsqueeze(0)
    mask = distance >= 0 if causal else torch.ones(length, length, dtype=torch.bool)
    mask = mask & (distance < window) if window is not None else mask
    return mask if keep is None else mask & keep.bool()[:, None, None, :]


def on_two_ranks():
    return {"attention": attention_errors(2),
            "cp2": train(LLAMA, {"cp2": Config(cp=2, global_batch=BATCH, micro_batch=2)}),
            "sliding window": train_hf("mistral", {"cp2": Config(cp=2, global_batch=BATCH,
                                                                 micro_batch=BATCH)},
                                       padded=True),
            "counted positions": train_hf("opt", {"cp2": Config(cp=2, global_batch=BATCH,
                                                                micro_batch=BATCH)}, padded=True)}


@pytest.fixture(scope="module")
def two_ranks():
    from autopar.models.hf_zoo import resolve

    resolve(["mistral", "opt"])    # before forking: transformers imports its models lazily
    return autopar.launch(on_two_ranks, 2, timeout=240)


def test_ring_and_all_to_all_attention_match_one_process(two_ranks):
    for rank, results in enumerate(two_ranks):
        for form, error in results["attention"].items():
            assert error < 1e-5, f"rank {rank}, {form}: {error}"


def test_cp2_llama_trains_like_one_process(two_ranks, form_problems):
    assert form_problems([r["cp2"] for r in two_ranks], ("cp2", "none")) == []


def test_sliding_window_and_padding_split_over_the_sequence(two_ranks, form_problems):
    """Mistral attends over a window of 8 of its 16 tokens, given an attention_mask with padding
    at the end, the start and inside: each rank's queries see the keys of the window by their
    true positions, whichever rank holds them, and no padded key."""
    assert form_problems([r["sliding window"] for r in two_ranks], ("cp2", "none")) == []


def test_positions_counted_from_the_mask_split_over_the_sequence(two_ranks, form_problems):
    """OPT counts its positions from the attention_mask (a cumsum along the sequence); with
    padding at the end, the start and inside, each rank's chunks count the real tokens of the
    chunks before them, whichever rank holds those."""
    assert form_problems([r["counted positions"] for r in two_ranks], ("cp2", "none")) == []


def offloaded(forms):
    """Each form's results, and whether every FSDP2 group of the last one holds CPUOffloadPolicy."""
    from torch.distributed.fsdp import CPUOffloadPolicy, FSDPModule

    results = train(LLAMA, forms)
    config = Config(dp=4, zero=3, offload=True, global_batch=BATCH, micro_batch=1)
    example = (batches()[0][0][:1],)
    cm = autopar.compile(model_of(LLAMA)(), "4:cpu", loss_fn=lm_loss, optimizer=sgd,
                         example_inputs=example, plan=config)
    groups = [m._get_fsdp_state()._fsdp_param_group for m in cm.stages.modules()
              if isinstance(m, FSDPModule)]
    offloads = [isinstance(group.offload_policy, CPUOffloadPolicy) for group in groups if group]
    return results, bool(offloads) and all(offloads)


def test_zero3_offload_trains_like_one_process(form_problems):
    forms = {"dp4 zero-3 offload": Config(dp=4, zero=3, offload=True, global_batch=BATCH, micro_batch=1)}
    by_rank = autopar.launch(offloaded, 4, forms, timeout=240)
    assert form_problems([r[0] for r in by_rank], ("dp4 zero-3 offload", "none")) == []
    assert all(r[1] for r in by_rank), "some FSDP2 group does not offload"


@pytest.mark.slow
@pytest.mark.parametrize("recompute", RECOMPUTE)
@pytest.mark.parametrize("form", [*FORMS_ON_4, *PIPELINES_ON_4])
def test_context_parallel_forms_on_4_ranks(four_ranks, form, recompute, form_problems):
    assert form_problems(four_ranks, (form, recompute)) == []


def on_four_ranks():
    return {**train(LLAMA, FORMS_ON_4, RECOMPUTE), **train(LLAMA_4, PIPELINES_ON_4, RECOMPUTE)}


@pytest.fixture(scope="module")
def four_ranks():
    return autopar.launch(on_four_ranks, 4, timeout=900)


@pytest.mark.slow
def test_gpt_learned_positions_cp2(form_problems):
    forms = {"cp2": Config(cp=2, global_batch=BATCH, micro_batch=4),
             "cp2 all-to-all": Config(cp=2, cp_kind="all-to-all", global_batch=BATCH, micro_batch=2)}
    by_rank = autopar.launch(train, 2, GPT, forms, timeout=240)
    for form in forms:
        assert form_problems(by_rank, (form, "none")) == []


def train_hf(name, forms, padded=False):
    """A HuggingFace model with causal scaled_dot_product_attention and no traced mask
    (autopar.models.hf_attention), each form against one process; `padded`: every batch has
    an attention_mask with padding (its forward's second input)."""
    from autopar.models.hf_attention import causal_sdpa
    from autopar.models.hf_zoo import ARCHITECTURES, loss_fn

    arch = ARCHITECTURES[name]
    generator = torch.Generator().manual_seed(1)
    data = [arch.batch(BATCH, generator) for _ in range(3)]
    if padded:
        data = [(ids, padding_of(ids), targets) for ids, targets in data]
    return train_forms_against_one_process(lambda: causal_sdpa(arch.build()), data, loss_fn, sgd,
                                           forms, ("none",))


def padding_of(ids):
    """An attention_mask for `ids` with padding at the end, the start and inside of rows."""
    keep = torch.ones_like(ids)
    keep[0, 11:], keep[1, :3], keep[2, 5:9] = 0, 0, 0
    return keep


@pytest.mark.slow
@pytest.mark.parametrize("name", ["bert-mlm", "gemma", "qwen3-moe"])
def test_padding_splits_over_the_sequence(name, form_problems):
    """Padded keys stay masked under every split: a bidirectional encoder, multi-query attention
    (all-to-all then splits the repeated heads), a mixture of experts."""
    from autopar.models.hf_zoo import resolve

    resolve([name])
    forms = {"dp2 x cp2": Config(dp=2, cp=2, global_batch=BATCH, micro_batch=2),
             "cp4 all-to-all": Config(cp=4, cp_kind="all-to-all", global_batch=BATCH,
                                      micro_batch=BATCH)}
    by_rank = autopar.launch(train_hf, 4, name, forms, True, timeout=600)
    for form in forms:
        assert form_problems(by_rank, (form, "none")) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["llama", "qwen2", "gpt2"])
def test_huggingface_models_cp(name, form_problems):
    from autopar.models.hf_zoo import resolve

    resolve([name])     # before forking: transformers imports its models lazily
    forms = {"dp2 x cp2, zero-3": Config(dp=2, cp=2, zero=3, global_batch=BATCH, micro_batch=2)}
    by_rank = autopar.launch(train_hf, 4, name, forms, timeout=600)
    assert form_problems(by_rank, ("dp2 x cp2, zero-3", "none")) == []


@pytest.mark.slow
@pytest.mark.parametrize("name", ["gemma2", "gpt-oss"])
def test_capped_scores_and_sinks_split_over_the_sequence(name, form_problems):
    """Gemma 2's soft-capped scores and GPT-OSS's sinks (autopar::attention), with padding, over
    the ring under tensor parallelism and a pipeline, and over the all-to-all."""
    from autopar.models.hf_zoo import resolve

    resolve([name])
    forms = {"tp2 x cp2": Config(tp=2, cp=2, global_batch=BATCH, micro_batch=BATCH),
             "pp2 x cp2 1f1b": Config(pp=2, cp=2, global_batch=BATCH, micro_batch=1),
             "dp2 x cp2 all-to-all": Config(dp=2, cp=2, cp_kind="all-to-all", global_batch=BATCH,
                                            micro_batch=2)}
    by_rank = autopar.launch(train_hf, 4, name, forms, True, timeout=600)
    for form in forms:
        assert form_problems(by_rank, (form, "none")) == []


def checkpoint_across_plans(path):
    """A checkpoint saved under dp2 x cp2 (ZeRO-3) loaded under dp2 x tp2: the next step's loss
    and parameters as if the first plan had gone on; and cp=4 in bf16."""
    make = model_of(LLAMA)
    ids, targets = batches(steps=1)[0]
    first = autopar.compile(make(), "4:cpu", loss_fn=lm_loss, optimizer=sgd, example_inputs=(ids[:1],),
                            plan=Config(dp=2, cp=2, zero=3, global_batch=BATCH, micro_batch=1))
    first.step(ids, targets)
    first.save(path)
    went_on = first.step(ids, targets), first.full_state_dict()
    second = autopar.compile(make(), "4:cpu", loss_fn=lm_loss, optimizer=sgd, example_inputs=(ids[:2],),
                             plan=Config(dp=2, tp=2, global_batch=BATCH, micro_batch=2))
    second.load(path)
    resumed = second.step(ids, targets), second.full_state_dict()
    bf16 = autopar.compile(make(), "4:cpu", loss_fn=lm_loss, optimizer=sgd, example_inputs=(ids[:1],),
                           plan=Config(cp=4, global_batch=BATCH, micro_batch=1), precision="bf16")
    return went_on, resumed, [bf16.step(ids, targets) for _ in range(2)]


@pytest.mark.slow
def test_checkpoints_cross_plans_and_bf16_runs(tmp_path):
    went_on, resumed, bf16 = autopar.launch(checkpoint_across_plans, 4, str(tmp_path / "ckpt"),
                                            timeout=600)[0]
    assert resumed[0] == pytest.approx(went_on[0], rel=1e-5)
    assert all(torch.allclose(resumed[1][k], went_on[1][k], atol=1e-6) for k in went_on[1])
    # bf16 trains (its losses fall from log(vocab))
    assert bf16[0] == pytest.approx(4.16, abs=0.05) and bf16[1] < bf16[0]
