"""What the estimator's calls on one graph, mesh and efficiencies share, kept in a dict the caller
owns (`estimate(..., cache=d)`), so that a planner pricing hundreds of configurations builds each
layout, chunk split and priced chunk once.

Every entry is a pure function of its key and of the (graph, mesh, efficiencies) context the dict
was first used with; a dict used with another context is refused rather than answering wrongly.
Entries are never mutated after they are stored: callers get copies of priced chunks.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from autopar.cost.chunk_shape import ChunkShape, chunk_shape
from autopar.cost.chunk_price import (Chunk, Pricing, chunk_states, node_prices, price_chunk,
                                     recomputed_regions)
from autopar.cost.context import attention_bytes, with_ring_attention
from autopar.cost.kernels import with_composite_norms
from autopar.cost.expert_layers import expert_layers, expert_parameters
from autopar.cost.experts import with_expert_parallelism
from autopar.cost.forms import expert_data_parallel
from autopar.cost.layout import GraphLayout, graph_batch, infer_layout
from autopar.cost.padding import padding_elements
from autopar.cost.mesh import Mesh
from autopar.cost.stages import StageSpec, block_mask, chunk_of_nodes, reduce_order, sharding_groups
from autopar.cost.traffic import parameter_readers, parameter_reads
from autopar.errors import AutoparError
from autopar.graph import Graph
from autopar.mixed_dtypes import mixed_dtypes, ties_apart_matter
from autopar.plans.vocabulary import DTYPE_BYTES
from autopar.plans.stage_flow import constants, live


@dataclass(kw_only=True, slots=True, frozen=True)
class Split:
    """Which nodes each chunk of a list of stages holds."""
    key: tuple                  # the stages' layers, hashable
    owner: list                 # graph node index -> chunk
    node_sets: list             # chunk -> id of its set of nodes (equal sets, equal ids)
    groups: list                # chunk -> FSDP groups its parameters fall into (stages.sharding_groups)


class PriceCache:
    """The estimator's memo over `store` (a caller's dict, or a fresh one for a single call)."""

    __slots__ = ("store", "graph", "mesh", "efficiencies", "dtype", "routing_imbalance",
                 "gemm_dtype", "dispatch", "autocast")

    def __init__(self, store: dict, graph: Graph, mesh: Mesh, efficiencies,
                 dtype: str | None = None, routing_imbalance: float = 1.0,
                 gemm_dtype: str = "", dispatch: str = "all-to-all", autocast: bool = True) -> None:
        self.store, self.graph, self.mesh, self.efficiencies = store, graph, mesh, efficiencies
        # the dtype activations are held in: the plan's precision, else what the device trains in
        self.dtype = dtype or mesh.device.training_dtype
        self.routing_imbalance = routing_imbalance     # cost/experts.py
        self.gemm_dtype = gemm_dtype                   # matmuls' own dtype (FP8), "" for dtype's
        self.dispatch = dispatch                       # cost.experts.exchange_time
        self.autocast = autocast                       # the runtime's (cost.overlap.Runtime)

    @classmethod
    def of(cls, store: dict | None, graph: Graph, mesh: Mesh, efficiencies,
           dtype: str | None = None, routing_imbalance: float = 1.0,
           gemm_dtype: str = "", dispatch: str = "all-to-all", autocast: bool = True) -> PriceCache:
        dtype = dtype or mesh.device.training_dtype
        settings = (mesh, efficiencies, dtype, routing_imbalance, gemm_dtype, dispatch, autocast)
        if store is None:
            return cls({}, graph, *settings)
        context = store.setdefault("context", (graph, *settings))
        if context[0] is not graph or context[1:] != settings:
            raise AutoparError("this estimator cache holds prices of another graph, mesh, "
                               "efficiencies, precision or routing; pass a fresh dict (or none) "
                               "for each of them")
        return cls(store, graph, *settings)

    def _get(self, key: tuple, make):
        if key not in self.store:
            self.store[key] = make()
        return self.store[key]

    def layout(self, spec: StageSpec) -> GraphLayout:
        """The stage's layout: its tensor-parallel placements, then its expert parallelism, then
        ring attention's saved keys and values."""
        tp, _, placements, ep, ring, apart = self.layout_key(spec)
        tensor = self._get(("layout", tp, placements, apart), lambda: self._device_kernels(
            infer_layout(self.graph, tp, compute_dtype=self.dtype, placements=placements,
                         wide=self.held_dtypes(apart))))
        experts = self._get(("layout", tp, placements, ep, apart), lambda: with_expert_parallelism(
            tensor, self.expert_layers(), self.graph, ep=ep, tp=tp))
        return self._get(("layout", *self.layout_key(spec)),
                         lambda: with_ring_attention(experts, self.graph) if ring else experts)

    def layout_key(self, spec: StageSpec) -> tuple:
        """What the stage's layout and prices depend on (StageSpec.layout_key): whether it is one
        of a pipeline's only where that changes the units FSDP2 wraps, a head tied to the
        embedding (autopar.mixed_dtypes.ties_apart_matter)."""
        *key, pipelined = spec.layout_key
        return (*key, pipelined and self._get(("ties_apart",), lambda: ties_apart_matter(self.graph)))

    def held_dtypes(self, ties_apart: bool = False) -> tuple[dict, dict]:
        """The values held wider than a 16-bit precision, and those whose gradients are, as the
        mesh's device type runs the graph under autocast (autopar.mixed_dtypes; in one of a
        pipeline's stages, `ties_apart`); none in fp32 or in a runtime that holds the whole model
        in 16 bits."""
        if DTYPE_BYTES[self.dtype] == 4 or not self.autocast:
            return {}, {}, {}
        return mixed_dtypes(self.graph, "cpu" if self.mesh.device.name == "cpu" else "cuda", ties_apart)

    def _device_kernels(self, layout: GraphLayout) -> GraphLayout:
        """What the mesh's device keeps where its kernels differ from a GPU's (cost/kernels.py)."""
        return with_composite_norms(layout, self.graph) if self.mesh.device.name == "cpu" else layout

    def expert_layers(self) -> list:
        """The graph's mixture-of-experts layers (cost/experts.py)."""
        return self._get(("expert_layers",), lambda: expert_layers(self.graph))

    def expert_params(self, split: Split, spec: StageSpec) -> list[float]:
        """Per chunk, the elements of experts' weights one of its devices holds."""
        def make():
            layout, owner = self.layout(spec), split.owner
            totals = [0.0] * len(split.node_sets)
            for name in expert_parameters(self.expert_layers()):
                totals[owner[layout.index[name]]] += layout.param_local.get(name, 0.0)
            return totals
        return self._get(("expert_params", split.key, *self.layout_key(spec)), make)

    def shard_padding(self, split: Split, spec: StageSpec) -> list[tuple[float, float]]:
        """Per chunk, the elements FSDP2 pads its parameters with when ZeRO shards them
        (cost/padding.py): (the dp x cp ranks' shards, the experts' over their own group)."""
        def make():
            layout, owner = self.layout(spec), split.owner
            experts = set(expert_parameters(self.expert_layers())) if spec.ep > 1 else set()
            split_by = spec.placements.parameters if spec.tp > 1 and spec.placements else None
            names = [[[], []] for _ in split.node_sets]
            for name in layout.param_local:
                names[owner[layout.index[name]]][name in experts].append(name)
            rows = 1 if self._experts_split_by_rows(spec) else 0
            return [(padding_elements(self.graph, layout, plain, spec.dp * spec.cp, split_by),
                     padding_elements(self.graph, layout, expert, expert_data_parallel(spec), dim=rows))
                    for plain, expert in names]
        return self._get(("shard_padding", split.key, *self.layout_key(spec), spec.dp, spec.cp), make)

    def experts_by_rows(self, split: Split, spec: StageSpec) -> list[float]:
        """Per chunk, the share of its experts' elements that FSDP2 shards on a dim after the
        first (autopar.runtime.data_parallel: split experts whose ranks' count does not divide
        among their group, grouped weights whose first dim does not divide among dp x cp).
        FSDP2 copies such a parameter's gather out through a temporary as large (its chunk-cat),
        a third copy at the copy-out moment."""
        def make():
            layout, owner = self.layout(spec), split.owner
            shapes = {node.name: node.shape for node in self.graph.nodes}
            ranks, split_experts = spec.dp * spec.cp, self._experts_split_by_rows(spec)
            later = [0.0] * len(split.node_sets), [0.0] * len(split.node_sets)
            for name in expert_parameters(self.expert_layers()):
                if name not in layout.param_local:
                    continue
                shape, chunk = shapes[name], owner[layout.index[name]]
                later[0][chunk] += layout.param_local[name]
                if split_experts if spec.ep > 1 else spec.tp == 1 and _later_dim(shape, ranks):
                    later[1][chunk] += layout.param_local[name]
            return [by_rows / total if total else 0.0 for total, by_rows in zip(*later)]
        return self._get(("experts_by_rows", split.key, *self.layout_key(spec), spec.dp, spec.cp), make)

    def _experts_split_by_rows(self, spec: StageSpec) -> bool:
        """Whether the runtime shards split experts on each expert's rows (dim 1), not on the
        experts: where a rank's experts do not divide among their own data-parallel ranks
        (autopar.runtime.data_parallel._expert_shards)."""
        edp = expert_data_parallel(spec)
        return any(layer.experts // spec.ep % edp for layer in self.expert_layers())

    def model_flops_per_sample(self) -> float:
        """A training step's model FLOPs per sample: 3x the forward (backward = 2x)."""
        return self._get(("model_flops",),
                         lambda: 3 * self.graph.forward_flops / graph_batch(self.graph))

    def layouts(self, stages: list[StageSpec]) -> dict:
        return {s.layout_key: self.layout(s) for s in stages}

    def split(self, stages: list[StageSpec]) -> Split:
        key = tuple(tuple(_hashable(layer) for layer in s.layers) for s in stages)
        return self._get(("split", key), lambda: self._make_split(key, stages))

    def _flow(self) -> list:
        return self._get(("flow",), lambda: live(self.graph.flow_nodes()))

    def _make_split(self, key: tuple, stages: list[StageSpec]) -> Split:
        owner = chunk_of_nodes(self.graph, stages, self._flow())
        members: list[list[int]] = [[] for _ in stages]
        for i, c in enumerate(owner):
            members[c].append(i)
        ids = self.store.setdefault("node_sets", {})
        node_sets = [ids.setdefault(tuple(m), len(ids)) for m in members]
        return Split(key=key, owner=owner, node_sets=node_sets,
                     groups=sharding_groups(self.graph, owner, len(stages)))

    def chunk(self, split: Split, c: int, spec: StageSpec, micro_batch: int, attention: str) -> Chunk:
        """Chunk `c` priced (`chunk_price.price_chunk`), a copy the caller may change. The price
        depends on the chunk's nodes, not on where it sits in the pipeline."""
        key = ("chunk", split.node_sets[c], *self.layout_key(spec), spec.cp, spec.cp_kind,
               spec.recompute, micro_batch, attention)
        priced = self._get(key, lambda: price_chunk(
            self._chunk_shape(split, c, spec), self._members(split, spec)[c],
            self._node_prices(spec, micro_batch, attention), micro_batch))
        return replace(priced)

    def _chunk_shape(self, split: Split, c: int, spec: StageSpec) -> ChunkShape:
        """What chunk `c`'s price takes from its nodes, layout and recompute alone."""
        key = ("chunk_shape", split.node_sets[c], *self.layout_key(spec), spec.recompute)
        return self._get(key, lambda: chunk_shape(self.graph, self.layout(spec), self._regions(spec.recompute),
                                                  self._members(split, spec)[c]))

    def _blocks(self) -> list:
        return self._get(("blocks",), lambda: block_mask(self.graph))

    def _regions(self, recompute: str) -> list:
        return self._get(("regions", recompute),
                         lambda: recomputed_regions(self.graph, self._blocks(), recompute))

    def _node_prices(self, spec: StageSpec, micro_batch: float, attention: str) -> dict:
        key = ("node_prices", *self.layout_key(spec), spec.cp, spec.cp_kind, micro_batch, attention)
        experts = {name: layer for layer in self.expert_layers() for name in layer.matmuls}
        return self._get(key, lambda: node_prices(
            self.layout(spec), spec, self.mesh, micro_batch, self.efficiencies, attention,
            Pricing(routing_imbalance=self.routing_imbalance, gemm_dtype=self.gemm_dtype,
                    attention_bytes=self._attention_bytes(spec) if spec.cp > 1 else {},
                    deduplicated_dispatch=self.dispatch == "deduplicated"), experts))

    def _attention_bytes(self, spec: StageSpec) -> dict:
        return self._get(("attention_bytes", *self.layout_key(spec)),
                         lambda: attention_bytes(self.graph, self.layout(spec)))

    def readers(self, split: Split) -> dict[str, set[int]]:
        """Parameter node -> the chunks of `split` that read it (`traffic.parameter_readers`)."""
        reads = self._get(("parameter_reads",), lambda: parameter_reads(self.graph))
        return self._get(("readers", split.key), lambda: parameter_readers(reads, split.owner))

    def states(self, split: Split, spec: StageSpec) -> tuple[list, list, list, list]:
        """Every chunk's parameters and loss buffers under `spec`'s layout
        (`chunk_price.chunk_states`): a tied weight counts once or twice depending on the whole split."""
        key = ("states", split.key, *self.layout_key(spec))
        return self._get(key, lambda: chunk_states(
            self.graph, self.layout(spec), split.owner, len(split.node_sets), self.readers(split)))

    def reduce_order(self, split: Split, spec: StageSpec) -> list[tuple]:
        """Per chunk, its FSDP groups in the order the step's one reduction meets them
        (cost.stages.reduce_order): split experts are groups of their own."""
        def make():
            experts = set(expert_parameters(self.expert_layers())) if spec.ep > 1 else set()
            return reduce_order(self.graph, self.layout(spec), split.owner, len(split.node_sets), experts,
                                self.readers(split))
        return self._get(("reduce_order", split.key, *self.layout_key(spec)), make)

    def _members(self, split: Split, spec: StageSpec) -> list:
        """Each chunk's node layouts, in graph order."""
        def make():
            layout = self.layout(spec)
            members = [[] for _ in split.node_sets]
            for node in layout.nodes:
                members[split.owner[layout.index[node.name]]].append(node)
            return members
        return self._get(("members", split.key, *self.layout_key(spec)), make)

    def crossing(self, split: Split, stages: list[StageSpec], bytes_of,
                 held_whole: bool = False) -> list[dict]:
        """Bytes per sample crossing each chunk boundary, {power of the sequence length: bytes},
        by `bytes_of` (the estimator's; `held_whole`: of the values a stage holds whole)."""
        degrees = tuple(s.layout_key for s in stages)
        made_anywhere = self._get(("constants",), lambda: frozenset(constants(self._flow())))
        return self._get(("crossing", split.key, degrees, held_whole), lambda: bytes_of(
            self.graph, self.layouts(stages), split.owner, stages, made_anywhere, held_whole))


def _hashable(layer):
    """A module path, or a (start, stop) node range given as a list or tuple."""
    return layer if isinstance(layer, str) else tuple(layer)


def _later_dim(shape, ranks: int) -> bool:
    """Whether FSDP2 shards a plain weight of `shape` over `ranks` on a dim after the first: a
    grouped weight ([experts, in, out]) whose first dim does not divide among them and a later
    one does (autopar.runtime.data_parallel._even_shards)."""
    return len(shape) >= 3 and shape[0] % ranks != 0 and any(size % ranks == 0 for size in shape[1:])
