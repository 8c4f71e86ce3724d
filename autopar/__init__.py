"""autopar: a graph compiler that parallelizes PyTorch training automatically.

    mesh = autopar.Mesh.parse("2x4:a100-80g")
    plan = autopar.plan(model, mesh, example_inputs=(ids,), global_batch=512)
    cm = autopar.compile(model, mesh, example_inputs=(ids,), loss_fn=loss_fn, optimizer=..., plan=plan)

Names are imported on first use so that `autopar` on the command line, and planning from a
saved plan, start without importing torch.
"""

from importlib import import_module

from autopar.errors import AutoparError, CaptureError, InfeasibleError, MeshError, PlanMismatchError

__version__ = "0.1.0"

_LAZY = {
    "capture": "autopar.tracer",
    "Graph": "autopar.graph",
    "Mesh": "autopar.cost.mesh",
    "Config": "autopar.cost.config",
    "estimate": "autopar.cost.estimator",
    "Plan": "autopar.plans",
    "plan": "autopar.api",
    "plan_from_config": "autopar.api",
    "compile": "autopar.api",
    "launch": "autopar.runtime.launch",
    "LaunchError": "autopar.runtime.launch",
}

__all__ = ["AutoparError", "CaptureError", "InfeasibleError", "MeshError", "PlanMismatchError",
           *_LAZY]


def __getattr__(name):
    if name not in _LAZY:
        raise AttributeError(f"module 'autopar' has no attribute {name!r}")
    return getattr(import_module(_LAZY[name]), name)
