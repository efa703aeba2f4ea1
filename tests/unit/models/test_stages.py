"""Decoder layers over pipeline stages (megarl/models/stages.py): megatron-core's rule for an even and
an uneven split, the owner stage of each layer, and every refusal naming the keys."""

import pytest

from megarl.models.stages import StageSplitError, layer_stage, stage_layer_counts


def test_even_and_uneven_splits_follow_megatron():
    assert stage_layer_counts(8, 4) == [2, 2, 2, 2]
    # DeepSeek-V3 at NeMo-RL's PP 8: 7, six stages of 8, 6
    assert stage_layer_counts(61, 8, 7, 6) == [7, 8, 8, 8, 8, 8, 8, 6]
    # Qwen3-235B at NeMo-RL's PP 8: 11, six stages of 12, 11
    assert stage_layer_counts(94, 8, 11, 11) == [11, 12, 12, 12, 12, 12, 12, 11]
    assert stage_layer_counts(3, 2, 1) == [1, 2] and stage_layer_counts(5, 3, None, 1) == [2, 2, 1]
    assert stage_layer_counts(3, 2, 2, 1) == [2, 1]  # every stage named: nothing left to spread


def test_the_owner_stage_of_each_layer():
    assert [layer_stage(i, 61, 8, 1, 7, 6) for i in (0, 6, 7, 14, 15, 54, 55, 60)] == [0, 0, 1, 1, 2, 6, 7, 7]
    assert [layer_stage(i, 8, 2, 2) for i in range(8)] == [0, 0, 1, 1, 0, 0, 1, 1]  # interleaved, even
    counts = stage_layer_counts(61, 8, 7, 6)
    assert [sum(layer_stage(i, 61, 8, 1, 7, 6) == s for i in range(61)) for s in range(8)] == counts


@pytest.mark.parametrize("args,match", [
    ((61, 8), r"num_hidden_layers=61 is not divisible by pipeline parallel size pp=8"),
    ((61, 8, 7, 7), r"leaves 47 layers for the 6 other stage\(s\) of pp=8"),
    ((4, 1, 2), r"need pp > 1"),
    ((4, 2, 0), r"parallel.first_stage_layers=0"),
    ((4, 2, 5), r"leaves -1 layers"),
    ((4, 2, 1, 1), r"leaves 2 layers for the 0 other stage"),
    ((4, 3, 2, 2), r"leaves 0 layers for the 1 other stage"),
])
def test_splits_that_do_not_fit_are_refused_by_name(args, match):
    with pytest.raises(StageSplitError, match=match):
        stage_layer_counts(*args)
