"""Which transformer layers each pipeline stage holds.

With ``pp`` pipeline ranks and ``vpp`` model chunks per rank there are
``pp * vpp`` global stages. Following Megatron's interleaving, chunk ``v`` of
pipeline rank ``r`` is global stage ``v * pp + r``: the activations visit rank
0, 1, ..., pp-1 with chunk 0, then wrap around to rank 0 with chunk 1, and so on.
Global stage 0 also carries the embedding and the last global stage the output
layer and loss, which is why the first and last stage may hold zero layers.

Three ways to cut the layers (``parallel.pipeline_layers``):

* ``None``: uniform; num_layers must divide by pp * vpp.
* a list of pp * vpp counts, one per global stage (Yuan 2.0 cut 24 layers on 8
  stages as [2,2,3,3,4,4,4,2] to shrink the first stage's activation memory).
* ``"auto"``: contiguous cut minimising the largest stage cost, where a stage
  costs the sum of its layers' costs plus the embedding (stage 0) or the head
  (last stage); `StageCost` gives those costs in any one unit (time or memory).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Optional, Union

from megascale.config import ConfigError
from megascale.distributed.pipeline.schedules import stage_of
from megascale.model.flops import layer_forward_flops_list, logits_forward_flops

if TYPE_CHECKING:
    from megascale.config import ModelConfig

Split = Union[Sequence[int], str, None]


@dataclass(frozen=True)
class StageCost:
    """Per-layer, embedding and head cost used by ``pipeline_layers: auto``.

    ``layer`` is either one cost shared by every layer or a sequence with one cost
    per layer. Any unit works (FLOPs, milliseconds, bytes) as long as it is the same
    for all three fields.
    """

    layer: Union[float, Sequence[float]] = 1.0
    embedding: float = 0.0
    head: float = 0.0

    def layer_costs(self, num_layers: int) -> list[float]:
        """Cost of each of the num_layers layers."""
        if isinstance(self.layer, (int, float)):
            costs = [float(self.layer)] * num_layers
        else:
            costs = [float(c) for c in self.layer]
        if any(c < 0 for c in costs) or self.embedding < 0 or self.head < 0:
            raise ConfigError("StageCost values must be >= 0")
        if len(costs) != num_layers:
            raise ConfigError(f"StageCost.layer has {len(costs)} entries but the model has {num_layers} layers; "
                              "give one cost per layer or a single number")
        return costs


def gpt_stage_cost(model: ModelConfig) -> StageCost:
    """Forward matmul FLOPs per token of one GPT layer, the embedding (a lookup: 0) and the head.

    The same per-layer count as MFU (`megascale.model.flops`). The output layer costs
    2*h*Vp per token: for GPT-2 small (h 768, V 50k) that is about four layers, which
    is why the last stage should hold fewer layers. An MoE model's dense and MoE layers
    differ, so it gets one cost per layer; every layer of a dense model costs the same.
    """
    costs = layer_forward_flops_list(model)
    layer: Union[float, list[float]] = costs[0] if len(set(costs)) == 1 else costs
    return StageCost(layer=layer, embedding=0.0, head=logits_forward_flops(model.hidden_size, model.padded_vocab_size))


def _check_sizes(num_layers: int, pp: int, vpp: int) -> None:
    if pp < 1:
        raise ConfigError(f"parallel.pp={pp} must be >= 1")
    if vpp < 1:
        raise ConfigError(f"parallel.vpp={vpp} must be >= 1")
    if vpp > 1 and pp == 1:
        raise ConfigError(f"parallel.vpp={vpp} needs parallel.pp > 1 (virtual stages interleave pipeline ranks); "
                          "set parallel.vpp=1 or raise parallel.pp")
    if num_layers < 1:
        raise ConfigError(f"model.num_layers={num_layers} must be >= 1")


def _normalise_split(split: Split) -> Union[list[int], str, None]:
    """Accept what the config loader produces: 'auto', ['auto'], [2, 3] or ['2', '3']."""
    if split is None or isinstance(split, str):
        return split.strip().lower() if isinstance(split, str) else None
    items = list(split)
    if len(items) == 1 and isinstance(items[0], str) and items[0].strip().lower() == "auto":
        return "auto"
    counts = []
    for item in items:
        if isinstance(item, bool):
            raise ConfigError(f"parallel.pipeline_layers={items!r} must hold integer layer counts")
        try:
            as_float = float(item)
        except (TypeError, ValueError):
            raise ConfigError(f"parallel.pipeline_layers={items!r} must be a list of integer layer counts "
                              "(one per pipeline stage) or 'auto'") from None
        if not as_float.is_integer():
            raise ConfigError(f"parallel.pipeline_layers={items!r} must hold whole layer counts")
        counts.append(int(as_float))
    return counts


def _uniform_counts(num_layers: int, stages: int, pp: int, vpp: int) -> list[int]:
    if num_layers % stages:
        low = num_layers // stages
        extra = num_layers - low * stages
        example = [low] * (stages - extra) + [low + 1] * extra
        raise ConfigError(
            f"model.num_layers={num_layers} is not divisible by parallel.pp {pp} * parallel.vpp {vpp} = {stages} "
            f"stages; set parallel.pipeline_layers to {stages} per-stage counts (e.g. {example}) or 'auto'"
        )
    return [num_layers // stages] * stages


def _check_explicit(counts: list[int], num_layers: int, stages: int, pp: int, vpp: int) -> list[int]:
    if len(counts) != stages:
        raise ConfigError(f"parallel.pipeline_layers has {len(counts)} entries but parallel.pp {pp} * "
                          f"parallel.vpp {vpp} = {stages} stages; give one layer count per stage")
    if any(c < 0 for c in counts):
        raise ConfigError(f"parallel.pipeline_layers={counts} has a negative layer count")
    if sum(counts) != num_layers:
        raise ConfigError(f"parallel.pipeline_layers={counts} sums to {sum(counts)} but model.num_layers={num_layers}; "
                          "the counts must add up to the number of layers")
    # A middle stage without layers only relays activations: a whole rank (or chunk)
    # spent on nothing, almost certainly a typo. First/last stages carry embedding/head.
    empty_middle = [s for s in range(1, stages - 1) if counts[s] == 0]
    if empty_middle:
        raise ConfigError(f"parallel.pipeline_layers={counts}: stage(s) {empty_middle} hold no layers; only the "
                          "first and last stage (embedding / output head) may be empty")
    return counts


def auto_stage_counts(num_layers: int, stages: int, cost: StageCost) -> list[int]:
    """Contiguous layer counts for `stages` stages minimising the largest stage cost.

    Ties between equally good cuts are broken by the smallest sum of squared stage
    costs, which spreads the slack evenly instead of piling it on one stage. Middle
    stages get at least one layer (see `_check_explicit`).
    """
    if stages == 1:
        return [num_layers]
    if num_layers < stages - 2:
        raise ConfigError(f"model.num_layers={num_layers} is too few for {stages} pipeline stages "
                          f"(every middle stage needs a layer); lower parallel.pp or parallel.vpp")
    layer_costs = cost.layer_costs(num_layers)
    prefix = [0.0]
    for c in layer_costs:
        prefix.append(prefix[-1] + c)

    def stage_cost(stage: int, start: int, end: int) -> float:
        extra = (cost.embedding if stage == 0 else 0.0) + (cost.head if stage == stages - 1 else 0.0)
        return prefix[end] - prefix[start] + extra

    def min_layers(stage: int) -> int:
        return 0 if stage in (0, stages - 1) else 1

    inf = float("inf")
    # best_max[s][j]: smallest achievable max cost of stages 0..s-1 covering layers 0..j-1.
    best_max = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    best_max[0][0] = 0.0
    for s in range(stages):
        for j in range(num_layers + 1):
            if best_max[s][j] == inf:
                continue
            for end in range(j + min_layers(s), num_layers + 1):
                value = max(best_max[s][j], stage_cost(s, j, end))
                if value < best_max[s + 1][end]:
                    best_max[s + 1][end] = value
    cap = best_max[stages][num_layers] * (1 + 1e-12) + 1e-12
    # Second pass: among cuts within the optimal cap, minimise the sum of squares (additive, so exact).
    best_sq = [[inf] * (num_layers + 1) for _ in range(stages + 1)]
    choice = [[-1] * (num_layers + 1) for _ in range(stages + 1)]
    best_sq[0][0] = 0.0
    for s in range(stages):
        for j in range(num_layers + 1):
            if best_sq[s][j] == inf:
                continue
            for end in range(j + min_layers(s), num_layers + 1):
                c = stage_cost(s, j, end)
                if c > cap:
                    break  # costs are non-negative, so longer stages only cost more
                value = best_sq[s][j] + c * c
                if value < best_sq[s + 1][end] - 1e-12:
                    best_sq[s + 1][end] = value
                    choice[s + 1][end] = j
    counts = []
    end = num_layers
    for s in range(stages, 0, -1):
        start = choice[s][end]
        counts.append(end - start)
        end = start
    return counts[::-1]


def stage_layer_counts(num_layers: int, pp: int, vpp: int = 1, split: Split = None,
                       cost: Optional[StageCost] = None) -> list[int]:
    """Number of layers of every global stage (pp * vpp of them), validated.

    Raises ConfigError naming parallel.pipeline_layers / parallel.pp / parallel.vpp.
    """
    _check_sizes(num_layers, pp, vpp)
    stages = pp * vpp
    split = _normalise_split(split)
    if split is None:
        return _uniform_counts(num_layers, stages, pp, vpp)
    if isinstance(split, str):
        if split != "auto":
            raise ConfigError(f"parallel.pipeline_layers={split!r} must be null, 'auto' or a list of "
                              f"{stages} layer counts")
        return auto_stage_counts(num_layers, stages, cost or StageCost())
    return _check_explicit(split, num_layers, stages, pp, vpp)


def layers_for_rank(num_layers: int, pp: int, vpp: int, pp_rank: int,
                    split: Split = None, cost: Optional[StageCost] = None, v_shape: bool = False) -> list[list[int]]:
    """Global layer indices of each model chunk of pipeline rank `pp_rank`, in virtual-stage order.

    Chunk v of rank r is global stage v * pp + r (Megatron interleaving), or with
    v_shape (ZB-V, two chunks) stage r for chunk 0 and 2 * pp - 1 - r for chunk 1.
    """
    return chunk_layer_ids(stage_layer_counts(num_layers, pp, vpp, split, cost), pp, vpp, pp_rank, v_shape)


def chunk_layer_ids(counts: Sequence[int], pp: int, vpp: int, pp_rank: int,
                    v_shape: bool = False) -> list[list[int]]:
    """Global layer ids of each chunk of pipeline rank `pp_rank`, from the layer counts of the
    pp * vpp global stages (chunk v of rank r is global stage `global_stage(pp, r, v, v_shape)`)."""
    if not 0 <= pp_rank < pp:
        raise ConfigError(f"pipeline rank {pp_rank} is outside parallel.pp={pp}")
    starts = [0]
    for count in counts:
        starts.append(starts[-1] + count)
    stages = (global_stage(pp, pp_rank, v, v_shape) for v in range(vpp))
    return [list(range(starts[stage], starts[stage + 1])) for stage in stages]


def global_stage(pp: int, pp_rank: int, chunk: int, v_shape: bool = False) -> int:
    """Global stage index of local chunk `chunk` on pipeline rank `pp_rank` (see `schedules.stage_of`)."""
    return stage_of(pp, pp_rank, chunk, v_shape)


__all__ = [
    "StageCost",
    "auto_stage_counts",
    "chunk_layer_ids",
    "global_stage",
    "gpt_stage_cost",
    "layers_for_rank",
    "stage_layer_counts",
]
