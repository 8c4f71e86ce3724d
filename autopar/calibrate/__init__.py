"""Measurement: the probes behind `autopar calibrate`, which time this machine and write a
calibration file. Apart from the cost model, which only reads such a file
(autopar.cost.calibration): measuring starts ranks and runs the runtime's machinery, which the
cost model never imports.

    measure.py      efficiencies of the local device (`calibrate`); on a gloo mesh the same on
                    every rank at once, collectives fitted per group size, the wait of a blocking
                    collective (`calibrate_mesh`)
    host_probes.py  what the runtime's machinery costs the host (DTensor ops, pipeline actions,
                    FSDP2 hooks and reductions, zero-bubble's split backward, checkpoints)
    timing.py       medians of timed calls, on one rank or agreed by every rank
"""
