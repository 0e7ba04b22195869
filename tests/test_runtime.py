"""The CPU runtime chosen by measurement (backends/runtime.py): made, logged, cached, overridable, and never an
unfaithful one however fast it is. Real models (a tiny BERT classifier saved to disk, all-MiniLM-L6-v2), real
runtimes (PyTorch, oneDNN, ONNX Runtime, PyTorch's dynamic int8 quantisation)."""

from __future__ import annotations

import copy
import json
import logging
import time
from types import SimpleNamespace

import numpy as np
import pytest
import tiny_models

torch = pytest.importorskip("torch")

from embedq.backends import load_backend  # noqa: E402
from embedq.backends import runtime as rt  # noqa: E402
from embedq.backends.kernels import onednn_available  # noqa: E402
from embedq.settings import Settings  # noqa: E402

try:
    import onnxruntime  # noqa: F401

    HAVE_ORT = True
except ImportError:  # pragma: no cover - the dev install has the onnx extra
    HAVE_ORT = False

TEXTS = ["short", "a somewhat longer sentence about embeddings and queues", "x " * 300, "the fourth one"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return tiny_models.bert_classifier(tmp_path_factory.mktemp("runtime") / "bert-cls")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    folder = tmp_path / "runtime"
    monkeypatch.setenv("EMBEDQ_RUNTIME_CACHE", str(folder))
    return folder


def _logits(backend, texts=TEXTS) -> np.ndarray:
    items, _ = backend.encoder.tokenization.encode_texts(texts)
    with torch.inference_mode():
        return backend.encoder.run(items)[0].logits.float().numpy()


def _runtime_lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "embedq.backends.runtime"]


class _FakeClock:
    """Stands in for the ``time`` module runtime.py reads (clocks injected, no sleeps in tests): its
    ``perf_counter`` moves only when a forward pass runs, by the cost the test gave that forward. A trial's
    seconds are then fixed by the test, not by how fast, or how loaded, the machine is; everything else is the
    real ``time`` module."""

    def __init__(self) -> None:
        self.now = 0.0

    def perf_counter(self) -> float:
        return self.now

    def __getattr__(self, name):
        return getattr(time, name)


def _fake_clock(monkeypatch, encoder, costs) -> _FakeClock:
    """Time the runtime tuner by ``costs`` (forward -> fake seconds per batch, 1.0 for every forward not named):
    each forward pass still runs for real (fidelity is measured on real outputs), then the clock moves by its
    cost."""
    clock = _FakeClock()
    cost = {id(forward): seconds for forward, seconds in costs.items()}
    real_run = encoder.run

    def run(batch, forward=None):
        try:
            return real_run(batch, forward=forward)
        finally:
            clock.now += cost.get(id(forward), 1.0)

    monkeypatch.setattr(encoder, "run", run)
    monkeypatch.setattr(rt, "time", clock)
    return clock


def test_pick_is_the_fastest_faithful_candidate():
    trials = [rt.Trial("torch", 0.0, True, 3.0), rt.Trial("onednn", 3e-7, True, 2.0),
              rt.Trial("int8", 4e-2, False, 0.5), rt.Trial("onnxruntime", error="not installed")]
    assert rt.pick(trials) == "onednn"  # int8 is fastest, but not faithful
    assert rt.pick([rt.Trial("fast-but-wrong", 1e-3, False, 0.1)]) == "torch"  # nothing faithful: the reference
    assert rt.pick([]) == "torch"


def test_auto_measures_logs_caches_and_the_cache_decides(tiny, cache, caplog):
    chosen: list = []  # what on_runtime_chosen is called with: the chosen runtime's facts (the worker's memory policy)
    with caplog.at_level(logging.INFO, logger="embedq.backends.runtime"):
        first = load_backend(str(tiny), on_runtime_chosen=chosen.append)
    choice = first.encoder.runtime_choice
    assert choice is not None and not choice.cached
    assert chosen == [rt.facts(choice.runtime)] and first.runtime_facts().name == choice.runtime
    assert first.info.linear_kernel == choice.runtime in rt.RUNTIMES
    trials = {t.name: t for t in choice.trials}
    expected = {"torch"} | ({"onednn"} if onednn_available() else set()) | ({"onnxruntime"} if HAVE_ORT else set())
    faithful = {name for name, t in trials.items() if t.faithful}
    assert expected <= faithful, choice.describe()
    assert all(trials[name].seconds > 0 for name in faithful)
    complete = {name for name in faithful if trials[name].complete}
    assert choice.runtime in complete
    assert trials[choice.runtime].seconds == min(trials[name].seconds for name in complete)
    for name in faithful - complete:  # dropped early: far behind the fastest over the batches it ran
        assert trials[name].dropped > rt.DROP_BEHIND and trials[name].batches < trials[choice.runtime].batches
    # logged: the choice and every candidate's timing
    (line,) = [m for m in _runtime_lines(caplog) if m.startswith("runtime: ")]
    assert line.startswith(f"runtime: {choice.runtime}, measured")
    assert all(trials[name].describe() in line for name in faithful)
    assert f"{choice.runtime}: {trials[choice.runtime].seconds:.3f} s" in line
    # cached: one file for this machine and model, naming the choice
    (path,) = cache.glob("*.json")
    assert json.loads(path.read_text())["runtime"] == choice.runtime
    assert choice.path == str(path)

    caplog.clear()
    with caplog.at_level(logging.INFO, logger="embedq.backends.runtime"):
        second = load_backend(str(tiny))
    assert second.encoder.runtime_choice.cached and second.info.linear_kernel == choice.runtime
    assert any("the cached choice" in m for m in _runtime_lines(caplog))
    assert not any(", measured in" in m for m in _runtime_lines(caplog))  # nothing timed again

    # the file is what a later load goes by: name another faithful runtime in it and that one serves
    other = sorted(faithful - {choice.runtime})[0]
    data = json.loads(path.read_text())
    data["runtime"] = other
    path.write_text(json.dumps(data))
    third = load_backend(str(tiny))
    assert third.info.linear_kernel == other and third.encoder.runtime_choice.cached
    reference = load_backend(str(tiny), linear_kernel="torch")
    for backend in (first, second, third):
        assert np.abs(_logits(backend) - _logits(reference)).max() <= 1e-5


@pytest.mark.parametrize("name", ["torch", "onednn", "onnxruntime"])
def test_an_operator_forces_a_runtime_and_nothing_is_measured(tiny, cache, caplog, monkeypatch, name):
    if name == "onednn" and not onednn_available():
        pytest.skip("this PyTorch build has no oneDNN linear ops")
    if name == "onnxruntime" and not HAVE_ORT:
        pytest.skip("no onnxruntime")
    monkeypatch.setenv("EMBEDQ_LINEAR_KERNEL", name)
    settings = Settings()  # the operator's setting, as a worker reads it
    with caplog.at_level(logging.INFO, logger="embedq.backends.runtime"):
        backend = load_backend(str(tiny), linear_kernel=settings.linear_kernel)
    assert backend.info.linear_kernel == name and backend.encoder.linear_kernel == name
    assert backend.encoder.runtime_choice is None
    assert _runtime_lines(caplog) == [] and not cache.exists()


def _skip_layers(model):
    """A real and much cheaper computation with the right output shape: the classifier on the embeddings,
    the transformer layers left out. As fast as a runtime gets, and nowhere near the model's numbers."""

    def forward(*, input_ids, attention_mask, token_type_ids=None, return_dict=True, **_):
        hidden = model.bert.embeddings(input_ids=input_ids, token_type_ids=token_type_ids)
        return SimpleNamespace(logits=model.classifier(model.bert.pooler(hidden)))

    return forward


@pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")  # torch.ao's deprecation notes
def test_an_unfaithful_candidate_is_never_chosen_however_fast(tmp_path_factory, cache, monkeypatch):
    folder = tiny_models.bert_classifier(tmp_path_factory.mktemp("runtime") / "bert-cls-6", layers=6, hidden=128)
    backend = load_backend(str(folder), linear_kernel="torch")
    encoder = backend.encoder
    int8 = torch.ao.quantization.quantize_dynamic(copy.deepcopy(encoder.model), {torch.nn.Linear}, dtype=torch.qint8)
    skip = _skip_layers(encoder.model)
    extra = [rt.Candidate("skip-layers", skip), rt.Candidate("int8", int8)]
    # Injected clock: skip-layers costs a quarter of every other runtime's batch, on any machine under any load
    # (measured for real, a scheduler stall in its first batches could make it the slow one, even drop it).
    _fake_clock(monkeypatch, encoder, {skip: 0.25})
    choice, candidate = rt.choose(encoder, weights="test", extra=extra)
    trials = {t.name: t for t in choice.trials}
    assert not trials["skip-layers"].faithful and trials["skip-layers"].delta > rt.FIDELITY[torch.float32]
    assert not trials["int8"].faithful and trials["int8"].delta > rt.FIDELITY[torch.float32]
    faithful = [t for t in choice.trials if t.faithful]
    # the unfaithful ones are timed too (the log shows what fidelity costs) and skip-layers is the fastest of all
    assert trials["skip-layers"].complete, choice.describe()
    assert trials["skip-layers"].seconds < min(t.seconds for t in faithful if t.complete), choice.describe()
    assert choice.runtime in {t.name for t in faithful} and candidate.name == choice.runtime
    assert not cache.exists()  # a run with experimental candidates is never cached


def test_a_candidate_far_behind_is_dropped_early_and_never_chosen(tiny, cache, monkeypatch):
    """The measurement stays short: a faithful candidate already DROP_BEHIND times the fastest after DROP_AFTER
    batches is timed no further, says so, and is not chosen; the others run every batch, one a little behind
    (under DROP_BEHIND) included."""
    backend = load_backend(str(tiny), linear_kernel="torch")
    encoder = backend.encoder

    def slow(**inputs):  # PyTorch's own numbers (faithful); its batches cost 3x on the injected clock
        return encoder.model(**inputs)

    def close(**inputs):  # PyTorch's own numbers (faithful); 1.2x on the injected clock: behind, not far behind
        return encoder.model(**inputs)

    # Injected clock, no sleeps: every other runtime's batch costs 1.0, these two 3.0 and 1.2, on any machine
    # under any load (a real 40 ms sleep was the margin before, and a loaded machine's real batches ate it).
    _fake_clock(monkeypatch, encoder, {slow: 3.0, close: 1.2})
    extra = [rt.Candidate("slow-torch", slow), rt.Candidate("close-torch", close)]
    choice, candidate = rt.choose(encoder, weights="test", extra=extra)
    trials = {t.name: t for t in choice.trials}
    total = len(rt.timing_batches(encoder, 2048, 256)[0])
    late = trials["slow-torch"]
    assert late.faithful and not late.complete and late.batches == rt.DROP_AFTER < total, choice.describe()
    assert late.dropped > rt.DROP_BEHIND
    assert late.dropped == pytest.approx(3.0)  # its time by then over the fastest's, as the log says
    near = trials["close-torch"]  # 1.2x the fastest is under DROP_BEHIND: timed on every batch
    assert near.faithful and near.complete and near.batches == total, choice.describe()
    assert f"slow-torch: dropped after {rt.DROP_AFTER} batches" in choice.describe()
    assert choice.runtime != "slow-torch" and candidate.name == choice.runtime
    assert trials[choice.runtime].complete and trials[choice.runtime].batches == total
    for t in choice.trials:  # every other candidate either ran every batch or was itself far behind
        assert t.batches == total if t.complete else t.dropped > rt.DROP_BEHIND, choice.describe()
