"""Attention over a sequence split across context-parallel ranks: a ring or an all-to-all.

Each of the cp ranks holds 2 chunks of every sequence, chunk r and chunk 2cp-1-r of 2cp equal
chunks (load-balanced causal attention, as Llama 3 and torchtitan split it: every rank then has
as many earlier keys to attend to). `chunk_positions` gives a rank's positions.

- `RingAttention` (ring attention, Liu et al. 2023; Megatron-Core's and torchtitan's default):
  the rank keeps its queries and passes its K/V block around the ring of cp ranks, computing
  attention against the block in hand while the next one travels (point-to-point to the ring's
  neighbours, started before the block's compute and waited for after it). With the load-balanced
  chunks each step is one unmasked rectangle of the block or its own causal block (`_pairs`), the
  same work on every rank, computed by a fused kernel (`has_kernel`: CPU flash attention, CUDA's
  memory-efficient attention) that keeps nothing of size queries x keys.
  Under a sliding window (`window`) or padding (`keep`, every rank's gathered once a call)
  each block is masked by its pairs' true positions, and a block no query of this rank can see
  is passed on without being computed.
  Blocks are merged with the online softmax (a running log-sum-exp per query row), so only one
  remote block is held at a time. Its backward passes each K/V block around again with the gradients of that block
  accumulated on the way, as flash attention's backward computes them from the forward's
  output and log-sum-exp; one last hop brings every block's gradients home.
- `ulysses_attention` (DeepSpeed-Ulysses): an all-to-all swaps the sequence split of q, k and v
  for a split of the heads, every rank attends over the whole sequence for its heads (the
  chunks put in position order, attended causally or over the sliding window), and an
  all-to-all swaps back.

Both take plain tensors [batch, heads, tokens, head_dim] of this rank's 2 chunks and compute in
fp32, on any backend (gloo's send and receive, NCCL's). `ContextParallelAttention` is the module
the pass puts in place of an attention call: it takes DTensors as tensor parallelism hands them
(heads split) and runs the split on each rank's local heads.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch.distributed._functional_collectives import all_to_all_single_autograd
from torch import nn
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autopar.models.capped_attention import (cap_gradient, capped_scores, finite, sink_gradient,
                                             with_sinks)
from autopar.models.hf_attention import visible_keys
from autopar.plans.head_split import kv_repeat


def chunk_positions(rank: int, cp: int, chunk: int, device=None) -> torch.Tensor:
    """The positions of rank `rank`'s tokens: chunk `rank`, then chunk 2cp-1-rank, of `chunk` each."""
    first = torch.arange(rank * chunk, (rank + 1) * chunk, device=device)
    second = torch.arange((2 * cp - 1 - rank) * chunk, (2 * cp - rank) * chunk, device=device)
    return torch.cat([first, second])


def _repeat_heads(tensor: torch.Tensor, group: int) -> torch.Tensor:
    """Grouped-query attention: each key/value head serves `group` consecutive query heads."""
    return tensor if group == 1 else tensor.repeat_interleave(group, dim=-3)


def _fold_heads(grad: torch.Tensor, group: int) -> torch.Tensor:
    """The gradient of `_repeat_heads`: the repeated heads' gradients summed."""
    if group == 1:
        return grad
    *lead, heads, tokens, dim = grad.shape
    return grad.view(*lead, heads // group, group, tokens, dim).sum(-3)


def _pairs(rank: int, source: int, chunk: int, causal: bool) -> tuple[slice, slice, bool]:
    """Which of this rank's query rows attend to which of `source`'s key columns, and whether
    causally. A rank's 2 chunks are in position order, so its own block is plain causal
    attention; a rank before it (source < rank) holds one chunk earlier than both of this rank's
    and one later than both: every query sees the first, none the second; a rank after it holds
    two chunks between this rank's: only this rank's second chunk sees them, whole. So each step
    computes one unmasked rectangle, and every rank as much as any other."""
    if not causal:
        return slice(None), slice(None), False
    if source == rank:
        return slice(None), slice(None), True
    if source < rank:
        return slice(None), slice(0, chunk), False
    return slice(chunk, None), slice(None), False


def _block(ring: "_Ring", step: int, chunk: int, causal: bool, window: int | None, keeps, device):
    """(rows, cols, mask) of this rank's step `step` in the ring: the query rows and key columns
    of the block in hand that meet, and `_attend`'s mask over them (None where none meet:
    nothing to compute). Under a sliding window or padding (`keeps`: every rank's [batch,
    tokens] attention_mask, or None) the pairs are masked by their true positions: each query
    sees the keys within `window` before it, and no padded key."""
    source = ring.source(step)
    if window is None and keeps is None:
        return _pairs(ring.rank, source, chunk, causal)
    queries = chunk_positions(ring.rank, ring.size, chunk, device).unsqueeze(1)
    keys = chunk_positions(source, ring.size, chunk, device).unsqueeze(0)
    mask = visible_keys(queries, keys, causal, window, None if keeps is None else keeps[source])
    if keeps is None:       # told from the chunks' positions alone (fake tensors hold no values)
        meet = _window_meets(ring.rank, source, ring.size, chunk, causal, window)
    else:
        meet = bool(mask.any())
    return slice(None), slice(None), mask if meet else None


def _window_meets(rank: int, source: int, cp: int, chunk: int, causal: bool, window: int) -> bool:
    """Whether some query of `rank`'s chunks sees some key of `source`'s within `window`: the
    keys a run of queries [a, b] sees are (a - window, b], causally."""
    spans = [(c * chunk, (c + 1) * chunk - 1) for c in (rank, 2 * cp - 1 - rank)]
    keys = [(c * chunk, (c + 1) * chunk - 1) for c in (source, 2 * cp - 1 - source)]
    if not causal:
        return True
    return any(first <= last_query and last > first_query - window
               for first_query, last_query in spans for first, last in keys)


def _attend(query, key, value, mask, scale: float, kernel: bool, softcap: float = 0.0):
    """(output, log-sum-exp per query row) of one block, fp32. `mask`: True for causal, False
    for none, or which keys each query sees (a sliding window's block; a row that sees none
    gives 0 and a log-sum-exp of -inf, which the merge weighs 0). With `kernel`, the device's
    fused attention (`_kernel_forward`: nothing of size queries x keys is kept), plain products
    otherwise, masked or with scores soft-capped at `softcap`."""
    if _fused(kernel, query, value, mask, softcap):
        return _kernel_forward(query, key, value, mask, scale)
    scores = _masked(capped_scores(query, key, scale, softcap), mask)
    lse = torch.logsumexp(scores, dim=-1)
    return torch.matmul(torch.exp(scores - finite(lse).unsqueeze(-1)), value), lse


def _fused(kernel: bool, query, value, mask, softcap: float) -> bool:
    """Whether a block runs the fused kernel: a plain causal or full block without a cap, and on
    a CPU, whose flash kernel takes one head size, values as wide as queries (MiMo's are not)."""
    same_width = query.device.type != "cpu" or query.shape[-1] == value.shape[-1]
    return kernel and isinstance(mask, bool) and not softcap and same_width


def has_kernel(device: torch.device) -> bool:
    """Whether a block on `device` runs a fused kernel that returns its log-sum-exp: CPU flash
    attention, or CUDA's memory-efficient attention (it takes fp32, as the ring computes)."""
    return device.type in ("cpu", "cuda")


def _kernel_forward(query, key, value, causal: bool, scale: float):
    if query.device.type == "cpu":
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
            query, key, value, 0.0, causal, scale=scale)
        return out, lse
    out, lse, _, _ = torch.ops.aten._scaled_dot_product_efficient_attention(
        query, key, value, None, True, 0.0, causal, scale=scale)
    # its log-sum-exp is padded to a multiple of 32 rows
    return out, lse.narrow(-1, 0, query.shape[-2])


def _kernel_backward(grad_out, query, key, value, out, lse, causal: bool, scale: float):
    if query.device.type == "cpu":
        return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward(
            grad_out, query, key, value, out, lse, 0.0, causal, scale=scale)
    rows = lse.shape[-1]
    # as the forward kernel returns it: padded to a multiple of 32 rows
    padded = torch.nn.functional.pad(lse, (0, -rows % 32))
    # no dropout: the random seed and offset are not read
    unused = torch.empty((), dtype=torch.long)
    grads = torch.ops.aten._scaled_dot_product_efficient_attention_backward(
        grad_out, query, key, value, None, out, padded, unused, unused, 0.0,
        [True, True, True, False], causal, scale=scale)
    return grads[:3]


def _masked(scores, mask):
    if mask is True:
        mask = torch.ones(scores.shape[-2:], dtype=torch.bool, device=scores.device).tril()
    if mask is not False:
        scores = scores.masked_fill(~mask, float("-inf"))
    return scores


def _attend_backward(grad_out, query, key, value, out, lse, mask, scale: float, kernel: bool,
                     softcap: float = 0.0):
    """(dq, dk, dv) of one block given the whole attention's output and log-sum-exp (flash
    attention's backward: what the block contributed to them); `mask`, `kernel` and `softcap`
    as for `_attend`."""
    if _fused(kernel, query, value, mask, softcap):
        return _kernel_backward(grad_out, query, key, value, out, lse, mask, scale)
    scores = capped_scores(query, key, scale, softcap)
    probs = torch.exp(_masked(scores, mask) - finite(lse).unsqueeze(-1))
    delta = (grad_out * out).sum(-1, keepdim=True)
    grad_scores = probs * (torch.matmul(grad_out, value.transpose(-1, -2)) - delta)
    grad_scores = grad_scores * cap_gradient(scores, softcap)
    return (torch.matmul(grad_scores, key) * scale,
            torch.matmul(grad_scores.transpose(-1, -2), query) * scale,
            torch.matmul(probs.transpose(-1, -2), grad_out))


def _merge(out, lse, part, part_lse, rows: slice):
    """The running output and log-sum-exp with one more block's, on the rows that attended it."""
    merged = torch.logaddexp(lse[..., rows], part_lse)
    seen = finite(merged)       # rows that have seen no key yet weigh 0
    mixed = out[..., rows, :] * torch.exp(lse[..., rows] - seen).unsqueeze(-1) \
        + part * torch.exp(part_lse - seen).unsqueeze(-1)
    if rows == slice(None):
        return mixed, merged
    start = rows.start
    return (torch.cat([out[..., :start, :], mixed], dim=-2),
            torch.cat([lse[..., :start], merged], dim=-1))


class _Ring:
    """The ring of a context-parallel group: who sends to whom, and one exchange at a time."""

    def __init__(self, group, *, causal: bool, masked: bool):
        self.group = group
        self.size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.next = dist.get_global_rank(group, (self.rank + 1) % self.size)
        self.previous = dist.get_global_rank(group, (self.rank - 1) % self.size)
        self.causal, self.masked = causal, masked

    def steps(self) -> range:
        """The hops of one pass, in order."""
        return range(self.size)

    def step_kind(self, step: int) -> tuple:
        """What a hop's shapes and messages depend on: the rows and columns of its block
        (`_pairs`), and whether it is the last hop (which the forward sends nothing after). Hops
        of one kind run the same ops on the same shapes (autopar.simulate runs one of each run of
        them); under a sliding window or padding every hop's mask is its own."""
        if self.masked:
            return (step,)
        rows, cols, causal = _pairs(self.rank, self.source(step), 1, self.causal)
        return (rows.start, cols.stop, causal, step == self.size - 1)

    def start(self, *tensors: torch.Tensor):
        """Send `tensors` to the next rank and receive the previous rank's; (works, received)."""
        received = [torch.empty_like(tensor) for tensor in tensors]
        works = dist.batch_isend_irecv(
            [dist.P2POp(dist.isend, tensor, self.next, self.group) for tensor in tensors]
            + [dist.P2POp(dist.irecv, into, self.previous, self.group) for into in received])
        return works, received

    @staticmethod
    def finish(pending) -> list[torch.Tensor]:
        works, received = pending
        for work in works:
            work.wait()
        return received

    def source(self, step: int) -> int:
        """Whose block this rank holds after `step` hops."""
        return (self.rank - step) % self.size


class RingAttention(torch.autograd.Function):
    """Attention of this rank's queries over every rank's keys and values, passed around a ring."""

    @staticmethod
    def forward(ctx, query, key, value, keep, sinks, group, causal: bool, scale: float,
                window: int | None, softcap: float):
        ring = _Ring(group, causal=causal, masked=keep is not None or window is not None)
        keeps = None if keep is None else _gathered(keep, group, ring.size)
        # the dtype scaled_dot_product_attention reads and returns (autocast's where it is on:
        # rotary tables may leave Llama's queries in fp32), computed on in fp32
        dtype, chunk = _attention_dtype(query), query.shape[-2] // 2
        given, given_dtypes = query.to(dtype), (query.dtype, key.dtype, value.dtype)
        query = query.float().contiguous()
        heads = query.shape[-3] // key.shape[-3]
        # one message per hop, in the dtype attention reads them in (autocast's, where it is on:
        # a model may compute them in fp32, as rotary tables make Llama's), computed on in fp32
        block = torch.cat([key, value], dim=-1).to(_attention_dtype(key))
        out = lse = None
        for step in ring.steps():
            pending = ring.start(block) if step < ring.size - 1 else None
            rows, cols, mask = _block(ring, step, chunk, causal, window, keeps, query.device)
            if mask is not None:
                k, v = (_repeat_heads(t[..., cols, :].float(), heads).contiguous()
                        for t in block.split([key.shape[-1], value.shape[-1]], dim=-1))
                part, part_lse = _attend(query[..., rows, :], k, v, mask, scale,
                                         kernel=has_kernel(query.device), softcap=softcap)
                out, lse = (part, part_lse) if out is None else _merge(out, lse, part, part_lse, rows)
            if pending is not None:
                [block] = ring.finish(pending)
        if sinks is not None:       # one more logit per head in every row's softmax, no value
            joined = with_sinks(lse, sinks)
            out, lse = out * torch.exp(lse - finite(joined)).unsqueeze(-1), joined
        # kept for the backward as a flash kernel keeps them, in the dtype of the inputs and of
        # the output it returns (no fp32 copies of queries and output per layer in flight)
        # laid out [batch, tokens, heads, dim] as a flash kernel lays its output out, so that the
        # model's transpose and reshape to [batch, tokens, hidden] is a view, not a second copy
        # (and a model that views it so, as the trace saw it do, can: AFMoE's `view`)
        result = flash_layout(out.to(dtype))
        ctx.save_for_backward(given, key.to(block.dtype), value.to(block.dtype), result, lse, sinks)
        ctx.settings = (group, causal, scale, window, keeps, given_dtypes, softcap)
        return result

    @staticmethod
    def backward(ctx, grad_out):
        query, key, value, out, lse, sinks = ctx.saved_tensors
        query, out = query.float().contiguous(), out.float()
        group, causal, scale, window, keeps, given_dtypes, softcap = ctx.settings
        ring = _Ring(group, causal=causal, masked=keeps is not None or window is not None)
        chunk, heads = query.shape[-2] // 2, query.shape[-3] // key.shape[-3]
        grad_out = grad_out.float().contiguous()
        sizes = [key.shape[-1], value.shape[-1]]
        # each block travels with its gradients so far: [K, V] as the forward sent them (and
        # kept them), [dK, dV] in fp32
        block = torch.cat([key, value], dim=-1)
        grads = torch.zeros(block.shape, dtype=torch.float32, device=block.device)
        grad_query = torch.zeros_like(query)
        for step in ring.steps():
            rows, cols, mask = _block(ring, step, chunk, causal, window, keeps, query.device)
            if mask is not None:
                _accumulate_block(block.split(sizes, dim=-1), grads.split(sizes, dim=-1), grad_query,
                                  (grad_out, query, out, lse), rows, cols, mask, scale, heads, softcap)
            block, grads = ring.finish(ring.start(block, grads))
        # after cp hops every block, with all of its gradients, is back on the rank that owns it
        grad_key, grad_value = grads.split(sizes, dim=-1)
        grads = (grad_query, grad_key, grad_value)
        return (*(g.to(d) for g, d in zip(grads, given_dtypes)), None, _sink_gradient(
            sinks, grad_out, out, lse), None, None, None, None, None)


def _gathered(keep: torch.Tensor, group, size: int) -> list[torch.Tensor]:
    """Every rank's [batch, tokens] attention_mask, by rank (one small all-gather a call)."""
    keep = keep.to(torch.uint8).contiguous()
    gathered = [torch.empty_like(keep) for _ in range(size)]
    dist.all_gather(gathered, keep, group=group)
    return gathered


def _sink_gradient(sinks, grad_out, out, lse):
    """d sinks ([heads]) of this rank's queries, or None without sinks."""
    if sinks is None:
        return None
    return sink_gradient(sinks, (grad_out * out).sum(-1), lse).to(sinks.dtype)


def _accumulate_block(block, grads, grad_query, saved, rows, cols, mask, scale, heads, softcap):
    """Add one block's share of the gradients: of this rank's queries to `grad_query`, of the
    block's keys and values to `grads` (views of the gradients travelling with the block)."""
    (k, v), (grad_k, grad_v) = block, grads
    grad_out, query, out, lse = saved
    parts = _attend_backward(
        grad_out[..., rows, :], query[..., rows, :],
        _repeat_heads(k[..., cols, :].float(), heads).contiguous(),
        _repeat_heads(v[..., cols, :].float(), heads).contiguous(),
        out[..., rows, :].contiguous(), lse[..., rows].contiguous(), mask, scale,
        kernel=has_kernel(query.device), softcap=softcap)
    grad_query[..., rows, :] += parts[0]
    grad_k[..., cols, :] += _fold_heads(parts[1], heads)    # views of `grads`: in place
    grad_v[..., cols, :] += _fold_heads(parts[2], heads)


def _attention_dtype(key: torch.Tensor) -> torch.dtype:
    """The dtype scaled_dot_product_attention would read `key` in: autocast's where it is on."""
    device = key.device.type
    return torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else key.dtype


def ring_attention(query, key, value, group, *, causal: bool, scale: float | None = None,
                   window: int | None = None, keep: torch.Tensor | None = None,
                   softcap: float = 0.0, sinks: torch.Tensor | None = None):
    """Attention of this rank's tokens (2 chunks) over the whole sequence by a ring over `group`;
    causal over the last `window` positions where `window` is given, to the keys `keep` (this
    rank's [batch, tokens] attention_mask) marks real where it is given; scores soft-capped at
    `softcap` (0: not) and the heads' `sinks` joining the softmax (autopar::attention's)."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else scale
    return RingAttention.apply(query, key, value, keep, sinks, group, causal, scale, window, softcap)


def ulysses_attention(query, key, value, group, *, causal: bool, scale: float | None = None,
                      window: int | None = None, keep: torch.Tensor | None = None,
                      softcap: float = 0.0, sinks: torch.Tensor | None = None):
    """Attention by a head split: all-to-all to [batch, heads/cp, whole sequence, dim] (rank r's
    chunks r-th), the sequence put in position order, causal attention over it, and back. Keys
    and values with fewer heads than cp divides (multi-query, or grouped-query heads that
    tensor parallelism split) go repeated the fewest times that split (`kv_repeat`), as
    DeepSpeed-Ulysses does; grouped-query heads that split go as they are."""
    size = dist.get_world_size(group)
    chunk = query.shape[-2] // 2
    dtype = query.dtype
    repeat = kv_repeat(query.shape[-3], key.shape[-3], size)
    key, value = (_repeat_heads(t, repeat) for t in (key, value))
    query, key, value = (_sequence_to_heads(t.float(), group, size) for t in (query, key, value))
    arrived = torch.cat([chunk_positions(r, size, chunk, query.device) for r in range(size)])
    order = torch.argsort(arrived)          # where each position arrived
    query, key, value = (t.index_select(-2, order) for t in (query, key, value))
    heads = query.shape[-3] // key.shape[-3]
    mask = None
    if window is not None or keep is not None:      # the sequence is in position order now
        positions = torch.arange(query.shape[-2], device=query.device)
        whole = None if keep is None else torch.cat(_gathered(keep, group, size), 1)[:, order]
        mask = visible_keys(positions.unsqueeze(1), positions.unsqueeze(0), causal, window, whole)
        causal = False
    key, value = _repeat_heads(key, heads), _repeat_heads(value, heads)
    if softcap or sinks is not None:        # this rank's heads: the r-th of cp groups
        mine = None if sinks is None else sinks.view(size, -1)[dist.get_rank(group)]
        out = torch.ops.autopar.attention(query, key, value, mask, 0.0, causal,
                                          query.shape[-1] ** -0.5 if scale is None else scale,
                                          softcap, mine)
    else:
        out = torch.nn.functional.scaled_dot_product_attention(
            query, key, value, attn_mask=mask, is_causal=causal, scale=scale)
    out = out.index_select(-2, torch.argsort(order))     # back to the order they arrived in
    return flash_layout(_heads_to_sequence(out, group, size).to(dtype))


def flash_layout(out: torch.Tensor) -> torch.Tensor:
    """[b, h, t, d] laid out as [b, t, h, d], as the attention kernels return their output (and
    the model was traced with): its transpose to [b, t, h, d] is contiguous. `.to(dtype,
    memory_format=...)` is not enough: where the dtype is already right it returns the view."""
    return out.transpose(-3, -2).contiguous().transpose(-3, -2)


def _sequence_to_heads(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """[b, h, t, d] of this rank's tokens -> [b, h/cp, cp*t, d] of its heads, rank r's tokens r-th."""
    b, h, t, d = tensor.shape
    # dim 0 of the all-to-all's input is split among the ranks: head group g goes to rank g
    send = tensor.reshape(b, size, h // size, t, d).permute(1, 0, 2, 3, 4).contiguous()
    received = all_to_all_single_autograd(send, None, None, group)
    # received[r] holds rank r's tokens for this rank's heads
    return received.permute(1, 2, 0, 3, 4).reshape(b, h // size, size * t, d)


def _heads_to_sequence(tensor: torch.Tensor, group, size: int) -> torch.Tensor:
    """The inverse of `_sequence_to_heads`."""
    b, h, whole, d = tensor.shape
    t = whole // size
    send = tensor.reshape(b, h, size, t, d).permute(2, 0, 1, 3, 4).contiguous()
    received = all_to_all_single_autograd(send, None, None, group)
    return received.permute(1, 0, 2, 3, 4).reshape(b, size * h, t, d)


KINDS = {"ring": ring_attention, "all-to-all": ulysses_attention}


class ContextParallelAttention(nn.Module):
    """An attention call of the traced graph (q, k, v and no mask) run over the context-parallel
    `group` by `kind` (ring or all-to-all). Under tensor parallelism q, k and v come as DTensors:
    each rank attends with its local heads (split on the heads, or whole), and the output is a
    DTensor placed as the heads were. `returns_lse`: the traced op was the CPU flash kernel, whose
    callers read (output, log-sum-exp); only the output is ever read there."""

    def __init__(self, kind: str, group, *, causal: bool, scale: float | None,
                 returns_lse: bool = False, window: int | None = None, softcap: float = 0.0):
        super().__init__()
        self.attend = KINDS[kind]
        self.group, self.causal, self.scale, self.returns_lse = group, causal, scale, returns_lse
        self.window, self.softcap = window, softcap

    def forward(self, query, key, value, keep=None, sinks=None):
        if isinstance(keep, DTensor):
            keep = keep.full_tensor()
        settings = dict(causal=self.causal, scale=self.scale, window=self.window, keep=keep,
                        softcap=self.softcap)
        if isinstance(query, DTensor):
            mesh = query.device_mesh
            placements = _local_heads(query, key, mesh.size())
            query, key, value = (t.redistribute(mesh, placements) for t in (query, key, value))
            out = self.attend(query.to_local(), key.to_local(), value.to_local(), self.group,
                              sinks=_local_sinks(sinks, mesh, placements[0]), **settings)
            out = DTensor.from_local(out, mesh, placements, run_check=False)
        else:
            out = self.attend(query, key, value, self.group, sinks=sinks, **settings)
        return (out, None) if self.returns_lse else out


def _local_sinks(sinks, mesh, place):
    """This rank's sinks where its q, k and v are local in `place`: its heads' where the heads
    are split; all of them otherwise, their gradient a partial sum where the batch is split."""
    if sinks is None:
        return None
    if not isinstance(sinks, DTensor):
        sinks = DTensor.from_local(sinks, mesh, (Replicate(),), run_check=False)
    if isinstance(place, Shard) and place.dim == 1:
        return sinks.redistribute(mesh, (Shard(0),)).to_local()
    grad = Partial() if isinstance(place, Shard) else Replicate()
    return sinks.redistribute(mesh, (Replicate(),)).to_local(grad_placements=(grad,))


def _local_heads(query: DTensor, key: DTensor, size: int) -> tuple:
    """Placements under which each rank's local q, k and v are whole sequences of whole heads:
    their batch or head split when they have one, else heads split where they divide."""
    place = query.placements[0]
    if isinstance(place, Shard) and place.dim in (0, 1) and key.shape[place.dim] % size == 0:
        return (place,)
    if query.shape[1] % size == 0 and key.shape[1] % size == 0:
        return (Shard(1),)
    return (Replicate(),)
