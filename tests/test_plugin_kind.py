"""A kind from outside the package (issue 38, acceptance a): a plugin module written here adds ``token_count`` (each
text's token count, served by a tiny head that runs the tokenizer alone) and it is used through ``Client``, a real
worker, the gateway's ``/jobs`` and ``embedq index`` — with no edit to any module of ``embedq/``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import uuid

import pytest
from conftest import ROOT_DIR, GatewayHandle, WorkerHandle
from test_index import _index_cmd, _write_jsonl

from embedq.settings import Settings

pytestmark = pytest.mark.integration

PLUGIN = '''
"""A kind embedq does not ship: how many tokens the worker's model sees in each text."""
import numpy as np

from embedq import __version__
from embedq.kinds import Column, TaskSpec
from embedq.protocol import Fingerprint, JobOptions, decode_array, encode_result


class CountOptions(JobOptions):
    add_special_tokens: bool = True


def counts(payload, texts=None):
    return decode_array(payload["counts"]).tolist()


TOKEN_COUNT = TaskSpec("token_count", "tokcount.token_count", CountOptions, arrays=("counts",), decode=counts,
                       what="{} texts to count", columns=(Column("tokens", "scalar", ("counts",)),),
                       head="tokcount_kind:make_head")
KINDS = [TOKEN_COUNT]


def make_head(backend):
    from embedq.backends.base import Head, Prepared  # the worker's side only

    class CountHead(Head):
        name = "token_count"
        kinds = ("token_count",)

        def prepare(self, kind, items, options):
            encoded, _ = backend.encoder.tokenization.encode_texts(items, truncate=options.truncate,
                                                                   truncation_side=options.truncation_side)
            special = 0 if options.add_special_tokens else 2
            n = [len(e.ids) - special for e in encoded]
            return Prepared([], sum(n), {"counts": n})

        def finish(self, kind, rows, prepared, options):
            info = backend.info
            fingerprint = Fingerprint(kind=kind, model=info.model_id, weights_sha256=info.weights_sha256,
                                      pooling="none", normalize=False, dimensions=0, dtype="int32",
                                      embedq_version=__version__)
            counts = np.asarray(prepared.state["counts"], dtype=np.int32)
            return encode_result(kind, {"counts": counts}, fingerprint, items=len(counts), tokens=prepared.tokens)

    return CountHead()
'''

TEXTS = ["hello world", "a somewhat longer sentence, with punctuation and more words in it", "x"]


@pytest.fixture(scope="module")
def plugin_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("plugin")
    (root / "tokcount_kind.py").write_text(PLUGIN)
    return root


def _env(plugin_dir, settings: Settings) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith(("_CACHE", "_MAX_WAIT"))}
    return {**env, "EMBEDQ_BROKER_URL": settings.broker_url, "EMBEDQ_QUEUE": settings.queue_name,
            "EMBEDQ_KINDS": "tokcount_kind", "PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT_DIR)])}


@pytest.fixture(scope="module")
def plugin_worker(redis_server, plugin_dir, tmp_path_factory):
    # The test process is a producer too: it imports the plugin as every producer of the kind does.
    sys.path.insert(0, str(plugin_dir))
    settings = Settings(broker_url=redis_server.url, queue=f"embedq.test.plugin.{uuid.uuid4().hex[:8]}",
                        kinds="tokcount_kind")
    handle = WorkerHandle(settings, tmp_path_factory.mktemp("logs") / "worker.log",
                          extra_env={"PYTHONPATH": os.pathsep.join([str(plugin_dir), str(ROOT_DIR)])})
    yield handle
    handle.stop()
    sys.path.remove(str(plugin_dir))


def _expected(worker: WorkerHandle) -> list[int]:
    """The counts, from the built-in tokenize kind of the same worker."""
    return [len(tokens) for tokens in worker.client.tokenize(TEXTS)]


def test_a_plugin_kind_through_the_client_and_a_real_worker(plugin_worker):
    expected = _expected(plugin_worker)
    handle = plugin_worker.client.submit_job("token_count", TEXTS)
    assert handle.result(120) == expected
    assert handle.fingerprint.kind == "token_count"
    no_specials = plugin_worker.client.submit_job("token_count", TEXTS, add_special_tokens=False).result(120)
    assert no_specials == [n - 2 for n in expected]
    # its options are its own model's: an unknown one is refused at the edge, like any kind's
    from embedq import errors

    with pytest.raises(errors.InvalidOption):
        plugin_worker.client.submit_job("token_count", TEXTS, top_k=3)
    # many jobs of the kind in one round trip, summed up on one line as the spec says
    handles = plugin_worker.client.submit_many([TEXTS[:2], TEXTS[2:]], kind="token_count")
    assert [h.result(120) for h in handles] == [expected[:2], expected[2:]]
    assert plugin_worker.stats()["jobs_by_kind"]["token_count"] == 4  # counted under its own name


def test_a_plugin_kind_through_the_gateways_jobs(plugin_worker, plugin_dir, tmp_path):
    import httpx

    expected = _expected(plugin_worker)
    env = _env(plugin_dir, plugin_worker.settings)
    gateway = GatewayHandle(plugin_worker.settings.broker_url, plugin_worker.settings.queue_name,
                            tmp_path / "gateway.log", EMBEDQ_KINDS=env["EMBEDQ_KINDS"], PYTHONPATH=env["PYTHONPATH"])
    try:
        created = httpx.post(gateway.url + "/jobs", json={"kind": "token_count", "body": {"inputs": TEXTS}},
                             timeout=30)
        assert created.status_code == 202, created.text
        job = created.json()["id"]
        deadline = time.monotonic() + 120
        while (state := httpx.get(f"{gateway.url}/jobs/{job}", timeout=30).json())["status"] == "queued":
            assert time.monotonic() < deadline, state
            time.sleep(0.1)
        assert state["status"] == "done", state
        assert state["result"] == expected
        refused = httpx.post(gateway.url + "/jobs", json={"kind": "token_count", "body": {"inputs": TEXTS,
                                                                                         "top_k": 3}}, timeout=30)
        assert refused.status_code == 422, refused.text
    finally:
        gateway.stop()


def test_a_plugin_kind_through_embedq_index(plugin_worker, plugin_dir, tmp_path):
    pq = pytest.importorskip("pyarrow.parquet")
    expected = _expected(plugin_worker)
    ids = _write_jsonl(tmp_path / "in.jsonl", TEXTS)
    out = tmp_path / "out.parquet"
    proc = subprocess.run(_index_cmd(tmp_path / "in.jsonl", out, "--kind", "token_count", "--chunk-size", "2"),
                          env=_env(plugin_dir, plugin_worker.settings), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    summary = json.loads(proc.stdout)
    assert summary["rows"] == len(TEXTS) and summary["failed"] == 0, summary
    table = pq.read_table(out)
    rows = dict(zip(table.column("id").to_pylist(), table.column("tokens").to_pylist()))
    assert [rows[i] for i in ids] == expected
    manifest = json.loads((out / "_embedq.json").read_text())
    assert "token_count" in json.dumps(manifest)
