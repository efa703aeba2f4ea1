"""The full-size proof's coverage rule (megarl/commands/full_size.py): the slices the positions
read must tile each HF tensor along one dimension, or every reader reads it whole."""

from megarl.commands.full_size import _coverage

SHAPES = {"w": (8, 4), "norm": (4,)}


def test_a_tiling_and_a_whole_read_are_covered_once():
    assert _coverage(SHAPES, {"w": {(0, 0, 4), (0, 4, 8)}, "norm": {None}}) == []
    # data-parallel replicas read the same slices again: still once
    assert _coverage(SHAPES, {"w": {(0, 0, 4), (0, 4, 8), (0, 0, 4)}, "norm": {None}}) == []


def test_a_gap_an_overlap_a_mixed_read_and_an_unread_tensor_are_named():
    assert _coverage(SHAPES, {"w": {(0, 0, 3), (0, 4, 8)}, "norm": {None}}) == [
        "'w' [3:4] along dim 0 is read by no rank"]
    assert _coverage(SHAPES, {"w": {(0, 0, 5), (0, 4, 8)}, "norm": {None}}) == [
        "'w' [4:5] along dim 0 is read by two shards"]
    assert _coverage(SHAPES, {"w": {(0, 0, 4)}, "norm": {None}}) == ["'w' [4:8] along dim 0 is read by no rank"]
    assert _coverage(SHAPES, {"w": {(0, 0, 8), None}, "norm": {None}}) == [
        "'w' is read whole by some ranks and in slices by others"]
    assert _coverage(SHAPES, {"w": {(0, 0, 8), (1, 0, 4)}, "norm": {None}}) == ["'w' is sliced along dims [0, 1]"]
    assert _coverage(SHAPES, {"w": {(0, 0, 8)}}) == ["'norm' [4] is read by no rank"]
