"""Shared fixtures. Tests never need a GPU; multi-process tests fork gloo ranks with autopar.launch."""

import pytest


def _form_problems(results_by_rank, form) -> list[str]:
    """What is wrong with one (parallel form, recompute) pair of the test models with 2 blocks, from
    each rank's (losses, mismatches against one process, checkpointed regions); [] when nothing."""
    problems = []
    for rank, results in enumerate(results_by_rank):
        losses, found, regions = results[form]
        if found:
            problems.append(f"rank {rank}, {form}: {found}")
        if losses != results_by_rank[0][form][0]:
            problems.append(f"rank {rank} returned losses {losses}, rank 0 {results_by_rank[0][form][0]}")
        # one checkpointed region per block (2 blocks), none without recompute
        if regions != (0 if form[1] == "none" else 2):
            problems.append(f"rank {rank}: {regions} recomputed regions")
    return problems


@pytest.fixture
def form_problems():
    return _form_problems
