"""The words plans and configurations are written in, one enum each: pipeline schedules,
recompute levels, context-parallel attention, the roles of mesh axes. Members are strings (`StrEnum`), so a Plan or Config
holding one writes the same JSON as the plain string, and a loaded plain string compares equal.

The tuples of values are what validation checks against and what error messages and command-line
choices list.
"""

from __future__ import annotations

from enum import StrEnum


class Schedule(StrEnum):
    GPIPE = "gpipe"
    ONE_F_ONE_B = "1f1b"
    INTERLEAVED_1F1B = "interleaved-1f1b"       # virtual chunks per rank, Megatron's interleaving
    ZERO_BUBBLE = "zero-bubble"                 # backward split into input and weight halves


class Recompute(StrEnum):
    NONE = "none"
    SELECTIVE = "selective"                     # attention's core only (Korthikanti et al. 2022)
    FULL = "full"                               # every block's forward again in backward


class ContextParallel(StrEnum):
    """How attention runs when the sequence is split over context-parallel ranks."""
    RING = "ring"                               # K/V blocks passed around a ring (ring attention)
    ALL_TO_ALL = "all-to-all"                   # sequence split swapped for a head split (Ulysses)


class AxisRole(StrEnum):
    DATA = "data"                               # splits the batch (and ZeRO's states)
    TENSOR = "tensor"                           # splits parameters and activations of each op


SCHEDULES = tuple(s.value for s in Schedule)
RECOMPUTE = tuple(r.value for r in Recompute)
AXIS_ROLES = tuple(r.value for r in AxisRole)
CONTEXT_PARALLEL = tuple(c.value for c in ContextParallel)
# schedules that run more than one chunk per pipeline rank
MULTI_CHUNK_SCHEDULES = (Schedule.INTERLEAVED_1F1B.value, Schedule.ZERO_BUBBLE.value)
