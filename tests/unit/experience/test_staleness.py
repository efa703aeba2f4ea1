"""The staleness contract (megarl/experience/staleness.py): a policy token's age is the trained
step minus the step of the version that generated it, a sample is as old as its oldest policy
token, and no token beyond the declared bound (or from a newer version) is ever trained."""

from types import SimpleNamespace

import pytest
import torch

from megarl.control.batch import collate, collate_trajectories
from megarl.experience.staleness import StalenessError, check_staleness, sample_ages, staleness_metrics, token_ages
from megarl.versions import VersionError, step_of_short_id

V3, V4, V5, V6 = "v3.0-0000aaaa", "v4.1-0000bbbb", "v5.0-0000cccc", "v6.0-0000dddd"


def trajectories():
    """Row 0 spans a weight update: turn 0 on v3, environment output, turn 1 on v4.  Row 1 is
    all v5 and shorter (padding at its end)."""
    c = collate_trajectories(
        prompts=[[1, 2], [1, 2, 3]], responses=[[10, 11, 20, 21, 12], [13, 14]],
        raw_log_probs=[torch.tensor([-0.1, -0.2, 0.0, 0.0, -0.3]), torch.tensor([-0.4, -0.5])],
        sources=[[1, 1, 2, 2, 1], [1, 1]], turns=[[0, 0, 0, 0, 1], [0, 0]],
        token_versions=[[V3, V3, None, None, V4], [V5, V5]], pad_id=0)
    return SimpleNamespace(response_mask=c.response_mask, token_origins=c.token_origins,
                           policy_version=(V4, V5), sample_id=("s0", "s1"))


def test_a_trajectory_is_as_old_as_its_oldest_policy_token():
    f = trajectories()
    ages = token_ages(f, trained_step=5)
    assert ages.tolist() == [[2, 2, -1, -1, 1], [0, 0, -1, -1, -1]]
    assert sample_ages(ages).tolist() == [2, 0]  # row 0 by its first turn (v3), not its last (v4)
    assert torch.equal(check_staleness(f, 5, 2), ages)
    assert staleness_metrics(ages) == {"prep/staleness/max_token_age": 2.0, "prep/staleness/mean_sample_age": 1.0,
                                       "prep/staleness/samples_age_0": 0.5, "prep/staleness/samples_age_2": 0.5}


def test_a_token_beyond_the_bound_or_from_a_newer_version_is_refused_by_name():
    f = trajectories()
    with pytest.raises(StalenessError, match=r"sample 's0', response position 0: .*v3\.0-0000aaaa is 2 steps old, "
                                             r"above the bound 1"):
        check_staleness(f, 5, 1)
    with pytest.raises(StalenessError, match=r"sample 's1', response position 0: .*v5\.0-0000cccc comes from version "
                                             r"step 5, after the trained step 4"):
        check_staleness(f, 4, 9)


def test_single_turn_records_age_by_the_sample_version():
    c = collate([[1], [1, 2]], [[7, 8, 9], [7]], [torch.zeros(3), torch.zeros(1)], pad_id=0)
    f = SimpleNamespace(response_mask=c.response_mask, token_origins=None, policy_version=(V6, V5),
                        sample_id=("a", "b"))
    assert token_ages(f, 6).tolist() == [[0, 0, 0], [1, -1, -1]]
    check_staleness(f, 6, 1)
    with pytest.raises(StalenessError, match="sample 'b', response position 0"):
        check_staleness(f, 6, 0)  # the synchronous bound: only the trained version's tokens


def test_the_step_is_read_from_the_short_id():
    assert step_of_short_id("v42.1-1a2b3c4d") == 42
    for bad in ("42", "v42-1a2b3c4d", "v4.1-XYZ", None):
        with pytest.raises(VersionError):
            step_of_short_id(bad)
