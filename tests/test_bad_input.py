"""Bad input, refused clearly: every case must end in an AutoparError (or, on the command line, a
non-zero exit with a one-line `autopar CMD: error:` or argparse message and no traceback) whose
message names the problem, before any work starts. Nothing may be accepted silently, crash with
another exception or hang.

CASES is a flat list so that the suite grows by appending; `classify` is shared with
benchmarks/bad_input.py, which counts the outcomes (clear / unclear / accepted / traceback / hang).
No case starts processes or plans a model: each one is refused by a check at the front door.
"""

from __future__ import annotations

import contextlib
import copy
import io
import json
import math
import re
import signal
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import pytest
import torch
from torch import nn

import autopar
import autopar.api as api
from autopar.cli import main
from autopar.cost.mesh import Mesh
from autopar.errors import AutoparError
from autopar.models import parse_spec
from autopar.plans import Plan, Stage

HANG_S = 60      # a case that takes longer than this counts as a hang


@dataclass(frozen=True)
class Case:
    id: str
    run: Callable[[Path], object]   # given a scratch folder; raises, or returns a CLI result
    words: str                      # regex the message must contain (case-insensitive)


@dataclass(frozen=True)
class CliResult:
    code: int
    stderr: str


def cli(*argv: str) -> CliResult:
    """`autopar ARGV` in this process: its exit code and what it wrote to stderr."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(list(argv))
        except SystemExit as exit_:   # argparse
            code = exit_.code if isinstance(exit_.code, int) else 1
    return CliResult(code, err.getvalue())


def classify(case: Case, scratch: Path) -> tuple[str, str]:
    """(outcome, message): "clear", "unclear" (refused, but the message misses the words),
    "accepted" (no error), "traceback" (another exception escaped), or "hang"."""
    def alarm(signum, frame):
        raise TimeoutError(f"no answer within {HANG_S} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    pending = signal.alarm(HANG_S)    # an outer alarm (pytest-timeout's) is re-armed afterwards
    try:
        result = case.run(scratch)
    except TimeoutError as err:
        return "hang", str(err)
    except AutoparError as err:
        message = str(err)
    except Exception as err:   # what the suite exists to find
        return "traceback", f"{type(err).__name__}: {err}"
    else:
        if not isinstance(result, CliResult) or result.code == 0:
            return "accepted", repr(result)
        if "Traceback" in result.stderr:
            return "traceback", result.stderr
        message = result.stderr
    finally:
        signal.signal(signal.SIGALRM, previous)
        signal.alarm(pending)
    return ("clear" if re.search(case.words, message, re.IGNORECASE | re.DOTALL) else "unclear"), message


# ---------------------------------------------------------------------------------------------
# Plan files
# ---------------------------------------------------------------------------------------------


def plan_dict() -> dict:
    """A valid two-stage plan on 2x4 devices: dp=2 x tp=2 per stage."""
    stages = [Stage(index=i, layers=layers, ranks=list(range(4 * i, 4 * i + 4)), tp=2, dp=2,
                    predicted={"time_per_micro_batch_s": 0.01, "memory_bytes": 2**30})
              for i, layers in enumerate([["tok_emb", "layers.0"], ["layers.1", "lm_head"]])]
    plan = Plan(fingerprint="0123456789abcdef", mesh=Mesh.parse("2x4:a100-80g").to_dict(),
                axes=[["dp", 2], ["tp", 2]], stages=stages, global_batch=64, micro_batches=8,
                micro_batch_size=4, parameters={"tok_emb.weight": ["R", "S(0)"],
                                                "lm_head.weight": ["S(0)", "S(1)"]},
                nodes={"mm": ["S(0)", "P"]}, predicted={"step_time_s": 0.1}, model_type="GPT")
    return json.loads(plan.to_json())


def bad_plan(change: Callable[[dict], object]) -> Callable[[Path], object]:
    def run(scratch: Path):
        data = plan_dict()
        change(data)
        return Plan.from_dict(data)
    return run


def interleaved(data: dict) -> None:
    """Four chunks on two pipeline ranks, the last on the wrong ranks."""
    data.update(schedule="interleaved-1f1b", virtual=2)
    extra = copy.deepcopy(data["stages"])
    for i, stage in enumerate(extra):
        stage["index"] = i + 2
    extra[1]["ranks"] = list(range(4))
    data["stages"] += extra


PLAN_CASES = [
    Case("plan-schema-string", bad_plan(lambda d: d.update(schema_version="1")), "schema version"),
    Case("plan-schema-bool", bad_plan(lambda d: d.update(schema_version=True)), "schema version"),
    Case("plan-schema-future", bad_plan(lambda d: d.update(schema_version=4)), "schema version 4"),
    Case("plan-missing-field", bad_plan(lambda d: d.pop("stages")), r"lacks fields \['stages'\]"),
    Case("plan-unknown-field", bad_plan(lambda d: d.update(colour="blue")), "unknown fields.*colour"),
    Case("plan-not-object", lambda s: Plan.from_dict([1, 2]), "JSON object"),
    Case("plan-no-stages", bad_plan(lambda d: d.update(stages=[])), "stages.*non-empty"),
    Case("plan-stage-not-object", bad_plan(lambda d: d.update(stages=[1])), "stage 1 is not an object"),
    Case("plan-batch-zero", bad_plan(lambda d: d.update(global_batch=0)), "global_batch.*integer from 1"),
    Case("plan-batch-1e12", bad_plan(lambda d: d.update(global_batch=10**12)),
         "global_batch.*integer from 1"),
    Case("plan-batch-string", bad_plan(lambda d: d.update(global_batch="64")), "global_batch.*integer"),
    Case("plan-batch-float", bad_plan(lambda d: d.update(global_batch=64.0)), "global_batch.*integer"),
    Case("plan-micro-batches-zero", bad_plan(lambda d: d.update(micro_batches=0)), "micro_batches"),
    Case("plan-micro-batches-1e12", bad_plan(lambda d: d.update(micro_batches=10**12)), "micro_batches"),
    Case("plan-micro-batches-1e6", bad_plan(lambda d: d.update(micro_batches=10**6, global_batch=8 * 10**6)),
         r"micro_batches.*integer from 1 to 65536"),
    Case("plan-micro-batch-size-negative", bad_plan(lambda d: d.update(micro_batch_size=-1)),
         "micro_batch_size"),
    Case("plan-batch-does-not-split", bad_plan(lambda d: d.update(global_batch=65)),
         "global_batch 65 is not dp x micro_batches x micro_batch_size"),
    Case("plan-schedule-unknown", bad_plan(lambda d: d.update(schedule="2f2b")), "schedule.*2f2b"),
    Case("plan-zero-bubble-recomputes",
         bad_plan(lambda d: (d.update(schedule="zero-bubble"), d["stages"][1].update(recompute="selective"))),
         "zero-bubble schedule does not recompute.*'1f1b'"),
    Case("plan-virtual-zero", bad_plan(lambda d: d.update(virtual=0)), "virtual"),
    Case("plan-virtual-without-interleaving", bad_plan(lambda d: d.update(virtual=2)),
         "virtual=2.*interleaved"),
    Case("plan-stages-not-multiple-of-virtual",
         bad_plan(lambda d: d.update(virtual=3, schedule="interleaved-1f1b")), "not a multiple of virtual"),
    Case("plan-stages-out-of-order",
         bad_plan(lambda d: [s.update(index=1 - s["index"]) for s in d["stages"]]), "in order"),
    Case("plan-ranks-twice", bad_plan(lambda d: d["stages"][1].update(ranks=[0, 1, 2, 3])),
         "exactly once"),
    Case("plan-rank-outside-mesh", bad_plan(lambda d: d["stages"][1].update(ranks=[4, 5, 6, 8])),
         r"ranks.*integer from 0 to 7"),
    Case("plan-rank-negative", bad_plan(lambda d: d["stages"][1].update(ranks=[-1, 5, 6, 7])), "ranks"),
    Case("plan-ranks-wrong-count", bad_plan(lambda d: d["stages"][0].update(ranks=[0, 1])),
         "must list the 4 ranks"),
    Case("plan-interleaved-chunk-misplaced", bad_plan(interleaved), r"stages\[3\].*belongs on"),
    Case("plan-tp-not-axes", bad_plan(lambda d: d["stages"][0].update(tp=4)), "tp=4.*sub-mesh"),
    Case("plan-dp-zero", bad_plan(lambda d: d["stages"][0].update(dp=0)), r"stages\[0\].dp"),
    Case("plan-recompute-unknown", bad_plan(lambda d: d["stages"][0].update(recompute="some")),
         "recompute.*some"),
    Case("plan-zero-4", bad_plan(lambda d: d["stages"][0].update(zero=4)), r"zero.*0 to 3"),
    Case("plan-zero-bool", bad_plan(lambda d: d["stages"][0].update(zero=True)), "zero"),
    Case("plan-sequence-parallel-string",
         bad_plan(lambda d: d["stages"][0].update(sequence_parallel="yes")), "sequence_parallel"),
    Case("plan-ep-zero", bad_plan(lambda d: d["stages"][0].update(ep=0)), r"stages\[0\].ep"),
    Case("plan-ep-bool", bad_plan(lambda d: d["stages"][0].update(ep=True)), r"stages\[0\].ep"),
    Case("plan-ep-not-dividing-ranks", bad_plan(lambda d: d["stages"][1].update(ep=3)),
         r"ep=3.*does not divide.*4 ranks.*\[1, 2, 4\]"),
    Case("plan-layers-not-names", bad_plan(lambda d: d["stages"][0].update(layers=[0, 1])), "layers"),
    Case("plan-axes-empty", bad_plan(lambda d: d.update(axes=[])), "axes"),
    Case("plan-axes-malformed", bad_plan(lambda d: d.update(axes=[["dp"]])), "axes"),
    Case("plan-axes-twice", bad_plan(lambda d: d.update(axes=[["dp", 2], ["dp", 2]])), "axis twice"),
    Case("plan-axis-size-zero", bad_plan(lambda d: d.update(axes=[["dp", 0], ["tp", 2]])), "axes.*dp"),
    Case("plan-mesh-empty", bad_plan(lambda d: d.update(mesh={})), "mesh.*not a mesh"),
    Case("plan-mesh-axis-negative", bad_plan(lambda d: d["mesh"]["axes"][0].update(size=-2)),
         r"axes\[0\].size"),
    Case("plan-mesh-bandwidth-nan",
         bad_plan(lambda d: d["mesh"]["device"].update(hbm_bandwidth=math.nan)), "hbm_bandwidth"),
    Case("plan-placement-unparsable",
         bad_plan(lambda d: d["parameters"].update({"tok_emb.weight": ["R", "S(x)"]})),
         r"parameters\['tok_emb.weight'\].*R, P or S\(dim\)"),
    Case("plan-placement-wrong-axes",
         bad_plan(lambda d: d["parameters"].update({"tok_emb.weight": ["R"]})), "one placement per axis"),
    Case("plan-node-placement-not-list", bad_plan(lambda d: d["nodes"].update(mm="S(0)")), r"nodes\['mm'\]"),
    Case("plan-parameters-not-object", bad_plan(lambda d: d.update(parameters=[])), "parameters"),
    Case("plan-model-type-not-string", bad_plan(lambda d: d.update(model_type=123)), "model_type"),
    Case("plan-replicated-ops-not-list", bad_plan(lambda d: d.update(replicated_ops="mm")),
         "replicated_ops"),
    Case("plan-predicted-not-object", bad_plan(lambda d: d.update(predicted=[])), "predicted"),
]


def write(name: str, text: str | bytes) -> Callable[[Path], Path]:
    def make(scratch: Path) -> Path:
        path = scratch / name
        (path.write_bytes if isinstance(text, bytes) else path.write_text)(text)
        return path
    return make


def shapes(change: dict) -> Callable[[Path], object]:
    def run(scratch: Path):
        plan = Plan.from_dict(plan_dict())
        plan.parameters.update(change)
        return plan.check_shapes({"tok_emb.weight": (250, 64), "lm_head.weight": (256, 64)})
    return run


def node_dims(change: dict) -> Callable[[Path], object]:
    def run(scratch: Path):
        plan = Plan.from_dict(plan_dict())
        plan.nodes.update(change)
        return plan.check_node_ranks({"mm": 2})
    return run


PLAN_FILE_CASES = [
    Case("plan-file-missing", lambda s: Plan.load(s / "none.json"), "no plan file"),
    Case("plan-file-not-json", lambda s: Plan.load(write("p.json", "{not json")(s)), "not valid JSON"),
    Case("plan-file-binary", lambda s: Plan.load(write("p.json", b"\xff\xfe\x00")(s)), "not valid JSON"),
    Case("plan-file-array", lambda s: Plan.load(write("p.json", "[1]")(s)), "JSON object"),
    Case("plan-file-folder", lambda s: Plan.load(s), "cannot be read"),
    Case("plan-shard-missing-dim", shapes({"tok_emb.weight": ["R", "S(2)"]}),
         "dim 2, which it does not have"),
    Case("plan-shard-uneven", shapes({"tok_emb.weight": ["S(0)", "S(0)"]}),
         r"dim 0 of parameter 'tok_emb.weight' \(size 250\) into 4 parts"),
    Case("plan-unknown-parameter", shapes({"nope.weight": ["R", "R"]}), "nope.weight.*does not have"),
    Case("plan-node-shard-beyond-its-dims", node_dims({"mm": ["S(0)", "S(3)"]}),
         "node 'mm' on dim 3, but its output has 2 dims"),
]

# ---------------------------------------------------------------------------------------------
# Meshes: specs and files
# ---------------------------------------------------------------------------------------------


def mesh_file(name: str, text: str) -> Callable[[Path], object]:
    return lambda scratch: Mesh.load(write(name, text)(scratch))


def mesh_json(change: Callable[[dict], object]) -> str:
    data = Mesh.parse("2x4:a100-80g").to_dict()
    change(data)
    return json.dumps(data)


MESH_CASES = [
    Case("mesh-unknown-device", lambda s: Mesh.parse("4:gpu9000"), "unknown device 'gpu9000'"),
    Case("mesh-zero-nodes", lambda s: Mesh.parse("0x8:a100-80g"), "at least one node"),
    Case("mesh-absurd", lambda s: Mesh.parse("1000000x1000000:a100-80g"), "more than autopar plans for"),
    Case("mesh-malformed", lambda s: Mesh.parse("4x:cpu"), "malformed"),
    Case("mesh-file-bad-json", mesh_file("m.json", "{'device':"), "m.json is not valid JSON"),
    Case("mesh-file-bad-toml", mesh_file("m.toml", "[device\nname = 1"), "m.toml is not valid TOML"),
    Case("mesh-file-negative-size", mesh_file("m.json", mesh_json(lambda d: d["axes"][1].update(size=-8))),
         r"axes\[1\].size is -8"),
    Case("mesh-file-no-device", mesh_file("m.json", mesh_json(lambda d: d.pop("device"))), "device"),
    Case("mesh-file-bandwidth-string",
         mesh_file("m.json", mesh_json(lambda d: d["device"]["intra_node"].update(bandwidth="fast"))),
         r"intra_node.bandwidth is 'fast'"),
    Case("mesh-file-efficiency-above-one",
         mesh_file("m.json", mesh_json(lambda d: d["axes"][0]["link"].update(efficiency=2))), "efficiency"),
    Case("mesh-file-no-float32",
         mesh_file("m.json", mesh_json(lambda d: d["device"].update(peak_flops={"bfloat16": 1e15}))),
         "float32"),
    Case("mesh-file-absurd-size", mesh_file("m.json", mesh_json(lambda d: d["axes"][0].update(size=2**40))),
         "more than autopar plans for"),
    Case("mesh-file-missing", lambda s: Mesh.load(s / "none.toml"), "cannot be read"),
]

# ---------------------------------------------------------------------------------------------
# Model specs, sizes, API arguments
# ---------------------------------------------------------------------------------------------

MODEL_CASES = [
    Case("spec-negative-ffn", lambda s: parse_spec("gpt:ffn=-5"), "ffn=-5"),
    Case("spec-zero-layers", lambda s: parse_spec("gpt:layers=0"), "layers=0"),
    Case("spec-absurd-layers", lambda s: parse_spec("mlp:layers=100000"), "layers=100000.*1 to 1024"),
    Case("spec-not-integer", lambda s: parse_spec("gpt:hidden=abc"), "hidden='abc' is not an integer"),
    Case("spec-negative-rope", lambda s: parse_spec("llama:rope_theta=-1"), "rope_theta"),
    Case("spec-infinite-eps", lambda s: parse_spec("llama:norm_eps=inf"), "norm_eps"),
    Case("spec-kv-heads", lambda s: parse_spec("llama:kv_heads=3"), "kv_heads"),
    Case("spec-zero-hidden", lambda s: parse_spec("mlp:hidden=0"), "hidden=0"),
    Case("spec-unknown-family", lambda s: parse_spec("bert:layers=2"), "unknown model 'bert'"),
    Case("spec-unknown-key", lambda s: parse_spec("gpt:depth=3"), "unknown key 'depth'"),
    Case("spec-dropout", lambda s: parse_spec("gpt:dropout=1.5"), "dropout"),
    Case("spec-no-value", lambda s: parse_spec("gpt:layers"), "not key=value"),
]

SIZE_CASES = [
    Case("memory-half-byte", lambda s: api.parse_bytes("0.5"), "memory size '0.5'"),
    Case("memory-1e400", lambda s: api.parse_bytes("1e400"), "memory size '1e400'"),
    Case("memory-unknown-unit", lambda s: api.parse_bytes("80 parsecs"), "not understood"),
    Case("memory-negative", lambda s: api.parse_bytes(-1), "memory size -1"),
    Case("memory-nan", lambda s: api.parse_bytes(math.nan), "memory size nan"),
    Case("memory-list", lambda s: api.parse_bytes([80]), "not understood"),
    Case("batch-1e12", lambda s: api.check_planning(10**12, 60, None), "global_batch=1000000000000"),
    Case("batch-float", lambda s: api.check_planning(8.5, 60, None), "global_batch=8.5"),
    Case("time-limit-zero", lambda s: api.check_planning(8, 0, None), "time_limit=0"),
    Case("time-limit-inf", lambda s: api.check_planning(8, math.inf, None), "time_limit=inf"),
    Case("time-limit-nan", lambda s: api.check_planning(8, math.nan, None), "time_limit=nan"),
    Case("plan-mesh-not-a-mesh",
         lambda s: autopar.plan(nn.Linear(2, 2), 42, example_inputs=(torch.ones(1, 2),), global_batch=8),
         "neither an autopar.Mesh nor a spec"),
    Case("plan-absurd-batch",
         lambda s: autopar.plan(nn.Linear(2, 2), "4:cpu", example_inputs=(torch.ones(1, 2),),
                                global_batch=10**12), "global_batch"),
    # context parallelism and offload
    Case("plan-offload-without-zero3", bad_plan(lambda d: d["stages"][0].update(offload=True, zero=2)),
         "offload is true with zero=2.*set stages\\[0\\].zero to 3"),
    Case("plan-cp-kind-unknown", bad_plan(lambda d: d["stages"][1].update(cp_kind="spiral")),
         "stages\\[1\\].cp_kind.*ring, all-to-all"),
    Case("plan-cp-not-the-axes", bad_plan(lambda d: d["stages"][0].update(cp=2)),
         "tp=2 x dp=2 x cp=2, which is not its sub-mesh"),
    Case("estimate-offload-zero1", lambda s: cli("estimate", "gpt-tiny", "--mesh", "4:cpu",
                                                 "--global-batch", "8", "--offload", "--zero", "1"),
         "needs ZeRO-3"),
    Case("estimate-cp-sequence", lambda s: cli("estimate", "gpt-tiny", "--mesh", "32:cpu",
                                               "--global-batch", "1", "--cp", "32"),
         "does not split into 2 x cp = 64 equal chunks"),
]


def compile_with(**change) -> Callable[[Path], object]:
    arguments = dict(model=nn.Linear(2, 2), mesh="2:cpu", example_inputs=(torch.ones(2, 2),),
                     loss_fn=nn.functional.mse_loss,
                     optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    return lambda scratch: autopar.compile(**{**arguments, **change})


COMPILE_CASES = [
    Case("compile-optimizer-none", compile_with(optimizer=None), "optimizer must be a function"),
    Case("compile-optimizer-built",
         compile_with(optimizer=torch.optim.SGD(nn.Linear(2, 2).parameters(), lr=0.1)),
         "optimizer must be a function.*already built"),
    Case("compile-loss-string", compile_with(loss_fn="mse"), "loss_fn must be a function"),
    Case("compile-no-inputs", compile_with(example_inputs=()), "example_inputs must start with a tensor"),
    Case("compile-model-string", compile_with(model="gpt"), "model must be a torch.nn.Module"),
    Case("compile-time-limit-zero", compile_with(time_limit=0), "time_limit=0"),
    Case("compile-memory-half-byte", compile_with(memory_limit="0.5"), "memory size '0.5'"),
    Case("compile-mesh-typo", compile_with(mesh="2:cpus"), "unknown device 'cpus'"),
    Case("compile-kwarg-other-batch", compile_with(example_kwargs={"mask": torch.ones(3, 2)}),
         r"example_kwargs\['mask'\] has shape \[3, 2\].*one row per sequence"),
    Case("compile-kwarg-scalar-tensor", compile_with(example_kwargs={"scale": torch.tensor(2.0)}),
         r"example_kwargs\['scale'\] has shape \[\]"),
    Case("compile-kwargs-not-dict", compile_with(example_kwargs=[("mask", 1)]),
         "example_kwargs must be a dict"),
    # Arguments are checked before the process group starts: in a plain process (as pytest's),
    # each gets its own message, not torch's "environment variable RANK expected".
    Case("compile-plan-number", compile_with(plan=42), "plan=42 is not a plan.*autopar.Plan"),
    Case("compile-inputs-not-tuple", compile_with(example_inputs=torch.ones(2, 2)),
         r"example_inputs must be a tuple.*\(ids,\); got a Tensor"),
    Case("compile-plan-file-missing", lambda s: compile_with(plan=s / "none.json")(s), "no plan file"),
    Case("compile-load-from-missing", lambda s: compile_with(load_from=s / "none.safetensors")(s),
         "load_from=.*does not exist"),
    Case("compile-seed-string", compile_with(seed="1"), "seed='1' must be an integer"),
    Case("compile-no-launcher", compile_with(),
         r"not started by a launcher.*torchrun --nproc-per-node 2.*autopar.launch.*\"1:cpu\""),
    Case("launch-no-ranks", lambda s: autopar.launch(print, 0), "world_size must be an integer"),
    Case("launch-negative-timeout", lambda s: autopar.launch(print, 1, timeout=-1), "timeout"),
]

# ---------------------------------------------------------------------------------------------
# The command line: each refused before capture, planning, training or timing
# ---------------------------------------------------------------------------------------------

TINY = "gpt:layers=1,hidden=32,heads=2,seq=8,vocab=64"


def plan_cli(*extra: str) -> Callable[[Path], CliResult]:
    return lambda scratch: cli("plan", TINY, "--mesh", "2:cpu", "--global-batch", "8", *extra)


CLI_CASES = [
    Case("cli-plan-batch-1e12", lambda s: cli("plan", TINY, "--mesh", "2:cpu", "--global-batch",
                                              "1000000000000"), "global_batch=1000000000000"),
    Case("cli-plan-batch-not-int", lambda s: cli("plan", TINY, "--mesh", "2:cpu", "--global-batch", "1e3"),
         "invalid int value"),
    Case("cli-plan-memory-half", plan_cli("--memory-limit", "0.5"), "memory size '0.5'"),
    Case("cli-plan-memory-1e400", plan_cli("--memory-limit", "1e400"), "memory size '1e400'"),
    Case("cli-plan-time-negative", plan_cli("--time-limit", "-1"), "time_limit=-1"),
    Case("cli-plan-time-nan", plan_cli("--time-limit", "nan"), "time_limit=nan"),
    Case("cli-plan-out-no-folder", lambda s: plan_cli("--out", str(s / "no" / "plan.json"))(s),
         "does not exist"),
    Case("cli-plan-out-is-folder", lambda s: plan_cli("--out", str(s))(s), "is a folder"),
    Case("cli-plan-mesh-malformed", lambda s: cli("plan", TINY, "--mesh", "4x:cpu", "--global-batch", "8"),
         "malformed"),
    Case("cli-plan-mesh-absurd",
         lambda s: cli("plan", TINY, "--mesh", "100000x100000:cpu", "--global-batch", "8"),
         "more than autopar plans for"),
    Case("cli-plan-unknown-model", lambda s: cli("plan", "gpt5", "--mesh", "2:cpu", "--global-batch", "8"),
         "unknown model 'gpt5'"),
    Case("cli-plan-bad-spec", lambda s: cli("plan", "gpt:ffn=-1", "--mesh", "2:cpu", "--global-batch", "8"),
         "ffn=-1"),
    Case("cli-explain-png-no-folder",
         lambda s: cli("explain", str(s / "p.json"), "--png", str(s / "no" / "t.png")), "does not exist"),
    Case("cli-explain-missing", lambda s: cli("explain", str(s / "none.json")), "no plan file"),
    Case("cli-explain-folder", lambda s: cli("explain", str(s)), "cannot be read"),
    Case("cli-explain-binary", lambda s: cli("explain", str(write("p.json", b"\x00\xff")(s))),
         "not valid JSON"),
    Case("cli-explain-bad-values", lambda s: cli("explain", str(write(
        "p.json", json.dumps({**plan_dict(), "micro_batches": 10**12}))(s))), "micro_batches"),
    Case("cli-diff-bad-plan", lambda s: cli("diff", str(write("a.json", "{}")(s)), str(s / "b.json")),
         "schema version"),
    Case("cli-bench-out-is-file", lambda s: cli("bench", "--quick", "--out", str(write("f", "x")(s))),
         "is a file, not a folder"),
    Case("cli-bench-time-zero", lambda s: cli("bench", "--quick", "--time-limit", "0", "--out", str(s)),
         "time_limit=0"),
    Case("cli-calibrate-out-no-folder", lambda s: cli("calibrate", "--out", str(s / "no" / "c.json")),
         "does not exist"),
    Case("cli-calibrate-budget-zero", lambda s: cli("calibrate", "--budget", "0", "--out", str(s / "c.json")),
         "--budget 0"),
    Case("cli-demo-steps-zero", lambda s: cli("demo", "--steps", "0"), "--steps 0"),
    Case("cli-demo-png-no-folder", lambda s: cli("demo", "--png", str(s / "no" / "d.png")), "does not exist"),
    Case("cli-demo-memory-half", lambda s: cli("demo", "--memory-limit", "0.5"), "memory size '0.5'"),
    Case("cli-demo-time-zero", lambda s: cli("demo", "--time-limit", "0"), "time_limit=0"),
    Case("cli-demo-ranks", lambda s: cli("demo", "--ranks", "3"), "invalid choice"),
    Case("cli-estimate-bad-toml", lambda s: cli("estimate", TINY, "--mesh", str(write("m.toml", "[x")(s)),
                                                "--global-batch", "8"), "not valid TOML"),
    Case("cli-estimate-batch-1e12", lambda s: cli("estimate", TINY, "--mesh", "2:cpu", "--global-batch",
                                                  "1000000000000"), "global_batch"),
    Case("cli-estimate-tp", lambda s: cli("estimate", TINY, "--mesh", "2:cpu", "--tp", "3",
                                          "--global-batch", "8"), "does not divide"),
    Case("cli-inspect-batch-zero", lambda s: cli("inspect", TINY, "--batch", "0"), "batch=0"),
    Case("cli-inspect-batch-absurd", lambda s: cli("inspect", TINY, "--batch", "1000000000000"), "batch="),
    Case("cli-unknown-command", lambda s: cli("plna"), "invalid choice"),
]

CASES = PLAN_CASES + PLAN_FILE_CASES + MESH_CASES + MODEL_CASES + SIZE_CASES + COMPILE_CASES + CLI_CASES


def test_cases_have_distinct_ids():
    ids = [case.id for case in CASES]
    assert len(ids) == len(set(ids)) and len(ids) >= 60


def test_the_base_plan_is_valid():
    """Each plan case breaks one thing of a plan that loads: the refusal is that thing's."""
    assert Plan.from_dict(plan_dict()).world_size == 8


@pytest.mark.parametrize("case", CASES, ids=[case.id for case in CASES])
def test_bad_input_is_refused_clearly(case, tmp_path):
    outcome, message = classify(case, tmp_path)
    assert outcome == "clear", f"{outcome}: {message}"


def test_time_limit_covers_capture():
    """time_limit bounds all of planning: a limit that capture alone exceeds is refused with the
    time capture took, not silently extended by the search's own budget."""
    from autopar.models import build_model

    model, example = build_model(TINY)
    with pytest.raises(AutoparError, match=r"capturing the model took .* all of the time_limit of 1e-06 s"):
        autopar.plan(model, "2:cpu", example_inputs=example, global_batch=2, time_limit=1e-6)
