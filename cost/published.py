"""Published training runs of any kind (mixture of experts, context parallelism, offload) read
from the columns of shared/reference/published_runs_moe_cp_offload.csv, as estimator inputs.

The fields are the sources' own words: a row says "n/a (all layers MoE)", "first 3 layers dense
(ffn 18432), remaining 58 MoE", "MLA (q_lora 1536, kv_lora 512, ...)", "FP8 (inferred; ...)",
"4 per tray; NVL72". Each field is read for what it states, and what it leaves out is filled by
a stated rule (listed in `PublishedRun.assumed`); a row whose model, cluster or configuration
cannot be read is refused with the reason (`RowError`). Nothing is fitted to a row's figure.

What a row becomes:
  model      a `moe:` spec (experts, MLA) or a `llama:`/`gpt:` one for dense rows; a head size
             from the notes ("head dim 128", "head_dim 64") where it is not hidden / heads
  cluster    the device by name (H100, B200, GB200, ...), nodes of `gpus_per_node` GPUs; on a
             GB200/GB300 the node is the NVLink domain (NVL72: the largest divisor of the GPUs
             up to 72 that is a multiple of the 4 GPUs of a tray)
  config     tp, pp, dp, ep, cp, interleaving (vpp), the micro-batch (1 where not stated), ZeRO
             (Megatron's distributed optimizer is ZeRO-1, FSDP ZeRO-3), recompute (Megatron's
             selective recompute of norms and activations costs too little to price: none),
             offload, the precision (FP8/MXFP8 prices matmuls at the device's FP8 rate)
  runtime    Megatron-Core's overlap for Megatron, NeMo and Megatron-Bridge rows (distributed
             optimizer, overlapped gradient reduction and parameter gather), PyTorch's for
             FSDP2 rows (torchtitan, NeMo Automodel, torchtune) and DeepSpeed's; the experts'
             dispatcher as the row names it (DeepEP and HybridEP deduplicate tokens per
             destination: cost.experts.exchange_time; Megatron's all-to-all where unnamed), and
             their all-to-alls overlapped with another micro-batch where the row says so
  figure     model TFLOP/s per GPU by the source's own count (`flops_per_sequence`: Megatron's
             model FLOPs count causal attention at half the score matrix, NeMo's long-context
             tables and others the full matrix; MoE layers count the top-k experts a token
             uses), tokens/s per GPU or in all, seconds per step, MFU, peak memory
"""

from __future__ import annotations

import csv
import re
from dataclasses import dataclass, field
from pathlib import Path

from autopar.cost.config import Config
from autopar.cost.megatron import megatron_placements
from autopar.cost.estimator import estimate_stages
from autopar.cost.mesh import Mesh
from autopar.cost.stages import uniform_stages
from autopar.errors import AutoparError
from autopar.plans.vocabulary import Schedule

KINDS = ("moe", "cp", "offload")
# Where a row's MLA gives only its ranks (Kimi-K2), DeepSeek-V3's head dims, which it shares.
MLA_DEFAULTS = {"qk_nope": 128, "qk_rope": 64, "v_head": 128}
NVLINK_DOMAIN = 72
TRAY = 4


class RowError(AutoparError):
    """A published row that cannot be modeled; the message says why."""


@dataclass(frozen=True, slots=True)
class PublishedRun:
    name: str
    kind: str
    spec: str                       # model spec for autopar.models.build_model
    mesh: Mesh
    config: Config
    precision: str                  # bf16, fp16, fp8
    runtime: str                    # a cost/overlap.py runtime
    figure: str                     # tflops_per_gpu, tokens_per_s_per_gpu, tokens_per_s, step_time_s,
                                    # mfu_pct, peak_mem_gib
    value: float                    # the published figure
    causal_flops: bool              # the source's model FLOPs halve causal attention
    offload: bool = False           # model states on the host (ZeRO-3's or ZeRO-Offload's)
    dispatch: str = "all-to-all"    # experts' dispatcher: "deduplicated" for DeepEP and HybridEP
    overlap_exchange: bool = False  # experts' all-to-alls behind another micro-batch's compute
    dims: dict = field(default_factory=dict)    # the spec's keys, for `flops_per_sequence`
    trust: str = ""
    assumed: tuple = field(default=())


def read_rows(path: str | Path) -> list[dict]:
    with open(path, newline="") as handle:
        return [row for row in csv.DictReader(handle) if any((v or "").strip() for v in row.values())]


def parse_row(row: dict, index: int) -> PublishedRun:
    """One CSV row as an estimator input; RowError names what cannot be read."""
    assumed: list[str] = []
    kind = _text(row, "kind").lower()
    if kind not in KINDS:
        raise RowError(f"kind {kind!r} is not one of {KINDS}")
    spec, dims = _model_spec(row, assumed)
    mesh = _mesh(row, assumed)
    config = _config(row, mesh, assumed)
    offload = _zero(row)[1]
    figure = _figure_kind(_text(row, "figure_kind"))
    value = _number(_text(row, "figure_value"), "figure_value")
    words = " ".join(_text(row, key).lower() for key in ("notes", "source", "model"))
    causal = "full attention" not in words and "full (non-causal) attention" not in words
    dispatch = "deduplicated" if ("deepep" in words or "hybridep" in words) else "all-to-all"
    overlap = "a2a overlap" in words or "overlapped with 1f1b" in words
    return PublishedRun(name=f"{index}: {_text(row, 'model')}", kind=kind, spec=spec, mesh=mesh,
                        config=config, precision=_precision(_text(row, "precision")),
                        runtime=_runtime(row), figure=figure, value=value, causal_flops=causal,
                        offload=offload, dispatch=dispatch, overlap_exchange=overlap, dims=dims, trust=_text(row, "trust"), assumed=tuple(assumed))


def estimate_run(graph, run: PublishedRun, *, calibration=None, cache: dict | None = None):
    """The estimator's prediction for a row: its configuration on its mesh, as its runtime
    overlaps, at its precision; offload on every stage where the row offloads (ZeRO-Offload's
    optimizer-only form under ZeRO-1/2, which a Config does not take). Tensor parallelism is
    priced on Megatron-LM's layout, as these frameworks split the dense layers (cost.megatron)."""
    placements = megatron_placements(graph, run.config.tp,
                                     sequence_parallel=run.config.sequence_parallel)
    stages = uniform_stages(graph, run.config, placements)
    for stage in stages:
        stage.offload = run.offload
    config = run.config
    return estimate_stages(graph, run.mesh, stages, global_batch=config.global_batch,
                           micro_batch=config.micro_batch, schedule=config.schedule,
                           virtual=config.virtual, runtime=run.runtime, calibration=calibration,
                           precision=run.precision, cache=cache, dispatch=run.dispatch,
                           overlap_exchange=run.overlap_exchange)


def flops_per_sequence(run: PublishedRun) -> float:
    """Model FLOPs of one sequence's training step as the sources count them: the matmuls only,
    3x the forward (backward twice), a multiply-add 2; attention's two matmuls over the score
    matrix, half of it where the source halves causal attention (`causal_flops`); MoE layers
    the top-k experts a token uses and its shared experts, with the router."""
    d = run.dims
    seq, hidden, heads = d["seq"], d["hidden"], d["heads"]
    if d.get("kv_lora"):
        qk, v = d["qk_nope"] + d["qk_rope"], d["v_head"]
        query = (hidden * d["q_lora"] + d["q_lora"] * heads * qk) if d["q_lora"] else hidden * heads * qk
        projections = (query + hidden * (d["kv_lora"] + d["qk_rope"])
                       + d["kv_lora"] * heads * (d["qk_nope"] + v) + heads * v * hidden)
    else:
        qk = v = d.get("head_dim", hidden // heads)
        kv_heads = d.get("kv_heads", heads)
        projections = 2 * hidden * heads * qk + 2 * hidden * kv_heads * qk
    scores = seq * heads * (qk + v) * (0.5 if run.causal_flops else 1.0)
    gated = 2 if run.spec.startswith("gpt:") else 3        # GELU MLP or SwiGLU
    dense_mlp = gated * hidden * d.get("ffn", 4 * hidden)
    per_layer = [projections + scores + dense_mlp] * d["layers"]
    if d.get("experts"):
        routed = (d["top_k"] * 3 * hidden * d["expert_ffn"] + hidden * d["experts"]
                  + 3 * hidden * d.get("shared_experts", 0) * d.get("shared_ffn", d["expert_ffn"]))
        every, first = d.get("moe_every", 1), d.get("dense_layers", 0)
        per_layer = [projections + scores + (routed if i >= first and i % every == 0 else dense_mlp)
                     for i in range(d["layers"])]
    return 6 * seq * (sum(per_layer) + hidden * d["vocab"])


def predicted_figure(run: PublishedRun, step_time_s: float, memory_bytes: float) -> float:
    """The figure the row publishes, from a predicted step time and peak memory."""
    gpus = run.mesh.world_size
    tokens = run.config.global_batch * run.dims["seq"]
    flops = flops_per_sequence(run) * run.config.global_batch
    return {"tflops_per_gpu": flops / step_time_s / gpus / 1e12,
            "tokens_per_s_per_gpu": tokens / step_time_s / gpus,
            "tokens_per_s": tokens / step_time_s,
            "step_time_s": step_time_s,
            "mfu_pct": 100 * flops / step_time_s / gpus / run.mesh.device.flops("bfloat16"),
            "peak_mem_gib": memory_bytes / 2**30}[run.figure]


# --- fields --------------------------------------------------------------------------------------

def _text(row: dict, key: str) -> str:
    return (row.get(key) or "").strip()


def _number(text: str, what: str) -> float:
    """The first number of a field; a K or M right after it scales it (sequence 128K)."""
    match = re.search(r"(\d+(?:\.\d+)?)\s*([kKmM]?)", text.replace(",", ""))
    if not match:
        raise RowError(f"{what} {text!r} holds no number")
    scale = {"k": 1024, "m": 1024 ** 2}.get(match.group(2).lower(), 1)
    return float(match.group(1)) * scale


def _integer(row: dict, key: str, default: int | None = None) -> int:
    text = _text(row, key)
    if not text or text.lower().startswith(("n/a", "none", "-")):
        if default is None:
            raise RowError(f"{key} is not given")
        return default
    return int(_number(text, key))


def _model_spec(row: dict, assumed: list) -> tuple[str, dict]:
    """The row's model as a spec, and the spec's keys."""
    layers, hidden, heads = (_integer(row, key) for key in ("layers", "hidden", "heads"))
    keys = {"layers": layers, "hidden": hidden, "heads": heads, "seq": _integer(row, "seq_len"),
            "vocab": _integer(row, "vocab")}
    kv_text = _text(row, "kv_heads")
    mla = _mla(kv_text, assumed) if "mla" in kv_text.lower() else {}
    if not mla:
        keys["kv_heads"] = _integer(row, "kv_heads", heads)
    head_dim = re.search(r"head[ _]dim\s*(\d+)", _text(row, "notes").lower())
    experts = _integer(row, "num_experts", 0)
    ffn = _integer(row, "ffn_hidden", 0)
    if experts or mla:
        keys.update(_moe_keys(row, experts, ffn, assumed), **mla)
        if head_dim and not mla:
            keys["head_dim"] = int(head_dim.group(1))
        return "moe:" + ",".join(f"{k}={v}" for k, v in keys.items()), keys
    if ffn:
        keys["ffn"] = ffn
    if "gpt" in _text(row, "model").lower():          # GPT-2/3: learned positions, GELU MLP
        keys.pop("kv_heads", None)
        return "gpt:" + ",".join(f"{k}={v}" for k, v in keys.items()) + ",bias=false", keys
    if head_dim:
        assumed.append("head size hidden / heads (a llama: spec has no head_dim)")
    return "llama:" + ",".join(f"{k}={v}" for k, v in keys.items()), keys


def _mla(text: str, assumed: list) -> dict:
    found = {name: int(value) for name, value in
             re.findall(r"(q_lora|kv_lora|qk_nope|qk_rope|v)\w*\s*[:=]?\s*(\d+)", text.lower())}
    if "kv_lora" not in found:
        raise RowError(f"MLA attention {text!r} does not give kv_lora")
    keys = {"q_lora": found.get("q_lora", 0), "kv_lora": found["kv_lora"],
            "qk_nope": found.get("qk_nope"), "qk_rope": found.get("qk_rope"),
            "v_head": found.get("v")}
    for key, default in MLA_DEFAULTS.items():
        if keys[key] is None:
            keys[key] = default
            assumed.append(f"MLA {key} {default} (DeepSeek-V3's)")
    return keys


def _moe_keys(row: dict, experts: int, ffn: int, assumed: list) -> dict:
    keys = {"experts": experts, "top_k": _integer(row, "top_k", 1 if experts else 0)}
    if experts:
        keys["expert_ffn"] = _integer(row, "expert_ffn_hidden", ffn or None)
    shared = _text(row, "shared_experts").lower()
    count = re.match(r"\s*(\d+)", shared)
    if count and int(count.group(1)):
        keys["shared_experts"] = int(count.group(1))
        width = re.search(r"x\s*(\d+)", shared)
        if width:
            keys["shared_ffn"] = int(width.group(1))
    frequency = _text(row, "moe_layer_freq").lower()
    dense = re.search(r"first\s+(\d+)\s+layers?\s+dense", frequency)
    if dense:
        keys["dense_layers"] = int(dense.group(1))
        width = re.search(r"ffn\s*(\d+)", frequency)
        ffn = int(width.group(1)) if width else ffn
    every = re.search(r"every\s+(\d+|other)", frequency)
    if every:
        keys["moe_every"] = 2 if every.group(1) == "other" else int(every.group(1))
    if keys.get("dense_layers") and not ffn:
        raise RowError(f"{keys['dense_layers']} dense layers but no dense ffn width given")
    if ffn:
        keys["ffn"] = ffn
    if "sliding" in frequency:
        assumed.append("sliding-window layers priced as full attention")
    return keys


_DEVICES = (("gb300", "gb300-288g"), ("gb200", "gb200-186g"), ("b200", "b200-180g"),
            ("h200", "h200-141g"), ("h100", "h100-80g"), ("h800", "h800-80g"),
            ("a100", "a100-80g"), ("a800", "a800-80g"),
            ("v100", "v100-32g"), ("l40s", "l40s-48g"), ("4090", "rtx4090-24g"),
            ("3090", "rtx3090-24g"))


def _device(text: str) -> str:
    lower = text.lower().replace(" ", "")
    for key, name in _DEVICES:
        if key in lower:
            memory = re.search(r"(\d+)gb", lower)
            if key == "h100" and memory and int(memory.group(1)) > 90:
                return "h100-96g"
            if key == "a100" and memory and int(memory.group(1)) == 40:
                return "a100-40g"
            return name
    raise RowError(f"GPU {text!r} is not in autopar's device table")


def _mesh(row: dict, assumed: list) -> Mesh:
    device = _device(_text(row, "gpu"))
    gpus = _integer(row, "gpus")
    where = f"{_text(row, 'gpus_per_node')} {_text(row, 'interconnect')}".lower()
    if "nvl72" in where or device.startswith("gb"):
        per_node = max(n for n in range(1, min(gpus, NVLINK_DOMAIN) + 1)
                       if gpus % n == 0 and (n % TRAY == 0 or n == gpus))
        assumed.append(f"NVLink domain of {per_node} GPUs")
    else:
        per_node = min(gpus, _integer(row, "gpus_per_node", 8))
        if gpus % per_node:
            raise RowError(f"{gpus} GPUs do not fill nodes of {per_node}")
    nodes = gpus // per_node
    return Mesh.parse(f"{nodes}x{per_node}:{device}" if nodes > 1 else f"{per_node}:{device}")


def _config(row: dict, mesh: Mesh, assumed: list) -> Config:
    tp, pp, cp, ep = (_integer(row, key, 1) for key in ("tp", "pp", "cp", "ep"))
    virtual = _integer(row, "vpp", 1)
    dp = mesh.world_size // (tp * pp * cp)
    if tp * pp * cp * dp != mesh.world_size:
        raise RowError(f"tp x pp x cp = {tp * pp * cp} does not divide the {mesh.world_size} GPUs")
    stated = _integer(row, "dp", dp)
    if stated != dp:
        assumed.append(f"dp {dp} (= GPUs / (tp pp cp); the row says {stated})")
    seq = _integer(row, "seq_len")
    batch = _integer(row, "global_batch")
    if "token" in _text(row, "global_batch_unit").lower():
        batch //= seq
    micro = _integer(row, "micro_batch", 1)
    if not _text(row, "micro_batch"):
        assumed.append("micro-batch 1")
    zero, _ = _zero(row)
    try:
        return Config(tp=tp, pp=pp, dp=dp, cp=cp, ep=ep, virtual=virtual, global_batch=batch,
                      micro_batch=micro, recompute=_recompute(_text(row, "recompute")), zero=zero,
                      sequence_parallel=tp > 1,
                      schedule=Schedule.INTERLEAVED_1F1B if virtual > 1 else Schedule.ONE_F_ONE_B)
    except AutoparError as err:
        raise RowError(f"configuration: {err}") from None


def _zero(row: dict) -> tuple[int, bool]:
    """(ZeRO level, offload) from the sharding and offload fields."""
    sharding = _text(row, "zero_fsdp").lower()
    offload = _text(row, "offload").lower()
    offloaded = bool(offload) and not offload.startswith("none") and "cpu" in offload
    stage = re.search(r"zero[- ]?(\d)", sharding)
    if stage:
        return int(stage.group(1)), offloaded
    if "fsdp" in sharding or "full shard" in sharding:
        return 3, offloaded
    return 1, offloaded         # Megatron's distributed optimizer, stated or (NeMo) by default


def _recompute(text: str) -> str:
    lower = text.lower()
    if "full" in lower or ("checkpointing" in lower and "selective" not in lower
                           and not lower.startswith("none")):
        return "full"
    return "none"


def _precision(text: str) -> str:
    lower = text.lower()
    if "fp8" in lower or "float8" in lower:
        return "fp8"
    return "fp16" if "fp16" in lower else "bf16"


def _runtime(row: dict) -> str:
    words = f"{_text(row, 'source')} {_text(row, 'zero_fsdp')}".lower()
    if "deepspeed" in words:
        return "deepspeed-2021" if "zero-3" in words else "torch"
    if "fsdp" in words or "torchtitan" in words or "torchtune" in words:
        return "torch"
    return "megatron-core"


def _figure_kind(text: str) -> str:
    lower = text.lower()
    if "mfu" in lower:
        return "mfu_pct"
    if "mem" in lower:
        return "peak_mem_gib"
    if "step" in lower:
        return "step_time_s"
    if "token" in lower:
        return "tokens_per_s" if "aggregate" in lower or "per_gpu" not in lower.replace(" ", "_") \
            else "tokens_per_s_per_gpu"
    if "flop" in lower:
        return "tflops_per_gpu"
    raise RowError(f"figure_kind {text!r} is not a figure autopar predicts")
