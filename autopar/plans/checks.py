"""Every value of a plan file checked on load, each refusal naming the field and what it should
hold: the file is read whatever it holds (not JSON, nested past any plan, NaN where a number
belongs, a string where an object belongs), and nothing of it reaches the runtime, `explain` or the
estimator unchecked. None of it needs torch or the cost model.

What is checked: field names (none unknown, none missing), types and ranges of every value, a mesh
that is one (autopar.plans.mesh), axes named by their roles (dp, cp, tp), stages in order whose
ranks cover the mesh once, an expert-parallel degree that divides each stage's dp x cp x tp ranks,
one context-parallel degree for all of them, offload only under ZeRO-3, a batch that splits
into dp x micro-batches x micro-batch size,
placements that parse (one per axis, S(d) within any tensor's rank), and `predicted` and `solver`
records that hold finite numbers and words where `explain` and the timeline read them.
"""

from __future__ import annotations

import json
import math
from dataclasses import MISSING, fields
from pathlib import Path

from autopar.errors import AutoparError, MeshError, PlanMismatchError
from autopar.plans.mesh import check_mesh_dict
from autopar.plans.placements import parse_placement
from autopar.plans.schedules import recompute_error
from autopar.plans.vocabulary import (AXIS_ROLES, CONTEXT_PARALLEL, MULTI_CHUNK_SCHEDULES,
                                      PRECISIONS, RECOMPUTE, SCHEDULES)

# Bounds that no real run comes near; a value past them is a corrupt or crafted file, and would
# otherwise make explain or the runtime loop over billions of micro-batches or ranks.
MAX_BATCH = 2**24
MAX_MICRO_BATCHES = 2**16     # the timeline of a plan is simulated and drawn per micro-batch
MAX_WORLD = 2**20
# Objects and lists inside a plan nest 4 deep at most (plan -> predicted -> memory_breakdown);
# a file nesting deeper is not a plan, and is refused before anything walks it.
MAX_DEPTH = 8
# What the planner records under `predicted` (the estimator's figures) and `solver`, by type.
NUMBER, COUNT, FLAG, WORD, NUMBERS, COUNTS, OPTIONAL_NUMBER, FIGURE, SCALAR = (
    "number", "count", "flag", "word", "numbers", "counts", "optional number", "figure", "scalar")
# "*": the kind of a field the schema does not name. The estimator's figures are numbers (a
# breakdown's part may be negative) or flags; the solver's statistics may also be words or null.
PREDICTED = {"*": FIGURE, "step_time_s": NUMBER, "tflops_per_gpu": NUMBER, "model_tflops_per_gpu": NUMBER,
             "mfu": NUMBER, "memory_per_gpu_bytes": NUMBER, "bubble_fraction": NUMBER,
             "simulated_bubble_fraction": NUMBER, "micro_batches": COUNT,
             "memory_limit_bytes": NUMBER, "fits": FLAG, "breakdown": NUMBERS,
             "comm_breakdown": NUMBERS, "memory_breakdown": NUMBERS}
STAGE_PREDICTED = {"*": FIGURE, "stage": COUNT, "time_per_micro_batch_s": NUMBER, "memory_bytes": NUMBER,
                   "chunk_time_per_micro_batch_s": NUMBER, "memory": NUMBERS}
INTRA_OP = {"*": SCALAR, "seconds": NUMBER, "status": WORD, "gap": OPTIONAL_NUMBER, "variables": COUNT,
            "constraints": COUNT, "objective_s": NUMBER}
SOLVER = {"*": SCALAR, "seconds": NUMBER, "status": WORD, "gap": OPTIONAL_NUMBER, "candidates": COUNT,
          "refused": COUNT, "refusal_reasons": COUNTS, "calibration": WORD, "method": WORD,
          "intra_op": INTRA_OP}


def read_plan_json(path: str | Path) -> dict:
    """The JSON object of a plan file, or PlanMismatchError saying why the file holds none."""
    try:
        text = Path(path).read_text()
    except FileNotFoundError:
        raise PlanMismatchError(f"no plan file at {path}; write one with `autopar plan`") from None
    except OSError as err:   # a folder, no permission
        raise PlanMismatchError(f"plan file {path} cannot be read: {err.strerror}") from None
    except UnicodeDecodeError as err:
        raise PlanMismatchError(f"{path} is not a plan: not valid JSON ({err})") from None
    try:
        data = json.loads(text)
    except json.JSONDecodeError as err:
        raise PlanMismatchError(f"{path} is not a plan: not valid JSON ({err})") from None
    except RecursionError:
        raise PlanMismatchError(f"{path} is not a plan: its JSON nests objects or lists deeper "
                                f"than any plan ({MAX_DEPTH} levels)") from None
    if not isinstance(data, dict):
        raise PlanMismatchError(f"{path} is not a plan: expected a JSON object")
    return data


def check_plan_dict(data, version: int, plan_type, stage_type) -> None:
    """Refuse `data` unless it is a plan of schema `version` whose every value is valid: the
    fields of `plan_type` and of `stage_type` for each stage."""
    if not isinstance(data, dict):
        raise PlanMismatchError("a plan is a JSON object; this is not one")
    found = data.get("schema_version")
    if type(found) is not int or found != version:
        raise PlanMismatchError(f"plan schema version {found!r} is not {version}, the one this "
                                f"autopar reads; plan the model again with this version")
    _check_depth(data, "", 0)
    _check_fields(plan_type, data, "plan")
    if not isinstance(data["stages"], list) or not data["stages"]:
        raise PlanMismatchError("plan field 'stages' must be a non-empty list of stages")
    for stage in data["stages"]:
        if not isinstance(stage, dict):
            raise PlanMismatchError(f"plan stage {stage!r} is not an object")
        _check_fields(stage_type, stage, "plan stage")
    _check_values(data)


def _check_depth(value, where: str, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise PlanMismatchError(f"plan field {where!r} nests objects or lists deeper than any plan "
                                f"({MAX_DEPTH} levels); the file is not one autopar wrote")
    items = ((f"{where}.{key}" if where else str(key), item) for key, item in value.items()) \
        if isinstance(value, dict) else ((f"{where}[{k}]", item) for k, item in enumerate(value))
    for name, item in items:
        if isinstance(item, (dict, list)):
            _check_depth(item, name, depth + 1)


def _check_fields(cls, data: dict, what: str) -> None:
    known = {f.name for f in fields(cls)}
    required = {f.name for f in fields(cls) if f.default is MISSING and f.default_factory is MISSING}
    unknown = sorted(str(key) for key in set(data) - known)
    missing = sorted(required - set(data))
    if unknown or missing:
        raise PlanMismatchError(f"{what} has unknown fields {unknown} and lacks fields {missing}; "
                                f"it was not written by this autopar version: plan the model again")


def _check_values(data: dict) -> None:
    for key in ("fingerprint", "model_type"):
        _expect(data.get(key, ""), str, key)
    for key in ("predicted", "solver", "parameters", "nodes"):
        _expect(data.get(key, {}), dict, key)
    world = _check_mesh(data["mesh"])
    axes = _check_axes(data["axes"])
    sub = math.prod(size for _, size in axes)
    for key in ("global_batch", "micro_batch_size"):
        _int(data[key], key, MAX_BATCH)
    _int(data.get("virtual", 1), "virtual", MAX_BATCH)
    _int(data["micro_batches"], "micro_batches", MAX_MICRO_BATCHES)
    _choice(data.get("precision", "fp32"), PRECISIONS, "precision")
    schedule = _choice(data.get("schedule", "1f1b"), SCHEDULES, "schedule")
    stages, virtual = data["stages"], data.get("virtual", 1)
    if virtual > 1 and schedule not in MULTI_CHUNK_SCHEDULES:
        raise PlanMismatchError(f"plan has virtual={virtual} chunks per rank with schedule "
                                f"{schedule!r}, which runs one; use interleaved-1f1b")
    if len(stages) % virtual:
        raise PlanMismatchError(f"plan has {len(stages)} stages, not a multiple of virtual={virtual}")
    for position, stage in enumerate(stages):
        _check_stage(stage, position, axes, sub, world)
    refusal = recompute_error(schedule, [stage.get("recompute", "none") for stage in stages])
    if refusal is not None:
        raise PlanMismatchError(f"plan: {refusal}")
    pp = len(stages) // virtual
    _check_ranks(stages, pp, world)
    dp = stages[0].get("dp", 1)
    if data["global_batch"] != dp * data["micro_batches"] * data["micro_batch_size"]:
        raise PlanMismatchError(
            f"plan's global_batch {data['global_batch']} is not dp x micro_batches x micro_batch_size "
            f"= {dp} x {data['micro_batches']} x {data['micro_batch_size']}")
    for key in ("parameters", "nodes"):
        for name, placement in data.get(key, {}).items():
            _check_placements(placement, f"{key}[{name!r}]", len(axes))
    replicated = data.get("replicated_ops", [])
    if not isinstance(replicated, list) or not all(isinstance(op, str) for op in replicated):
        raise PlanMismatchError("plan field 'replicated_ops' must be a list of op names")
    _check_record(data.get("predicted", {}), PREDICTED, "predicted")
    _check_record(data.get("solver", {}), SOLVER, "solver")


_KIND_NAMES = {dict: "an object", list: "a list", str: "a string", bool: "true or false"}


def _expect(value, kind, name: str) -> None:
    if not isinstance(value, kind):
        raise PlanMismatchError(f"plan field {name!r} is {value!r}; expected {_KIND_NAMES[kind]}")


def _int(value, name: str, largest: int, smallest: int = 1) -> int:
    # bool is an int to Python, never to a plan
    if not isinstance(value, int) or isinstance(value, bool) or not smallest <= value <= largest:
        raise PlanMismatchError(f"plan field {name!r} is {value!r}; expected an integer from "
                                f"{smallest} to {largest}")
    return value


def _choice(value, choices: tuple[str, ...], name: str) -> str:
    if not isinstance(value, str) or value not in choices:
        raise PlanMismatchError(f"plan field {name!r} is {value!r}; expected one of "
                                f"{', '.join(choices)}")
    return value


def _check_mesh(mesh) -> int:
    try:
        return check_mesh_dict(mesh)
    except MeshError as err:
        raise PlanMismatchError(f"plan field 'mesh' is not a mesh: {err}") from None


def _check_axes(axes) -> list:
    if (not isinstance(axes, list) or not axes
            or not all(isinstance(a, list) and len(a) == 2 and isinstance(a[0], str) for a in axes)):
        raise PlanMismatchError(f"plan field 'axes' is {axes!r}; expected [[role, size], ...] such as "
                                f"[['dp', 2], ['tp', 4]]")
    for name, size in axes:
        _int(size, f"axes[{name!r}]", MAX_WORLD)
    names = [name for name, _ in axes]
    if len(set(names)) != len(names):
        raise PlanMismatchError(f"plan field 'axes' names an axis twice: {names}")
    unknown = [name for name in names if name not in AXIS_ROLES]
    if unknown:
        raise PlanMismatchError(f"plan field 'axes' names axis {unknown[0]!r}; a plan's axes are "
                                f"named by their roles, {', '.join(AXIS_ROLES)}")
    return axes


def _check_stage(stage: dict, position: int, axes: list, sub: int, world: int) -> None:
    where = f"stages[{position}]"
    if _int(stage["index"], f"{where}.index", MAX_WORLD, smallest=0) != position:
        raise PlanMismatchError(f"plan {where} has index {stage['index']!r}; stages must be listed "
                                f"in order, 0, 1, 2, ...")
    # a single-stage plan may list no layers: it holds the whole model
    if not isinstance(stage["layers"], list) or not all(isinstance(x, str) for x in stage["layers"]):
        raise PlanMismatchError(f"plan {where}.layers must be a list of module paths")
    tp = _int(stage.get("tp", 1), f"{where}.tp", MAX_WORLD)
    dp = _int(stage.get("dp", 1), f"{where}.dp", MAX_WORLD)
    cp = _int(stage.get("cp", 1), f"{where}.cp", MAX_WORLD)
    named = dict(axes)
    if (tp, dp, cp) != (named.get("tp", 1), named.get("dp", 1), named.get("cp", 1)):
        raise PlanMismatchError(f"plan {where} has tp={tp} x dp={dp} x cp={cp}, which is not its "
                                f"sub-mesh {axes}")
    ranks = stage["ranks"]
    if not isinstance(ranks, list) or len(ranks) != sub:
        raise PlanMismatchError(f"plan {where}.ranks must list the {sub} ranks of the stage's "
                                f"sub-mesh {axes}")
    for rank in ranks:
        _int(rank, f"{where}.ranks", world - 1, smallest=0)
    _choice(stage.get("recompute", "none"), RECOMPUTE, f"{where}.recompute")
    _int(stage.get("zero", 0), f"{where}.zero", 3, smallest=0)
    _check_forms(stage, where)
    _expect(stage.get("sequence_parallel", False), bool, f"{where}.sequence_parallel")
    ep = _int(stage.get("ep", 1), f"{where}.ep", MAX_WORLD)
    if sub % ep:
        fits = [d for d in range(1, sub + 1) if sub % d == 0]
        raise PlanMismatchError(f"plan {where} has ep={ep}, which does not divide its dp x cp x tp "
                                f"= {dp} x {cp} x {tp} = {sub} ranks (expert parallelism is carved "
                                f"out of them); use an ep in {fits}")
    _expect(stage.get("predicted", {}), dict, f"{where}.predicted")
    _check_record(stage.get("predicted", {}), STAGE_PREDICTED, f"{where}.predicted")


def _check_forms(stage: dict, where: str) -> None:
    """Context parallelism's attention and offload (what the runtime runs: ZeRO-3's offload)."""
    _choice(stage.get("cp_kind", "ring"), CONTEXT_PARALLEL, f"{where}.cp_kind")
    offload = stage.get("offload", False)
    _expect(offload, bool, f"{where}.offload")
    if offload and stage.get("zero", 0) != 3:
        raise PlanMismatchError(f"plan {where}.offload is true with zero={stage.get('zero', 0)}; "
                                f"offload keeps ZeRO-3's shards, gradients and optimizer state on "
                                f"the host: set {where}.zero to 3")


def _check_ranks(stages: list, pp: int, world: int) -> None:
    """The pp pipeline ranks' sub-meshes cover the mesh once; chunk i runs where stage i % pp does."""
    covered = sorted(rank for stage in stages[:pp] for rank in stage["ranks"])
    if covered != list(range(world)):
        raise PlanMismatchError(f"the plan's {pp} pipeline stages run on ranks {covered}, which do not "
                                f"cover the mesh's {world} devices exactly once")
    for i, stage in enumerate(stages[pp:], start=pp):
        if stage["ranks"] != stages[i % pp]["ranks"]:
            raise PlanMismatchError(f"plan stages[{i}] runs on ranks {stage['ranks']}, but as chunk "
                                    f"of pipeline rank {i % pp} it belongs on {stages[i % pp]['ranks']}")


def _check_placements(placement, where: str, axes: int) -> None:
    if (not isinstance(placement, list) or len(placement) != axes
            or not all(isinstance(p, str) for p in placement)):
        raise PlanMismatchError(f"plan {where} is {placement!r}; expected one placement per axis "
                                f"({axes}), each R, P or S(dim)")
    for text in placement:
        try:
            parse_placement(text)
        except AutoparError as err:
            raise PlanMismatchError(f"plan {where} is {placement!r}: {err}; each is R, P or "
                                    f"S(dim)") from None


def _check_record(record: dict, schema: dict, where: str) -> None:
    """A `predicted` or `solver` record: the fields the planner writes with their types; any
    other field holds a finite number or a flag (and, in `solver`, a word or nothing). A time, a
    size or a fraction is never negative (a breakdown's parts may be: the cores idle ranks lend)."""
    for key, found in record.items():
        name = f"{where}.{key}"
        kind = schema.get(key, schema["*"])
        if isinstance(kind, dict):
            _expect(found, dict, name)
            _check_record(found, kind, name)
        elif kind in (NUMBERS, COUNTS):
            _expect(found, dict, name)
            for part, number in found.items():
                _number(number, f"{name}.{part}", kind == COUNTS, negative=kind == NUMBERS)
        elif kind in (NUMBER, COUNT):
            _number(found, name, kind == COUNT)
        elif kind == OPTIONAL_NUMBER:
            if found is not None:
                _number(found, name)
        elif kind in (FLAG, WORD):
            _expect(found, bool if kind == FLAG else str, name)
        elif kind == FIGURE and not isinstance(found, bool) or kind == SCALAR and not (
                found is None or isinstance(found, (str, bool))):
            _number(found, name, negative=True)


def _number(value, name: str, integer: bool = False, negative: bool = False) -> None:
    kinds = int if integer else (int, float)
    finite = isinstance(value, int) or isinstance(value, float) and math.isfinite(value)
    if (not isinstance(value, kinds) or isinstance(value, bool) or not finite
            or (value < 0 and not negative)):
        what = "integer" if integer else "number"
        raise PlanMismatchError(f"plan field {name!r} is {value!r}; expected a finite {what}"
                                f"{'' if negative else ' of 0 or more'}")
