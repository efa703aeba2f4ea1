"""How a model's decoder layers fall on pipeline stages: evenly, or with a first and a last stage of
their own sizes (``parallel.first_stage_layers`` / ``parallel.last_stage_layers``).

megatron-core's rule (``transformer_block.get_num_layers_to_build``): the first stage holds
``first`` layers and the last ``last`` when given, and the layers left are split evenly over the
stages left.  An uneven split is how a model whose layer count no PP divides is pipelined at all
(DeepSeek-V3's 61 layers at PP 8: 7, six stages of 8, 6; NeMo-RL's layout), and how the first and
last stages, which also hold the embedding and the output layer, are lightened.

Every place that needs "which stage holds layer i" or "how many layers on stage s" asks here: the
builder (megatron's config), the weight stream (the owner stage of a tensor), the dry run and the
full-size plan (parameters and activations per stage).
"""

from __future__ import annotations

from typing import List, Optional

from megarl.errors import MegarlError


class StageSplitError(MegarlError, ValueError):
    """Layers that do not fall on the pipeline stages as asked; the message names the keys."""


def stage_layer_counts(num_layers: int, pp: int, first: Optional[int] = None,
                       last: Optional[int] = None) -> List[int]:
    """The number of decoder layers on each of the ``pp`` stages (raises :class:`StageSplitError`
    naming ``parallel.*`` and ``num_hidden_layers`` when they do not split)."""
    if first is None and last is None:
        if num_layers % pp:
            raise StageSplitError(f"num_hidden_layers={num_layers} is not divisible by pipeline parallel size pp={pp} "
                                  "(parallel.first_stage_layers / parallel.last_stage_layers split it unevenly)")
        return [num_layers // pp] * pp
    if pp < 2:
        raise StageSplitError(f"parallel.first_stage_layers / parallel.last_stage_layers need pp > 1 (pp={pp})")
    for key, n in (("first_stage_layers", first), ("last_stage_layers", last)):
        if n is not None and n < 1:
            raise StageSplitError(f"parallel.{key}={n}: a stage holds at least one layer")
    left, stages = num_layers, pp
    for n in (first, last):
        if n is not None:
            left, stages = left - n, stages - 1
    if left < 0 or (stages == 0 and left != 0) or (stages > 0 and (left % stages or left == 0)):
        raise StageSplitError(
            f"num_hidden_layers={num_layers} with parallel.first_stage_layers={first} and "
            f"parallel.last_stage_layers={last} leaves {left} layers for the {stages} other stage(s) of pp={pp}, "
            "which do not split evenly")
    middle = left // stages if stages else 0
    counts = [middle] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    return counts


def layer_stage(layer: int, num_layers: int, pp: int, vpp: int = 1, first: Optional[int] = None,
                last: Optional[int] = None) -> int:
    """The PP rank holding decoder layer ``layer`` (0-based).  Under virtual stages (even split
    only) global chunk c of ``num_layers / (pp x vpp)`` layers lives on PP rank ``c mod pp``."""
    if first is None and last is None:
        return (layer // (num_layers // (pp * vpp))) % pp
    end = 0
    for stage, n in enumerate(stage_layer_counts(num_layers, pp, first, last)):
        end += n
        if layer < end:
            return stage
    raise StageSplitError(f"layer {layer} is past num_hidden_layers={num_layers}")
