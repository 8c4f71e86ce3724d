"""Traffic between ranks besides the data-parallel kind (cost/overlap.py), as the estimator
prices it: activations and their gradients crossing pipeline boundaries, the gradients of a
weight tied across pipeline ranks, and the step's closing all-reduce of the loss."""

from __future__ import annotations

from autopar.cost.chunk_price import poly_at
from autopar.cost.collectives import Group, Level, send_recv_time
from autopar.cost.compute import Efficiencies
from autopar.cost.layout import GraphLayout, element_bytes, whole_bytes
from autopar.cost.memory import BYTES_PER_PARAM
from autopar.cost.mesh import Mesh
from autopar.cost.stages import StageSpec
from autopar.graph import Graph, Role
from autopar.plans.vocabulary import DTYPE_BYTES


def parameter_reads(graph: Graph) -> list[tuple[str, int]]:
    """(parameter node, index of a node that reads it), in graph order."""
    parameters = {n.name for n in graph.parameters}
    return [(name, i) for i, node in enumerate(graph.nodes) for name in node.inputs if name in parameters]


def parameter_readers(reads: list[tuple[str, int]], owner: list[int]) -> dict[str, set[int]]:
    """Parameter node -> the chunks of the nodes that read it (`reads`: `parameter_reads`)."""
    readers: dict[str, set[int]] = {}
    for name, i in reads:
        readers.setdefault(name, set()).add(owner[i])
    return readers


def crossing_bytes(graph: Graph, layouts: dict, owner: list[int], stages: list[StageSpec],
                   constants: frozenset = frozenset(), held_whole: bool = False) -> list[dict]:
    """Activation bytes per sample that one rank sends from chunk c to chunk c + 1, as {power of
    the sequence length: bytes}. A tensor used several chunks later is relayed through every
    boundary between. A floating value crosses as each tensor-parallel rank's 1/tp chunk
    (autopar.passes.stage_boundaries): the rank's share where the stage splits it already (a
    sequence-parallel stream), a 1/tp slice of it where the stage holds it whole. `constants`
    (autopar.plans.stage_flow's: rotary tables, a position `arange`) cross no boundary: the
    runtime's split makes them again in every layer that reads them. `held_whole`: only the
    floating values the stage holds whole, which a tensor-parallel stage gathers (`add_sends`)."""
    layout = layouts[stages[0].layout_key]
    sent: set[tuple[str, int]] = set()     # (tensor, boundary): each tensor crosses once
    for i, node in enumerate(graph.nodes):
        for name in node.inputs:
            j = layout.index[name]
            if 0 <= owner[j] < owner[i] and graph.nodes[j].role is Role.ACTIVATION \
                    and name not in constants:
                sent.update((layout.storage[name], c) for c in range(owner[j], owner[i]))
    crossing: list[dict] = [{} for _ in stages]
    for tensor, c in sent:
        spec = stages[c]
        mine = layouts[spec.layout_key]
        degree = mine.seq_degree.get(tensor, 0)
        local = mine.storage_bytes.get(tensor, 0.0)
        node = graph.nodes[layout.index[tensor]]
        if node.dtype.startswith(("float", "bfloat")):
            # sent in the training dtype, even a value mixed precision keeps in fp32
            # (autopar.passes.stage_interfaces.boundary_copy)
            local *= DTYPE_BYTES[mine.dtype] / element_bytes(node, mine.dtype, mine.wide)
        floating = spec.tp > 1 and node.dtype.startswith(("float", "bfloat"))
        if floating:
            chunk = whole_bytes(node, mine.batch, mine.dtype) / spec.tp
            if held_whole and local <= chunk * (1 + 1e-9):      # split already: sent as it is
                continue
            local = min(local, chunk)
        elif held_whole:
            continue
        crossing[c][degree] = crossing[c].get(degree, 0.0) + local
    return crossing


def add_sends(memo, split, stages: list[StageSpec], chunks: list, mesh: Mesh, b: int) -> None:
    """Activations crossing chunk boundaries forward, and their gradients backward, each
    tensor-parallel rank its chunk (`crossing_bytes`, by `memo`, a PriceCache), as Megatron-LM
    and autopar send them: a value the stage splits is sent as it is held (on the dim it is split
    on, autopar.passes.stage_boundaries); a whole one is gathered over the tensor-parallel ranks
    after it arrives (its gradient by the sender). On a GPU the transfers
    run beside the compute and the sender's side stands for the pair; where the cores that
    compute also move the data (gloo on CPUs), a transfer holds both ends: the receiver waits in
    its blocking receive as long as the sender sends."""
    both_ends = not mesh.device.overlaps_communication
    crossing, gathered = captured_crossings(memo, split, stages)
    for c in range(len(stages) - 1):
        spec = stages[c]
        per_rank = spec.tp * spec.dp
        link = mesh.device.inter_node if per_rank >= mesh.gpus_per_node else mesh.device.intra_node
        one_way = send_recv_time(crossing[c] * b, link)      # one tensor-parallel rank's chunk
        if gathered[c]:
            one_way += Group.strided(mesh, spec.tp, 1).all_gather(gathered[c] * b * spec.tp)
        chunks[c].send_s += 2 * one_way
        if both_ends:
            chunks[c + 1].send_s += 2 * one_way


def captured_crossings(memo, split, stages: list[StageSpec]) -> tuple[list[float], list[float]]:
    """Bytes per sample each chunk sends on at the captured sequence length (`crossing_bytes`, by
    `memo`, a PriceCache), and of those the values it holds whole, which it gathers."""
    return tuple([poly_at(poly, 1) for poly in memo.crossing(split, stages, crossing_bytes, held_whole=whole)]
                 for whole in (False, True))


def tied_exposed(readers: dict[str, set[int]], layout: GraphLayout, spec: StageSpec, mesh: Mesh,
                 *, pp: int) -> float:
    """Megatron's embedding-group all-reduce: a weight that chunks on several pipeline ranks read
    (tied embedding and LM head) has a copy on each, whose gradients are summed over those ranks
    after the backward, with nothing left to overlap it (copies on one rank are summed in place).
    `readers`: `parameter_readers`."""
    seconds = 0.0
    for name, chunks in readers.items():
        if len(chunks) < 2:
            continue
        ranks = sorted({chunk % pp * spec.tp * spec.dp for chunk in chunks})
        if len(ranks) < 2:
            continue
        nodes = {rank // mesh.gpus_per_node for rank in ranks}
        link = mesh.device.intra_node if len(nodes) == 1 else mesh.device.inter_node
        seconds += Group((Level(len(ranks), link),)).all_reduce(tied_gradient_bytes(name, layout, spec))
    return seconds


def tied_gradient_bytes(name: str, layout: GraphLayout, spec: StageSpec) -> float:
    """Bytes of a tied weight's gradient that a copy's rank sums over the embedding group: the
    copy's tensor-parallel part, split over the dp x cp ranks where ZeRO shards it (its
    parameter's layout: autopar/runtime/tied.py)."""
    shards = spec.dp * spec.cp if spec.zero else 1
    return layout.param_local.get(name, 0.0) / shards * BYTES_PER_PARAM["gradients"]


def loss_sync(mesh: Mesh, eff: Efficiencies) -> float:
    """The step's closing all-reduce of the loss over every rank (the mean that `step` returns
    on each), waited for after the whole step's compute."""
    return (Group.strided(mesh, mesh.world_size, 1).all_reduce(8, algorithm="auto")
            + eff.wait_after(float("inf")))


def received_bytes(crossing: list[dict], stages: list) -> list[dict]:
    """Per chunk, the bytes per sample it receives ({power of the sequence: bytes}): its inputs
    from the chunk before, and the gradients of what it sends to the chunk after, each rank its
    chunk (`crossing_bytes`)."""
    received: list[dict] = [{} for _ in stages]
    for c in range(len(stages) - 1):
        for power, size in crossing[c].items():
            for chunk in (c, c + 1):
                received[chunk][power] = received[chunk].get(power, 0.0) + size
    return received
