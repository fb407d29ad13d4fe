"""One stream per replica for every step's items: the replica's outbox, the ingress's
routing of batches to requests, and what a lost stream does to them (fakes, no cluster)."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from deploy.replica import Outbox, Outboxes
from engine.core.params import SamplingParams
from router.calls import ReplicaLost
from router.contract import Accepted, Lost, RequestShape, SequenceDelta, StepItem
from router.dispatch import RayCall, migrated_seed
from router.routing import register
from router.step_streams import StepStreams, StreamLost


class FakeCall:
    """A streaming call: yields ``first`` (if any), then whatever is fed to it."""

    def __init__(self, first=None) -> None:
        self.first, self.fed, self.cancelled = first, asyncio.Queue(), False

    def __aiter__(self):
        return self

    async def __anext__(self):
        if self.first is not None:
            first, self.first = self.first, None
            return first
        item = await self.fed.get()
        if isinstance(item, BaseException):
            raise item
        return item

    def cancel(self) -> None:
        self.cancelled = True


class FakeReplicas:
    """The replica deployment's handle: ``generate`` answers Accepted from the replica
    named in ``replicas`` (one per call, in turn); ``step_items`` opens a stream.

    Its router's view (:class:`FakeView`) lists ``alive`` (default: every replica named)
    less those found dead."""

    app_name = "app"

    def __init__(self, replicas: list[str], alive: set[str] | None = None) -> None:
        self.replicas, self.calls, self.streams = list(replicas), [], {}
        self.generate, self.step_items = self._Method(self._generate), self._Method(self._stream)
        self.deployment_name = f"dep-{id(self)}"
        self.view = FakeView(set(replicas) if alive is None else alive)
        register(self.view, self.app_name, self.deployment_name)

    class _Method:
        def __init__(self, fn) -> None:
            self.remote = fn

    def _generate(self, rid, ids, params, shape, ingress, resume=()):
        call = FakeCall(Accepted(len(ids), self.replicas.pop(0)))
        self.calls.append((rid, ingress, call, params, resume))
        return call

    def _stream(self, ingress, pin):
        call = self.streams[pin] = FakeCall([])
        return call


class FakeView:
    """The router's view of the replicas: the live ones, less those found dead."""

    def __init__(self, alive: set[str]) -> None:
        self.alive, self.dead = alive, set()

    def replica_ids(self) -> set[str]:
        return self.alive - self.dead

    def replica_died(self, replica: str) -> None:
        self.dead.add(replica)

    def observe_load(self, replica, snap) -> None:
        pass


def item(text: str, finished: bool = False, token: int = 1) -> StepItem:
    delta = SequenceDelta(0, text, [token], None, "stop" if finished else None, None)
    return StepItem([delta], finished)


async def test_outbox_gives_one_step_of_every_request_in_one_take():
    box = Outbox()
    take = asyncio.create_task(box.take())
    await asyncio.sleep(0)
    assert not take.done()  # nothing put yet: the stream waits
    box.put("a", item("x"))
    box.put("b", item("y"))  # the same event-loop pass, as the engine hands out a step
    assert [rid for rid, _ in await take] == ["a", "b"]
    box.put("a", item("z"))
    assert [rid for rid, _ in await box.take()] == ["a"]


async def test_a_reopened_stream_takes_over_its_ingress_outbox():
    # The ingress's stream failed while the replica lived and it opened another: items
    # must go to the new stream, and the old one ending must not drop them.
    boxes = Outboxes()
    old = boxes.open("ing")
    boxes.put("ing", "a", item("1"))  # not taken by the old stream yet
    new = boxes.open("ing")
    boxes.put("ing", "a", item("2"))
    boxes.close("ing", old)
    boxes.put("ing", "b", item("3"))
    assert [(rid, i.outputs[0].text) for rid, i in await new.take()] == [
        ("a", "1"),
        ("a", "2"),
        ("b", "3"),
    ]
    assert old.drain() == []
    boxes.close("ing", new)
    boxes.put("ing", "c", item("4"))  # a stream opened later still gets it
    assert [rid for rid, _ in boxes.open("ing").drain()] == ["c"]


async def test_batches_reach_their_requests_and_a_lost_stream_fails_only_its_own():
    handle = FakeReplicas([])
    streams = StepStreams(handle)
    qa, qb, qc = (streams.register(r) for r in ("a", "b", "c"))
    streams.assign("a", "r1")
    streams.assign("b", "r1")
    streams.assign("c", "r2")
    await asyncio.sleep(0)  # the stream tasks start
    assert set(handle.streams) == {"r1", "r2"}  # one stream per replica, not per request
    handle.streams["r1"].fed.put_nowait([("a", item("1")), ("gone", item("?")), ("b", item("2"))])
    assert (await qa.get()).outputs[0].text == "1"
    assert (await qb.get()).outputs[0].text == "2"
    streams.forget("b")
    handle.streams["r1"].fed.put_nowait(RuntimeError("replica died"))
    assert isinstance(await asyncio.wait_for(qa.get(), 1), StreamLost)
    assert qb.empty() and qc.empty()  # forgotten, and on another replica
    old = handle.streams["r1"]
    streams.assign("a", "r1")  # the failed stream is replaced on the next acceptance
    await asyncio.sleep(0)
    assert handle.streams["r1"] is not old


async def test_dispatch_reads_its_stream_and_resends_when_lost_before_a_token():
    handle = FakeReplicas(["r1", "r2"])
    streams = StepStreams(handle)
    shape = RequestShape(3, "standard", 1)
    d = RayCall(handle, "req", [1, 2, 3], SamplingParams(), shape, streams)
    await d.start()
    assert (d.replica, handle.calls[0][1]) == ("r1", streams.ingress_id)
    await asyncio.sleep(0)
    got = d.items()
    handle.streams["r1"].fed.put_nowait(RuntimeError("replica died"))
    handle_r2_ready = asyncio.create_task(got.__anext__())
    await asyncio.sleep(0.05)  # re-sent to r2, whose stream opened
    assert handle.calls[0][2].cancelled and d.replica == "r2" and d.attempts == 2
    handle.streams["r2"].fed.put_nowait([("req", item("ok", finished=True))])
    assert (await asyncio.wait_for(handle_r2_ready, 1)).finished
    with pytest.raises(StopAsyncIteration):
        await got.__anext__()
    assert streams.register("req").empty()  # a new queue: the finished one was dropped


async def _one_token_then(failure, params=None, alive=None) -> None:
    """A request on replica r1 gets one token, then ``failure`` on r1's stream: a raised
    exception (the stream is lost) or a batch (what the replica reports)."""
    handle = FakeReplicas(["r1"], alive)
    d = RayCall(
        handle,
        "req",
        [1],
        params or SamplingParams(),
        RequestShape(1, "standard", 1),
        StepStreams(handle),
    )
    await d.start()
    await asyncio.sleep(0)
    got = d.items()
    handle.streams["r1"].fed.put_nowait([("req", item("t"))])
    assert (await got.__anext__()).outputs[0].text == "t"
    handle.streams["r1"].fed.put_nowait(failure)
    await asyncio.wait_for(got.__anext__(), 1)


async def test_dispatch_lost_after_a_token_with_no_other_replica_is_replica_lost():
    with pytest.raises(ReplicaLost, match="no other is alive.*replica died"):
        await _one_token_then(RuntimeError("replica died"), alive=set())


async def test_dispatch_told_its_engine_failed_is_replica_lost_after_a_token():
    # The replica's own call is not read after Accepted: an engine failure must come
    # on the stream, or the request would wait forever. Its replica is out of routing.
    with pytest.raises(ReplicaLost, match="EngineDeadError"):
        await _one_token_then([("req", Lost("EngineDeadError: loop failed"))])


async def test_dispatch_with_several_sequences_is_not_migrated():
    with pytest.raises(ReplicaLost, match="replica died"):
        await _one_token_then(RuntimeError("replica died"), params=SamplingParams(n=2))


async def test_dispatch_migrates_after_tokens_and_continues_the_same_stream():
    # r1 streams two tokens and dies; the request moves to r2 with those tokens, its
    # seed derived and its prompt log-probabilities not asked again; r2's items follow on
    # the same iterator; a late item from r1 is dropped; prompt and cached tokens stay r1's.
    handle = FakeReplicas(["r1", "r2"])
    streams = StepStreams(handle)
    params = SamplingParams(seed=7, prompt_logprobs=1, max_tokens=5)
    d = RayCall(handle, "req", [1, 2, 3], params, RequestShape(3, "standard", 1), streams)
    await d.start()
    await asyncio.sleep(0)
    got = d.items()
    first = StepItem([SequenceDelta(0, "a", [10], None, None, None)], False, cached_tokens=2)
    handle.streams["r1"].fed.put_nowait([("req", first), ("req", item("b", token=11))])
    assert [(await got.__anext__()).outputs[0].text for _ in range(2)] == ["a", "b"]
    handle.streams["r1"].fed.put_nowait(RuntimeError("replica died"))
    nxt = asyncio.create_task(got.__anext__())
    await asyncio.sleep(0.05)
    rid, ingress, call, sent, resume = handle.calls[1]
    assert (rid, ingress, resume) == ("req", streams.ingress_id, (10, 11))
    assert sent == replace(params, seed=migrated_seed(7, 2), prompt_logprobs=None)
    assert params.seed == 7  # the request's own parameters are left as they were
    assert d.replica == "r2" and d.migrations == 1 and handle.calls[0][2].cancelled
    streams.deliver([("req", item("late", token=99))], "r1")  # r1's stream, had it lived
    again = StepItem([SequenceDelta(0, "c", [12], None, None, None)], False, cached_tokens=3)
    handle.streams["r2"].fed.put_nowait([("req", again), ("req", item("d", True, 13))])
    assert (await asyncio.wait_for(nxt, 1)).outputs[0].text == "c"
    assert (await got.__anext__()).finished
    assert d.output_ids == [10, 11, 12, 13]
    assert (d.prompt_tokens, d.cached_tokens) == (3, 2)


def test_migrated_seed_is_a_signed_64_bit_integer_per_migration_point():
    seeds = {migrated_seed(s, k) for s in (0, -1, 2**63 - 1, -(2**63)) for k in (1, 2, 3)}
    assert len(seeds) == 12 and all(-(2**63) <= x < 2**63 for x in seeds)
    assert migrated_seed(5, 3) == migrated_seed(5, 3)


async def test_streams_to_retired_replicas_close_once_no_request_is_on_them():
    # Serve stopped routing to r1 (scaled down): its stream stays open while a request is
    # on it, since the replica counts the stream as a request in flight and would wait
    # for it until its shutdown timeout, then closes; r2, still running, keeps its own.
    handle = FakeReplicas([])
    streams = StepStreams(handle)
    for rid, replica in (("a", "r1"), ("b", "r2")):
        streams.register(rid)
        streams.assign(rid, replica)
    await asyncio.sleep(0)
    assert streams.close_unused({"r1", "r2"}) == []
    assert streams.close_unused({"r2"}) == []  # request a is still on r1
    streams.forget("a")
    streams.forget("b")
    assert streams.close_unused({"r2"}) == ["r1"]
    await asyncio.sleep(0)
    assert handle.streams["r1"].cancelled and not handle.streams["r2"].cancelled
    streams.close_all()  # the ingress is stopping
    await asyncio.sleep(0)
    assert handle.streams["r2"].cancelled


async def test_a_stopping_server_ends_open_requests_without_moving_them():
    handle = FakeReplicas(["r1", "r2"])
    streams = StepStreams(handle)
    d = RayCall(handle, "req", [1], SamplingParams(), RequestShape(1, "standard", 1), streams)
    await d.start()
    await asyncio.sleep(0)
    got = d.items()
    handle.streams["r1"].fed.put_nowait([("req", item("t"))])
    await got.__anext__()
    assert streams.open_requests == 1
    streams.end_all("the server is shutting down")
    with pytest.raises(ReplicaLost, match="shutting down"):
        await asyncio.wait_for(got.__anext__(), 1)
    assert len(handle.calls) == 1 and streams.open_requests == 0


def test_a_request_that_could_not_move_answers_503_with_retry_after():
    from router.ingress import _lost

    err = _lost(ReplicaLost("no other replica is alive"))
    assert err.status == 503 and err.body()["error"]["code"] == "replica_lost"
    assert int(err.headers["Retry-After"]) > 0
