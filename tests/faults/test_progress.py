"""A replica's progress watch: stalled only while it holds work and no step finishes."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

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


def test_a_stalled_replica_fails_its_health_check_and_lets_its_requests_go():
    pytest.importorskip("ray")
    from deploy.replica import ModelReplica, Outboxes
    from router.contract import Lost

    now = [0.0]
    replica = ModelReplica.__new__(ModelReplica)  # no Serve context, no engine: the check only
    replica.engine = SimpleNamespace(dead=False, num_unfinished=2)
    replica.progress = ProgressWatch(lambda: 2, clock=lambda: now[0])
    replica.stall_timeout_s = 5.0
    replica._outboxes = Outboxes()
    replica._serving = {"a": "ingress-1", "b": "ingress-2"}
    now[0] = 4.0
    replica.check_health()  # slow, not stalled
    now[0] = 6.0
    with pytest.raises(RuntimeError, match="stalled"):
        replica.check_health()
    for ingress, rid in (("ingress-1", "a"), ("ingress-2", "b")):
        ((got, item),) = replica._outboxes.open(ingress).drain()
        assert got == rid and isinstance(item, Lost) and "stalled" in item.message
