"""The device side of issue 53's layout (embedq/workers/device.py), in one process: two hosts' jobs, sent as records
over real channels with their ids in real shared-memory arenas, coalesce in one service; online overtakes bulk across
hosts; rows come back equal to the backend's own; a host that is gone has its jobs dropped. (Separate processes and
their SIGKILLs: the worker's tests, once the host side is built.)"""

from __future__ import annotations

import json
import threading
import time

import numpy as np
import pytest

from embedq.backends.fake import FakeBackend
from embedq.protocol import EmbedOptions, decode_result
from embedq.settings import Settings
from embedq.workers import channel
from embedq.workers.arena import IdsArena
from embedq.workers.channel import FAILED, ITEM, ITEMS, ROWS, STARTED, unpack_rows
from embedq.workers.device import DeviceService, HostLink, error_of

HEADS = ["mean", "tokens"]
STATE_TIMEOUT = 60.0  # bounds each wait for a state; never a pause


def wait_for(ready, what: str) -> None:
    end = time.monotonic() + STATE_TIMEOUT
    while not ready():
        assert time.monotonic() < end, f"never reached: {what}"
        time.sleep(0.01)


class Recording(FakeBackend):
    """The fake model, recording the ids of each micro-batch it runs."""

    def __init__(self) -> None:
        super().__init__()
        self.batches: list[list[tuple[int, ...]]] = []

    def forward(self, batch):
        self.batches.append([tuple(item.ids) for item in batch])
        return super().forward(batch)


class Host:
    """The host side, by hand: prepare with the backend, ids into an arena, ITEMS out, ROWS and FAILED in."""

    def __init__(self, number: int, backend: FakeBackend) -> None:
        self.backend = backend
        self.arena = IdsArena.create(1 << 14)
        self.mine, theirs = channel.pair()
        self.mine.send_hello({"arena": self.arena.name, "capacity": self.arena.capacity, "pid": number,
                              "heads": HEADS})
        self.theirs = theirs
        self.prepared: dict[int, object] = {}
        self.rows: dict[int, dict[int, np.ndarray]] = {}
        self.failed: dict[int, tuple[str, str]] = {}
        self.done = threading.Condition()

    def send(self, slot: int, texts: list[str], traffic: int) -> None:
        prepared = self.backend.prepare("embed", texts, EmbedOptions.parse({}))
        self.prepared[slot] = prepared
        _, offsets = self.arena.write([e.ids for e in prepared.items])
        records = np.zeros(len(texts), dtype=ITEM)
        records["slot"], records["item"], records["offset"] = slot, np.arange(len(texts)), offsets
        records["length"] = records["cost"] = [len(e.ids) for e in prepared.items]
        records["head"], records["traffic"], records["client"] = HEADS.index("mean"), traffic, 7
        records["deadline"] = np.nan
        self.mine.send(ITEMS, records)

    def receive(self, jobs: int) -> None:
        while len(self.rows) + len(self.failed) < jobs:
            assert self.mine.poll(STATE_TIMEOUT), "no answer"
            message = self.mine.recv()
            if message.kind == ROWS:
                for slot, item, row in unpack_rows(message.records, message.payload):
                    self.rows.setdefault(slot, {})[item] = np.array(row)
            elif message.kind != STARTED:  # (the jobs whose first micro-batch starts: the host's business)
                assert message.kind == FAILED
                for slot, (code, text) in zip(message.records["slot"].tolist(), json.loads(bytes(message.payload))):
                    self.failed[slot] = (code, text)

    def vectors(self, slot: int) -> np.ndarray:
        rows = self.rows[slot]
        payload = self.backend.finish("embed", [rows[i] for i in range(len(rows))], self.prepared[slot],
                                      EmbedOptions.parse({}))
        return decode_result(payload)[0]


@pytest.fixture
def device():
    backend = Recording()
    settings = Settings(model="embedq-fake", allow_fake_backend=True, max_batch_tokens=256, online_batch_tokens=256)
    service = DeviceService(backend, settings)
    hosts = [Host(n, backend) for n in range(2)]
    links = [HostLink(n, host.theirs, service).start() for n, host in enumerate(hosts)]
    yield backend, service, hosts, links
    service.stop(5)
    for host, link in zip(hosts, links):
        host.mine.close()
        link.close()
        host.arena.close()


def _texts(tag: str, n: int) -> list[str]:
    return [f"{tag} text number {i} with a few more words" for i in range(n)]


def test_two_hosts_jobs_share_micro_batches_online_first_and_rows_equal_the_backends_own(device):
    backend, service, hosts, links = device
    hosts[0].send(1, _texts("bulk", 60), traffic=1)  # 60 bulk texts on host 0: several micro-batches
    hosts[1].send(1, _texts("online", 2), traffic=0)  # 2 online texts on host 1, sent after them
    hosts[1].send(2, _texts("bulk b", 3), traffic=1)
    # every item in the scheduler before the first micro-batch is chosen
    # (texts 25 and 50 of the bulk job tokenize alike in the fake model: one waits beside the other, issue 57)
    wait_for(lambda: service.intake() or len(service.scheduler) + service.dedupe.waiting == 65, "65 items buffered")
    service.start()
    for host, jobs in zip(hosts, (1, 2)):
        host.receive(jobs)
    online = {tuple(e.ids) for e in hosts[1].prepared[1].items}
    assert online <= set(backend.batches[0])  # host 1's online job ran first, ahead of host 0's older bulk job
    ids = {0: {tuple(e.ids) for e in hosts[0].prepared[1].items}, 1: {tuple(e.ids) for e in hosts[1].prepared[2].items}}
    assert any(set(b) & ids[0] and set(b) & ids[1] for b in backend.batches)  # one micro-batch, both hosts' jobs
    for host, slot, texts in ((hosts[0], 1, _texts("bulk", 60)), (hosts[1], 1, _texts("online", 2)),
                              (hosts[1], 2, _texts("bulk b", 3))):
        alone = backend.finish("embed", backend.forward(backend.prepare("embed", texts, EmbedOptions.parse({})).items),
                               host.prepared[slot], EmbedOptions.parse({}))
        assert np.array_equal(host.vectors(slot), decode_result(alone)[0])
    assert not links[0].jobs and not links[1].jobs


def test_a_cancelled_job_and_the_jobs_of_a_host_that_is_gone_are_dropped_unrun(device):
    backend, service, hosts, links = device
    hosts[0].send(1, _texts("kept", 4), traffic=0)
    hosts[0].send(2, _texts("cancelled", 4), traffic=0)
    hosts[1].send(1, _texts("orphan", 4), traffic=0)
    wait_for(lambda: service.intake() or len(service.scheduler) == 12, "12 items buffered")
    hosts[0].mine.send(channel.CANCEL, np.array([(2,)], dtype=channel.SLOT))
    hosts[1].mine.close()  # host 1 is gone
    wait_for(lambda: service.intake() or links[1].gone.is_set(), "host 1 seen gone")
    wait_for(lambda: service.intake() or len(service.scheduler) == 4, "the cancelled and the orphaned items dropped")
    service.start()
    hosts[0].receive(2)
    assert set(hosts[0].rows) == {1} and hosts[0].failed[2][0] == "cancelled"
    assert isinstance(error_of(*hosts[0].failed[2]), Exception)
    ran = {ids for batch in backend.batches for ids in batch}
    assert not ran & {tuple(e.ids) for e in hosts[1].prepared[1].items}
    assert not ran & {tuple(e.ids) for e in hosts[0].prepared[2].items}


def test_a_host_whose_message_cannot_be_read_is_cut_off_and_the_other_is_served(device):
    """A malformed ITEMS record (ids outside the host's arena: a bug of the sender) drops that host alone: its channel
    is ended, so it sees the device gone instead of waiting; the other host's jobs run as before."""
    _, service, hosts, links = device
    records = np.zeros(1, dtype=ITEM)
    records["slot"], records["offset"], records["length"] = 1, hosts[0].arena.capacity - 2, 8  # past its end
    records["head"], records["deadline"] = HEADS.index("mean"), np.nan
    hosts[0].mine.send(ITEMS, records)
    hosts[1].send(1, _texts("served", 3), traffic=0)
    service.start()
    hosts[1].receive(1)
    assert set(hosts[1].rows) == {1}
    assert hosts[0].mine.poll(STATE_TIMEOUT)
    with pytest.raises(EOFError):
        hosts[0].mine.recv()  # cut off: the end of its channel, not silence
    assert links[0].dropped and not links[1].dropped
