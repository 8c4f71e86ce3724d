"""Solvers: the intra-op sharding ILP (`solve_intra_op`) and the torch-free `Problem` it solves."""

from autopar.solver.intra_op import IntraOpSolution, solve_intra_op

__all__ = ["IntraOpSolution", "solve_intra_op"]
