"""The one reader of the environment: ``EMBEDQ_*`` variables become a :class:`Settings` object.

Build it once at an entry point (CLI, worker, client) and pass it down.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator
from pydantic_settings import SettingsConfigDict

from embedq.connection import RedisSettings
from embedq.sentinel import is_sentinel
from embedq.sentinel import parse as parse_sentinel

DEFAULT_MODEL = "sentence-transformers/all-MiniLM-L6-v2"

Dtype = Literal["float32", "float16", "bfloat16"]


def cache_dir(variable: str, name: str) -> Path:
    """A cache folder of embedq's: ``$<variable>`` if set, else ``$XDG_CACHE_HOME/embedq/<name>`` (default
    ``~/.cache``). Read at each call, so a test or a worker can point it elsewhere."""
    configured = os.environ.get(variable)
    if configured:
        return Path(configured).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "embedq" / name


def model_slug(model: str) -> str:
    """A queue-safe short name for a model id or path (``all-minilm-l6-v2``)."""
    base = model.rstrip("/").split("/")[-1]
    return re.sub(r"[^a-z0-9_.-]+", "-", base.lower()).strip("-") or "model"


#: The URL schemes of a broker or result store: redis-py's, and Celery's ``sentinel://`` (embedq/sentinel.py).
REDIS_SCHEMES = ("redis://", "rediss://", "unix://", "sentinel://")

Pooling = Literal["splade", "cls", "mean", "max", "lasttoken", "weightedmean", "mean_sqrt_len_tokens"]
LinearKernel = Literal["auto", "onednn", "torch", "onnxruntime"]


class BackendSettings(BaseModel):
    """What loading a model takes (``embedq.backends.load_backend``), as one object passed whole: the settings of
    :class:`Settings` of the same names (:meth:`Settings.backend`), ``batch_tokens`` and ``online_tokens`` as the
    worker resolves them for its device. Their meanings are the descriptions of :class:`Settings`' fields."""

    model_config = ConfigDict(frozen=True, extra="forbid")

    device: str = "cpu"
    dtype: Dtype = "float32"
    torch_threads: int | None = Field(default=None, ge=1)
    linear_kernel: LinearKernel = "auto"
    batch_tokens: int = Field(default=2048, ge=1)  # the runtime tuner times micro-batches of this many tokens
    online_tokens: int = Field(default=256, ge=1)  # ... and online ones of this many
    pooling: Pooling | None = None
    trust_remote_code: bool = False
    allow_fake_backend: bool = False
    max_windows: int = Field(default=128, ge=1)


class Settings(RedisSettings):
    """All knobs of embedq. Every field can be set as ``EMBEDQ_<FIELD>`` in the environment (those of how Redis is
    reached, TLS, Sentinel and replica acknowledgements, are declared in embedq/connection.py)."""

    model_config = SettingsConfigDict(env_prefix="EMBEDQ_", extra="ignore", protected_namespaces=())

    broker_url: str | None = Field(
        default=None,
        description="Redis URL of the broker (redis://, rediss://, unix://, or Celery's "
        "sentinel://host:port[;sentinel://host:port...][/db] with sentinel_master). None: the CLI starts a "
        "private redis-server and worker (the embedded default).",
    )
    result_backend: str | None = Field(default=None, description="Result store; defaults to broker_url.")
    model: str = Field(default=DEFAULT_MODEL, description="Model id or local sentence-transformers folder.")
    queue: str | None = Field(default=None, description="Queue of online jobs; defaults to embedq.<model slug>.")
    bulk_queue: str | None = Field(default=None, description="Queue of bulk jobs; defaults to <queue>.bulk.")
    device: str = "cpu"
    dtype: Dtype = "float32"
    max_batch_tokens: int | None = Field(
        default=None, ge=16,
        description="Padded tokens per micro-batch. None: 2048 on CPU (cache-sized batches are fastest "
        "there), 16384 on CUDA.",
    )
    online_batch_tokens: int | None = Field(
        default=None, ge=16,
        description="Padded tokens a micro-batch with bulk texts in it may cost while online jobs are about "
        "(one arrived in the last second): an online job waits behind at most one such batch; and what one "
        "client's online micro-batch may cost while another online client is about (fair share). Online texts "
        "of one client alone always use max_batch_tokens. None: 256 on CPU, 4096 on CUDA.",
    )
    preempt: bool = Field(
        default=True,
        description="Online micro-batches run between two layers of a running bulk micro-batch, which then "
        "resumes where it stopped (same result, bit for bit): an online job waits at most one layer. Where the "
        "model cannot be stopped between layers (ONNX Runtime, no layer stack found) the worker says so once "
        "and caps bulk micro-batches at online_batch_tokens while online jobs are about instead.",
    )
    dedupe: bool = Field(
        default=True,
        description="Identical items waiting in a worker at the same time (the same token ids after prompt and "
        "truncation, the same head) run through the model once, and each job gets a copy of the row; counted as "
        "items_deduplicated. Exact: an item's row does not depend on the others in its micro-batch.",
    )
    bulk_min_share: float = Field(
        default=0.1, ge=0.0, le=1.0,
        description="While online and bulk jobs both wait, the least share of the model's tokens bulk gets.",
    )
    online_reserve: float = Field(
        default=0.25, ge=0.0, lt=1.0,
        description="Share of the prefetch window (messages and texts) kept for online jobs: bulk jobs never "
        "fill it, so an online job is fetched at once even while a bulk run saturates the worker.",
    )
    online_queue_limit: int = Field(
        default=1000, ge=0,
        description="Deprecated (issue 50): online admission is by texts and expected wait (online_max_wait, "
        "online_queue_texts). Kept as a last cap on online jobs (messages) waiting in a queue's Redis list, "
        "beyond which producers refuse new online jobs with `overloaded` (HTTP 429); 0: no limit.",
    )
    bulk_queue_limit: int = Field(
        default=10_000, ge=0,
        description="Bulk jobs waiting in a queue beyond which bulk producers (the indexer) wait for room "
        "before sending more; 0: no limit.",
    )
    bulk_wait_timeout: float | None = Field(
        default=None, gt=0,
        description="Seconds a bulk producer waits for room in a full bulk queue before it raises "
        "`overloaded`; None: as long as it takes.",
    )
    max_batch_requests: int = Field(default=256, ge=1, description="Texts per micro-batch.")
    max_chars: int = Field(default=100_000, ge=1, description="Characters per text.")
    max_windows: int = Field(
        default=128, ge=1,
        description="Windows one text of a long_inputs='windows' job may need (each of the model's length); a "
        "text that needs more fails alone with too_many_windows, the other texts of its job are answered. The "
        "character limit (max_chars) applies first.",
    )
    max_texts_per_job: int = Field(default=2048, ge=1)
    result_ttl: int = Field(default=3600, ge=1, description="Seconds a result is kept in Redis.")
    prefetch_window: int = Field(
        default=1024, ge=1, description="Messages (jobs) a worker holds unacknowledged at most."
    )
    prefetch_texts: int = Field(
        default=8192, ge=1,
        description="Texts a worker buffers at most: it takes no new job while this many are held (one job "
        "may overshoot by its own size; a long_inputs='windows' job counts its windows once tokenized). Bounds the "
        "time a message waits, see visibility_timeout.",
    )
    fetch_batch: int = Field(
        default=64, ge=1,
        description="Messages a worker takes from Redis in one round trip at most (within the prefetch window); "
        "1: one per BRPOP, as kombu does.",
    )
    visibility_timeout: int = Field(
        default=300, ge=5,
        description="Seconds before Redis redelivers a message whose worker stopped renewing its lease. A live "
        "worker renews the messages it holds every visibility_timeout/4 s, so this bounds how long a dead "
        "worker's jobs wait, not how long a job may take.",
    )
    max_attempts: int = Field(
        default=3, ge=1,
        description="Deliveries that may end with the worker dead before a job is dead-lettered.",
    )
    max_message_bytes: int = Field(
        default=16 * 1024 * 1024, ge=1024, description="Size of one serialized job message, checked by "
        "producers and again by workers.",
    )
    max_result_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Size of one job's stored result at most (vectors, "
        "scores, tokens); a larger one fails that job with `result_too_large` instead of filling Redis.",
    )
    shutdown_timeout: float = Field(
        default=30.0, gt=0, description="Seconds a worker stopping on SIGTERM waits for the micro-batch in "
        "progress and the results being written before it returns what it holds to the queue.",
    )
    stall_timeout: float = Field(
        default=300.0, gt=0, description="Seconds a worker's inference thread may show no progress (no finished "
        "micro-batch, no layer of a bulk one) while work waits before the worker gives up and exits (exit status "
        "70) for its supervisor to restart it; a dead inference or results thread stops it at once. Keep it above "
        "the longest micro-batch a model without preemption points runs.",
    )
    broker_timeout: float = Field(
        default=30.0, gt=0, description="Seconds a producer's blocking call rides out an unreachable broker "
        "before it raises `unavailable`.",
    )
    worker_start_timeout: float = Field(
        default=900.0, gt=0, description="Seconds `embedq index` waits for a worker that is starting (registered, "
        "loading its model: exporting ONNX, measuring runtimes, a large model) before it gives up; a queue with no "
        "worker at all, starting or ready, is refused after --wait-for-worker.",
    )
    resend_after: float | None = Field(
        default=None, gt=0, description="Seconds after which a producer waiting on a job with no result "
        "sends it again under the same id (None: 2 × visibility_timeout). Workers recognise the copy.",
    )
    metrics_port: int | None = Field(
        default=None, ge=0, le=65535, description="Port of the worker's Prometheus endpoint (/metrics). Unset: the "
        "first free port from 9808 to 9839 (several workers of a machine need no configuration; the registry and "
        "`embedq status` show each one's); a number: exactly that port (taken: the worker stops); 0: none.",
    )
    metrics_addr: str = Field(default="127.0.0.1", description="Address the metrics endpoint listens on; 0.0.0.0 "
                              "where Prometheus scrapes over the network (ops/ sets it).")
    flower_basic_auth: SecretStr | None = Field(
        default=None, description="user:password[,user:password] for `embedq flower` (HTTP basic auth).",
    )
    flower_address: str = Field(default="127.0.0.1", description="Address `embedq flower` listens on (its "
                                "--address wins); any but a loopback address needs flower_basic_auth.")
    api_key: SecretStr | None = Field(
        default=None, description="`embedq serve`: every route but /health, /ping, /metrics, /docs and /redoc then "
        "needs `Authorization: Bearer <key>` (exact match).",
    )
    max_client_batch_size: int = Field(
        default=2048, ge=1, description="`embedq serve`: inputs one HTTP request may carry (TEI's is 32; framework "
        "clients send up to 1,000). Larger requests get a 422; a request is split into jobs of max_texts_per_job.",
    )
    gateway_payload_limit: int = Field(
        default=16_000_000, ge=1, description="`embedq serve`: bytes of a request body; larger ones get a 413.",
    )
    cors_allow_origins: str | None = Field(
        default=None, description="`embedq serve`: comma-separated origins browsers may call it from, or `*`; "
        "unset: no CORS headers.",
    )
    gateway_require_worker: bool = Field(
        default=True, description="`embedq serve`: a synchronous request for a model no live worker serves is "
        "answered 503 (`no_worker`, Retry-After) at once, nothing sent; false: it waits for a worker (deployments "
        "that scale workers up from zero on queue depth). `POST /jobs` always queues.",
    )
    gateway_models: str | None = Field(
        default=None, description="`embedq serve`: more models behind the same gateway, comma-separated, each "
        "`name` (a model id: its workers' default queue) or `name=queue`; a request picks one by OpenAI's `model` "
        "or the `X-Embedq-Model` header (default: EMBEDQ_MODEL).",
    )
    webhook_allow: str | None = Field(
        default=None, description="`embedq serve`: comma-separated URL prefixes a `POST /jobs` webhook may call "
        "(e.g. `https://hooks.example.com/`); unset: webhooks are refused (a gateway that calls any URL a caller "
        "names is a server-side request forgery).",
    )
    webhook_secret: SecretStr | None = Field(
        default=None, description="`embedq serve`: key of the HMAC-SHA256 signature each webhook call carries "
        "(`X-Embedq-Signature: t=<unix time>,v1=<hex of HMAC(key, '<t>.<body>')>`).",
    )
    webhook_attempts: int = Field(
        default=5, ge=1, description="`embedq serve`: calls of a webhook before it is given up (a network error, "
        "a 5xx or a 429 is tried again, with doubling pauses from 1 s).",
    )
    webhook_lease: float = Field(
        default=30.0, gt=0, description="`embedq serve`: seconds a replica's claim on delivering a webhook lasts "
        "unless renewed; the webhooks of a replica that died are taken over by another after this.",
    )
    webhook_timeout: float = Field(
        default=10.0, gt=0, description="`embedq serve`: seconds one call of a webhook may take in all (connecting, "
        "sending, and reading the answer, however slowly it comes); past it the call is aborted, its connection "
        "closed, and it counts as a failed call (tried again like a network error, up to webhook_attempts).",
    )
    webhook_response_limit: int = Field(
        default=65536, ge=0, description="`embedq serve`: bytes of a webhook receiver's answer body the gateway "
        "reads (only the status code is used); past them the connection is closed and the rest never read, the "
        "call's outcome still its status code.",
    )
    serializer: Literal["json", "msgpack"] = "json"
    callback_queue: str = Field(
        default="celery", min_length=1, description="Queue of the Celery tasks a job's canvas sends (link, "
        "link_error, the next step of a chain, a chord's body) whose signature names no queue; any task that is not "
        "an embedq kind is routed there, never to embedq's own queues (Celery's default queue is `celery`).",
    )
    # -- a job's canvas (issue 50): what one message's callbacks may ask, checked at the edge (workers/canvas_rules.py)
    callback_queues: str = Field(
        default="", description="Comma-separated queues a job's canvas may send tasks to besides "
        "`callback_queue` (a signature's `queue`, or an `exchange`/`routing_key` naming one); a message whose "
        "canvas names another is refused with `invalid_message`.",
    )
    callback_kinds: str = Field(
        default="", description="Comma-separated embedq kinds (`embed`, or task names such as `embedq.embed`) a "
        "job's canvas may run as callbacks, chain steps or chord bodies; they go to the online queue and pass its "
        "admission (`online_queue_limit`). Empty: every embedq kind in a canvas is refused with `invalid_message`.",
    )
    canvas_max_signatures: int = Field(
        default=32, ge=1, le=100_000, description="Signatures one message's canvas may hold at most (callbacks, "
        "errbacks, chain steps, the chord body, and every signature nested in them).",
    )
    canvas_max_depth: int = Field(
        default=4, ge=1, le=64, description="Nesting of signatures inside signatures (a group in a chord's "
        "body, a link of a link...) one message's canvas may have at most.",
    )
    canvas_max_chain: int = Field(
        default=16, ge=1, le=10_000, description="Steps a chain in one message's canvas may have at most.",
    )
    canvas_max_chord_size: int = Field(
        default=10_000, ge=1, description="A chord part's `chord_size` at most (the parts its chord waits for).",
    )
    canvas_max_bytes: int = Field(
        default=64 * 1024 * 1024, ge=1024, description="Bytes the canvas work of one job may publish at most: "
        "the messages carrying its result (callbacks, the chain's next step, its chord part) times the size of "
        "the result's JSON form, estimated before it is built. Past it that work fails (errbacks run), counted "
        "in `canvas_failures`.",
    )

    torch_threads: int | None = Field(default=None, ge=1, description="torch intra-op threads (CPU).")
    worker_processes: int | None = Field(
        default=None, ge=1, le=64,
        description="Worker processes (replicas) `embedq worker` runs for its device, each a full worker with its own "
        "copy of the model, under one supervisor. None: one per four cores on a GPU (at most four), one on the CPU.",
    )
    device_process: bool = Field(
        default=False,
        description="The split layout (`embedq worker --device-process`, embedq/workers/split.py): one device process "
        "loads the model and schedules and runs the items of every host process; the host processes "
        "(`worker_processes` of them) receive, check, tokenize, encode, store and acknowledge. False: each worker "
        "process is a whole worker (replicas).",
    )
    linear_kernel: LinearKernel = Field(
        default="auto",
        description="The runtime of the model's forward pass on CPU. auto: the worker times torch, onednn and "
        "onnxruntime on micro-batches like its own at load and keeps the fastest of those that reproduce "
        "PyTorch's outputs within 1e-5; the choice is cached per machine and model in EMBEDQ_RUNTIME_CACHE "
        "(backends/runtime.py). torch: PyTorch's own kernels (MKL); onednn: the Linear layers on oneDNN with "
        "prepacked weights; onnxruntime: the whole forward pass in ONNX Runtime with its transformer fusions "
        "(CPU, float32, encoders; exported once into EMBEDQ_ONNX_CACHE; needs the onnx extra). On a GPU: torch.",
    )
    pooling: Pooling | None = Field(
        default=None,
        description="None: the model folder says what it serves (always right for a sentence-transformers folder). "
        "splade: serve a bare *ForMaskedLM folder as a SPLADE model (embed_sparse; TEI's --pooling splade) instead "
        "of a mean-pooled embedding model; a SparseEncoder folder is SPLADE without it. cls, mean, max, lasttoken "
        "(TEI's last-token), weightedmean, mean_sqrt_len_tokens: override an embedding model's pooling (TEI's "
        "--pooling); another pooling is another vector space, so the fingerprint names it and an index made "
        "without it refuses the new vectors (docs/FIDELITY.md).",
    )
    trust_remote_code: bool = Field(
        default=False,
        description="Run the code a model folder ships (config.json's auto_map: Jina, Nomic, GTE-new models). "
        "Off: such a folder is refused with a clear error (without its code, transformers may load a stock "
        "architecture and serve other vectors silently). On: only modules inside the folder are run, never "
        "downloaded ones; their source is part of the weights hash.",
    )
    allow_fake_backend: bool = Field(
        default=False,
        description="Let `EMBEDQ_MODEL=embedq-fake` load the deterministic fake model (embedq/backends/fake.py: "
        "vectors from a hash of the token ids, for tests of the queue). Off: that name is refused.",
    )
    kinds: str = Field(
        default="",
        description="Job kinds from plugins: comma-separated import paths, each 'package.module' (its KINDS list) or "
        "'package.module:NAME' (a TaskSpec or a list of them); packages may also declare kinds under the "
        "'embedq.kinds' entry-point group. Every process that meets such a kind (worker, producers, gateway, "
        "indexer) must load the same plugins (docs/ARCHITECTURE.md, Adding a kind).",
    )
    sinks: str = Field(
        default="",
        description="Sinks of `embedq index` from plugins: comma-separated import paths, each 'package.module' (its "
        "SINKS list) or 'package.module:NAME' (a SinkScheme or a list of them); packages may also declare sinks "
        "under the 'embedq.sinks' entry-point group. `-o SCHEME://...` then writes through the sink of that scheme "
        "(embedq/producers/index/sinks/contract.py: the contract it implements).",
    )
    memory_policy: Literal["auto", "trim", "mmap", "glibc"] = Field(
        default="auto",
        description="How a worker keeps its RSS flat (embedq/workers/memory.py). auto: trim when the chosen runtime "
        "is ONNX Runtime (its arena reuses the activation buffers), else mmap. trim: glibc's heap with "
        "malloc_trim at most every malloc_trim_interval s and when idle. mmap: every block over 128 KiB mapped "
        "and unmapped per use (flat, but page faults on every batch). glibc: nothing done. All but glibc cap "
        "oneDNN's/ideep's per-shape caches at 64 entries.",
    )
    malloc_trim_interval: float = Field(
        default=5.0, gt=0, description="Seconds of work between two malloc_trim calls (memory_policy=trim).",
    )
    # -- fair share (issue 50)
    client_id: str | None = Field(
        default=None, min_length=1, max_length=128,
        description="Producers: the identity a Client puts on every job it sends (message header embedq_client), "
        "what a worker shares its model time out by between clients; default <hostname>:<pid>.",
    )
    online_overflow_texts: int = Field(
        default=24576, ge=0,
        description="Workers: texts of online jobs a worker may hold beyond prefetch_texts, so that a small online "
        "job queued behind one client's flood reaches the worker, whose fair share runs it in the next "
        "micro-batch (0: none; bulk jobs never use it).",
    )
    # -- admission (issue 50)
    online_max_wait: float = Field(
        default=2.0, ge=0, description="Seconds an online job may be expected to wait before it starts (the texts "
        "ahead of it, as its client's fair share sees them, over the live workers' measured texts/s): past it the "
        "producer refuses the job at once with `overloaded` (HTTP 429 with Retry-After), nothing sent. 0: off. "
        "Unknown throughput (workers that have not run under load yet): only online_queue_texts applies.",
    )
    online_queue_texts: int = Field(
        default=16_384, ge=0, description="Online texts waiting (buffered by the workers or queued) beyond which "
        "producers refuse new online jobs at once with `overloaded` (HTTP 429), whatever the throughput; a job "
        "that finds nothing ahead of it is always admitted. 0: no cap.",
    )

    @field_validator("pooling", mode="before")
    @classmethod
    def _tei_pooling_names(cls, value: Any) -> Any:
        """TEI's spellings (``last-token``) beside sentence-transformers' (``lasttoken``)."""
        if isinstance(value, str):
            value = value.strip().lower()
            return {"last-token": "lasttoken", "last_token": "lasttoken", "": None}.get(value, value)
        return value

    @field_validator("broker_url", "result_backend")
    @classmethod
    def _redis_url(cls, value: str | None) -> str | None:
        """Blank is None; anything else must be a Redis URL (embedq's broker and result store are Redis)."""
        if not value:
            return None
        if is_sentinel(value):
            parse_sentinel(value)  # its ValueError says what is wrong
        elif not value.startswith(REDIS_SCHEMES):
            scheme = value.split("://", 1)[0] + "://" if "://" in value else "no scheme"
            raise ValueError(f"must be a Redis URL starting with {', '.join(REDIS_SCHEMES)}; got {scheme} "
                             "(e.g. redis://localhost:6379/0)")
        return value

    @model_validator(mode="after")
    def _sentinel_master(self) -> Settings:
        if (is_sentinel(self.broker_url) or is_sentinel(self.result_backend)) and not self.sentinel_master:
            raise ValueError("a sentinel:// URL needs the name of the primary: set EMBEDQ_SENTINEL_MASTER")
        return self

    @property
    def batch_tokens(self) -> int:
        if self.max_batch_tokens is not None:
            return self.max_batch_tokens
        return 16384 if self.device.startswith("cuda") else 2048

    @property
    def online_tokens(self) -> int:
        if self.online_batch_tokens is not None:
            return min(self.online_batch_tokens, self.batch_tokens)
        return min(4096 if self.device.startswith("cuda") else 256, self.batch_tokens)

    def backend(self) -> BackendSettings:
        """The settings loading the model takes, as one object (``load_backend`` takes it whole)."""
        return BackendSettings.model_validate(self, from_attributes=True)

    @property
    def queue_name(self) -> str:
        """The online queue (what producers send to unless a job is bulk)."""
        return self.queue or f"embedq.{model_slug(self.model)}"

    @property
    def bulk_queue_name(self) -> str:
        return self.bulk_queue or f"{self.queue_name}.bulk"

    def queue_for(self, traffic_class: str) -> str:
        return self.bulk_queue_name if traffic_class == "bulk" else self.queue_name

    @property
    def kind_plugins(self) -> list[str]:
        """:attr:`kinds` as a list of import paths."""
        return [path.strip() for path in self.kinds.split(",") if path.strip()]

    @property
    def sink_plugins(self) -> list[str]:
        """:attr:`sinks` as a list of import paths."""
        return [path.strip() for path in self.sinks.split(",") if path.strip()]

    @property
    def callback_queue_names(self) -> frozenset[str]:
        """Queues a job's canvas may send to: :attr:`callback_queue` and :attr:`callback_queues`."""
        return frozenset({self.callback_queue, *(q.strip() for q in self.callback_queues.split(",") if q.strip())})

    @property
    def callback_kind_names(self) -> frozenset[str]:
        """:attr:`callback_kinds` as given (kinds or task names; workers/canvas_rules.py reads both)."""
        return frozenset(k.strip() for k in self.callback_kinds.split(",") if k.strip())

    @property
    def queues(self) -> list[str]:
        """What a worker consumes: the online queue first."""
        return [self.queue_name, self.bulk_queue_name]

    @property
    def result_url(self) -> str | None:
        return self.result_backend or self.broker_url
