"""The cost model: devices and meshes, compute, communication, memory, and one estimator.

    mesh.py         devices (vendors' figures) and meshes of nodes x GPUs with their links
    compute.py      roofline time of one op, efficiencies per op family (defaults or calibrated)
    collectives.py  alpha-beta time of all-reduce, all-gather, reduce-scatter, all-to-all, send/recv
    layout.py       what each captured node costs one rank on given tensor-parallel placements
    megatron.py     Megatron-LM's layout as placements (published runs are priced on it)
    reshard.py      which collective a change of placement needs (shared with the sharding ILP)
    memory.py       model states under ZeRO, activations in flight per pipeline schedule
    overlap.py      data-parallel traffic (gradients, ZeRO gathers) and what each runtime hides
    stages.py       which nodes each pipeline chunk holds (StageSpec, even and uneven splits)
    estimator.py    the one estimator: `estimate`, `estimate_stages`
    capacity.py     how large a micro-batch or sequence fits: `max_batch`, `max_seq`
    plan_estimate.py  `estimate_plan`: a Plan priced from its own stages and placements (what it
                    records)
    price_cache.py  what the estimator's calls share, in a dict the caller passes as `cache=`
    calibration.py  a calibration file applied: efficiencies and measured links (the file is
                    measured and written by autopar.calibrate)
    reference.py    published training runs as estimator inputs, with what each run assumed

    autopar.cost.estimate(graph, mesh, config, placements=..., runtime="autopar", calibration=None)
    autopar.cost.estimate_plan(graph, plan)

The estimator's names are imported on first use, so that `import autopar.cost.mesh` stays light.
"""

from importlib import import_module

_LAZY = {
    "estimate": "autopar.cost.estimator",
    "estimate_stages": "autopar.cost.estimator",
    "estimate_plan": "autopar.cost.plan_estimate",
    "max_batch": "autopar.cost.capacity",
    "max_seq": "autopar.cost.capacity",
    "Estimate": "autopar.cost.estimator",
    "StageSpec": "autopar.cost.stages",
}

__all__ = [*_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar.cost' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
