"""LoadAwareRouter's choice between two replicas, on fake replicas (no cluster)."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

import pytest

pytest.importorskip("ray")
from ray.serve._private.common import DeploymentHandleSource, DeploymentID  # noqa: E402
from ray.serve.request_router import PendingRequest  # noqa: E402

from engine.core.params import LoRARequest  # noqa: E402
from policies import DEFAULT_CLASSES, LoadSnapshot  # noqa: E402
from router.contract import RequestShape  # noqa: E402
from router.prefix import (  # noqa: E402
    ENTRIES_PER_KV_BLOCK,
    MIN_ENTRIES,
    PrefixMap,
    prefix_hashes,
)
from router.request_router import LoadAwareRouter  # noqa: E402
from router.routing import load_view  # noqa: E402


class FakeId(str):
    """Stands in for Serve's ``ReplicaID``: equal to its name, which is its ``unique_id``."""

    @property
    def unique_id(self) -> str:
        return str(self)


@dataclass
class FakeReplica:
    replica_id: str
    routing_stats: dict = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.replica_id = FakeId(self.replica_id)


def _stats(
    a: float, running: int = 0, waiting_tokens: int = 0, waiting: int = 0, decode: float = 0.005
) -> dict:
    return LoadSnapshot(
        max_num_batched_tokens=512,
        max_num_seqs=64,
        num_kv_blocks_free=1000,
        running_seqs={"standard": running},
        waiting_prefill_tokens={"standard": waiting_tokens},
        waiting_requests={"standard": waiting},
        step_coefficients=(a, 0.001, decode),
        timestamp=time.time(),
    ).to_dict()


def _pending(prompt_tokens: int) -> PendingRequest:
    shape = RequestShape(prompt_tokens, "standard", 1)
    return PendingRequest(args=[], kwargs={"shape": shape}, metadata=None, future=asyncio.Future())


@pytest.fixture
def router():
    r = LoadAwareRouter(
        DeploymentID(name="ModelReplica", app_name="app-test"), DeploymentHandleSource.UNKNOWN
    )
    r.initialize_state(traffic_classes=None, policy={"name": "priority", "options": {}})
    return r


async def test_registered_for_the_ingress(router):
    assert load_view("app-test", "ModelReplica") is router
    assert load_view("app-test", "Other") is None


async def test_a_load_streamed_by_the_replica_counts_until_serve_publishes_a_newer_one(router):
    # Serve's published stats (polled by its controller) lag; the replica streams its load.
    a = FakeReplica("a", _stats(0.05, waiting_tokens=5000, waiting=10))
    b = FakeReplica("b", _stats(0.05, waiting_tokens=2000, waiting=4))
    router.observe_load("a", LoadSnapshot.from_dict(_stats(0.05)))  # a has drained
    for _ in range(5):
        ranks = await router.choose_replicas([a, b], _pending(100))
        assert [[r.replica_id for r in rank] for rank in ranks] == [["a"], ["b"]]
    a.routing_stats = _stats(0.05, waiting_tokens=9000, waiting=20)  # newer than the stream
    ranks = await router.choose_replicas([a, b], _pending(100))
    assert [[r.replica_id for r in rank] for rank in ranks] == [["b"], ["a"]]


async def test_lower_predicted_ttft_first(router):
    busy = FakeReplica("busy", _stats(0.05, waiting_tokens=5000, waiting=10))
    idle = FakeReplica("idle", _stats(0.05))
    for _ in range(5):  # the pair is sampled in random order
        ranks = await router.choose_replicas([busy, idle], _pending(100))
        assert [[r.replica_id for r in rank] for rank in ranks] == [["idle"], ["busy"]]


async def test_within_one_step_the_replica_with_fewer_requests_first(router):
    # The faster replica (lower fitted step time) holds more requests; a short prompt
    # would finish its prefill in one step on either, so TTFT alone cannot tell them apart.
    fast = FakeReplica("fast", _stats(0.04, running=6))
    slow = FakeReplica("slow", _stats(0.06, running=1))
    ranks = await router.choose_replicas([fast, slow], _pending(8))
    assert ranks[0][0].replica_id == "slow"


async def test_routed_requests_count_until_a_newer_snapshot(router):
    a, b = FakeReplica("a", _stats(0.05)), FakeReplica("b", _stats(0.05))
    chosen = []
    for _ in range(6):  # a burst between two snapshots alternates
        first = (await router.choose_replicas([a, b], pending := _pending(8)))[0][0]
        router.on_request_routed(pending, first.replica_id, None)
        chosen.append(first.replica_id)
    assert sorted(chosen) == ["a", "a", "a", "b", "b", "b"]
    snap = router.snapshot(a)
    assert snap.waiting_requests["standard"] == 3
    a.routing_stats = _stats(0.05)  # a newer snapshot has counted them
    assert router.snapshot(a).waiting_requests["standard"] == 0


async def test_no_stats_or_no_shape_falls_back_to_queue_length(router):
    a, b = FakeReplica("a"), FakeReplica("b", _stats(0.05))
    ranks = await router.choose_replicas([a, b], _pending(8))
    assert len(ranks) == 1 and {r.replica_id for r in ranks[0]} == {"a", "b"}
    ranks = await router.choose_replicas([b], None)
    assert [[r.replica_id for r in rank] for rank in ranks] == [["b"]]


async def test_a_pinned_call_goes_to_its_replica_alone(router):
    # A replica's step-items stream must reach that replica, however loaded it is.
    a, b = FakeReplica("a", _stats(0.01)), FakeReplica("b", _stats(0.5, running=40))
    pinned = PendingRequest(args=[], kwargs={"pin": "b"}, metadata=None, future=asyncio.Future())
    ranks = await router.choose_replicas([a, b], pinned)
    assert [[r.replica_id for r in rank] for rank in ranks] == [["b"]]
    gone = PendingRequest(args=[], kwargs={"pin": "c"}, metadata=None, future=asyncio.Future())
    assert await router.choose_replicas([a, b], gone) == [[]]


# -- prefix affinity ------------------------------------------------------------------------


def _prefixed(tokens: list[int], traffic_class: str = "standard") -> PendingRequest:
    priority = DEFAULT_CLASSES[traffic_class].default_priority
    shape = RequestShape(len(tokens), traffic_class, priority, prefix_hashes(tokens, 16))
    return PendingRequest(args=[], kwargs={"shape": shape}, metadata=None, future=asyncio.Future())


def test_prefix_hashes_chain_and_map_matches_longest_prefix():
    a = list(range(100))
    b = a[:40] + [7] * 60
    ha, hb = prefix_hashes(a, 16), prefix_hashes(b, 16)
    assert len(ha) == 6 and ha[:2] == hb[:2] and ha[2] != hb[2]
    assert prefix_hashes(a, 16, max_blocks=3) == ha[:3]
    m = PrefixMap(max_entries=10)
    m.record(ha, "r1")
    m.record(hb, "r2")
    assert m.matched_blocks(ha) == {"r1": 6, "r2": 2}
    m.record(prefix_hashes(list(range(500, 600)), 16), "r3")  # 6 more names: LRU drops
    # The 6 least recent names went: a's, including the two it shares with b.
    assert len(m) == 10 and m.matched_blocks(ha) == {} == m.matched_blocks(hb)
    m.forget("r3")
    assert len(m) == 4


async def test_affinity_replica_goes_first_unless_another_predicts_a_lower_ttft(router):
    a, b, c = (FakeReplica(x, _stats(0.05)) for x in "abc")
    conversation = list(range(1000, 1600))
    router.on_request_routed(_prefixed(conversation), "c", None)
    # The next turn re-sends the history: c holds it and is never outside the pair.
    turn = conversation + list(range(50))
    for _ in range(5):
        ranks = await router.choose_replicas([a, b, c], _prefixed(turn))
        assert ranks[0][0].replica_id == "c"
    # A queue on c that costs more than the prefix saves (c predicts 1.21 s, an idle
    # replica computing the whole prompt 0.75 s) sends the turn elsewhere, although c
    # would meet the class's 5 s TTFT SLO.
    c.routing_stats = _stats(0.05, waiting_tokens=1000, waiting=2)
    for _ in range(5):
        ranks = await router.choose_replicas([a, b, c], _prefixed(turn))
        assert ranks[0][0].replica_id != "c"
    # Within a step of the idle replicas (0.76 against 0.75 s), affinity breaks the tie,
    # although c has more requests.
    c.routing_stats = _stats(0.05, waiting_tokens=600, waiting=2)
    for _ in range(5):
        ranks = await router.choose_replicas([a, b, c], _prefixed(turn))
        assert ranks[0][0].replica_id == "c"
    # With a queue that breaks the TTFT SLO on c, the request goes elsewhere.
    c.routing_stats = _stats(0.05, waiting_tokens=50_000, waiting=40)
    ranks = await router.choose_replicas([a, b, c], _prefixed(turn))
    assert ranks[0][0].replica_id != "c"
    # Admission sees the cached tokens: all of the prefix c was sent, in whole blocks.
    router._replicas = {r.replica_id: r for r in (a, b, c)}
    cached = [n for _, n in router.loads_for(_prefixed(turn).kwargs["shape"])]
    assert sorted(cached) == [0, 0, 592]


def _with_adapter(prompt_tokens: int, name: str) -> PendingRequest:
    shape = RequestShape(prompt_tokens, "standard", 1, lora=LoRARequest(name, f"/adapters/{name}"))
    return PendingRequest(args=[], kwargs={"shape": shape}, metadata=None, future=asyncio.Future())


async def test_a_replica_holding_the_adapter_competes_and_a_cold_read_counts_in_ttft(router):
    warm = {**_stats(0.05, running=2), "loras": ["tenant-a"], "lora_load_s": 0.5}
    a, b, c = FakeReplica("a", _stats(0.05)), FakeReplica("b", _stats(0.05)), FakeReplica("c", warm)
    # c holds the adapter and is never outside the pair; the others would read it from
    # disk first, which costs more than c's two running requests.
    for _ in range(10):
        ranks = await router.choose_replicas([a, b, c], _with_adapter(100, "tenant-a"))
        assert ranks[0][0].replica_id == "c"
    # Another adapter, or the base model, gets no such pull.
    firsts = set()
    for _ in range(20):
        ranks = await router.choose_replicas([a, b, c], _with_adapter(100, "tenant-b"))
        firsts.add(ranks[0][0].replica_id)
    assert "c" not in firsts
    # A long queue on c outweighs the read: the request goes where it starts sooner.
    c.routing_stats = {**_stats(0.05, waiting_tokens=20_000, waiting=20), "loras": ["tenant-a"]}
    for _ in range(5):
        ranks = await router.choose_replicas([a, b, c], _with_adapter(100, "tenant-a"))
        assert ranks[0][0].replica_id != "c"


async def test_routed_request_that_follows_its_prefix_queues_only_its_suffix(router):
    a, b = FakeReplica("a", _stats(0.05)), FakeReplica("b", _stats(0.05))
    conversation = list(range(1000, 1600))
    router.on_request_routed(_prefixed(conversation), "a", None)
    assert router.snapshot(a).waiting_prefill_tokens["standard"] == 600  # nothing cached
    turn = conversation + list(range(50))
    router.on_request_routed(_prefixed(turn), "a", None)
    # 592 of the turn's 650 tokens are whole blocks a was sent: only 58 are queued work,
    # so a stays first for the next turn until a snapshot shows otherwise.
    assert router.snapshot(a).waiting_prefill_tokens["standard"] == 600 + 58
    ranks = await router.choose_replicas([a, b], _prefixed(turn + list(range(9))))
    assert ranks[0][0].replica_id == "a"


async def test_a_burst_on_one_prompt_uses_both_replicas_within_the_tpot_slo(router):
    # 16 streams with one prompt arrive before either replica publishes a newer load.
    # The first leaves the prompt's prefix on its replica, so every later one predicts a
    # lower TTFT there; but each stream then decodes there too. A replica whose step
    # with all its decodes would break the class's TPOT SLO must lose to one with room.
    a, b = FakeReplica("a", _stats(0.1, decode=0.03)), FakeReplica("b", _stats(0.1, decode=0.03))
    prompt = list(range(1000, 1600))
    chosen = {"a": 0, "b": 0}
    for _ in range(16):
        pending = _prefixed(prompt, "interactive")
        first = (await router.choose_replicas([a, b], pending))[0][0]
        router.on_request_routed(pending, first.replica_id, None)
        chosen[first.replica_id] += 1
    slo = router.admission.classes["interactive"].tpot_slo_s
    for r in (a, b):
        snap = router.snapshot(r)
        decodes = snap.total_running + sum(snap.waiting_requests.values())
        assert snap.step_time(0, decodes) <= slo, chosen
    assert min(chosen.values()) >= 16 // 4, chosen


async def test_a_replica_found_dead_is_out_of_routing_and_of_the_view_at_once(router):
    # A call found replica a's actor dead: Serve's controller still lists a for seconds,
    # but nothing is routed to it, and /health (the view) lists and counts only b.
    a, b = FakeReplica("a", _stats(0.01)), FakeReplica("b", _stats(0.05, waiting=4))
    router._replicas = {a.replica_id: a, b.replica_id: b}
    assert router.replica_ids() == {"a", "b"} and router.num_replicas() == 2
    router.replica_died("a")
    assert router.replica_ids() == {"b"} and router.num_replicas() == 1
    assert set(router.unique_snapshots()) == {"b"} and set(router.replica_stats()) == {"b"}
    for _ in range(5):
        ranks = await router.choose_replicas([a, b], _pending(100))
        assert [r.replica_id for rank in ranks for r in rank] == ["b"]
    assert await router.choose_replicas([a], _pending(100)) == []
    router._dead["a"] -= 1000  # long ago: a replica that only stalled and recovered
    assert router.replica_ids() == {"a", "b"}


def test_prefix_map_is_bounded_by_the_replicas_kv_capacity():
    """Names beyond what the replicas' caches can hold are forgotten, least recent first;
    a replica that dies takes its capacity with it."""
    m = PrefixMap()
    m.fit("r1", 2000)
    m.fit("r2", 2000)
    assert m.max_entries == ENTRIES_PER_KV_BLOCK * 4000
    for i in range(m.max_entries + 500):
        m.record((i,), "r1" if i % 2 else "r2")
    assert len(m) == m.max_entries
    assert m.matched_blocks((m.max_entries + 499,)) and not m.matched_blocks((0,))
    m.forget("r2")
    assert m.max_entries == max(MIN_ENTRIES, ENTRIES_PER_KV_BLOCK * 2000) >= len(m)
    m.fit("r1", 1)
    assert m.max_entries == MIN_ENTRIES
