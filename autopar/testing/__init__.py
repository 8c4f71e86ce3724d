"""Measurement of what a compiled model does, for autopar's tests and benchmarks: harnesses that
start gloo ranks and compare a parallel run with one process, and a count of a rank's tensor
memory. Nothing in the compiler imports them.

    equivalence.py  one process's losses and parameters, and the comparison (rtol 1e-5 with an
                    absolute floor) every equivalence test uses
    conformance.py  one architecture of autopar.models.hf_zoo under one parallel form, trained on
                    gloo ranks against one process (benchmarks/conformance.py runs the matrix)
    memory.py       `LiveBytes`: a rank's peak tensor memory, measured
    simulated.py    a plan's ranks simulated beside its prediction, and the checks of each
"""
