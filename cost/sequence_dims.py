"""Which dims of each captured value grow with the sequence length: how the cost model scales a
graph captured at one length to another (activations, flowing gradients, attention scores)."""

from __future__ import annotations

# Ops whose output dims are their input's, reordered or regrouped; the rest align to the right.
_REGROUP = {"view", "reshape", "_unsafe_view", "flatten", "unflatten"}
_MATMULS = {"mm": (0, 1), "bmm": (0, 1), "matmul": (0, 1), "addmm": (1, 2), "baddbmm": (1, 2)}


def sequence_dims(graph, seq: int) -> dict[str, tuple[int, ...]]:
    """Per node, how many factors of the sequence length each dim of its output holds (1 for a
    [.., seq, ..] dim, 2 for a merged seq*seq dim), so that a tensor's size at sequence length s'
    is its captured size times (s'/seq) ** sum(dims).

    Derived from the shapes, starting from the model's inputs of token ids (integers, [batch,
    seq, ...]: the ids, the targets of a loss), whose dim 1 is the sequence (`seq`, 0 for a model
    fed features: then nothing scales):
    views and transposes move dims, matmuls and embeddings take the dims of the operand they come
    from, other ops align their output with their inputs from the right (broadcasting) and keep an
    input dim's factor where the sizes agree. Assumptions: a tensor made from no tensor (the
    positions of `arange`) has the sequence in its dims of size `seq`, as has a parameter or buffer
    table sliced to `seq` rows (rotary tables); parameters and buffers themselves never scale; the
    sequence is captured longer than 1; a tensor cut to another length (targets shifted by one,
    `seq - 1`) is taken not to scale. Exact for the GPT and Llama presets."""
    from autopar.cost.layout import op_name      # layout builds on this module
    by_name = {n.name: n for n in graph.nodes}
    dims: dict[str, tuple[int, ...]] = {}
    for node in graph.nodes:
        if node.role.value == "input":
            ids = node.dtype.startswith(("int", "uint")) and len(node.shape) >= 2
            dims[node.name] = tuple(int(ids and d == 1 and seq > 0 and size == seq)
                                    for d, size in enumerate(node.shape))
        elif node.role.value in ("parameter", "buffer") or node.target == "output":
            dims[node.name] = (0,) * len(node.shape)
        else:
            dims[node.name] = _node_dims(node, op_name(node.target), by_name, dims, seq)
    return dims


def _node_dims(node, name: str, by_name: dict, dims: dict, seq: int) -> tuple[int, ...]:
    shape = node.shape
    sources = [dims[i] for i in node.inputs]
    if not node.dtype and node.inputs:         # a multi-output op (chunk, split): its input's
        return sources[0]
    if not node.inputs:                        # made from nothing: positions, masks
        return tuple(int(size == seq) for size in shape)
    source = _shape(by_name, node.inputs[0])
    if name in ("transpose", "t") and len(source) == len(shape):
        marks = list(sources[0])
        d0, d1 = (node.args[1], node.args[2]) if name == "transpose" else (0, 1)
        marks[d0], marks[d1] = marks[d1], marks[d0]
        return tuple(marks)
    if name == "permute":
        return tuple(sources[0][d] for d in node.args[1])
    if name in _REGROUP:
        return _regroup(source, sources[0], shape, seq)
    if name == "embedding" and len(sources) == 2:   # (weight, indices): the indices' dims, features
        return sources[1] + (0,)
    if name in _MATMULS and _matrices(shape, sources, _MATMULS[name]):
        a, b = _MATMULS[name]
        lead = _aligned(shape[:-2], [(_shape(by_name, node.inputs[a])[:-2], sources[a][:-2]),
                                     (_shape(by_name, node.inputs[b])[:-2], sources[b][:-2])])
        return lead + (sources[a][-2], sources[b][-1])
    if name == "linear":                       # the weight's rows are the output features
        return sources[0][:-1] + (0,)
    if name in ("slice", "narrow") and not any(sources[0]):
        dim = node.args[1] if len(node.args) > 1 else 0
        marks = [0] * len(shape)
        marks[dim] = int(shape[dim] == seq and source[dim] != seq)
        return tuple(marks)
    return _aligned(shape, [(_shape(by_name, i), dims[i]) for i in node.inputs])


def _matrices(shape, sources: list, operands: tuple[int, int]) -> bool:
    """Both operands of a matmul and its output are (batches of) matrices."""
    return (len(shape) >= 2 and len(sources) > max(operands)
            and all(len(sources[k]) >= 2 for k in operands))


def _shape(by_name: dict, name: str) -> tuple[int, ...]:
    """A node's output shape; a multi-output op's (chunk, split) is taken as its input's."""
    node = by_name[name]
    while not node.dtype and node.inputs:
        node = by_name[node.inputs[0]]
    return node.shape


def _aligned(shape, operands: list) -> tuple[int, ...]:
    """Right-aligned broadcasting: an output dim keeps the largest factor of the operand dims of
    the same size at the same place from the right."""
    marks = []
    for k in range(-len(shape), 0):
        found = [m[k] for s, m in operands if len(s) >= -k and len(m) == len(s) and s[k] == shape[k]]
        marks.append(max(found, default=0) if shape[k] != 1 else 0)
    return tuple(marks)


def _regroup(source, marks, shape, seq: int) -> tuple[int, ...]:
    """A view or reshape: dims are matched in runs of equal products; a run's factors go to its
    output dims of size `seq`, the rest to its largest dim."""
    out, i, j = [], 0, 0
    while j < len(shape):
        if i >= len(source):
            out.append(0)
            j += 1
            continue
        run_in, run_out = [i], [j]
        p_in, p_out = source[i], shape[j]
        while p_in != p_out:
            if p_in < p_out:
                i += 1
                run_in.append(i)
                p_in *= source[i]
            else:
                j += 1
                run_out.append(j)
                p_out *= shape[j]
        i, j = i + 1, j + 1
        total = sum(marks[k] for k in run_in)
        group = [0] * len(run_out)
        if len(run_in) == len(run_out) == 1:
            group[0] = total
        else:
            for n, k in enumerate(run_out):
                if total and shape[k] == seq:
                    group[n], total = 1, total - 1
            if total:
                group[max(range(len(run_out)), key=lambda n: shape[run_out[n]])] += total
        out.extend(group)
    return tuple(out)
