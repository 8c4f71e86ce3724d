"""Sharding rules per op family: what each op allows on one mesh axis, and the N-D expansion."""

import pytest

from autopar.cost.strategies import (P, R, S, OpStrategy, OpView, axis_strategies, combine,
                                     parse_placement, placement_str)
from autopar.errors import AutoparError


def strategies(target, input_shapes, output_shape, args=None):
    view = OpView(target=target, args=tuple(args or (None,) * len(input_shapes)),
                  input_shapes=tuple(map(tuple, input_shapes)), output_shape=tuple(output_shape))
    found = axis_strategies(view)
    return None if found is None else {(placement_str(s.output), tuple(map(placement_str, s.inputs)))
                                       for s in found}


def test_placements_print_like_dtensor_and_parse_back():
    for text in ("R", "P", "S(0)", "S(3)"):
        assert placement_str(parse_placement(text)) == text
    assert str(S(1)) == "S(1)" and str(R) == "R"
    with pytest.raises(AutoparError, match="malformed"):
        parse_placement("Shard(0)")


def test_mm_from_einsum():
    assert strategies("aten.mm.default", [(64, 32), (32, 16)], (64, 16)) == {
        ("R", ("R", "R")), ("S(0)", ("S(0)", "R")), ("S(1)", ("R", "S(1)")), ("P", ("S(1)", "S(0)"))}


def test_linear_column_and_row_parallel_with_bias():
    found = strategies("aten.linear.default", [(2, 8, 16), (32, 16), (32,)], (2, 8, 32))
    assert ("S(2)", ("R", "S(0)", "S(0)")) in found        # column-parallel: weight [out, in] on out
    assert ("P", ("S(2)", "S(1)", "P")) in found           # row-parallel: bias added once
    assert ("S(0)", ("S(0)", "R", "R")) in found           # batch
    assert ("S(1)", ("S(1)", "R", "R")) in found           # sequence
    assert len(found) == 5


def test_bmm_addmm_baddbmm_matmul():
    assert ("S(0)", ("S(0)", "S(0)")) in strategies("aten.bmm.default", [(4, 8, 16), (4, 16, 2)], (4, 8, 2))
    assert ("P", ("P", "S(1)", "S(0)")) in strategies("aten.addmm.default", [(16,), (8, 4), (4, 16)], (8, 16))
    assert ("S(0)", ("S(0)", "S(0)", "S(0)")) in strategies(
        "aten.baddbmm.default", [(4, 8, 2), (4, 8, 16), (4, 16, 2)], (4, 8, 2))
    found = strategies("aten.matmul.default", [(2, 8, 16), (16, 4)], (2, 8, 4))
    assert {("S(0)", ("S(0)", "R")), ("S(2)", ("R", "S(1)")), ("P", ("S(2)", "S(0)"))} <= found


def test_attention_shards_batch_and_heads_not_sequence():
    shape = (2, 4, 16, 8)
    found = strategies("aten.scaled_dot_product_attention.default", [shape] * 3, shape,
                       args=(None, None, None, None, 0.0, True))
    assert found == {("R", ("R",) * 3), ("S(0)", ("S(0)",) * 3), ("S(1)", ("S(1)",) * 3)}


def test_embedding_vocab_hidden_and_ids():
    found = strategies("aten.embedding.default", [(100, 64), (2, 16)], (2, 16, 64))
    assert found == {("R", ("R", "R")), ("S(0)", ("R", "S(0)")), ("S(1)", ("R", "S(1)")),
                     ("S(2)", ("S(1)", "R")), ("P", ("S(0)", "R"))}


def test_norms_shard_all_but_the_normalized_dims():
    found = strategies("aten.layer_norm.default", [(2, 16, 64), (64,), (64,)], (2, 16, 64),
                       args=(None, [64], None, None, 1e-5, False))
    assert found == {("R", ("R",) * 3), ("S(0)", ("S(0)", "R", "R")), ("S(1)", ("S(1)", "R", "R"))}
    rms = strategies("aten.rms_norm.default", [(2, 16, 64), (64,)], (2, 16, 64), args=(None, [64], None, 1e-6))
    assert ("S(1)", ("S(1)", "R")) in rms and ("S(2)", ("S(2)", "R")) not in rms


def test_softmax_keeps_its_dim_whole():
    found = strategies("aten._softmax.default", [(2, 4, 8)], (2, 4, 8), args=(None, -1, False))
    assert found == {("R", ("R",)), ("S(0)", ("S(0)",)), ("S(1)", ("S(1)",))}


def test_pointwise_broadcasting_and_partial_sums():
    found = strategies("aten.add.Tensor", [(2, 8, 16), (16,)], (2, 8, 16))
    assert ("S(2)", ("S(2)", "S(0)")) in found and ("S(0)", ("S(0)", "R")) in found
    assert ("P", ("P", "P")) not in found                  # shapes differ: a broadcast bias
    same = strategies("aten.add.Tensor", [(2, 8), (2, 8)], (2, 8))
    assert ("P", ("P", "P")) in same
    assert all(out != "P" for out, _ in strategies("aten.add.Tensor", [(2, 8)], (2, 8), args=(None, 1.0)))
    mul = strategies("aten.mul.Tensor", [(2, 8), (2, 8)], (2, 8))
    assert {("P", ("P", "R")), ("P", ("R", "P"))} <= mul
    div = strategies("aten.div.Tensor", [(2, 8), (2, 8)], (2, 8))
    assert ("P", ("P", "R")) in div and ("P", ("R", "P")) not in div
    gelu = strategies("aten.gelu.default", [(2, 8)], (2, 8))
    assert gelu == {("R", ("R",)), ("S(0)", ("S(0)",)), ("S(1)", ("S(1)",))}


def test_in_place_ops_keep_the_value_they_write_where_it_is():
    """An in-place op takes its out-of-place form's rule, but only the strategies that leave its
    first input as it is: DTensor cannot move a value it writes into (add_ onto a row-parallel
    linear's partial sums, as Llama 4's MoE adds its routed experts onto its shared one)."""
    found = strategies("aten.add_.Tensor", [(2, 8), (2, 8)], (2, 8))
    assert found and all(out == inputs[0] for out, inputs in found)
    assert {("P", ("P", "P")), ("S(1)", ("S(1)", "S(1)"))} <= found
    assert found == {case for case in strategies("aten.add.Tensor", [(2, 8), (2, 8)], (2, 8))
                     if case[0] == case[1][0]}
    mul = strategies("aten.mul_.Tensor", [(2, 8), (2, 8)], (2, 8))
    assert ("P", ("P", "R")) in mul and ("P", ("R", "P")) not in mul


def test_dropout_is_pointwise_without_partial_sums():
    found = strategies("aten.dropout.default", [(2, 8, 16)], (2, 8, 16), args=(None, 0.1, True))
    assert ("S(1)", ("S(1)",)) in found and all(out != "P" for out, _ in found)


def test_reductions():
    found = strategies("aten.sum.dim_IntList", [(2, 8, 16)], (2, 16), args=(None, [1], False))
    assert found == {("R", ("R",)), ("S(0)", ("S(0)",)), ("S(1)", ("S(2)",)), ("P", ("S(1)",))}
    kept = strategies("aten.mean.dim", [(2, 8, 16)], (2, 8, 1), args=(None, [-1], True))
    assert kept == {("R", ("R",)), ("S(0)", ("S(0)",)), ("S(1)", ("S(1)",))}


def test_views_carry_the_outermost_dim_of_a_group():
    heads = strategies("aten.view.default", [(2, 16, 64)], (2, 16, 4, 16))
    assert heads == {("R", ("R",)), ("S(0)", ("S(0)",)), ("S(1)", ("S(1)",)), ("S(2)", ("S(2)",)),
                     ("P", ("P",))}
    merged = strategies("aten.reshape.default", [(2, 16, 64)], (32, 64))
    assert merged == {("R", ("R",)), ("S(0)", ("S(0)",)), ("S(1)", ("S(2)",)), ("P", ("P",))}
    expanded = strategies("aten.expand.default", [(1, 8, 16)], (4, 8, 16))
    assert ("S(1)", ("S(1)",)) in expanded and ("S(0)", ("S(0)",)) not in expanded


def test_transpose_permute():
    assert ("S(2)", ("S(1)",)) in strategies("aten.transpose.int", [(2, 4, 8)], (2, 8, 4), args=(None, 1, 2))
    found = strategies("aten.permute.default", [(2, 4, 8)], (8, 2, 4), args=(None, [2, 0, 1]))
    assert ("S(0)", ("S(2)",)) in found and ("S(2)", ("S(1)",)) in found


def test_transposes_of_every_spelling():
    """x.T, x.mT, swapaxes and movedim move a sharding like transpose and permute (a linear written
    x @ w.T reads its weight through numpy_T)."""
    assert ("S(1)", ("S(0)",)) in strategies("aten.numpy_T.default", [(96, 64)], (64, 96))
    mt = strategies("aten.mT.default", [(2, 4, 8)], (2, 8, 4))
    assert ("S(2)", ("S(1)",)) in mt and ("S(0)", ("S(0)",)) in mt
    assert ("S(0)", ("S(2)",)) in strategies("aten.swapaxes.default", [(2, 4, 8)], (8, 4, 2),
                                             args=(None, 0, 2))
    moved = strategies("aten.movedim.int", [(2, 4, 8)], (4, 8, 2), args=(None, 0, 2))
    assert ("S(2)", ("S(0)",)) in moved and ("S(0)", ("S(1)",)) in moved


def test_split_cat_getitem():
    split = strategies("aten.split.Tensor", [(2, 8, 48)], (), args=(None, 16, 2))
    assert ("S(2)", ("S(2)",)) not in split and ("S(1)", ("S(1)",)) in split
    cat = strategies("aten.cat.default", [(2, 8), (2, 8)], (2, 16), args=(None, 1))
    assert ("S(0)", ("S(0)", "S(0)")) in cat and ("S(1)", ("S(1)", "S(1)")) not in cat
    item = strategies("getitem", [()], (2, 8), args=(None, 0))
    assert ("S(1)", ("S(1)",)) in item


def test_cross_entropy_batch_and_vocab_parallel():
    found = strategies("aten.cross_entropy_loss.default", [(32, 100), (32,)], ())
    assert found == {("R", ("R", "R")), ("P", ("S(0)", "S(0)")), ("P", ("S(1)", "R"))}


def test_convolution_splits_batch_output_channels_with_the_bias_or_input_channels_into_sums():
    x, w, out = (4, 3, 32, 32), (64, 3, 8, 8), (4, 64, 4, 4)
    found = strategies("aten.conv2d.default", [x, w, (64,)], out, args=(None, None, None, [8, 8]))
    assert found == {("R", ("R", "R", "R")), ("S(0)", ("S(0)", "R", "R")),
                     ("S(1)", ("R", "S(0)", "S(0)")), ("P", ("S(1)", "S(1)", "P"))}
    assert ("P", ("S(1)", "S(1)")) in strategies("aten.conv1d.default", [(4, 8, 16), (16, 8, 3)],
                                                 (4, 16, 14))
    # grouped (depthwise) and transposed convolutions split the batch only; an unbatched input
    # has channels first and no batch
    grouped = strategies("aten.conv2d.default", [(4, 8, 6, 6), (8, 1, 3, 3)], (4, 8, 4, 4),
                         args=(None, None, None, [1, 1], [0, 0], [1, 1], 8))
    assert grouped == {("R", ("R", "R")), ("S(0)", ("S(0)", "R"))}
    transposed = strategies("aten.convolution.default", [(4, 8, 6, 6), (8, 4, 3, 3)], (4, 4, 8, 8),
                            args=(None, None, None, [1, 1], [0, 0], [1, 1], True, [0, 0], 1))
    assert transposed == {("R", ("R", "R")), ("S(0)", ("S(0)", "R"))}
    unbatched = strategies("aten.conv2d.default", [(3, 32, 32), (64, 3, 8, 8)], (64, 4, 4))
    assert unbatched == {("R", ("R", "R")), ("S(0)", ("R", "S(0)")), ("P", ("S(0)", "S(1)"))}


def test_unknown_op_has_no_rule():
    assert strategies("aten.sort.default", [(4, 4)], ()) is None


def test_index_by_leading_indices():
    found = strategies("aten.index.Tensor", [(16, 8), (2, 4)], (2, 4, 8), args=(None, [None]))
    assert ("S(2)", ("S(1)", "R")) in found and ("S(0)", ("R", "S(0)")) in found


def model_graphs():
    import torch
    import transformers

    import autopar
    from autopar.models import build_model
    for spec in ("gpt:layers=1,hidden=64,heads=4,seq=16,vocab=128",
                 "llama:layers=1,hidden=64,heads=4,seq=16,vocab=128", "mlp"):
        model, inputs = build_model(spec)
        yield spec, autopar.capture(model, inputs)
    ids = torch.zeros(2, 16, dtype=torch.long)
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        n_layer=1, n_embd=64, n_head=4, vocab_size=128, n_positions=32, bos_token_id=0, eos_token_id=0))
    llama = transformers.LlamaForCausalLM(transformers.LlamaConfig(
        num_hidden_layers=1, hidden_size=64, num_attention_heads=4, num_key_value_heads=2,
        intermediate_size=128, vocab_size=128, bos_token_id=0, eos_token_id=0, pad_token_id=0))
    for name, model in (("hf-gpt2", gpt2), ("hf-llama", llama)):
        yield name, autopar.capture(model, (), {"input_ids": ids, "use_cache": False})


def test_every_op_of_the_models_has_a_rule():
    from autopar.cost.strategies import RULES
    missing = {(name, n.target) for name, graph in model_graphs() for n in graph.nodes
               if n.target not in ("placeholder", "output") and n.target not in RULES}
    assert not missing


def test_combine_checks_divisibility_on_every_axis():
    view = OpView(target="aten.mm.default", args=(None, None), input_shapes=((6, 8), (8, 4)),
                  output_shape=(6, 4))
    one_axis = axis_strategies(view)
    combos = combine([one_axis, one_axis], [2, 4], view.output_shape, view.input_shapes)
    as_text = {tuple(placement_str(s.output) for s in c) for c in combos}
    assert ("S(0)", "R") in as_text and ("R", "S(0)") not in as_text     # 6 rows over 4
    assert ("S(1)", "S(1)") not in as_text and ("P", "P") in as_text     # 4 cols over 8; 8 over 8
    assert all(isinstance(c[0], OpStrategy) for c in combos)


def test_a_replicated_factor_of_a_partial_product_gets_a_partial_gradient():
    """mul(R, P) -> P: the replicated factor's gradient is the output's gradient (whole) times
    the partial factor, a partial sum; the partial factor's is whole."""
    from autopar.cost.reshard import gradient_given

    assert gradient_given(("P",), [("R",), ("P",)], 0) == ("P",)
    assert gradient_given(("P",), [("R",), ("P",)], 1) == ("R",)
    assert gradient_given(("R",), [("R",), ("R",)], 0) == ("R",)
    assert gradient_given(("S(0)",), [("R",), ("S(0)",)], 0) == ("P",)
