"""The errors autopar raises. Each message names the problem and the fix."""


class AutoparError(Exception):
    """Base of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be captured as a graph (the op, the source line, a likely fix)."""


class InfeasibleError(AutoparError):
    """No plan fits the memory budget (the least memory that would, the largest contributors)."""


class MeshError(AutoparError):
    """A mesh or device spec is malformed, unknown, or does not match the world size."""


class PlanMismatchError(AutoparError):
    """A plan was made for another model, mesh or batch than the one it is used with."""
