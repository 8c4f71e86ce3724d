"""Graph rewrites the runtime applies to a stage's exported program, in this order:
1. the stage split (stage_split.py, stage_interfaces.py) cuts the model into per-layer units and stages;
   recompute wraps units or their attention in `Recomputed` checkpoints (`checkpoint_regions`);
2. tensor parallelism distributes parameters as DTensors and inserts a `Redistribute` after each
   value the plan places (tensor_parallel.py, with DTensor rules of dtensor_rules.py);
3. data parallelism and ZeRO are not graph rewrites: FSDP2 wraps the rewritten stage's layers.
"""

from autopar.passes.collectives import Redistribute
from autopar.passes.recompute import Recomputed, checkpoint_regions

__all__ = ["Recomputed", "Redistribute", "checkpoint_regions"]
