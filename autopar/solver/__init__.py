"""Solvers: the intra-op sharding ILP and the torch-free `Problem` it solves.

    from autopar.solver import solve_intra_op          # Graph + Mesh -> IntraOpSolution
    from autopar.solver.problem import Problem         # no torch: stored problems
    from autopar.solver.ilp import solve               # no torch: Problem -> Assignment

The ILP's formulation is written down in `autopar.solver.ilp`. Names are imported on first use so
that solving a stored Problem never imports torch.
"""

from importlib import import_module

_LAZY = {"solve_intra_op": "autopar.solver.intra_op", "IntraOpSolution": "autopar.solver.intra_op",
         "Problem": "autopar.solver.problem", "solve": "autopar.solver.ilp",
         "build_problem": "autopar.solver.build"}

__all__ = list(_LAZY)


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar.solver' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
