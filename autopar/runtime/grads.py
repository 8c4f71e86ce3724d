"""Gradient reduction over the data-parallel axes, and the optimizer on local shards.

Gradients of parameters replicated over the data axes are averaged in buckets. Each bucket is
launched as an asynchronous collective from an autograd hook as soon as its last gradient is
accumulated, so communication overlaps the rest of backward, as in torch's DDP. Buckets fill in
the order gradients become ready (reverse forward order) and launch in a fixed order on every rank.

ZeRO-1 and ZeRO-2 give each parameter one owner among the data-parallel ranks (contiguous runs
balanced by bytes, so a bucket has one owner): only the owner keeps optimizer state for it and
steps it, then broadcasts the new values. ZeRO-1 all-reduces gradients; ZeRO-2 reduces each bucket
to its owner and frees the others' gradients. Whole parameters, not flat slices, are owned, so any
torch.optim optimizer gives exactly the unsharded result, per-tensor norms included.
ZeRO-3 parameters are sharded in the graph: their all-gather's backward already reduce-scatters
the gradient, which is only averaged here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

DEFAULT_BUCKET_BYTES = 25 * 1024 * 1024   # torch DDP's default


@dataclass(kw_only=True, slots=True)
class Bucket:
    params: list[nn.Parameter]
    owner: int | None                 # data-parallel rank that steps them (ZeRO-1/2), else None
    ready: int = 0
    flat: torch.Tensor | None = None
    work: object = None


class GradientReducer:
    """Average gradients over `group`; `armed` only during the last micro-batch's backward."""

    def __init__(self, params: list[nn.Parameter], sharded: list[nn.Parameter], *, group, zero: int,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES):
        self.group = group
        self.size = dist.get_world_size(group) if group is not None else 1
        self.rank = dist.get_rank(group) if group is not None else 0
        self.zero = zero
        self.sharded = sharded
        owned = zero in (1, 2) and self.size > 1
        self.buckets = _make_buckets(list(reversed(params)), bucket_bytes, self.size if owned else None)
        self.bucket_of = {p: b for b in self.buckets for p in b.params}
        self.armed = False
        self.next_launch = 0
        if self.size > 1:
            for param in params:
                param.register_post_accumulate_grad_hook(self._on_grad)

    def owned_params(self, all_params: list[nn.Parameter]) -> list[nn.Parameter]:
        """The parameters this rank's optimizer steps."""
        return [p for p in all_params if p not in self.bucket_of or self.bucket_of[p].owner in (None, self.rank)]

    def _on_grad(self, param: nn.Parameter) -> None:
        if not self.armed:
            return
        self.bucket_of[param].ready += 1
        while self.next_launch < len(self.buckets):
            bucket = self.buckets[self.next_launch]
            if bucket.ready < len(bucket.params):
                break
            self._launch(bucket)
            self.next_launch += 1

    def _launch(self, bucket: Bucket) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in bucket.params]
        bucket.flat = torch.cat([g.reshape(-1) for g in grads])
        if self.zero == 2:
            dst = dist.get_global_rank(self.group, bucket.owner)
            bucket.work = dist.reduce(bucket.flat, dst=dst, group=self.group, async_op=True)
            if bucket.owner != self.rank:
                for param in bucket.params:
                    param.grad = None
        else:
            bucket.work = dist.all_reduce(bucket.flat, group=self.group, async_op=True)

    def finish(self) -> None:
        """Launch what autograd did not (unused parameters count as zero), wait, and average."""
        if self.size == 1:
            return
        for bucket in self.buckets[self.next_launch:]:
            self._launch(bucket)
        for bucket in self.buckets:
            bucket.work.wait()
            if bucket.owner in (None, self.rank) or self.zero != 2:
                bucket.flat.div_(self.size)
                offset = 0
                for param in bucket.params:
                    # The gradient becomes a view of the bucket: no copy back.
                    param.grad = bucket.flat[offset:offset + param.numel()].view_as(param)
                    offset += param.numel()
            bucket.flat, bucket.work, bucket.ready = None, None, 0
        for param in self.sharded:
            if param.grad is not None:
                param.grad.div_(self.size)
        self.next_launch = 0
        self.armed = False

    def broadcast_owned(self) -> None:
        """After a ZeRO-1/2 step: every rank gets the owners' new values."""
        if self.zero not in (1, 2) or self.size == 1:
            return
        pending = []
        for bucket in self.buckets:
            flat = torch.cat([p.detach().reshape(-1) for p in bucket.params])
            work = dist.broadcast(flat, src=dist.get_global_rank(self.group, bucket.owner),
                                  group=self.group, async_op=True)
            pending.append((bucket, flat, work))
        with torch.no_grad():
            for bucket, flat, work in pending:
                work.wait()
                if bucket.owner != self.rank:
                    for param, value in zip(bucket.params,
                                            torch._utils._unflatten_dense_tensors(flat, bucket.params)):
                        param.copy_(value)


def _make_buckets(params: list[nn.Parameter], bucket_bytes: int, owners: int | None) -> list[Bucket]:
    """Consecutive parameters up to `bucket_bytes`; with owners, a bucket never spans two."""
    total = sum(p.numel() * p.element_size() for p in params) or 1
    buckets: list[Bucket] = []
    seen = 0
    for param in params:
        nbytes = param.numel() * param.element_size()
        owner = None if owners is None else min(owners - 1, seen * owners // total)
        last = buckets[-1] if buckets else None
        if (last is None or last.owner != owner or last.params[0].dtype != param.dtype
                or sum(p.numel() * p.element_size() for p in last.params) + nbytes > bucket_bytes):
            buckets.append(Bucket(params=[], owner=owner))
        buckets[-1].params.append(param)
        seen += nbytes
    return buckets
