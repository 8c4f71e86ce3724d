"""Mixed precision's one graph rewrite: the export's dtype checks go.

Under bf16 or fp16 a stage computes under autocast (the runtime's hooks, autopar.runtime.precision):
values are 16-bit where the trace saw fp32, so the export's `_assert_tensor_metadata` checks would
fail, and they compute nothing.
"""

from __future__ import annotations

from autopar.passes.dtensor_adapters import drop_metadata_checks
from autopar.passes.program import PassTarget, StageProgram


def drop_traced_dtype_checks(program: StageProgram, plan, target: PassTarget) -> StageProgram:
    """The stage without the export's dtype checks when it computes in 16 bits."""
    if target.compute_dtype is not None:
        drop_metadata_checks(program.module)
    return program
