"""What a context-parallel rank exchanges, as priced: a recomputed attention's second forward
exchanges again (the ring's forward hops, the all-to-all's four swaps), and the all-to-all swaps
keys and values as the attention reads them, heads the model repeated included."""

import pytest

from autopar.cost.config import Config
from autopar.models.hf_zoo import Architecture
from autopar.testing.simulated import assert_sent_as_priced, simulated_hf

SMALL = dict(num_hidden_layers=2, hidden_size=256, num_attention_heads=4, num_key_value_heads=2,
             intermediate_size=512, max_position_embeddings=128, vocab_size=8192)


def _cp_entry(report, kind: str) -> dict:
    [entry] = [e for e in report.collectives if e["kind"] == kind and e["axis"] == "cp"]
    return entry


def test_a_recomputed_ring_attention_passes_its_blocks_again():
    """Selective recompute reruns the attention in the backward, and the ring with it: its
    forward hops are sent twice. Priced once, the ring's sends were 5/6 of what was sent."""
    report = simulated_hf("llama", Config(dp=2, cp=2, recompute="selective", global_batch=8,
                                          micro_batch=2))
    sent = _cp_entry(report, "send")
    assert sent["sent_bytes"] == sent["predicted_sent_bytes"]
    assert_sent_as_priced(report)


@pytest.mark.slow
@pytest.mark.parametrize("recompute", ["full", "selective"])
def test_a_recomputed_head_split_swaps_its_four_tensors_again(recompute):
    """Under the all-to-all kind a rerun attention swaps q, k, v and its output once more: 48
    all-to-alls where 32 were priced (OLMo, held out)."""
    arch = Architecture(name="OlmoForCausalLM", model_class="OlmoForCausalLM",
                        config_class="OlmoConfig", kind="held out",
                        config={**SMALL, "num_key_value_heads": 4})
    report = simulated_hf(arch, Config(dp=2, cp=2, cp_kind="all-to-all", recompute=recompute,
                                       global_batch=4), seq=128)
    swapped = _cp_entry(report, "all_to_all")
    assert swapped["count"] == 48
    assert swapped["sent_bytes"] == swapped["predicted_sent_bytes"]


@pytest.mark.slow
def test_keys_the_model_repeats_are_swapped_before_the_repeat():
    """Gemma3's attention reads its two key/value heads repeated to the four query heads. Both
    kinds move them before the repeat: the all-to-all splits the two heads over cp=2 (3/4 of
    the bytes of swapping the repeated four), as priced."""
    arch = Architecture(name="Gemma3ForCausalLM", model_class="Gemma3ForCausalLM",
                        config_class="Gemma3TextConfig", kind="held out",
                        config={**SMALL, "head_dim": 64})
    report = simulated_hf(arch, Config(dp=2, cp=2, cp_kind="all-to-all", global_batch=4), seq=128)
    swapped = _cp_entry(report, "all_to_all")
    assert swapped["sent_bytes"] == swapped["predicted_sent_bytes"]
    # per swap: q, k, v and the output, [1, heads, 64 tokens, 64] fp32 of which half is sent;
    # 2 layers x 2 micro-batches x (forward + backward) swaps of each
    q, kv = 4 * 64 * 64 * 4 // 2, 2 * 64 * 64 * 4 // 2
    assert swapped["sent_bytes"] == 2 * 2 * 2 * (q + 2 * kv + q)


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["ring", "all-to-all"])
def test_one_key_value_head_is_attended_whole_on_every_tensor_parallel_rank(kind):
    """Multi-query attention (one key/value head) under tp2 x cp2: the head does not split over
    the tp ranks, so each runs every query head with it and moves it whole: the ring passed
    twice the bytes priced at half the heads (held out)."""
    report = simulated_hf("llama", Config(tp=2, cp=2, cp_kind=kind, global_batch=4), rank=1,
                          num_key_value_heads=1)
    moved = _cp_entry(report, "send" if kind == "ring" else "all_to_all")
    assert moved["sent_bytes"] == moved["predicted_sent_bytes"]
    assert_sent_as_priced(report)
