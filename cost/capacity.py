"""How large a micro-batch or sequence fits a device's memory, by the estimator's memory model:
`memory_expression` (bytes on the fullest device as a sympy expression in the micro-batch size and
the sequence length), `max_batch` and `max_seq`.
"""

from __future__ import annotations

import sympy

from autopar.cost.compute import Efficiencies
from autopar.cost.config import Config
from autopar.cost.estimator import _Pipeline, check_world, pipeline_memory, price_pipeline
from autopar.cost.layout import graph_sequence
from autopar.cost.mesh import Mesh
from autopar.cost.overlap import RUNTIMES, holds_every_transfer
from autopar.cost.price_cache import PriceCache
from autopar.cost.stages import StageSpec, uniform_stages
from autopar.errors import AutoparError
from autopar.graph import Graph


def memory_expression(graph: Graph, mesh: Mesh, config: Config, *,
                      batch: sympy.Symbol | None = None, seq: sympy.Symbol | None = None,
                      attention: str = "flash", placements=None) -> sympy.Expr:
    """Bytes on the fullest device as an expression in the micro-batch size `batch` (a sympy
    symbol), for config's number of micro-batches per step; with `seq`, also in the sequence
    length.

    Sequence scaling comes from the graph (`autopar.cost.sequence_dims`): every saved
    tensor's bytes are its captured bytes times (seq / captured seq) to the number of its dims
    that derive from the input ids' dim 1 (2 for unfused attention's score matrices); parameters
    and optimizer states do not scale (a learned position table is fixed in size). Exact while
    the model's ops keep their shapes' structure as the sequence changes, as transformers do."""
    check_world(mesh, config)
    batch = batch if batch is not None else sympy.Symbol("b", positive=True, integer=True)
    pipe, stages = _uniform_pipeline(graph, mesh, config, attention, placements)
    ratio = 1 if seq is None else seq / _captured_sequence(graph)
    totals = [sympy.Add(*part.values()) for part in pipeline_memory(
        pipe, stages, batch / config.cp, config.schedule, config.virtual, ratio,
        receive_buffers=holds_every_transfer(RUNTIMES["autopar"], config.schedule))[0]]
    return sympy.Max(*totals)


def _uniform_pipeline(graph: Graph, mesh: Mesh, config: Config, attention: str,
                      placements=None) -> tuple[_Pipeline, list[StageSpec]]:
    stages = uniform_stages(graph, config, placements)
    pipe = price_pipeline(graph, mesh, stages, global_batch=config.global_batch,
                           micro_batch=config.micro_batch, virtual=config.virtual,
                           efficiencies=Efficiencies(), attention=attention,
                           memo=PriceCache.of(None, graph, mesh, Efficiencies()))
    return pipe, stages


def _captured_sequence(graph: Graph) -> int:
    seq = graph_sequence(graph)
    if not seq:
        raise AutoparError("the graph has no sequence length: its first input is not a "
                           "[batch, seq] tensor of token ids; capture a language model")
    return seq


def max_batch(graph: Graph, mesh: Mesh, config: Config, memory_limit: float | None = None, *,
              attention: str = "flash", placements=None) -> int:
    """The largest MICRO-batch that fits `memory_limit` bytes per device (the device's memory by
    default), keeping config's number of micro-batches per step (so the global batch grows with it).
    0 when even the model states do not fit."""
    check_world(mesh, config)
    limit = memory_limit if memory_limit is not None else mesh.device.memory_bytes
    pipe, stages = _uniform_pipeline(graph, mesh, config, attention, placements)
    memory = lambda size: max(sum(part.values()) for part in pipeline_memory(
        pipe, stages, size / config.cp, config.schedule, config.virtual,
        receive_buffers=holds_every_transfer(RUNTIMES["autopar"], config.schedule))[0])
    return 0 if memory(0) > limit else _largest_fitting(memory, limit, 0)


def max_seq(graph: Graph, mesh: Mesh, config: Config, memory_limit: float | None = None, *,
            attention: str = "flash", placements=None) -> int:
    """The longest sequence that fits `memory_limit` bytes per device (the device's memory by
    default) at config's micro-batch, by `memory_expression` in the sequence length (see there
    for how it scales). 0 when not even a sequence of 1 fits. The model's own limit (its position
    table or rotary tables) is not checked."""
    limit = memory_limit if memory_limit is not None else mesh.device.memory_bytes
    s = sympy.Symbol("s", positive=True)
    expression = memory_expression(graph, mesh, config, batch=config.micro_batch, seq=s,
                                   attention=attention, placements=placements)
    if s not in expression.free_symbols:
        raise AutoparError("no activation of this graph grows with the sequence length, so no "
                           "length bounds its memory")
    memory = sympy.lambdify(s, expression, "math")
    return 0 if memory(1) > limit else _largest_fitting(memory, limit, 1)


def _largest_fitting(memory, limit: float, low: int) -> int:
    """The largest size from `low` on whose `memory` fits `limit`, memory growing with the size
    and memory(low) fitting: doubling, then bisection."""
    high = max(1, 2 * low)            # memory(low) fits, memory(high) is not yet known to
    while memory(high) <= limit:
        low, high = high, 2 * high
    while high - low > 1:
        middle = (low + high) // 2
        low, high = (middle, high) if memory(middle) <= limit else (low, middle)
    return low
