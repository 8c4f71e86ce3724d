"""autopar.launch: forked gloo ranks, results by rank, failures named, nothing hangs."""

import pytest
import torch
import torch.distributed as dist

import autopar


def _all_reduce_rank():
    tensor = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(tensor)
    return dist.get_rank(), tensor.item()


def _rank_one_raises():
    if dist.get_rank() == 1:
        raise ValueError("broken on purpose")
    dist.barrier()  # the others wait on a collective that rank 1 never joins
    return dist.get_rank()


def test_results_by_rank():
    results = autopar.launch(_all_reduce_rank, 4)
    assert results == [(rank, 6.0) for rank in range(4)]


def test_failed_rank_is_named_and_others_stop():
    with pytest.raises(autopar.LaunchError, match=r"rank 1 failed: ValueError: broken on purpose"):
        autopar.launch(_rank_one_raises, 3, timeout=60, pg_timeout=10)
