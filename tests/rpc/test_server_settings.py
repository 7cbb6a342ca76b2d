"""Process settings a service applies at start (`run_service`)."""

from __future__ import annotations

import sys

import pytest

from cleave.rpc.server import set_gil_switch_interval


@pytest.fixture
def switch_interval():
    """The interpreter's switch interval, restored after the test."""
    before = sys.getswitchinterval()
    yield before
    sys.setswitchinterval(before)


def test_gil_switch_interval_set_in_milliseconds_or_left_alone(switch_interval):
    set_gil_switch_interval(None)
    assert sys.getswitchinterval() == switch_interval
    set_gil_switch_interval(0.5)
    assert sys.getswitchinterval() == pytest.approx(0.0005)
