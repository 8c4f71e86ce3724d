"""Published training runs as estimator inputs, to check predictions against measurements.

Two tables in shared/reference (see its README for how each row was normalized):

megatron_sc21_table1.csv, rows of Table 1 of Narayanan et al., "Efficient Large-Scale Language
Model Training on GPU Clusters Using Megatron-LM" (SC'21). Each row becomes the model that ran, the
cluster and the configuration, with Megatron-LM's defaults of that time where the table is silent,
because they decide what the GPUs executed:
  - hidden and attention dropout 0.1 (Megatron-LM's `--hidden-dropout`/`--attention-dropout`);
  - attention as two batched matmuls around a fused scale-mask-softmax kernel, the score matrix
    in HBM ("unfused"): FlashAttention did not exist yet;
  - DGX A100 80GB nodes of 8 GPUs;
  - the data-parallel gradient reduction as the paper's launch script (examples/sc21) chose it:
    PyTorch DDP (`--DDP-impl torch`) for the runs without pipelining, which all-reduces in buckets
    during the last micro-batch's backward (Megatron's schedule runs the others under `no_sync`);
    Megatron's local DDP for the pipelined runs, one all-reduce after the pipeline flush, not
    overlapped (Megatron-LM's `--overlap-grad-reduce` came in 2023). Runtime "torch" and
    "megatron-local" of cost/overlap.py.

published_runs.csv, runs of other kinds, with the runtime each used, which decides overlap:
  - Megatron-LM 2022 (Korthikanti et al.): as SC'21, dropout 0.1, unfused attention, Megatron's
    local DDP ("megatron-local").
  - DeepSpeed ZeRO-3 (SC'21 Table 2, 2021): the stage-3 engine of that year gathered every
    sub-module's parameters in its forward and backward hooks and again for the recomputed
    forward, a collective per parameter tensor, and waited on them ("deepspeed-2021"). The
    table's own figures show it: at one micro-batch per GPU the step takes as long on 1536 GPUs as
    on 768, as communication that nothing hides does. Dropout 0.1 (Megatron-DeepSpeed's GPT).
  - PyTorch FSDP (llm-foundry MPT, 2023): FULL_SHARD per block with forward and backward
    prefetch, gradients reduce-scattered per block during the backward of every micro-batch,
    activation checkpointing inside the FSDP unit (no second gather) ("torch"); MPT's dropouts
    are 0 by default; FlashAttention.
Every run is priced on Megatron-LM's tensor-parallel layout (`ReferenceRun.placements`), the
one these frameworks trained with. Nothing here is fitted to the published figures.
"""

from __future__ import annotations

import csv
from dataclasses import dataclass
from pathlib import Path

from autopar.cost.config import Config
from autopar.cost.layout import TensorPlacements
from autopar.cost.megatron import megatron_placements
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError
from autopar.plans.vocabulary import Recompute, Schedule

SC21_DROPOUT = 0.1
SC21_ATTENTION = "unfused"
MEGATRON_DROPOUT = 0.1
MPT_DROPOUT = 0.0



@dataclass(frozen=True, slots=True)
class ReferenceRun:
    name: str
    spec: str                     # model spec for autopar.models.build_model
    mesh: Mesh
    config: Config
    attention: str
    published_step_s: float       # seconds per optimizer step
    runtime: str                  # how it overlapped communication: a cost/overlap.py runtime
    published_tflops: float = 0.0  # per GPU, recomputation counted (SC'21 rows)

    def placements(self, graph) -> TensorPlacements | None:
        """The run's tensor parallelism as it was trained: Megatron-LM's layout (cost.megatron),
        which the estimator prices as `estimate(..., placements=run.placements(graph))`."""
        return megatron_placements(graph, self.config.tp,
                                   sequence_parallel=self.config.sequence_parallel)


def sc21_step_flops(*, batch: int, seq: int, layers: int, hidden: int, vocab: int,
                    recompute: str) -> float:
    """FLOPs of one step by the SC'21 paper's formula (recomputed forward counted with "full")."""
    factor = 96 if recompute == Recompute.FULL else 72
    return factor * batch * seq * layers * hidden ** 2 * (
        1 + seq / (6 * hidden) + vocab / (16 * layers * hidden))


SC21_COLUMNS = ("params_b", "layers", "hidden", "heads", "seq", "vocab", "tp", "pp",
                "virtual_chunks", "gpus", "global_batch", "micro_batch", "recompute",
                "published_tflops_per_gpu")
PUBLISHED_COLUMNS = ("source", "spec", "mesh", "tp", "pp", "virtual", "global_batch", "micro_batch",
                     "recompute", "zero", "sequence_parallel", "attention", "published_step_s")


def sc21_runs(path: str | Path) -> list[ReferenceRun]:
    return [_sc21_run(row) for row in _rows(path, SC21_COLUMNS, "megatron_sc21_table1.csv")]


def _rows(path: str | Path, columns: tuple[str, ...], like: str) -> list[dict]:
    """The rows of a CSV that has every one of `columns`, or an error naming the missing ones."""
    with open(path, newline="") as handle:
        reader = csv.DictReader(handle)
        missing = [name for name in columns if name not in (reader.fieldnames or ())]
        if missing:
            raise AutoparError(f"{path} lacks the column(s) {', '.join(missing)}; give a CSV with "
                               f"the columns of shared/reference/{like}: {', '.join(columns)}")
        return list(reader)


def _sc21_run(row: dict) -> ReferenceRun:
    value = lambda key: int(row[key])
    tp, pp, virtual, gpus = value("tp"), value("pp"), value("virtual_chunks"), value("gpus")
    spec = (f"gpt:layers={value('layers')},hidden={value('hidden')},heads={value('heads')},"
            f"seq={value('seq')},vocab={value('vocab')},dropout={SC21_DROPOUT}")
    config = Config(tp=tp, pp=pp, dp=gpus // (tp * pp), virtual=virtual,
                    global_batch=value("global_batch"), micro_batch=value("micro_batch"),
                    recompute=row["recompute"],
                    schedule=Schedule.INTERLEAVED_1F1B if virtual > 1 else Schedule.ONE_F_ONE_B)
    tflops = float(row["published_tflops_per_gpu"])
    flops = sc21_step_flops(batch=config.global_batch, seq=value("seq"), layers=value("layers"),
                            hidden=value("hidden"), vocab=value("vocab"), recompute=config.recompute)
    return ReferenceRun(name=f"SC'21 {row['params_b']}B", spec=spec,
                        mesh=Mesh.parse(f"{gpus // 8}x8:a100-80g"), config=config,
                        attention=SC21_ATTENTION, published_step_s=flops / (tflops * 1e12 * gpus),
                        runtime="megatron-local" if pp > 1 else "torch", published_tflops=tflops)


def published_runs(path: str | Path) -> list[ReferenceRun]:
    return [_published_run(row) for row in _rows(path, PUBLISHED_COLUMNS, "published_runs.csv")]


def _runtime(source: str, zero: int) -> str:
    """The runtime of a published run, from its source: FSDP (llm-foundry) is PyTorch's; a ZeRO
    run of 2021-22 outside it is DeepSpeed's; the rest is Megatron-LM with its local DDP."""
    if "llm-foundry" in source or "FSDP" in source:
        return "torch"
    if zero:
        return "deepspeed-2021"
    return "megatron-local"


def _published_run(row: dict) -> ReferenceRun:
    value = lambda key: int(row[key])
    mesh = Mesh.parse(row["mesh"])
    tp, pp, virtual = value("tp"), value("pp"), value("virtual")
    runtime = _runtime(row["source"], value("zero"))
    dropout = MPT_DROPOUT if "llm-foundry" in row["source"] else MEGATRON_DROPOUT
    spec = row["spec"] if "dropout=" in row["spec"] else f"{row['spec']},dropout={dropout}"
    config = Config(tp=tp, pp=pp, dp=mesh.world_size // (tp * pp), virtual=virtual,
                    global_batch=value("global_batch"), micro_batch=value("micro_batch"),
                    recompute=row["recompute"], zero=value("zero"),
                    sequence_parallel=bool(value("sequence_parallel")),
                    schedule=Schedule.INTERLEAVED_1F1B if virtual > 1 else Schedule.ONE_F_ONE_B)
    return ReferenceRun(name=_short_name(row["source"], mesh), spec=spec, mesh=mesh, config=config,
                        attention=row["attention"], published_step_s=float(row["published_step_s"]),
                        runtime=runtime)


def _short_name(source: str, mesh: Mesh) -> str:
    words = source.replace("'", " ").split()
    size = next((w for w in reversed(words) if w[:1].isdigit() and w.endswith("B")), "")
    model = next((w for w in words if w.startswith("MPT-")), size)
    where = "FSDP" if "llm-foundry" in source else words[0].rstrip("+")
    detail = ""
    if "selective" in source:
        detail = " selective+SP"
    elif "full recompute" in source:
        detail = " full"
    elif "ZeRO-3" in source:
        detail = " ZeRO-3"
    return f"{where} {model}{detail} {mesh}"
