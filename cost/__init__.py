"""The cost model: devices and meshes, compute, communication, memory, and one estimator.

    mesh.py         devices (vendors' figures) and meshes of nodes x GPUs with their links
    compute.py      roofline time of one op, efficiencies per op family (defaults or calibrated)
    collectives.py  alpha-beta time of all-reduce, all-gather, reduce-scatter, all-to-all, send/recv
    layout.py       what each captured node costs one rank under Megatron-style tensor parallelism
    memory.py       model states under ZeRO, activations in flight per pipeline schedule
    stages.py       which nodes each pipeline chunk holds (StageSpec, uniform splits)
    estimate.py     the one estimator: `estimate`, `estimate_stages`, `max_batch`
    calibrate.py    measured efficiencies of the local device
    reference.py    published training runs as estimator inputs
"""
