"""Published training runs as estimator inputs, to check predictions against measurements.

Rows of Table 1 of Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters
Using Megatron-LM" (SC'21), as found in shared/reference/megatron_sc21_table1.csv. Each row becomes
the model that ran, the cluster and the configuration, with Megatron-LM's defaults of that time
where the table is silent, because they decide what the GPUs executed:
  - hidden and attention dropout 0.1 (Megatron-LM's `--hidden-dropout`/`--attention-dropout`);
  - attention as two batched matmuls around a fused scale-mask-softmax kernel, the score matrix
    in HBM ("unfused"): FlashAttention did not exist yet;
  - DGX A100 80GB nodes of 8 GPUs.
Nothing here is fitted to the published figures.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from autopar.cost.config import Config
from autopar.cost.mesh import Mesh

SC21_DROPOUT = 0.1
SC21_ATTENTION = "unfused"


@dataclass(frozen=True, slots=True)
class ReferenceRun:
    name: str
    spec: str                     # model spec for autopar.models.build_model
    mesh: Mesh
    config: Config
    attention: str
    published_tflops: float       # per GPU, recomputation counted


def sc21_runs(path: str | Path) -> list[ReferenceRun]:
    with open(path, newline="") as handle:
        return [_run(row) for row in csv.DictReader(handle)]


def _run(row: dict) -> ReferenceRun:
    value = lambda key: int(row[key])
    tp, pp, virtual, gpus = value("tp"), value("pp"), value("virtual_chunks"), value("gpus")
    spec = (f"gpt:layers={value('layers')},hidden={value('hidden')},heads={value('heads')},"
            f"seq={value('seq')},vocab={value('vocab')},dropout={SC21_DROPOUT}")
    config = Config(tp=tp, pp=pp, dp=gpus // (tp * pp), virtual=virtual,
                    global_batch=value("global_batch"), micro_batch=value("micro_batch"),
                    recompute=row["recompute"],
                    schedule="interleaved-1f1b" if virtual > 1 else "1f1b")
    return ReferenceRun(name=f"{row['params_b']}B", spec=spec,
                        mesh=Mesh.parse(f"{gpus // 8}x8:a100-80g"), config=config,
                        attention=SC21_ATTENTION,
                        published_tflops=float(row["published_tflops_per_gpu"]))
