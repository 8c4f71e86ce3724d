"""Which tensor a view's storage belongs to, whether the view is contiguous, and which ops copy
their input: a copy of a partial sum is a reduced one under DTensor (its clone reduces the
partial sums first), so the layout places such an op's output as the runtime computes it."""

from __future__ import annotations

from autopar.graph import Node

# Views that leave the tensor non-contiguous; a reshape after them copies.
_STRIDING = {"transpose", "permute", "t", "expand", "expand_as", "numpy_T", "mT", "mH", "adjoint",
              "swapaxes", "swapdims", "movedim"}
# Reshapes return a view of a contiguous input and copy any other (as contiguous does).
_RESHAPES = {"reshape", "flatten", "unflatten"}


def is_noop(node: Node, name: str) -> bool:
    """Dropout with p=0 or in eval returns its input untouched."""
    if name in ("dropout", "native_dropout", "feature_dropout", "alpha_dropout"):
        p = node.args[1] if len(node.args) > 1 else node.kwargs.get("p", 0.5)
        train = node.args[2] if len(node.args) > 2 else node.kwargs.get("train", True)
        return p == 0 or not train
    return False


# Flash attention kernels (CUDA's and CPU's) write their output as [batch, seq, heads, dim] and
# return it as [batch, heads, seq, dim]: the transpose that merges the heads back is contiguous,
# so the reshape after it is a view, not a copy.
_HEADS_TRANSPOSED = "heads transposed"


def storage_of(node: Node, name: str, family: str, storage: dict, contiguous: dict,
               source_shape: tuple | None = None) -> None:
    """Which node owns `node`'s storage, and whether that view of it is contiguous (True,
    False, or `_HEADS_TRANSPOSED`: contiguous once heads and sequence are swapped back). A
    reshape to its input's own shape (`source_shape`) returns a view of any input, its layout
    unchanged."""
    source = node.inputs[0] if node.inputs else None
    if source is not None and (family == "view" or is_noop(node, name)):
        if not (name in _RESHAPES and contiguous[source] is not True and tuple(node.shape) != source_shape):
            storage[node.name] = storage[source]
            layout = contiguous[source]
            if name == "transpose" and layout == _HEADS_TRANSPOSED:
                contiguous[node.name] = sorted(node.args[1:3]) in ([1, 2], [-3, -2])
            elif name in _RESHAPES and tuple(node.shape) == source_shape:
                contiguous[node.name] = layout
            else:
                contiguous[node.name] = layout is True and name not in _STRIDING
            return
    storage[node.name] = node.name
    contiguous[node.name] = _HEADS_TRANSPOSED if family == "attention" else True


def copies(name: str, source_contiguous) -> bool:
    """Whether op `name` copies an input whose contiguity is `source_contiguous` (True, False or
    `_HEADS_TRANSPOSED`) into a new tensor."""
    return name == "clone" or (name in {*_RESHAPES, "contiguous"} and source_contiguous is not True)


def sixteen_bit_copy(key: str, reader: str, storage_bytes: dict, seq_degree: dict, narrowing: float) -> str:
    """The 16-bit copy of wide storage `key` that autocast makes for op `reader`, which keeps it
    for its backward (`narrowing`: its bytes over the storage's), entered beside the storage."""
    copy = f"{key}:16:{reader}"
    storage_bytes[copy], seq_degree[copy] = storage_bytes.get(key, 0.0) * narrowing, seq_degree.get(key, 0)
    return copy
