"""The write quota of `ragkv serve` (WritePolicy): what it admits, on a clock the test moves."""

from __future__ import annotations

import pytest

from ragkv.integrations.serve.writes import WritePolicy


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_quota_slides_with_its_window():
    clock = Clock()
    policy = WritePolicy("quota", quota=150, window_s=60, clock=clock)
    policy.settle(policy.reserve(100), written=True)
    assert policy.reserve(100) is None and policy.refused == 1
    clock.now = 59.0
    assert policy.reserve(60) is None
    clock.now = 60.0  # the first write leaves the window
    assert policy.reserve(150) is not None
    assert (policy.written, policy.written_bytes) == (1, 100)


def test_a_failed_write_gives_back_exactly_its_reservation():
    """A failed write used to add a negative entry beside its reservation; when the reservation left
    the window first, the quota counted -n bytes and admitted n bytes too many."""
    clock = Clock()
    policy = WritePolicy("quota", quota=150, window_s=60, clock=clock)
    ticket = policy.reserve(100)
    clock.now = 5.0
    policy.settle(ticket, written=False)
    clock.now = 61.0  # past the reservation, not yet past the failure
    assert policy.reserve(200) is None  # over the quota whatever happened before
    assert policy.reserve(150) is not None
    assert policy.written == 0


@pytest.mark.parametrize("name,admits", [("all", True), ("none", False)])
def test_all_and_none(name, admits):
    policy = WritePolicy(name)
    assert (policy.reserve(1 << 40) is not None) == admits
    assert policy.refused == (0 if admits else 1)
