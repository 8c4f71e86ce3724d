"""The errors autopar raises. Each message names the problem and the fix."""


class AutoparError(Exception):
    """Base of every error autopar raises on purpose."""


class CaptureError(AutoparError):
    """The model could not be captured as a graph (the op, the source line, a likely fix)."""


class InfeasibleError(AutoparError):
    """No plan fits the memory budget (the least memory that would, the largest contributors)."""

    least_memory_bytes: float | None = None     # the least plan found needs this much, if any


class MeshError(AutoparError):
    """A mesh or device spec is malformed, unknown, or does not match the world size."""


class PlanMismatchError(AutoparError):
    """A plan was made for another model, mesh or batch than the one it is used with."""


def format_bytes(nbytes: float) -> str:
    """A size in the largest binary unit that keeps it at 1 or more (1.50 GiB, 37.20 MiB, 512 B),
    so that a message never says "0.00 GiB" of something that is not nothing."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(nbytes) >= size:
            return f"{nbytes / size:.2f} {unit}"
    return f"{nbytes:.0f} B"
