"""What autograd keeps for the backward, as the estimator counts it (cost/layout.py and the
transforms after it) and as a simulated rank holds it."""

from __future__ import annotations

from autopar.cost.config import Config
from autopar.cost.kernels import with_composite_norms
from autopar.cost.layout import infer_layout
from autopar.models import build_model
from autopar.tracer import capture
from autopar.testing.simulated import assert_holds_as_predicted, assert_sent_as_priced, simulated

GQA_SPEC = "llama:layers=8,hidden=256,heads=4,kv_heads=2,ffn=512,seq=512,vocab=1024"


def _llama_layout(dtype: str = "bfloat16"):
    model, inputs = build_model("llama-tiny", device="meta")
    graph = capture(model, example_inputs=inputs)
    return graph, infer_layout(graph, 1, compute_dtype=dtype)


def test_a_product_keeps_each_factor_only_for_the_others_gradient():
    """Rotary embeddings multiply queries and keys by a table that takes no gradient: autograd
    keeps the table (a buffer, model state) for their gradient, and not them. SwiGLU's product of
    two activations keeps both."""
    graph, layout = _llama_layout()
    by_name = {n.name: n for n in graph.nodes}
    products = {node.name: node for node in layout.nodes
                if by_name[node.name].target == "aten.mul.Tensor"}
    rotary = [node for name, node in products.items()
              if any(layout.storage[i].startswith("b_rope") for i in by_name[name].inputs)]
    assert len(rotary) == 4 * 2 and all(node.saved == () for node in rotary)
    gated = [node for name, node in products.items() if node not in rotary]
    assert gated and all(set(node.saved) == {layout.storage[i] for i in by_name[node.name].inputs}
                         for node in gated)


def test_a_cpu_norm_keeps_what_the_composite_keeps():
    """A CPU runs rms_norm by torch's composite, which also keeps the normalized rows (fp32):
    one more tensor of the input's size in fp32 training, three in 16-bit."""
    for dtype, extra in (("float32", 1.0), ("bfloat16", 3.0)):
        graph, layout = _llama_layout(dtype)
        composite = with_composite_norms(layout, graph)
        by_name = {n.name: n for n in graph.nodes}
        norms = [n for n in composite.nodes if by_name[n.name].target == "aten.rms_norm.default"]
        assert norms
        for node in norms:
            key = f"{node.name}:normalized"
            assert key in node.saved
            source = layout.storage[by_name[node.name].inputs[0]]
            assert composite.storage_bytes[key] == extra * layout.storage_bytes[source]


def test_ring_attention_keeps_keys_and_values_as_the_ring_passes_them():
    """dp2 x cp4 ZeRO-3, grouped-query heads, no recompute, the first rank. Ring attention keeps
    the keys and values before their heads are repeated (it repeats them per block, in its
    backward), returns its output laid out as a flash kernel does (the model's transpose and
    reshape is then a view), and its fp32 backward holds copies of queries, output and their
    gradients besides each block's repeated keys and values. The prediction counted repeated
    keys and values and no working set: +6.8% under it once rotary products were counted
    right."""
    _, [report] = simulated(GQA_SPEC, "1x8:h100-80g", Config(dp=2, cp=4, zero=3, global_batch=8,
                                                              micro_batch=1))
    assert_holds_as_predicted(report)
    assert_sent_as_priced(report)
