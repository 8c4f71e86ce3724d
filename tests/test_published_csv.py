"""`benchmarks/published_runs.py --csv FILE --json`: any CSV with the published-runs columns is read
and every row priced or failed with its reason (no processes; small models captured on meta)."""

import csv
import json
import subprocess
import sys
from pathlib import Path

COLUMNS = ("kind,model,layers,hidden,heads,kv_heads,ffn_hidden,vocab,num_experts,top_k,expert_ffn_hidden,"
           "shared_experts,moe_layer_freq,seq_len,global_batch,global_batch_unit,micro_batch,gpu,gpus,"
           "gpus_per_node,interconnect,tp,pp,vpp,cp,ep,etp,dp,zero_fsdp,offload,recompute,precision,"
           "tflops_per_gpu,mfu_pct,tokens_per_s_per_gpu,step_time_s,peak_mem_gib,figure_kind,"
           "figure_value,source,inferred_fields,trust,notes").split(",")
DENSE = dict(layers=2, hidden=256, heads=8, kv_heads=4, ffn_hidden=512, vocab=1024, seq_len=1024,
             global_batch=16, global_batch_unit="sequences", micro_batch=1, gpu="H100", gpus=8,
             gpus_per_node=8, precision="BF16", trust="A")
ROWS = [
    # experts split over ep=4 beside Megatron's tensor parallelism (tp=2)
    dict(DENSE, kind="moe", model="tiny MoE", num_experts=8, top_k=2, expert_ffn_hidden=128,
         shared_experts=0, moe_layer_freq="every layer", tp=2, ep=4, figure_kind="tflops_per_gpu",
         figure_value=100),
    # context parallelism with tensor parallelism
    dict(DENSE, kind="cp", model="tiny Llama", tp=2, cp=2, seq_len=4096, figure_kind="step_time_s",
         figure_value=0.05, zero_fsdp="FSDP full shard"),
    # ZeRO-3 with CPU offload on one consumer card
    dict(DENSE, kind="offload", model="tiny Llama offloaded", gpu="RTX 4090", gpus=1, gpus_per_node=1,
         zero_fsdp="ZeRO-3", offload="CPU (params and optimizer)", figure_kind="step_time_s",
         figure_value=0.5, source="DeepSpeed"),
    # the export H800 (DeepSeek-V3's), its NVLink a fraction of an H100's
    dict(DENSE, kind="moe", model="tiny MoE on H800s", gpu="H800 SXM5 80GB", gpus=16,
         num_experts=8, top_k=2, expert_ffn_hidden=128, shared_experts=0,
         moe_layer_freq="every layer", ep=8, figure_kind="tflops_per_gpu", figure_value=100),
    # a device that is not in the table: failed, with the reason
    dict(DENSE, kind="cp", model="unknown card", gpu="TPU v5", figure_kind="step_time_s", figure_value=1),
]


def test_every_row_is_priced_or_fails_with_its_reason(tmp_path):
    path = tmp_path / "runs.csv"
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=COLUMNS)
        writer.writeheader()
        writer.writerows({key: row.get(key, "") for key in COLUMNS} for row in ROWS)
    script = Path(__file__).parent.parent / "benchmarks" / "published_runs.py"
    done = subprocess.run([sys.executable, str(script), "--csv", str(path), "--json"],
                          capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    summary = json.loads(done.stdout)
    assert (summary["estimated"], summary["failed"]) == (4, 1), summary["rows"]
    failed = [row for row in summary["rows"] if row["status"] == "failed"]
    assert "TPU v5" in failed[0]["reason"] and "device table" in failed[0]["reason"]
    for row in summary["rows"][:3]:
        assert row["predicted"] > 0 and row["error"] == row["predicted"] / row["published"] - 1
    moe, context, offload = summary["rows"][:3]
    assert (moe["config"]["tp"], moe["config"]["ep"]) == (2, 4) and moe["comm"].get("expert", 0) > 0
    assert context["config"]["cp"] == 2 and offload["config"]["offload"]
    assert summary["rows"][3]["mesh"] == "2x8:h800-80g"
    assert set(summary) >= {"estimated", "failed", "median_abs_err", "worst_abs_err", "rows"}


def test_reference_tables_of_other_columns_are_refused_naming_the_missing_ones(tmp_path):
    import pytest

    from autopar.cost.reference import published_runs, sc21_runs
    from autopar.errors import AutoparError

    other = tmp_path / "other.csv"
    other.write_text("source,spec,mesh,tp\nx,gpt-tiny,4:cpu,1\n")
    with pytest.raises(AutoparError, match=r"lacks the column\(s\) pp, virtual.*published_runs.csv"):
        published_runs(other)
    with pytest.raises(AutoparError, match=r"lacks the column\(s\) params_b, layers.*sc21_table1.csv"):
        sc21_runs(other)
    script = Path(__file__).resolve().parents[1] / "benchmarks" / "published_runs.py"
    run = subprocess.run([sys.executable, str(script), "--runs", str(other)], capture_output=True,
                         text=True)
    assert run.returncode == 1 and run.stderr.startswith("error: ") and "Traceback" not in run.stderr
