"""Models too big for one process: built on the meta device, each rank allocates only its shards.

A model built under `torch.device("meta")` has shapes and no storage. The runtime exports it on
meta inputs, cuts the stages and keeps its stages' tensors on meta through the sharding: DTensor's
`distribute_tensor` of a meta tensor and FSDP2's `fully_shard` of meta parameters only compute
shapes. `fill_stages` then gives each rank storage for its local shards alone (`to_empty`) and
fills them, from one of:

- `load_from`: a safetensors file, a directory of safetensors shards (HuggingFace's layout, with or
  without `model.safetensors.index.json`), or a DCP checkpoint directory. Names are those of
  `model.state_dict()` (a tied weight under any of its names). Each rank reads only the slices it
  holds: safetensors through `safe_open(...).get_slice(name)[region]`, which reads those bytes of
  the file; DCP through `dcp.load`, which reads the stored chunks that overlap the local shards.
- `init(module)`: called like `model.apply(init)`, on each module that owns tensors of this rank's
  stages, materialized on the CPU with its own tensors whole (its children stay on meta), the
  random generator seeded from `seed` and the module's name. Each rank then keeps the slices it
  holds. Values depend on the seed and the names only, so they are the same under every plan. The
  cost: every rank computes each whole tensor it holds a slice of, one module at a time, so the
  extra memory is the largest module's own tensors and the time is that of initializing the
  stage's whole tensors on every rank that shares them.

`init` runs first and `load_from` overwrites what it holds, so a checkpoint without the model's
non-persistent buffers (rotary tables) can come with an `init` that computes them. Tensors of a
meta model that neither fills are refused by name.
"""

from __future__ import annotations

import copy
import json
import zlib
from pathlib import Path

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from autopar.errors import AutoparError
from autopar.runtime.fake_tensors import simulated
from autopar.runtime.hf_checkpoint import own_initializer, stored_names
from autopar.passes.program import TensorRef

INDEX_FILE = "model.safetensors.index.json"


def is_meta_model(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def check_sources(model: nn.Module, load_from, init) -> None:
    """A meta model needs values from somewhere; a path must exist (checked on every rank before
    any collective). Fake tensors need none (autopar simulate)."""
    if is_meta_model(model) and load_from is None and init is None and not simulated():
        raise AutoparError(
            f"{type(model).__name__} has tensors on the meta device and no values: pass "
            f"load_from= (a safetensors file, a directory of safetensors shards or a DCP checkpoint) "
            f"or init= (a function initializing one module in place, as model.apply takes)")
    if load_from is not None and not Path(load_from).exists():
        raise AutoparError(f"load_from={str(load_from)!r} does not exist; pass a safetensors file, a "
                           f"directory of safetensors shards or a DCP checkpoint directory")
    if init is not None and not callable(init):
        raise AutoparError(f"init={init!r} is not callable; pass a function of one module, such as "
                           f"the model's _init_weights")


def export_meta_model(model: nn.Module, inputs: tuple, kwargs: dict, device: torch.device):
    """The ExportedProgram of a meta model as if its tensors were on `device`: the export runs on
    fake tensors of `device`, as torch.export runs a real model (it wraps real tensors as fake
    ones). An export on meta would record device='meta' in ops that create tensors (a position
    `arange`, `x.to(inv_freq.device)`) and leave constants created in forward (Falcon's
    `torch.tensor([-2], device=x.device)` index) without values. The model's tensors are swapped
    for fake ones while it exports, and put back after."""
    mode = FakeTensorMode(allow_non_fake_inputs=True)
    fakes: dict[int, torch.Tensor] = {}     # by the meta tensor: a tied weight stays one tensor

    def fake(tensor: torch.Tensor) -> torch.Tensor:
        if id(tensor) not in fakes:
            # the Parameter too: its detach would otherwise run under whatever mode is active
            # (autopar simulate's, which would count the whole model's weights as allocated)
            with mode:
                value = torch.empty_strided(tensor.shape, tensor.stride(), dtype=tensor.dtype, device=device)
                fakes[id(tensor)] = (nn.Parameter(value, requires_grad=tensor.requires_grad)
                                     if isinstance(tensor, nn.Parameter) else value)
        return fakes[id(tensor)]

    swapped = []
    try:
        for module in model.modules():
            for slots in (module._parameters, module._buffers):
                for name, tensor in slots.items():
                    if tensor is not None and tensor.is_meta:
                        swapped.append((slots, name, tensor))
                        slots[name] = fake(tensor)
        as_fake = lambda x: fake(x) if isinstance(x, torch.Tensor) else x
        return torch.export.export(model, tuple(as_fake(x) for x in inputs),
                                   {k: as_fake(v) for k, v in kwargs.items()}, strict=False)
    finally:
        for slots, name, tensor in reversed(swapped):
            slots[name] = tensor


def fill_stages(modules: list[nn.Module], model: nn.Module, device: torch.device, *, load_from=None,
                init=None, seed: int = 0) -> None:
    """Give the stages' meta tensors storage for this rank's shards only and fill them: from the
    model where it holds real values, then `init`, then `load_from`, then the model's own
    initializer for non-persistent buffers still unfilled (what HuggingFace's loading does: they
    are never in a checkpoint). A collective when loading a DCP checkpoint: call on every rank."""
    refs = [ref for module in modules for ref in module.modules() if isinstance(ref, TensorRef)]
    # constants created in forward hold the values the export recorded; to_empty drops them
    constants = {ref.fqn: ref.value.detach().clone() for ref in refs if not ref.value.is_meta}
    if simulated():     # fake tensors have shapes and no values: nothing to fill (autopar simulate)
        for module in modules:
            if any(isinstance(sub, FSDPModule) for sub in module.modules()):
                module.to_empty(device=device)      # FSDP2 swaps its own shards
            else:
                _fake_storage(module, device)
        return
    for module in modules:
        if any(t.is_meta for t in [*module.parameters(), *module.buffers()]):
            module.to_empty(device=device)
    unfilled = {ref.fqn for ref in refs}
    with torch.no_grad():
        for ref in refs:
            if ref.fqn in constants:
                _copy_local(ref.value, constants[ref.fqn])
                unfilled.discard(ref.fqn)
        for ref in refs:
            source = model_tensor(model, ref.fqn)
            if source is not None and not source.is_meta:
                _copy_local(ref.value, source)
                unfilled.discard(ref.fqn)
        if init is not None:
            unfilled -= _initialize(refs, model, lambda owner: init, seed)
        if load_from is not None:
            unfilled -= _load(refs, model, Path(load_from))
        buffers = [ref for ref in refs if ref.fqn in unfilled and _non_persistent(model, ref.fqn)]
        unfilled -= _initialize(buffers, model, lambda owner: own_initializer(model, owner), seed)
    if unfilled:
        raise AutoparError(unfilled_message(sorted(unfilled), model, load_from, init))


def _fake_storage(module: nn.Module, device: torch.device) -> None:
    """`module.to_empty(device)` under a fake tensor mode, which cannot swap a meta tensor for a
    fake one in place: each meta tensor is replaced by a fake one of its shape (a DTensor's
    local shard)."""
    for sub in module.modules():
        for table in (sub._parameters, sub._buffers):
            for name, tensor in list(table.items()):
                if tensor is None or not tensor.is_meta:
                    continue
                if isinstance(tensor, DTensor):
                    local = torch.empty_like(tensor._local_tensor, device=device)
                    empty = DTensor.from_local(local, tensor.device_mesh, tensor.placements,
                                               shape=tensor.shape, stride=tensor.stride(),
                                               run_check=False)
                else:
                    empty = torch.empty_like(tensor, device=device)
                if isinstance(tensor, nn.Parameter):
                    empty = nn.Parameter(empty, requires_grad=tensor.requires_grad)
                table[name] = empty


def _non_persistent(model: nn.Module, fqn: str) -> bool:
    owner, _, name = fqn.rpartition(".")
    try:
        return name in model.get_submodule(owner)._non_persistent_buffers_set
    except AttributeError:
        return False


def unfilled_message(names: list[str], model: nn.Module, load_from, init) -> str:
    """What is missing and the fix: tensors a checkpoint should hold, or non-persistent buffers
    (never saved) that the model does not compute itself."""
    buffers = [name for name in names if _non_persistent(model, name)]
    saved = [name for name in names if name not in buffers]
    parts = []
    if saved:
        source = f"not in {load_from}" if load_from is not None else "left unset by init="
        parts.append(f"{saved[:6]} ({len(saved)} tensors) are on the meta device and {source}: load "
                     f"a checkpoint of this model (names as in model.state_dict()), or pass an init= "
                     f"that sets them")
    if buffers:
        parts.append(f"{buffers[:6]} ({len(buffers)} tensors) are non-persistent buffers (never in a "
                     f"checkpoint) on the meta device that {'init= left unset and ' if init else ''}the "
                     f"model does not compute itself (no HuggingFace _init_weights sets them): pass "
                     f"init=, a function of one module that sets them, as model.apply takes")
    return "no values for " + "; and ".join(parts)


def local_region(value: torch.Tensor) -> tuple[slice, ...]:
    """The part of the whole tensor this rank holds: all of a plain tensor, a box of a DTensor
    (TP and FSDP placements alike, torch.chunk's split as FSDP2 and DTensor use)."""
    if not isinstance(value, DTensor):
        return tuple(slice(0, size) for size in value.shape)
    shape, offset = compute_local_shape_and_global_offset(value.shape, value.device_mesh, value.placements)
    return tuple(slice(o, o + s) for o, s in zip(offset, shape))


def _local(value: torch.Tensor) -> torch.Tensor:
    return value.to_local() if isinstance(value, DTensor) else value


def _copy_local(target: torch.Tensor, whole: torch.Tensor) -> None:
    _local(target).copy_(whole[local_region(target)])


def _initialize(refs: list[TensorRef], model: nn.Module, initializer_of, seed: int) -> set[str]:
    """Run `initializer_of(owner)` (a function of one module, or None) on each owning module with
    its own tensors whole, seeded by its name; keep the local slices of the tensors it set. A
    tensor it leaves as it was is not counted as set (its storage would be garbage)."""
    by_owner: dict[str, list[TensorRef]] = {}
    for ref in refs:
        by_owner.setdefault(ref.fqn.rpartition(".")[0], []).append(ref)
    done = set()
    for owner, owned in sorted(by_owner.items()):
        try:
            module = model.get_submodule(owner)
        except AttributeError:
            continue                      # a constant the export lifted: no module to initialize
        initializer = initializer_of(owner)
        if initializer is None:
            continue
        whole = _materialized(module)
        before = {name: _unset_marker(tensor) for name, tensor in _own_tensors(whole).items()}
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(seed * 1_000_003 + zlib.crc32(owner.encode()))
            initializer(whole)
        for ref in owned:
            name = ref.fqn.rpartition(".")[2]
            tensor = getattr(whole, name, None)
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta and _was_set(tensor, before.get(name)):
                _copy_local(ref.value, tensor.detach())
                done.add(ref.fqn)
    return done


def _own_tensors(module: nn.Module) -> dict[str, torch.Tensor]:
    return {name: t for name, t in [*module._parameters.items(), *module._buffers.items()] if t is not None}


def _unset_marker(tensor: torch.Tensor) -> tuple[torch.Tensor, object]:
    """Fill a new tensor with a value no initializer writes everywhere (NaN, an integer type's
    largest value) so that one left unset is told from one set: `tensor.data.normal_()` and
    attribute assignment escape version counters."""
    with torch.no_grad():
        if tensor.is_floating_point() or tensor.is_complex():
            tensor.fill_(float("nan"))
        elif tensor.dtype != torch.bool:
            tensor.fill_(torch.iinfo(tensor.dtype).max)
    return tensor, tensor.detach().clone() if tensor.dtype != torch.bool else None


def _was_set(tensor: torch.Tensor, marker) -> bool:
    """Whether an initializer wrote `tensor`: a new object, or no element still the marker."""
    original, unset = marker if marker is not None else (None, None)
    if tensor is not original or unset is None:
        return True
    if tensor.is_floating_point() or tensor.is_complex():
        return not bool(torch.isnan(tensor).any())
    return tensor.numel() == 0 or not torch.equal(tensor, unset)


def _materialized(module: nn.Module) -> nn.Module:
    """A shallow copy of `module` (same type, for init's isinstance checks) whose own tensors are
    new, whole and on the CPU; its children are the model's, still on meta."""
    whole = copy.copy(module)
    whole._parameters = {name: None if p is None else nn.Parameter(torch.empty_like(p, device="cpu"),
                                                                  requires_grad=p.requires_grad)
                         for name, p in module._parameters.items()}
    whole._buffers = {name: None if b is None else torch.empty_like(b, device="cpu")
                      for name, b in module._buffers.items()}
    return whole


def _aliases(model: nn.Module) -> dict[str, list[str]]:
    """Every name of each tensor (a tied weight has several; a file may keep any one of them)."""
    names: dict[int, list[str]] = {}
    for name, tensor in [*model.named_parameters(remove_duplicate=False),
                         *model.named_buffers(remove_duplicate=False)]:
        names.setdefault(id(tensor), []).append(name)
    return {name: group for group in names.values() for name in group}


def _load(refs: list[TensorRef], model: nn.Module, path: Path) -> set[str]:
    aliases = _aliases(model)
    if path.is_dir() and (path / ".metadata").exists():
        return _load_dcp(refs, aliases, path)
    files = _safetensors_files(path)
    names_of = {ref.fqn: aliases.get(ref.fqn, [ref.fqn]) for ref in refs}
    # a HuggingFace directory may store a tensor under another name (transformers' renaming rules)
    renamed, converted = stored_names(model, list(files), {n for names in names_of.values() for n in names})
    done = set()
    for ref in refs:
        names = names_of[ref.fqn]
        name = next((n for n in names if n in files), None) or next(
            (renamed[n] for n in names if n in renamed), None)
        if name is None:
            continue
        _read_slice(ref, files[name], name)
        done.add(ref.fqn)
    merged = sorted(fqn for fqn in names_of if fqn not in done and any(n in converted for n in names_of[fqn]))
    if merged:
        raise AutoparError(
            f"{merged[:4]} ({len(merged)} tensors) are stored in {path} as several tensors that "
            f"transformers merges when it loads them (e.g. {converted[next(n for n in names_of[merged[0]] if n in converted)]!r}); "
            f"autopar reads each tensor's slices by the model's names: save the model's own "
            f"state_dict() names once (from_pretrained, then safetensors' save_file(model.state_dict()))")
    return done


def _safetensors_files(path: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (only the headers are read)."""
    from safetensors import safe_open

    if path.is_file():
        candidates = [path]
    elif (path / INDEX_FILE).exists():
        weight_map = json.loads((path / INDEX_FILE).read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    else:
        candidates = sorted(path.glob("*.safetensors"))
        if not candidates:
            raise AutoparError(f"{path} holds no safetensors files and no DCP checkpoint (.metadata); "
                               f"pass a safetensors file, a directory of them or a DCP checkpoint")
    files = {}
    for file in candidates:
        with safe_open(file, framework="pt") as handle:
            files.update({name: file for name in handle.keys()})
    return files


def _read_slice(ref: TensorRef, file: Path, name: str) -> None:
    from safetensors import safe_open

    with safe_open(file, framework="pt") as handle:
        stored = handle.get_slice(name)
        if tuple(stored.get_shape()) != tuple(ref.value.shape):
            raise AutoparError(f"{name} in {file} has shape {tuple(stored.get_shape())} but the model's "
                               f"is {tuple(ref.value.shape)}; the checkpoint is of another model")
        region = local_region(ref.value)
        if any(part.stop == part.start for part in region):
            return                        # a dimension smaller than the ranks splitting it
        _local(ref.value).copy_(stored[region] if region else stored[:])


def _load_dcp(refs: list[TensorRef], aliases: dict[str, list[str]], path: Path) -> set[str]:
    """DCP reads into DTensors and plain tensors alike, each rank the chunks overlapping its own.
    Keys are the model's names, or those names under "model." (a checkpoint of model and
    optimizer)."""
    import torch.distributed.checkpoint as dcp

    stored = set(dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata)
    by_key: dict[str, list[TensorRef]] = {}
    for ref in refs:
        names = [k for alias in aliases.get(ref.fqn, [ref.fqn]) for k in (alias, f"model.{alias}")]
        key = next((k for k in names if k in stored), None)
        if key is not None:
            by_key.setdefault(key, []).append(ref)
    dcp.load({key: held[0].value for key, held in by_key.items()}, checkpoint_id=str(path))
    for held in by_key.values():          # copies of a tied weight in two stages of this rank
        for ref in held[1:]:
            _local(ref.value).copy_(_local(held[0].value))
    return {ref.fqn for held in by_key.values() for ref in held}


def model_tensor(model: nn.Module, fqn: str) -> torch.Tensor | None:
    """The model's tensor at `fqn`, or None when the name is not one of its attributes (a constant
    the export lifted out of the forward)."""
    owner, _, name = fqn.rpartition(".")
    try:
        value = getattr(model.get_submodule(owner), name)
    except AttributeError:
        return None
    return value if isinstance(value, torch.Tensor) else None
