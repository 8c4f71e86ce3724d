"""Shared fixtures. Tests never need a GPU; multi-process tests fork gloo ranks with autopar.launch."""

import pytest


def _check_form(results_by_rank, form):
    """Each rank's (losses, mismatches against one process, checkpointed regions) for one
    (parallel form, recompute) pair of the test models with 2 blocks."""
    for rank, results in enumerate(results_by_rank):
        losses, found, regions = results[form]
        assert found == [], f"rank {rank}, {form}: {found}"
        assert losses == results_by_rank[0][form][0], "ranks returned different losses"
        # one checkpointed region per block (2 blocks), none without recompute
        assert regions == (0 if form[1] == "none" else 2), f"{regions} recomputed regions"


@pytest.fixture
def check_form():
    return _check_form
