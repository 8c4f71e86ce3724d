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
- `autopar.step` (steps taken), `autopar.samples` (samples trained: the data position
  `CompiledModel.sampler` resumes at, whatever plan and world load it), `autopar.plan` (the saving plan's JSON), `autopar.tied`,
  `autopar.extra` (the user's dict: a data position, a scheduler's state), and under fp16
  `autopar.scaler` (the loss scale, its growth count, the steps it skipped: the same on every rank),
  written by rank 0;
- `rng.<rank>.*`: each rank's random number generator states.
plus `plan.json`, the same plan, for `autopar explain`.

A save is atomic: every rank writes a new version beside the target (`<path>.v-<id>`), and once all
have written, rank 0 points `path` at it: `path` is a symbolic link (to the version's name, so the
folder can be moved whole) replaced by one `os.replace`, which is atomic. At every instant `path` is
the previous complete checkpoint or the new one, never absent: a script that resumes when
`Path(path).exists()` cannot start over and overwrite finished work after a kill mid-save. Older
versions are removed after the switch. (A checkpoint directory an earlier autopar wrote at `path`
is moved to `<path>.old-<id>` before the first switch; `load` reads such a directory when `path`
is missing, as that earlier two-rename swap could leave it.)

`load(..., strict=True)` refuses a checkpoint whose model tensors are not exactly this model's,
naming the missing and the unexpected ones; `strict=False` loads what both have (explicitly
partial: fine-tuning a model grown from a smaller one) and warns with what it left out.
"""

from __future__ import annotations

import json
import os
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
        self.name_of = name_of                    # every name of the model's tensors -> its first
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
        """The loaded entries back under this rank's local keys (every tied copy gets its weight's);
        `loaded` holds every entry of this rank's tensors."""
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
    if path.is_dir() and not path.is_symlink() and not (path / ".metadata").is_file() and any(path.iterdir()):
        raise CheckpointError(f"{path} is a directory that is not a checkpoint, which a save would "
                              f"replace; choose another path")
    names = StageNames(cm)
    token = [uuid.uuid4().hex[:12] if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(token, src=0)
    version = path.with_name(f"{path.name}.v-{token[0]}")
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
        state["autopar"] = {"step": cm.steps, "samples": cm.samples, "plan": cm.plan.to_json(), "tied": json.dumps(names.tied),
                            "extra": payload}
        if cm.scaler is not None:
            state["autopar"]["scaler"] = pickle.dumps({"state": cm.scaler.state_dict(),
                                                       "skipped": cm.skipped_steps})
    dcp.save(state, checkpoint_id=version)
    # dcp.save returns after rank 0 wrote the metadata, which it does once every rank has written
    outcome = [None]
    if dist.get_rank() == 0:
        (version / "plan.json").write_text(cm.plan.to_json())
        try:
            _point(path, version, token[0])
        except CheckpointError as err:    # raised on every rank
            outcome[0] = str(err)
    dist.broadcast_object_list(outcome, src=0)
    if outcome[0] is not None:
        raise CheckpointError(outcome[0])
    return path


def _pickled(extra) -> bytes:
    try:
        return pickle.dumps(extra)
    except Exception as err:
        raise CheckpointError(f"save(extra=...) must be picklable (a dict of numbers, strings, "
                              f"tensors): {type(err).__name__}: {err}") from err


def _point(path: Path, version: Path, token: str) -> None:
    """Make `path` the link to the finished `version` in one atomic rename, then remove what
    earlier versions and interrupted saves left beside it."""
    if path.is_dir() and not path.is_symlink():
        # an earlier autopar's checkpoint directory: a link cannot replace a directory
        path.rename(path.with_name(f"{path.name}.old-{token}"))
    link = path.with_name(f"{path.name}.link-{token}")
    try:
        link.symlink_to(version.name)
    except OSError as err:
        shutil.rmtree(version, ignore_errors=True)
        raise CheckpointError(f"cannot save {path}: this file system refuses a symbolic link beside it "
                              f"({err.strerror}), which an atomic switch of checkpoints needs; save on a "
                              f"POSIX file system (local disk, NFS, Lustre)") from None
    os.replace(link, path)
    left = [*path.parent.glob(f"{path.name}.v-*"), *path.parent.glob(f"{path.name}.old-*"),
            *path.parent.glob(f"{path.name}.tmp-*"), *path.parent.glob(f"{path.name}.link-*")]
    for stale in left:
        if stale.is_symlink():
            stale.unlink()
        elif stale != version:
            shutil.rmtree(stale, ignore_errors=True)


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": pickle.dumps(random.getstate())}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def load(cm, path: str | Path, strict: bool = True) -> dict | None:
    """Restore a checkpoint under cm's plan (any plan, any world size may have saved it) and
    return the `extra` saved with it. A collective: every rank calls it with the same path.
    `strict`: the checkpoint's model tensors must be exactly this model's (names missing on either
    side are refused, named); False loads those both have and leaves the rest as they are."""
    if not isinstance(strict, bool):
        raise CheckpointError(f"strict={strict!r} must be True or False")
    path = readable(path)
    metadata = dcp.FileSystemReader(path).read_metadata().state_dict_metadata
    names = StageNames(cm)
    stepped = any(key.startswith("optim.") for key in metadata)
    if stepped:
        model_state, optim_state = get_state_dict(names.modules, cm.optimizer, options=OPTIONS)
    else:
        model_state, optim_state = get_model_state_dict(names.modules, options=OPTIONS), {}
    model, optim = _matched(path, metadata, names, model_state, optim_state, strict)
    rank = str(dist.get_rank())
    rng_rank = rank if f"rng.{rank}.torch" in metadata else "0"
    rng = {"torch": torch.get_rng_state(), "python": b""}
    if f"rng.{rng_rank}.cuda" in metadata and torch.cuda.is_available() and torch.cuda.is_initialized():
        rng["cuda"] = torch.cuda.get_rng_state()
    state = {"model": model, "autopar": {"step": 0, "extra": b""}, "rng": {rng_rank: rng}}
    counted = "autopar.samples" in metadata
    if counted:
        state["autopar"]["samples"] = 0
    scaled = "autopar.scaler" in metadata
    if scaled:
        state["autopar"]["scaler"] = b""
    if optim:
        state["optim"] = optim
    dcp.load(state, checkpoint_id=path)
    # what a partial load left out keeps this run's values
    local_model = {local: state["model"].get(name, model_state[local])
                   for local, name in names.model_name.items()}
    local_model.update({k: v for k, v in model_state.items() if k not in names.model_name})
    if stepped:
        loaded = {**names.rename_optimizer(optim_state, saving=False), **state.get("optim", {})}
        set_state_dict(names.modules, cm.optimizer, model_state_dict=local_model,
                       optim_state_dict=names.local_optimizer(loaded, optim_state), options=OPTIONS)
    else:
        set_model_state_dict(names.modules, local_model, options=OPTIONS)
        cm.optimizer.state.clear()      # the saving run had not stepped: nor has this one now
    torch.set_rng_state(rng["torch"])
    random.setstate(pickle.loads(rng["python"]))
    if "cuda" in rng:
        torch.cuda.set_rng_state(rng["cuda"])
    cm.steps = state["autopar"]["step"]
    # a checkpoint written before samples were counted: its steps took this run's global batch
    cm.samples = state["autopar"]["samples"] if counted else cm.steps * cm.global_batch
    _restore_scaler(cm, pickle.loads(state["autopar"]["scaler"]) if scaled else None)
    return pickle.loads(state["autopar"]["extra"])


def _restore_scaler(cm, saved: dict | None) -> None:
    """fp16's loss scale continues where the saving run left it. A checkpoint of another precision
    has none: the scale starts afresh, and none of its steps was skipped."""
    if cm.scaler is not None and saved is not None:
        cm.scaler.load_state_dict(saved["state"])
    cm.skipped_steps = 0 if saved is None else saved["skipped"]


def readable(path: str | Path) -> Path:
    """The checkpoint directory at `path` (or the link there), or, when `path` is missing, the
    previous checkpoint an earlier autopar's save, interrupted between its two renames, left
    beside it."""
    path = Path(path)
    if not (path / ".metadata").is_file():
        left = sorted(path.parent.glob(f"{path.name}.old-*"), key=lambda p: p.stat().st_mtime)
        if left and (left[-1] / ".metadata").is_file():
            return left[-1]
        what = "is not a finished checkpoint (no .metadata)" if path.exists() else "does not exist"
        raise CheckpointError(f"checkpoint {path} {what}; pass a directory written by "
                              f"CompiledModel.save")
    return path


def _matched(path: Path, metadata: dict, names: StageNames, model_state: dict, optim_state: dict,
             strict: bool) -> tuple[dict, dict]:
    """This rank's {model name: tensor} and {optimizer key: value} to read from the checkpoint:
    all of them, or under strict=False those the checkpoint has. Checked on every rank before
    any loading collective; a partial load warns (on rank 0) with what it leaves out."""
    model = names.rename_model(model_state, saving=False)
    optim = names.rename_optimizer(optim_state, saving=False)
    missing = [name for name in model if f"model.{name}" not in metadata]
    missing += [key for key in optim if f"optim.{key}" not in metadata]
    # names of no tensor of this model, and optimizer entries of this rank's tensors that its
    # optimizer does not have (another optimizer saved them)
    known = set(names.name_of)
    unexpected = [key[len("model."):] for key in metadata
                  if key.startswith("model.") and key[len("model."):] not in known]
    if optim:
        held = {name.partition(".")[2].rpartition(".")[0] for name in optim}
        unexpected += [key[len("optim."):] for key in metadata if key.startswith("optim.")
                       and key.partition(".")[2].partition(".")[2].rpartition(".")[0] in held
                       and key[len("optim."):] not in optim]
    problem = _problem(path, metadata, model, missing, unexpected, strict)
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, (problem, missing, unexpected))
    found = next((report[0] for report in reports if report[0] is not None), None)
    if found is not None:
        raise CheckpointError(found)
    left_out = sorted({name for report in reports for name in report[1]})
    ignored = sorted({name for report in reports for name in report[2]})
    if (left_out or ignored) and dist.get_rank() == 0:
        warnings.warn(f"partial load of {path} (strict=False): {len(left_out)} entries of this model "
                      f"not in it keep their values {left_out[:6]}; {len(ignored)} entries of it are "
                      f"not this model's {ignored[:6]}", stacklevel=3)
    return ({name: t for name, t in model.items() if f"model.{name}" in metadata},
            {key: v for key, v in optim.items() if f"optim.{key}" in metadata})


def _problem(path: Path, metadata: dict, model: dict, missing: list[str], unexpected: list[str],
             strict: bool) -> str | None:
    """Why this rank cannot load the checkpoint into its tensors, or None."""
    if "autopar.step" not in metadata:
        return f"{path} is a DCP checkpoint but not one of CompiledModel.save (no autopar.step)"
    if strict and (missing or unexpected):
        parts = ([f"this model's {missing[:4]} ({len(missing)}) are not in it"] if missing else []) + \
            ([f"it holds {unexpected[:4]} ({len(unexpected)}), which this model does not"] if unexpected else [])
        return (f"{path} is a checkpoint of another model or optimizer: {'; '.join(parts)}. Load "
                f"it with strict=False to take only the tensors both have")
    for name, tensor in model.items():
        if f"model.{name}" not in metadata:
            continue
        shape = tuple(tensor.shape)
        saved = tuple(metadata[f"model.{name}"].size)
        if shape != saved:
            return f"{name} has shape {saved} in {path} but {shape} in this model"
    return None



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
