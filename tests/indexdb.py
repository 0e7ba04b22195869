"""What the database-sink tests of ``embedq index`` share (tests/test_index_pgvector.py, test_index_lancedb.py, ...):
the indexer's command line and environment, the input file, the acceptance's texts, and the kill-and-resume step.

Plain functions, imported as ``from indexdb import ...`` (tests/ is on the path, as for ``conftest``).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
from conftest import ROOT_DIR, WorkerHandle

from embedq.producers.index.content import ContentHasher
from embedq.protocol import Fingerprint
from embedq.settings import Settings

#: acceptance a's 2,000 corpus texts: the short ones (under 400 characters, in corpus order) keep CI's time low
N_TEXTS = 2000
#: the longest text (characters, exclusive) the acceptance takes from the corpus
SHORT_TEXT = 400
#: environment variables not handed to the indexer: embedq's own settings (the tests pass theirs) and libpq's (a
#: PGPASSWORD or PGHOST of the machine must not reach a test's database); ``*_CACHE`` ones are kept (model caches)
FOREIGN_ENV = ("EMBEDQ_", "PG")


def env(settings: Settings, **extra: str) -> dict[str, str]:
    """The environment of an ``embedq index`` run against ``settings``' broker and queue, this checkout on the path,
    with ``extra`` added."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(FOREIGN_ENV) or k.endswith("_CACHE")}
    return {**base, "EMBEDQ_BROKER_URL": settings.broker_url, "EMBEDQ_QUEUE": settings.queue_name,
            "PYTHONPATH": str(ROOT_DIR), **extra}


def cmd(src: Path, url: str, *extra: str) -> list[str]:
    """``embedq index SRC -o URL -q --json EXTRA...`` as an argument list (the JSON summary on stdout)."""
    return [sys.executable, "-m", "embedq", "index", str(src), "-o", url, "-q", "--json", *extra]


def run(settings: Settings, src: Path, url: str, *extra: str, cwd: Path | None = None) -> tuple[int, dict, str]:
    """Run :func:`cmd` to its end: exit status, the JSON summary ({} when none was printed), stderr + stdout."""
    proc = subprocess.run(cmd(src, url, *extra), env=env(settings), capture_output=True, text=True, timeout=900,
                          cwd=cwd)
    summary = json.loads(proc.stdout) if proc.stdout.strip() else {}
    return proc.returncode, summary, proc.stderr + proc.stdout


def run_without(module: str, settings: Settings, url: str, cwd: Path) -> subprocess.CompletedProcess:
    """``embedq index`` of a one-text input into ``url`` with ``module`` made unimportable in the CLI's own process
    (the real import path of a missing extra, not a mock of the sink)."""
    src = cwd / "one.jsonl"
    write_jsonl(src, ["one text"])
    code = (f"import sys; sys.modules[{module!r}] = None; from embedq.cli import main; "
            f"sys.exit(main(['index', {str(src)!r}, '-o', {url!r}, '-q']))")
    return subprocess.run([sys.executable, "-c", code], env=env(settings), capture_output=True, text=True,
                          timeout=300, cwd=cwd)


def tiny_worker(broker_url: str, root: Path, model: str, corpus: list[str] | None = None) -> WorkerHandle:
    """A real worker, on its own queue, of a tiny random model built under ``root`` (tests/tiny_models.py): ``splade``
    (a masked-LM with SPLADE max pooling) or ``bge-m3`` (its vocabulary from ``corpus``'s first 400 texts). Its
    settings' ``model`` is the model's folder. Stop it with ``.stop()``."""
    import uuid

    import tiny_models

    if model == "splade":
        folder = tiny_models.splade(root / "splade", tiny_models.bert_mlm(root / "mlm"), "max")
    else:
        assert model == "bge-m3" and corpus is not None, model
        folder = tiny_models.bge_m3(root / "bge-m3", corpus[:400])
    settings = Settings(broker_url=broker_url, queue=f"embedq.test.{model}.{uuid.uuid4().hex[:8]}",
                        model=str(folder), linear_kernel="torch")
    return WorkerHandle(settings, root / f"{model}-worker.log")


def write_jsonl(path: Path, texts: list[str]) -> list[str]:
    """Write ``{"id": "doc-N", "text": ...}`` lines, one per text, to ``path``; returns the ids in order."""
    ids = [f"doc-{i}" for i in range(len(texts))]
    path.write_text("".join(json.dumps({"id": i, "text": t}) + "\n" for i, t in zip(ids, texts)))
    return ids


#: Each text's bulk vector from a worker (by its queue), once per test process: the sinks' acceptance a embeds the
#: same 2,000 texts (:func:`corpus_texts`) on the session's worker, and each compares its table with them.
_BULK_VECTORS: dict[tuple[str, str], np.ndarray] = {}


def bulk_vectors(worker, texts: list[str]) -> np.ndarray:
    """``worker.client.embed(texts, traffic_class="bulk")`` (as the indexer sends its jobs), each text embedded once
    per test process: the same text, the same worker, the same vector within the batch-invariance bound."""
    queue = worker.settings.queue_name
    missing = list(dict.fromkeys(t for t in texts if (queue, t) not in _BULK_VECTORS))
    if missing:
        vectors = worker.client.embed(missing, timeout=600, traffic_class="bulk")
        _BULK_VECTORS.update(((queue, t), v) for t, v in zip(missing, np.asarray(vectors)))
    return np.stack([_BULK_VECTORS[(queue, t)] for t in texts])


def items_received(worker) -> int:
    """How many texts ``worker`` (a conftest ``WorkerHandle``) has received so far."""
    return worker.stats()["items_received"]


def corpus_texts(corpus: list[str]) -> list[str]:
    """Acceptance a's texts: the first :data:`N_TEXTS` corpus texts shorter than :data:`SHORT_TEXT` characters."""
    return [t for t in corpus if len(t) < SHORT_TEXT][:N_TEXTS]


def query_texts(corpus: list[str], n: int = 20) -> list[str]:
    """``n`` short corpus texts that follow :func:`corpus_texts` (none of them indexed): the ANN check's queries."""
    return [t for t in corpus if len(t) < SHORT_TEXT][N_TEXTS:N_TEXTS + n]


def kill_after_rows(command: list[str], environ: dict[str, str], cwd: Path, rows: Callable[[], int],
                    at_least: int = 200, timeout: float = 300) -> int:
    """Start ``command``, poll ``rows()`` (the rows the target has committed, read with the database's own client)
    until it is at least ``at_least``, SIGKILL the indexer, and return ``rows()`` after the kill.

    Fails the test when the indexer exits first (its output in the message) or ``timeout`` seconds pass.
    """
    proc = subprocess.Popen(command, env=environ, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        deadline = time.monotonic() + timeout
        while rows() < at_least:
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, f"no {at_least} rows committed"
            time.sleep(0.1)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    return rows()


def milvus_client(uri: str, **kwargs):
    """A ``pymilvus.MilvusClient`` of ``uri``. The server may have sent this process's idle channel a GOAWAY for its
    keepalive pings ("too_many_pings": a slow fixture or a long run leaves it idle for a minute); that connection is
    gone, and a new one is made once."""
    import pymilvus

    try:
        return pymilvus.MilvusClient(uri=uri, **kwargs)
    except pymilvus.exceptions.MilvusException as exc:
        if "Fail connecting" not in str(exc):
            raise
        return pymilvus.MilvusClient(uri=uri, **kwargs)


class MilvusCollections:
    """Collections of a ``milvus-lite server`` (``milvus_server_at``), named with a prefix of the test's own, read
    while the indexer writes them (a Milvus Lite file is one process's). Each read has a client of its own, closed
    after it (an idle shared channel outlives it, and the server drops that for its keepalive pings)."""

    def __init__(self, server: tuple[str, str], tmp: Path) -> None:
        self.base, self.uri = server
        self.prefix = "c" + "".join(ch for ch in tmp.name if ch.isalnum())[-12:]

    def url(self, name: str) -> str:
        return f"{self.base}?collection={self.prefix}_{name}"

    def client(self):
        return milvus_client(self.uri, dedicated=True)

    def count(self, name: str) -> int:
        """Rows of a collection (0 before it exists)."""
        client = self.client()
        try:
            if not client.has_collection(f"{self.prefix}_{name}"):
                return 0
            rows = client.query(f"{self.prefix}_{name}", filter="", output_fields=["count(*)"],
                                consistency_level="Strong")
        finally:
            client.close()
        return int(rows[0]["count(*)"])

    def scan(self, name: str, fields: list[str]) -> list[dict]:
        """Every row of a collection, with ``fields``."""
        client = self.client()
        try:
            client.load_collection(f"{self.prefix}_{name}")
            it = client.query_iterator(f"{self.prefix}_{name}", batch_size=1000, output_fields=fields,
                                       consistency_level="Strong")
            rows = []
            while batch := it.next():
                rows += batch
            it.close()
        finally:
            client.close()
        return rows


def milvus_server_at(root: Path) -> Iterator[tuple[str, str]]:
    """A module fixture's body: ``milvus-lite server`` on a free port of 127.0.0.1 with its data under ``root``, ready
    when a client's call is answered; yields its ``milvus://`` URL and its client URI, and stops it after."""
    import psutil
    import pymilvus

    from embedq.producers.embedded import free_port

    for _ in range(5):  # another process may take the free port first (two test workers start servers at once)
        port = free_port()
        with open(root / "server.log", "w") as log:  # the child keeps its own descriptor
            proc = subprocess.Popen([str(Path(sys.executable).with_name("milvus-lite")), "server", "--data-dir",
                                     str(root / "data"), "--host", "127.0.0.1", "--port", str(port)], stdout=log,
                                     stderr=subprocess.STDOUT)
        uri = f"http://127.0.0.1:{port}"
        deadline = time.monotonic() + 120
        while proc.poll() is None:
            # ready when this server listens on the port (not another one that holds it) and answers
            try:
                ours = {proc.pid, *(c.pid for c in psutil.Process(proc.pid).children(recursive=True))}
            except psutil.NoSuchProcess:  # it exited meanwhile: the port was taken, try another
                break
            listening = any(c.pid in ours for c in psutil.net_connections("tcp")
                            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port)
            try:
                if listening:
                    pymilvus.MilvusClient(uri=uri, timeout=2).list_collections()
                    break
            except Exception:
                pass
            assert time.monotonic() < deadline, (root / "server.log").read_text()
            time.sleep(0.2)
        if proc.poll() is None:
            break
    assert proc.poll() is None, (root / "server.log").read_text()
    yield f"milvus://127.0.0.1:{port}", uri
    proc.terminate()
    proc.wait(timeout=30)


# -- the sinks' own tests of issue 57 (content hashes, replacing, pruning, reading back; no worker) ------------------
#: A made-up embedding space of 4 dimensions, for rows written straight into a sink.
SPACE4 = Fingerprint(model="m", weights_sha256="ab" * 32, pooling="mean", normalize=True, dimensions=4,
                     dtype="float32", embedq_version="0")


def random_rows(n: int, seed: int) -> np.ndarray:
    """``n`` random float32 rows of :data:`SPACE4`'s dimension."""
    return np.random.default_rng(seed).standard_normal((n, 4)).astype(np.float32)


def text_hash(text: str) -> bytes:
    """A text's content hash under the default options and float32 (``content.ContentHasher``)."""
    return ContentHasher({}, "float32")(text)
