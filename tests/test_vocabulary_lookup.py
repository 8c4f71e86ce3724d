"""A lookup in a table split on the vocabulary over tensor-parallel ranks: the same rows and the
same gradient as one process, each rank keeping the gradient of its own rows only. On 2 gloo
ranks, with ids on both ranks' rows and a padding row on the second rank's."""

import pytest
import torch
import torch._dynamo  # noqa: F401  (imported before the ranks fork)
import torch.nn.functional as F

import autopar

pytestmark = pytest.mark.multiprocess

VOCAB, WIDTH, PADDING = 8, 3, 5


def _lookup_on_two_ranks():
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from autopar.passes.dtensor_adapters import SettledLookup
    from autopar.passes.vocabulary_lookup import VocabularySplitLookup

    mesh = init_device_mesh("cpu", (2,))
    table = torch.randn(VOCAB, WIDTH, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 5, 7, 3], [4, 4, 1, 5]])
    weights = torch.randn(2, 4, WIDTH, generator=torch.Generator().manual_seed(1))
    whole = table.clone().requires_grad_(True)
    (F.embedding(ids, whole, PADDING) * weights).sum().backward()

    split = distribute_tensor(table, mesh, [Shard(0)]).requires_grad_(True)
    rows = SettledLookup(mesh)(VocabularySplitLookup()(
        split, distribute_tensor(ids, mesh, [Replicate()]), PADDING))
    (rows * distribute_tensor(weights, mesh, [Replicate()])).sum().backward()
    local = split.grad.to_local()
    return (torch.equal(rows.full_tensor(), F.embedding(ids, table)), tuple(split.grad.placements),
            tuple(local.shape), torch.allclose(split.grad.full_tensor(), whole.grad, atol=1e-6))


def test_each_rank_looks_up_and_keeps_the_gradient_of_its_own_rows():
    for same_rows, placements, local_shape, same_gradient in autopar.launch(_lookup_on_two_ranks, 2,
                                                                          timeout=120):
        assert same_rows and same_gradient
        assert placements == (torch.distributed.tensor.Shard(0),)
        assert local_shape == (VOCAB // 2, WIDTH)
