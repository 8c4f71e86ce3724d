"""The words plans and configurations are written in, one enum each: pipeline schedules,
recompute levels, training precisions, context-parallel attention, the roles of mesh axes. Members are strings (`StrEnum`), so
a Plan or Config holding one writes the same JSON as the plain string, and a loaded plain string
compares equal.

The tuples of values are what validation checks against and what error messages and command-line
choices list.
"""

from __future__ import annotations

from enum import StrEnum

from autopar.errors import AutoparError


class _Words(StrEnum):
    """A vocabulary whose members read as their strings everywhere, `repr` too: messages quote
    them as plan files write them."""

    def __repr__(self) -> str:
        return repr(self.value)


class Schedule(_Words):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"       # virtual chunks per rank, Megatron's interleaving
    ZERO_BUBBLE = "zero-bubble"                 # backward split into input and weight halves


class Recompute(_Words):
    NONE = "none"
    SELECTIVE = "selective"                     # attention's core only (Korthikanti et al. 2022)
    FULL = "full"                               # every block's forward again in backward


class Precision(_Words):
    """What a step computes in: 16-bit precisions keep fp32 master weights, gradients and
    optimizer state, and compute (activations, gathered weights, pipeline sends) in 16 bits."""
    FP32 = "fp32"
    BF16 = "bf16"
    FP16 = "fp16"

    @property
    def dtype(self) -> str:
        """The name of the dtype activations are held in and matmuls run at (torch's name)."""
        return _COMPUTE_DTYPE[self]

    @property
    def scales_loss(self) -> bool:
        """fp16's range (6e-8 to 65504) loses small gradients unless the loss is scaled."""
        return self is Precision.FP16

    @classmethod
    def of_dtype(cls, dtype: str) -> Precision:
        """The precision that computes in `dtype` ("bfloat16" -> bf16)."""
        for precision, name in _COMPUTE_DTYPE.items():
            if name == dtype:
                return precision
        raise AutoparError(f"no precision computes in {dtype!r}; a device trains in one of "
                           f"{', '.join(_COMPUTE_DTYPE.values())}")


_COMPUTE_DTYPE = {Precision.FP32: "float32", Precision.BF16: "bfloat16", Precision.FP16: "float16"}
# Bytes of one element of each dtype a captured graph names.
DTYPE_BYTES = {"float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "int64": 8, "int32": 4,
               "int16": 2, "int8": 1, "uint8": 1, "bool": 1}


class ContextParallel(_Words):
    """How attention runs when the sequence is split over context-parallel ranks."""
    RING = "ring"                               # K/V blocks passed around a ring (ring attention)
    ALL_TO_ALL = "all-to-all"                   # sequence split swapped for a head split (Ulysses)


class AxisRole(_Words):
    """What a mesh axis of a plan's sub-mesh does. The values are the axis names a plan writes
    (`Plan.axes`): a plan's axes are named by their roles, so that nothing reads a role from a
    name by convention. (The intra-op solver alone works on the cluster's own axes, "node" and
    "gpu", given roles by its `roles=` argument; it writes a solution, not a Plan.)"""
    DATA = "dp"                                 # splits the batch (and ZeRO's states)
    CONTEXT = "cp"                              # splits every sequence (context parallelism)
    TENSOR = "tp"                               # splits parameters and activations of each op


SCHEDULES = tuple(s.value for s in Schedule)
RECOMPUTE = tuple(r.value for r in Recompute)
PRECISIONS = tuple(p.value for p in Precision)
AXIS_ROLES = tuple(r.value for r in AxisRole)
CONTEXT_PARALLEL = tuple(c.value for c in ContextParallel)
# schedules that run more than one chunk per pipeline rank
# The default bound of planning, capture included (autopar.plan, compile, `autopar plan`): a
# bound, not a budget. The search ends on its own (the largest presets, MoE models on 128-256
# GPUs, in under 90 s on a 2-core host); a plan the clock cut short says so (solver status
# "time_limit"), and its search refines what it found in the time it kept for that.
TIME_LIMIT_S = 300.0
MULTI_CHUNK_SCHEDULES = (Schedule.INTERLEAVED_1F1B, Schedule.ZERO_BUBBLE)
