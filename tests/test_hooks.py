"""The inference thread's public seams (embedq/workers/hooks.py), in process on the fake model: a ``before_pick`` that
holds the service back lets jobs pile up and then run together, ``before_launch`` sees each micro-batch's items, and a
service made without installed hooks calls the do-nothing defaults. tests/controlled_worker.py (the gate, the hold)
and tests/faults/crashy_worker.py (a death in the model) steer real workers through them."""

from __future__ import annotations

import threading

from embedq.backends.fake import FakeBackend
from embedq.settings import Settings
from embedq.workers import hooks
from embedq.workers.jobs import Job
from embedq.workers.service import EmbeddingService


class Recorder(hooks.ServiceHooks):
    def __init__(self) -> None:
        self.open = threading.Event()
        self.picks = 0
        self.launches: list[list[tuple[str, int]]] = []

    def before_pick(self, service) -> None:
        self.picks += 1
        while not self.open.is_set() and not service.stopping:
            service.wait_locked(0.01)

    def before_launch(self, service, keys) -> None:
        self.launches.append([(job.id, i) for job, i in keys])


def _service(on_done) -> EmbeddingService:
    settings = Settings(model="embedq-fake", allow_fake_backend=True, max_batch_requests=64)
    return EmbeddingService(FakeBackend(), settings, on_done=on_done)


def test_a_closed_before_pick_lets_jobs_pile_up_and_before_launch_sees_them_together():
    recorder = Recorder()
    hooks.install(recorder)
    try:
        done: dict[str, object] = {}
        all_done = threading.Event()

        def on_done(job, outcome):
            done[job.id] = outcome
            if len(done) == 8:
                all_done.set()

        service = _service(on_done).start()
        try:
            assert service.hooks is recorder
            for k in range(8):  # one by one, each after the thread could have picked the last
                service.submit(Job(f"j{k}", [[f"text {k}", f"more text {k}"]], options={}))
            assert recorder.launches == []  # held back before picking anything
            recorder.open.set()
            assert all_done.wait(30)
        finally:
            service.stop()
        assert recorder.picks >= 1
        assert all(isinstance(outcome, dict) for outcome in done.values()), done  # results, not errors
        items = [key for launch in recorder.launches for key in launch]
        assert sorted(items) == sorted((f"j{k}", i) for k in range(8) for i in range(2))  # every item, once
        assert len(recorder.launches[0]) == 16  # all piled up: one micro-batch
    finally:
        hooks.install(hooks.ServiceHooks())


def test_the_default_hooks_do_nothing():
    assert type(hooks.installed()) is hooks.ServiceHooks
    done = threading.Event()
    outcomes: dict[str, object] = {}

    def on_done(job, outcome):
        outcomes[job.id] = outcome
        done.set()

    service = _service(on_done).start()
    try:
        service.submit(Job("j", [["a text"]], options={}))
        assert done.wait(30)
    finally:
        service.stop()
    assert isinstance(outcomes["j"], dict), outcomes
