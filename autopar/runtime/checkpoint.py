"""Checkpoints of a CompiledModel in torch.distributed.checkpoint's format (DCP), resharded on load.

Every rank writes only its own shards. Each stage knows its tensors under stage-local module paths
("0.submod_2.ref_p_layers_0_attn_wq_weight.value"); the checkpoint stores them, and the optimizer
state of each, under the model's own state_dict names ("layers.0.attn.wq.weight"), so a checkpoint
of any plan loads under any other: DTensor shards (tensor parallelism, ZeRO) are cut and joined by
DCP itself, and each rank reads only the slices it holds. The state dicts of the stage modules and
the optimizer come from `torch.distributed.checkpoint.state_dict` (it knows FSDP2 and DTensor); the
optimizer's is flattened to one entry per parameter and statistic, which is what lets a rank load
the state of parameters another rank saved.

One checkpoint directory holds, flattened by DCP:
- `model.<name>`: each parameter and buffer a stage reads, once (a weight tied to another name is
  stored under the first of its names; `autopar.tied` maps the others to it);
- `optim.state.<name>.<statistic>` and `optim.param_groups.<name>.<option>` (lr, betas, ...);
- `autopar.step` (steps taken), `autopar.plan` (the saving plan's JSON), `autopar.tied`,
  `autopar.extra` (the user's dict: a data position, a scheduler's state), and under fp16
  `autopar.scaler` (the loss scale, its growth count, the steps it skipped: the same on every rank),
  written by rank 0;
- `rng.<rank>.*`: each rank's random number generator states.
plus `plan.json`, the same plan, for `autopar explain`.

A save is atomic: it is written beside the target (`<path>.tmp-<id>`) and renamed over it on rank 0
after every rank has written, so a crash or kill while saving leaves the previous checkpoint at
`path` as it was. Replacing a directory takes two renames (old away, new in); a crash between them
leaves the previous checkpoint at `<path>.old-<id>`, which `load` then reads.
"""

from __future__ import annotations

import json
import pickle
import random
import shutil
import uuid
import warnings
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)

from autopar.errors import AutoparError
from autopar.passes.program import TensorRef

# Flattened optimizer state: one entry per parameter and statistic, whoever holds the parameter.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete, or of another model."""


class StageNames:
    """This rank's stage-local state-dict keys and the model's names for them.

    `saved` says which local key writes each name: a tied weight held by several stages is
    written by its first stage only, so each name has one writer per shard."""

    def __init__(self, cm):
        modules = nn.ModuleList(program.module for program in cm.programs)
        name_of = _canonical_names(cm.state_aliases)
        self.modules = modules
        self.model_name: dict[str, str] = {}      # local key -> the model's name
        self.saved: dict[str, str] = {}           # the model's name -> the local key that writes it
        for position, program in enumerate(cm.programs):
            for path, ref in program.module.named_modules():
                if not isinstance(ref, TensorRef) or ref.fqn not in name_of:
                    continue    # constants the export lifted are not the model's state
                local = f"{position}.{path}.value"
                name = name_of[ref.fqn]
                self.model_name[local] = name
                first = min(program.tied.get(ref.fqn, (program.index,)))
                if first == program.index and name not in self.saved:
                    self.saved[name] = local
        self.tied = {alias: name for alias, name in name_of.items()
                     if alias != name and alias in cm.state_aliases}

    def rename_model(self, state: dict, saving: bool) -> dict:
        """{model name: tensor}: when saving, only the tensors this rank writes; when loading,
        one entry per name this rank holds."""
        keep = set(self.saved.values()) if saving else None
        renamed = {}
        for local, tensor in state.items():
            name = self.model_name.get(local)
            if name is not None and (keep is None or local in keep):
                renamed.setdefault(name, tensor)
        return renamed

    def rename_optimizer(self, state: dict, saving: bool) -> dict:
        """Flattened optimizer entries `state.<local>.<key>` renamed to `state.<name>.<key>`."""
        keep = set(self.saved.values()) if saving else None
        renamed = {}
        for key, value in state.items():
            section, local, option = _split_optimizer_key(key)
            if keep is None or local in keep:
                renamed.setdefault(f"{section}.{self.model_name[local]}.{option}", value)
        return renamed

    def local_optimizer(self, loaded: dict, template: dict) -> dict:
        """The loaded entries back under this rank's local keys (every tied copy gets its weight's)."""
        result = {}
        for key in template:
            section, local, option = _split_optimizer_key(key)
            result[key] = loaded[f"{section}.{self.model_name[local]}.{option}"]
        return result


def _canonical_names(aliases: dict[str, list[str]]) -> dict[str, str]:
    """Every name of a tensor (graph's and state_dict's) -> the first state_dict name of it."""
    canonical = {}
    for key, names in aliases.items():
        for name in [key, *names]:
            canonical.setdefault(name, key)
    return canonical


def _split_optimizer_key(key: str) -> tuple[str, str, str]:
    """`state.0.submod_1.ref_x.value.exp_avg` -> (`state`, `0.submod_1.ref_x.value`, `exp_avg`):
    statistic and option names have no dots; stage-local keys always end in `.value`."""
    section, _, rest = key.partition(".")
    local, _, option = rest.rpartition(".")
    return section, local, option


def save(cm, path: str | Path, extra: dict | None = None) -> Path:
    """Write the model, optimizer, step count, RNG states, plan and `extra` to directory `path`.
    A collective: every rank calls it with the same path, on a file system they share."""
    path = Path(path)
    payload = _pickled(extra)       # refused before any collective when it cannot be stored
    if path.exists() and not path.is_dir():
        raise CheckpointError(f"{path} is a file; a checkpoint is a directory: choose another path")
    names = StageNames(cm)
    token = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    aside = path.with_name(f"{path.name}.tmp-{token[0]}")
    # an optimizer that never stepped (every step so far skipped by fp16's scaler) has no state
    stepped = cm.steps > cm.skipped_steps
    if stepped:
        model_state, optim_state = get_state_dict(names.modules, cm.optimizer, options=OPTIONS)
    else:
        model_state, optim_state = get_model_state_dict(names.modules, options=OPTIONS), {}
    state = {"model": names.rename_model(model_state, saving=True),
             "rng": {str(dist.get_rank()): _rng_state()}}
    if optim_state:
        state["optim"] = names.rename_optimizer(optim_state, saving=True)
    if dist.get_rank() == 0:
        state["autopar"] = {"step": cm.steps, "plan": cm.plan.to_json(), "tied": json.dumps(names.tied),
                            "extra": payload}
        if cm.scaler is not None:
            state["autopar"]["scaler"] = pickle.dumps({"state": cm.scaler.state_dict(),
                                                       "skipped": cm.skipped_steps})
    dcp.save(state, checkpoint_id=aside)
    # dcp.save returns after rank 0 wrote the metadata, which it does once every rank has written
    if dist.get_rank() == 0:
        (aside / "plan.json").write_text(cm.plan.to_json())
        _replace(aside, path, token[0])
    dist.barrier()
    return path


def _pickled(extra) -> bytes:
    try:
        return pickle.dumps(extra)
    except Exception as err:
        raise CheckpointError(f"save(extra=...) must be picklable (a dict of numbers, strings, "
                              f"tensors): {type(err).__name__}: {err}") from err


def _replace(aside: Path, path: Path, token: str) -> None:
    """Put the finished checkpoint at `path`, then remove what earlier interrupted saves left."""
    if path.exists():
        old = path.with_name(f"{path.name}.old-{token}")
        path.rename(old)
        aside.rename(path)
        shutil.rmtree(old)
    else:
        aside.rename(path)
    for stale in [*path.parent.glob(f"{path.name}.tmp-*"), *path.parent.glob(f"{path.name}.old-*")]:
        shutil.rmtree(stale, ignore_errors=True)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": pickle.dumps(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load(cm, path: str | Path) -> dict | None:
    """Restore a checkpoint under cm's plan (any plan, any world size may have saved it) and
    return the `extra` saved with it. A collective: every rank calls it with the same path."""
    path = readable(path)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    names = StageNames(cm)
    stepped = any(key.startswith("optim.") for key in metadata)
    if stepped:
        model_state, optim_state = get_state_dict(names.modules, cm.optimizer, options=OPTIONS)
    else:
        model_state, optim_state = get_model_state_dict(names.modules, options=OPTIONS), {}
    model = names.rename_model(model_state, saving=False)
    optim = names.rename_optimizer(optim_state, saving=False)
    _agree(_problem(path, metadata, model, optim))
    rank = str(dist.get_rank())
    rng_rank = rank if f"rng.{rank}.torch" in metadata else "0"
    rng = {"torch": torch.get_rng_state(), "python": b""}
    if f"rng.{rng_rank}.cuda" in metadata and torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"model": model, "autopar": {"step": 0, "extra": b""}, "rng": {rng_rank: rng}}
    scaled = "autopar.scaler" in metadata
    if scaled:
        state["autopar"]["scaler"] = b""
    if optim:
        state["optim"] = optim
    dcp.load(state, checkpoint_id=path)
    local_model = {local: state["model"][name] for local, name in names.model_name.items()}
    local_model.update({k: v for k, v in model_state.items() if k not in names.model_name})
    if stepped:
        set_state_dict(names.modules, cm.optimizer, model_state_dict=local_model,
                       optim_state_dict=names.local_optimizer(state["optim"], optim_state), options=OPTIONS)
    else:
        set_model_state_dict(names.modules, local_model, options=OPTIONS)
        cm.optimizer.state.clear()      # the saving run had not stepped: nor has this one now
    torch.set_rng_state(rng["torch"])
    random.setstate(pickle.loads(rng["python"]))
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    cm.steps = state["autopar"]["step"]
    _restore_scaler(cm, pickle.loads(state["autopar"]["scaler"]) if scaled else None)
    return pickle.loads(state["autopar"]["extra"])


def _restore_scaler(cm, saved: dict | None) -> None:
    """fp16's loss scale continues where the saving run left it. A checkpoint of another precision
    has none: the scale starts afresh, and none of its steps was skipped."""
    if cm.scaler is not None and saved is not None:
        cm.scaler.load_state_dict(saved["state"])
    cm.skipped_steps = 0 if saved is None else saved["skipped"]


def readable(path: str | Path) -> Path:
    """The checkpoint directory at `path`, or the previous one a save interrupted between its
    two renames left beside it."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        left = sorted(path.parent.glob(f"{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
        if left and (left[-1] / ".metadata").is_file():
            return left[-1]
        what = "is not a finished checkpoint (no .metadata)" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}; pass a directory written by "
                              f"CompiledModel.save")
    return path


def _problem(path: Path, metadata: dict, model: dict, optim: dict) -> str | None:
    """Why this rank cannot load the checkpoint into its tensors, or None."""
    if "autopar.step" not in metadata:
        return f"{path} is a DCP checkpoint but not one of CompiledModel.save (no autopar.step)"
    missing = [name for name in model if f"model.{name}" not in metadata]
    missing += [key for key in optim if f"optim.{key}" not in metadata]
    if missing:
        return (f"{path} has no {missing[:3]} ({len(missing)} missing): it was saved from another "
                f"model or with another optimizer")
    for name, tensor in model.items():
        shape = tuple(tensor.shape)
        saved = tuple(metadata[f"model.{name}"].size)
        if shape != saved:
            return f"{name} has shape {saved} in {path} but {shape} in this model"
    return None


def _agree(problem: str | None) -> None:
    """Raise on every rank if any rank found a problem (before the loading collectives, so that
    no rank waits for one that gave up)."""
    problems: list = [None] * dist.get_world_size()
    dist.all_gather_object(problems, problem)
    found = next((p for p in problems if p is not None), None)
    if found is not None:
        raise CheckpointError(found)



# Export: one plain state dict from a checkpoint of any plan, read by one process.

def export(directory: str | Path, out: str | Path, max_shard_bytes: int = 5 * 2**30) -> list[Path]:
    """Write the checkpoint's model as one safetensors file (`out` ending in .safetensors) or as a
    HuggingFace-style directory (`model-0000i-of-0000n.safetensors` and
    `model.safetensors.index.json`) under model.state_dict()'s names, tied names included as
    copies. Needs no process group: DCP reads every rank's shards and joins them. A directory is
    written shard by shard, so only one shard is in memory at a time. Returns the files written."""
    from safetensors.torch import save_file

    directory, out = readable(directory), Path(out)
    single = out.suffix == ".safetensors"
    _check_output(out, single)
    metadata = dcp.FileSystemReader(directory).read_metadata().state_dict_metadata
    if "autopar.tied" not in metadata:
        raise CheckpointError(f"{directory} is a DCP checkpoint but not one of CompiledModel.save")
    tied = json.loads(_load_plain(directory, {"autopar": {"tied": ""}})["autopar"]["tied"])
    sizes = {key[len("model."):]: entry for key, entry in metadata.items() if key.startswith("model.")}
    shards = [list(sizes)] if single else _shards(sizes, max_shard_bytes)
    files = [out] if single else [out / f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
                                  for i in range(len(shards))]
    weight_map = {}
    for names, path in zip(shards, files):
        empty = {name: torch.empty(tuple(sizes[name].size), dtype=sizes[name].properties.dtype)
                 for name in names}
        state = _load_plain(directory, {"model": empty})["model"]
        state.update({alias: state[name].clone() for alias, name in tied.items() if name in state})
        save_file(state, str(path), metadata={"format": "pt"})
        weight_map.update({name: path.name for name in state})
    if not single:
        total = sum(entry.size.numel() * entry.properties.dtype.itemsize for entry in sizes.values())
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / "model.safetensors.index.json").write_text(json.dumps(index, indent=2) + "\n")
        files.append(out / "model.safetensors.index.json")
    return files


def _check_output(out: Path, single: bool) -> None:
    """Refuse an output that cannot be written before reading anything."""
    if single:
        if not out.parent.is_dir():
            raise CheckpointError(f"cannot write {out}: directory {out.parent} does not exist")
        if out.is_dir():
            raise CheckpointError(f"{out} is a directory; pass a file name ending in .safetensors")
        return
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise CheckpointError(f"{out} exists and is not an empty directory; pass a new directory, "
                              f"or a file name ending in .safetensors")
    out.mkdir(parents=True, exist_ok=True)


def _shards(sizes: dict, max_bytes: int) -> list[list[str]]:
    """Names in checkpoint order, cut into runs of at most `max_bytes` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name, entry in sizes.items():
        nbytes = entry.size.numel() * entry.properties.dtype.itemsize
        if shards[-1] and used + nbytes > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += nbytes
    return shards


def _load_plain(directory: Path, state: dict) -> dict:
    """`state` filled from the checkpoint in this process alone (no process group needed)."""
    with warnings.catch_warnings():
        # DCP warns that it reads in one process, which is the point here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=directory, no_dist=True)
    return state
