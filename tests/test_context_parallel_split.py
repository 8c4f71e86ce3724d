"""What context parallelism rewrites in a model's program, and what it refuses, naming why: no
processes (the analysis compares two exports; the runtime runs it on every rank before any
collective)."""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autopar.errors import AutoparError
from autopar.models import build_model
from autopar.passes import find_sequence_split
from autopar.passes.context_attention import chunk_positions
from autopar.passes.context_parallel import MARK, ChunkRows
from autopar.passes.program import export_for_pipeline

VOCAB, HIDDEN, HEADS, SEQ = 32, 16, 2, 16


class Tokens(nn.Module):
    """An embedding, one attention written as `attend`, and a per-token head; subclasses change
    `attend` or `forward`."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, HIDDEN)
        self.qkv = nn.Linear(HIDDEN, 3 * HIDDEN)
        self.head = nn.Linear(HIDDEN, VOCAB)

    def heads(self, x):
        b, t, _ = x.shape
        return [part.view(b, t, HEADS, -1).transpose(1, 2) for part in self.qkv(x).chunk(3, -1)]

    def attend(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def forward(self, ids):
        x = self.embed(ids)
        y = self.attend(*self.heads(x))
        return self.head(x + y.transpose(1, 2).reshape(x.shape))


class Masked(Tokens):
    def attend(self, q, k, v):
        t = q.shape[2]
        window = torch.ones(t, t, dtype=torch.bool).tril() & ~torch.ones(t, t, dtype=torch.bool).tril(-4)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=window)


class Eager(Tokens):
    def attend(self, q, k, v):
        return torch.softmax(q @ k.transpose(-1, -2) / 4.0, dim=-1) @ v


class Pooled(Tokens):
    def forward(self, ids):
        return super().forward(ids).mean(dim=1)


class NoAttention(Tokens):
    def forward(self, ids):
        return self.head(self.embed(ids))


class Convolved(Tokens):
    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(HIDDEN, HIDDEN, 3, padding=1)

    def forward(self, ids):
        x = self.conv(self.embed(ids).transpose(1, 2)).transpose(1, 2)
        return self.head(x + self.attend(*self.heads(x)).transpose(1, 2).reshape(x.shape))


class Counted(Tokens):
    """Positions counted from the tokens that are not padding (RoBERTa's, OPT's)."""

    def __init__(self):
        super().__init__()
        self.positions = nn.Embedding(SEQ + 1, HIDDEN)

    def forward(self, ids):
        x = self.embed(ids) + self.positions((ids != 0).cumsum(1))
        return self.head(x + self.attend(*self.heads(x)).transpose(1, 2).reshape(x.shape))


class RunningSum(Tokens):
    """A running sum of the embeddings: a scan that takes gradients."""

    def forward(self, ids):
        x = self.embed(ids).cumsum(1)
        return self.head(x + self.attend(*self.heads(x)).transpose(1, 2).reshape(x.shape))


def split(model, cp=2, seq=SEQ):
    ids = torch.randint(0, VOCAB, (2, seq))
    short = export_for_pipeline(model, (ids[:, :seq // cp],))
    long = export_for_pipeline(model, (ids[:, :2 * seq // cp],))
    return short, find_sequence_split(short, long, cp)


def test_positions_tables_and_attention_are_found():
    model, _ = build_model("llama:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64")
    program, found = split(model)
    marks = {node.name: node.meta[MARK][0] for node in program.graph.nodes if MARK in node.meta}
    # Llama's rotary tables are sliced to the length; both attentions are causal
    assert sorted(marks.values()) == ["attention", "attention", "table", "table"]
    assert (found.cp, found.chunk) == (2, 4)
    gpt, _ = build_model("gpt:layers=1,hidden=32,heads=4,seq=16,vocab=64")
    _, found = split(gpt, cp=4)
    assert [mark[0] for mark in found.marked.values()].count("positions") == 1


def test_a_count_along_the_sequence_is_split_and_a_running_sum_of_activations_is_not():
    # the count reads integers alone; RunningSum (refused below) sums values that take gradients
    program, found = split(Counted())
    assert sorted(mark[0] for mark in found.marked.values()) == ["attention", "scan"]
    # the planner knows it too: it prices the count's all-gather and refuses the running sum
    # before any plan is made, naming it
    import autopar
    from autopar.cost.context import scan_bytes

    ids = torch.randint(0, VOCAB, (2, SEQ))
    mesh, config = autopar.Mesh.parse("2:cpu"), autopar.Config(cp=2, global_batch=2)
    counted = autopar.capture(Counted(), (ids,))
    assert list(scan_bytes(counted).values()) == [2 * 8]       # 2 int64 totals a sequence
    autopar.estimate(counted, mesh, config)
    with pytest.raises(AutoparError, match="cumsum.* running sum along the sequence of values that "
                                           "take gradients"):
        autopar.estimate(autopar.capture(RunningSum(), (ids,)), mesh, config)


def test_load_balanced_chunks():
    # each rank holds chunk r and chunk 2cp-1-r: together they cover the sequence once
    positions = [chunk_positions(rank, 4, 2).tolist() for rank in range(4)]
    assert positions[0] == [0, 1, 14, 15] and positions[3] == [6, 7, 8, 9]
    assert sorted(p for rank in positions for p in rank) == list(range(16))


@pytest.mark.parametrize("model, words", [
    (Masked, "takes an explicit mask"),
    (Eager, "softmax over the sequence .attention written as its own matmul"),
    (Pooled, "reduces over the sequence|works along the sequence"),
    (NoAttention, "no scaled_dot_product_attention call"),
    (Convolved, "convolves along the sequence"),
    (RunningSum, "cumsum.* works along the sequence"),
])
def test_models_that_cannot_be_split_are_refused_with_the_reason(model, words):
    torch.manual_seed(0)
    with pytest.raises(AutoparError, match=words):
        split(model())


class Routed(Tokens):
    """Attention, then one expert of 4 per token chosen by a router."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(HIDDEN, 4)
        self.experts = nn.Parameter(torch.randn(4, HIDDEN, HIDDEN) / 4)

    def forward(self, ids):
        x = self.embed(ids)
        x = x + self.attend(*self.heads(x)).transpose(1, 2).reshape(x.shape)
        tokens = x.reshape(-1, HIDDEN)
        return self.head(x + self.route(tokens).view(x.shape))


class CapacityRouted(Routed):
    """A token is dropped when 2 tokens before it chose its expert: its place counts the others."""

    def route(self, tokens):
        chosen = self.router(tokens).topk(1, dim=-1).indices.view(-1)
        place = F.one_hot(chosen, 4).cumsum(0).gather(1, chosen[:, None])
        return torch.bmm(tokens[:, None], self.experts[chosen])[:, 0] * (place <= 2)


class ExpertChoice(Routed):
    """Each expert picks its 2 best tokens: a top-k over the tokens."""

    def route(self, tokens):
        picked = self.router(tokens).t().topk(2, dim=-1).indices.reshape(-1)
        out = torch.bmm(tokens[picked][:, None], self.experts.repeat_interleave(2, 0))[:, 0]
        return torch.zeros_like(tokens).index_add(0, picked, out)


def test_moe_layers_split_token_by_token_and_routing_over_tokens_is_refused():
    # dropless top-k routing: the dispatch sorts and gathers rows, each token's output its own
    model, _ = build_model("moe:layers=2,hidden=32,heads=4,kv_heads=2,seq=16,vocab=64,experts=4,"
                           "top_k=2,expert_ffn=16")
    _, found = split(model)
    assert sorted(mark[0] for mark in found.marked.values()) == ["attention"] * 2 + ["table"] * 2
    torch.manual_seed(0)
    for routed in (CapacityRouted, ExpertChoice):
        with pytest.raises(AutoparError, match="works along the sequence.*use cp=1"):
            split(routed())


def test_output_without_the_sequence_is_refused():
    class LastToken(Tokens):
        def forward(self, ids):
            return super().forward(ids)[:, -1]

    with pytest.raises(AutoparError, match="keeps part of the sequence|works along the sequence"):
        split(LastToken())


def test_runtime_checks_before_any_collective():
    from autopar.cost.config import Config
    from autopar.plans import Plan, Stage
    from autopar.runtime.build import check_forms

    def plan(cp=2, offload=False, zero=3):
        stage = Stage(index=0, layers=[], ranks=list(range(cp)), cp=cp, offload=offload, zero=zero)
        return Plan(fingerprint="f", mesh={}, axes=[["dp", 1], ["cp", cp], ["tp", 1]],
                    stages=[stage], global_batch=2, micro_batches=1, micro_batch_size=2)

    ids = torch.zeros(2, 30, dtype=torch.long)
    with pytest.raises(AutoparError, match="30 tokens does not split into 2 x cp = 4 equal chunks"):
        check_forms(plan(), (ids,), {})
    with pytest.raises(AutoparError, match="keyword tensors \\['attention_mask'\\]"):
        check_forms(plan(), (ids[:, :16],), {"attention_mask": torch.ones(2, 16)})
    with pytest.raises(AutoparError, match="offloads with ZeRO-2"):
        check_forms(plan(cp=1, offload=True, zero=2), (ids,), {})
    with pytest.raises(AutoparError, match="offload=True .* needs ZeRO-3"):
        Config(dp=2, zero=2, offload=True)


@pytest.mark.parametrize("causal", [True, False])
def test_block_attention_without_the_kernel_matches_it(causal):
    """Off CPUs a ring block is computed by plain products: the same numbers as CPU flash
    attention's kernel, forward and backward."""
    from autopar.passes.context_attention import _attend, _attend_backward

    generator = torch.Generator().manual_seed(0)
    q, k, v, grad = (torch.randn(2, 4, 6, 8, generator=generator) for _ in range(4))
    out, lse = _attend(q, k, v, causal, 0.3, kernel=True)
    plain_out, plain_lse = _attend(q, k, v, causal, 0.3, kernel=False)
    assert torch.allclose(out, plain_out, atol=1e-6) and torch.allclose(lse, plain_lse, atol=1e-6)
    for a, b in zip(_attend_backward(grad, q, k, v, out, lse, causal, 0.3, kernel=True),
                    _attend_backward(grad, q, k, v, out, lse, causal, 0.3, kernel=False)):
        assert torch.allclose(a, b, atol=1e-5)


@pytest.mark.parametrize("causal", [True, False])
def test_a_cuda_block_runs_the_fused_kernel_and_holds_no_score_matrix(causal):
    """On CUDA a ring block runs memory-efficient attention (fp32), forward and backward: its
    log-sum-exp, padded to 32 rows by the kernel, comes back one per query row, and no tensor of
    queries x keys is made. Shapes and calls checked on fake CUDA tensors; the numbers need a
    GPU (benchmarks/gpu_check.py compares them with the plain products)."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.utils._python_dispatch import TorchDispatchMode

    from autopar.passes.context_attention import _attend, _attend_backward, has_kernel

    # the log-sum-exp of 40 rows is padded to 64 by the kernel; a causal block is square
    rows, keys = (40, 40) if causal else (40, 72)

    class Largest(TorchDispatchMode):
        elements, called = 0, set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            Largest.called.add(func.__name__.split(".")[0])
            for value in result if isinstance(result, (tuple, list)) else [result]:
                if isinstance(value, torch.Tensor):
                    Largest.elements = max(Largest.elements, value.numel())
            return result

    with FakeTensorMode(), Largest():
        device = torch.device("cuda")
        q, grad = (torch.randn(2, 4, rows, 16, device=device) for _ in range(2))
        k, v = (torch.randn(2, 4, keys, 16, device=device) for _ in range(2))
        assert has_kernel(q.device)
        out, lse = _attend(q, k, v, causal, 0.3, kernel=True)
        grads = _attend_backward(grad, q, k, v, out, lse, causal, 0.3, kernel=True)
    assert out.shape == q.shape and lse.shape == (2, 4, rows)
    assert [g.shape for g in grads] == [q.shape, k.shape, v.shape]
    assert {"_scaled_dot_product_efficient_attention",
            "_scaled_dot_product_efficient_attention_backward"} <= Largest.called
    assert Largest.elements < 2 * 4 * rows * keys


def test_a_tables_chunk_rows_are_made_once_for_every_layer():
    """Each layer's program slices the rotary tables itself; the rank's 2 chunks of rows are cut
    once and shared (each layer's rotary product keeps them for its backward), through a view of
    the same table too, and cut again when the table changes or takes a gradient."""
    rows = ChunkRows(((0, 2), (6, 8)))          # rank 0 of cp=2 over 8 positions
    table = torch.arange(16.0).view(8, 2)
    first = rows(table, 0)
    assert torch.equal(first, torch.cat([table[0:2], table[6:8]]))
    assert rows(table, 0) is first and rows(table.view(8, 2), 0) is first
    table.add_(1.0)                              # a new version: cut again
    assert torch.equal(rows(table, 0), torch.cat([table[0:2], table[6:8]]))
    learned = torch.ones(8, 2, requires_grad=True)
    assert rows(learned, 0) is not rows(learned, 0)
