"""A replica's progress watch: stalled only while it holds work and no step finishes."""

from __future__ import annotations

from deploy.engine_replica import ProgressWatch


def test_stalled_only_while_work_waits_without_a_step():
    now, unfinished = [100.0], [0]
    watch = ProgressWatch(lambda: unfinished[0], clock=lambda: now[0])
    now[0] = 200.0
    assert watch.stalled_s() == 0.0  # idle for long: not stalled, and counted as progress
    unfinished[0] = 3
    now[0] = 201.0
    assert watch.stalled_s() == 1.0
    watch.stepped(object())  # a step finished
    now[0] = 231.0
    assert watch.stalled_s() == 30.0
    unfinished[0] = 0
    assert watch.stalled_s() == 0.0
