"""Windows through a real worker (issue 58): a job's long texts cut into windows that pack with other jobs' items, a
text over the worker's ``max_windows`` failing alone (the other texts of its job, and other jobs, answered), and
what the Python client returns for each."""

from __future__ import annotations

import numpy as np
import pytest
from conftest import WorkerHandle

from embedq import errors
from embedq.settings import Settings
from embedq.windows import TextWindow

pytestmark = pytest.mark.integration

SENTENCE = "The quick brown fox jumps over the lazy dog near the river bank."


def text_of(sentences: int) -> str:
    return " ".join(f"{SENTENCE[:-1]} {i}." for i in range(sentences))


@pytest.fixture(scope="module")
def worker(redis_server, tmp_path_factory):
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.windows", model="embedq-fake",
                        allow_fake_backend=True, max_windows=4)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("windows") / "worker.log")
    yield handle
    handle.stop()


def test_a_text_over_max_windows_fails_alone(worker):
    client = worker.client
    small, long, huge = SENTENCE, text_of(20), text_of(200)  # 1, 3 and far more than 4 windows of 128 tokens
    mixed = client.submit([small, huge, long], long_inputs="windows")
    other = client.submit([long, small], long_inputs="windows", pool_windows=False)
    plain = client.submit([huge])
    with pytest.raises(errors.TooManyWindows, match=r"inputs\[1\]") as caught:
        mixed.result()
    vectors = caught.value.partial
    assert list(caught.value.failed) == [1] and vectors.shape == (3, 32)
    assert not vectors[1].any() and np.allclose(np.linalg.norm(vectors[[0, 2]], axis=1), 1.0, atol=1e-5)
    windows = other.result()
    assert [len(w) for w in windows] == [3, 1] and all(isinstance(w, TextWindow) for w in windows[0])
    assert all(long[w.start:w.end].startswith(SENTENCE[:-1]) for w in windows[0])  # each starts a sentence
    assert windows[0][0].start == 0 and windows[0][-1].end == len(long)
    assert np.allclose(windows[1][0].output, vectors[0], atol=1e-6)  # a text that fits: one window, the same vector
    assert plain.result().shape == (1, 32)  # without windows the huge text is truncated, as before
    assert (other.usage["texts"], other.usage["windows"]) == (2, 4)
    assert mixed.fingerprint is not None and mixed.fingerprint.window_overlap == 0


def test_every_text_over_the_cap_fails_the_job(worker):
    with pytest.raises(errors.TooManyWindows):
        worker.client.embed([text_of(200)], long_inputs="windows")
    assert worker.client.embed([SENTENCE], long_inputs="windows").shape == (1, 32)


def test_an_enormous_document_does_not_hold_back_online_jobs(redis_server, tmp_path):
    """A bulk job of one document at the character limit: its windows are bulk items, so an online job sent while
    they run is answered before the document is (each item takes 40 ms in this worker's fake model)."""
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.windows.huge", model="embedq-fake",
                        allow_fake_backend=True, max_windows=1000, max_chars=100_000)
    handle = WorkerHandle(settings, tmp_path / "worker.log", extra_env={"EMBEDQ_FAKE_ITEM_MS": "40"})
    try:
        handle.stats()  # finds the worker's node first: later reads of its counters return at once
        document = text_of(10_000)[:100_000]
        bulk = handle.client.submit([document], long_inputs="windows", traffic_class="bulk")
        stats = handle.wait_until(lambda s: s["batches"] > 0, "the document's first micro-batch")
        assert stats["held_texts"] > 100  # the prefetch window counts the document's windows, not one text
        online = handle.client.submit([SENTENCE, text_of(30)], long_inputs="windows")
        assert online.result(120).shape == (2, 32)
        assert not bulk.ready()  # the document's windows are still running
        assert bulk.result(300).shape == (1, 32)
        assert bulk.usage["windows"] > 100
        counted = handle.stats()
        # the document and the online job's long text; the short one is one window, not counted
        assert counted["texts_windowed"] == 2
        assert counted["windows"] == bulk.usage["windows"] + online.usage["windows"] - 1
        handle.wait_until(lambda s: s["held_texts"] == 0, "the window released with the job")
    finally:
        handle.stop()


def test_long_bulk_documents_are_tokenized_off_the_consumer_thread(redis_server, tmp_path):
    """A bulk windows job of long documents is tokenized on the preparer's thread: an online job sent while it is
    being tokenized is fetched, run and answered meanwhile (this worker's fake tokenizer takes 400 ms per 10,000
    characters of a windows job: 5.6 s for this one)."""
    settings = Settings(broker_url=redis_server.url, queue="embedq.test.windows.prepare", model="embedq-fake",
                        allow_fake_backend=True, max_windows=1000)
    handle = WorkerHandle(settings, tmp_path / "worker.log", extra_env={"EMBEDQ_FAKE_PREPARE_MS": "400"})
    try:
        handle.stats()  # finds the worker's node first
        documents = [text_of(1200)[:70_000], text_of(1300)[-70_000:]]
        bulk = handle.client.submit(documents, long_inputs="windows", traffic_class="bulk")
        handle.wait_until(lambda s: s["preparing"] == 1, "the bulk job handed to the preparer")
        assert handle.client.submit([SENTENCE, text_of(3)]).result(120).shape == (2, 32)
        assert handle.stats()["preparing"] == 1  # answered while the documents were still being tokenized
        assert bulk.result(300).shape == (2, 32)
        handle.wait_until(lambda s: s["preparing"] == 0 and s["held_texts"] == 0, "the job done and released")
    finally:
        handle.stop()
