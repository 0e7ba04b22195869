"""Hostile queue entries for tests/faults/test_fuzz_messages.py: hypothesis strategies and their wire bytes.

A strategy draws a small *spec* (a frozen dataclass: a few choices, cheap to draw and to print); the test
turns each spec into the raw bytes it LPUSHes onto a worker's queue list with :func:`materialize`, giving it
a fresh job id and delivery tag. Large payloads (nesting thousands deep, compression bombs) are built there
from a number in the spec, so an example stays small for hypothesis and its printout stays readable.

What an entry can be:

* junk: random bytes, text that is not JSON, JSON that is not an object, an empty entry;
* deep: JSON (or msgpack) nested up to 200,000 levels, as the whole entry, inside an envelope field, or as
  the task's arguments inside a well-formed message;
* a Celery message (protocol 1 or 2) in kombu's Redis envelope ``{"body", "content-encoding",
  "content-type", "headers", "properties": {"delivery_tag", "delivery_info", "body_encoding", ...}}``, each
  part either well-formed or hostile: task names (embedq's kinds, Celery's built-in tasks, others, not
  strings), job ids, argument and option shapes, header values (``expires``, ``eta``, ``timelimit``,
  ``retries``, ... as null, huge ints, NaN, lists, far dates), serializers (json with NaN, msgpack, pickle,
  yaml, unknown), body encodings, compression (kombu's gzip/zlib, bz2, lzma; brotli, zstd, unknown; proper,
  garbage, or bombs that inflate to 512 MiB), delivery tags and delivery info of the wrong type, and a whole
  envelope field replaced. A message has none to four hostile parts, the others well-formed;
* a Celery canvas (:class:`CanvasSpec`) of each shape embedq bounds (callbacks, errbacks, chains, nesting, groups,
  chord parts; the tasks and queues they name), within and beyond each bound: beyond one, only a typed error will do.

:attr:`Entry.answerable` marks the entries whose job id the worker can read (see :attr:`Message.answerable`):
those must end with a terminal record; :attr:`Entry.must_fail` says why one can only end with a typed error.
"""

from __future__ import annotations

import base64
import bz2
import functools
import json
import lzma
import pickle
import uuid
import zlib
from dataclasses import dataclass
from typing import Any

import msgpack
from hypothesis import strategies as st

from embedq.kinds import TASKS
from embedq.protocol import TASK_NAME

#: Celery's built-in tasks: registered on every Celery app, so a worker that ran them would run them for anyone.
BUILTIN_TASKS = ("celery.accumulate", "celery.backend_cleanup", "celery.chord_unlock", "celery.chain",
                 "celery.group", "celery.chord", "celery.map", "celery.starmap", "celery.chunks")
EMBEDQ_TASKS = tuple(TASKS)
#: kombu's names (its "gzip" is zlib's format) and others; brotli and zstd are unknown unless their packages are.
COMPRESSIONS = ("application/x-gzip", "application/x-bz2", "application/x-lzma", "gzip", "zlib", "bzip2", "bzip",
                "lzma", "xz", "application/zlib", "application/x-brotli", "brotli", "application/zstd", "zstd",
                "x-nope")
#: Bytes a bomb inflates to. Cheap when the worker stops inflating at its message limit; far above the
#: test's memory bound when it does not.
BOMB_BYTES = 512 * 1024 * 1024
NAN, INF = float("nan"), float("inf")

#: A value where the field wants something else. Hypothesis also draws ints, floats and text.
HOSTILE_VALUES: tuple[Any, ...] = (
    None, True, False, 0, -1, 1, 2**31, 2**63, -(2**63) - 1, 10**40, 1.5, -0.0, 1e308, -1e308, NAN, INF, -INF,
    "", " ", "x", "\x00", "\ud800", "9999-12-31T23:59:59", "0001-01-01T00:00:00", "2024-13-45T99:99:99",
    "1e309", "NaN", [], {}, [None], [None, None], [1e308, -1], ["x", "y"], {"a": None}, {"__proto__": {}},
)


@dataclass(frozen=True)
class Deep:
    """A value nested ``depth`` levels (lists, or one-key objects), spliced in at serialization."""

    depth: int
    objects: bool = False

    def json(self) -> str:
        if self.objects:
            return '{"a":' * self.depth + "null" + "}" * self.depth
        return "[" * self.depth + "]" * self.depth

    def msgpack(self) -> bytes:
        return (b"\x81\xa1a" * self.depth + b"\xc0") if self.objects else b"\x91" * self.depth + b"\x90"


@dataclass(frozen=True)
class Huge:
    """A long string value: ``size`` characters."""

    size: int


def _values(value: Any, deep: list[Deep], *, int64: bool = False) -> Any:
    """``value`` with Deep and Huge replaced (Deep by a placeholder string, spliced back by the caller); with
    ``int64``, ints msgpack cannot hold become floats."""
    if int64 and isinstance(value, int) and not isinstance(value, bool) and not -(2**63) <= value < 2**64:
        return float(value)
    if isinstance(value, Deep):
        deep.append(value)
        return f"\x01DEEP{len(deep) - 1}\x01"
    if isinstance(value, Huge):
        return "h" * value.size
    if isinstance(value, dict):
        return {str(k): _values(v, deep, int64=int64) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_values(v, deep, int64=int64) for v in value]
    return value


def to_json(value: Any) -> str:
    """JSON as Python writes it (NaN and Infinity included), with Deep values spliced in."""
    deep: list[Deep] = []
    text = json.dumps(_values(value, deep))
    for i, d in enumerate(deep):
        text = text.replace(json.dumps(f"\x01DEEP{i}\x01"), d.json(), 1)
    return text


def to_msgpack(value: Any) -> bytes:
    deep: list[Deep] = []
    packed = msgpack.packb(_values(value, deep, int64=True), use_bin_type=True, unicode_errors="surrogatepass")
    for i, d in enumerate(deep):
        packed = packed.replace(msgpack.packb(f"\x01DEEP{i}\x01"), d.msgpack(), 1)
    return packed


# -- compression ---------------------------------------------------------------------------------------------

def _repeat_streams(compress: Any, head: bytes, fill: bytes, times: int, tail: bytes) -> bytes:
    """Concatenated streams (gzip, bz2 and lzma decompress them all): ``head + fill * times + tail`` inflated,
    at the cost of compressing ``fill`` once."""
    return compress(head) + compress(fill) * times + compress(tail)


@functools.cache
def bomb(algorithm: str) -> bytes:
    """A body of a few KB that inflates to a ``BOMB_BYTES`` embed job (one text of 'a's) with ``algorithm``."""
    head, tail = b'[["', b'"], {}, {"callbacks": null, "errbacks": null, "chain": null, "chord": null}]'
    chunk = 16 * 1024 * 1024
    fill = b"a" * chunk
    times = BOMB_BYTES // chunk
    if algorithm == "bz2":
        return _repeat_streams(lambda b: bz2.compress(b, 9), head, fill, times, tail)
    if algorithm == "lzma":
        return _repeat_streams(lambda b: lzma.compress(b, preset=1), head, fill, times, tail)
    if algorithm == "zlib":  # one stream only (zlib.decompress stops at the first): repeat a flushed deflate block
        def deflate(data: bytes, mode: int) -> bytes:
            c = zlib.compressobj(9, zlib.DEFLATED, -15)
            return c.compress(data) + c.flush(mode)

        adler = zlib.adler32(head)
        for _ in range(times):
            adler = zlib.adler32(fill, adler)
        adler = zlib.adler32(tail, adler)
        return (b"\x78\xda" + deflate(head, zlib.Z_FULL_FLUSH) + deflate(fill, zlib.Z_FULL_FLUSH) * times
                + deflate(tail, zlib.Z_FINISH) + adler.to_bytes(4, "big"))
    raise ValueError(algorithm)


_COMPRESSORS = {"bz2": bz2.compress, "lzma": lzma.compress, "zlib": zlib.compress}
#: What kombu decompresses each header value with.
_ALGORITHM = {"application/x-gzip": "zlib", "gzip": "zlib", "zlib": "zlib", "application/x-bz2": "bz2",
              "bzip2": "bz2", "bzip": "bz2", "application/x-lzma": "lzma", "lzma": "lzma", "xz": "lzma"}


# -- specs ---------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Junk:
    """Not a kombu envelope at all."""

    data: bytes


@dataclass(frozen=True)
class DeepEntry:
    """JSON nested ``depth`` deep: the whole entry, or one field of an otherwise good envelope."""

    depth: int
    where: str  # "entry", "entry-open" (never closed), "headers", "properties", "delivery_info", "extra" (a new field)
    objects: bool = False


@dataclass(frozen=True)
class CanvasSpec:
    """A Celery canvas in the message's ``embed`` part, of a shape embedq bounds (workers/canvas_rules.py, the
    worker's defaults: 32 signatures, nesting 4 deep, chains of 16, chord_size 10,000, callbacks only to
    ``callback_queue``, no embedq kind or Celery built-in as a callback), within or beyond each bound."""

    shape: str  # callbacks, errbacks, chain, nested, chord, group
    n: int  # signatures, steps, depth or chord_size, by shape
    task: str = "user.store"
    queue: Any = None  # a signature's queue option (None: the worker's callback queue)

    def value(self) -> dict[str, Any]:
        def sig(**options: Any) -> dict[str, Any]:
            if self.queue is not None:
                options.setdefault("queue", self.queue)
            return {"task": self.task, "args": [], "kwargs": {}, "options": options, "subtask_type": None,
                    "immutable": False, "chord_size": None}

        embed: dict[str, Any] = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}
        if self.shape in ("callbacks", "errbacks", "chain"):
            embed[self.shape] = [sig() for _ in range(self.n)]
        elif self.shape == "nested":
            inner = sig()
            for _ in range(self.n - 1):
                inner = sig(link=[inner])
            embed["callbacks"] = [inner]
        elif self.shape == "group":
            embed["callbacks"] = [{"task": "celery.group", "args": [], "kwargs": {"tasks": [sig() for _ in
                                                                                          range(self.n)]},
                                   "options": {}, "subtask_type": "group", "immutable": False}]
        else:  # chord: the part of a made-up group, whose body waits for n parts
            embed["chord"] = {**sig(), "chord_size": self.n}
        return embed

    @property
    def why(self) -> str:
        """Why the worker must refuse it ("" when it is within every bound)."""
        limits = {"callbacks": 32, "errbacks": 32, "chain": 16, "nested": 4, "group": 31, "chord": 10_000}
        if self.n > limits[self.shape]:
            return f"canvas {self.shape} of {self.n}"
        if self.task in EMBEDQ_TASKS or (self.task.startswith("celery.") and self.task not in (
                "celery.group", "celery.chain", "celery.chord")):
            return f"canvas task {self.task}"
        if self.queue not in (None, "celery"):  # the fuzz worker's callback_queue is the default, "celery"
            return f"canvas queue {self.queue!r}"
        return ""


class _Ok:
    """A well-formed part (distinct from every hostile value, None included)."""

    def __repr__(self) -> str:
        return "OK"


OK: Any = _Ok()


@dataclass(frozen=True)
class Message:
    """A Celery task message in kombu's Redis envelope; parts left ``OK`` are well-formed."""

    protocol: int = 2
    task: Any = OK  # OK: embedq.embed
    job_id: Any = OK  # OK: a fresh uuid
    args: Any = OK  # OK: one short good text
    kwargs: Any = OK  # OK: {}
    embed: Any = OK  # OK: Celery's usual {"callbacks": None, ...}
    headers: tuple[tuple[str, Any], ...] = ()  # header values set (or replaced) on top of the usual ones
    serializer: str = "json"  # json, msgpack, pickle, yaml, raw-bytes, deep-json, deep-msgpack
    raw_body: bytes = b""  # the body, for serializer raw-bytes
    content_type: Any = OK  # OK: the serializer's own
    content_encoding: Any = OK  # OK: the serializer's own
    compression: Any = OK  # OK: none; else the compression header's value
    compressed: str = "proper"  # proper, garbage, bomb, plain (header set, body not compressed)
    body_encoding: Any = OK  # OK: base64; "<none>": no body_encoding (the body as text); else the value
    body_mangle: str = ""  # "", bad-base64, body-int, body-list, body-null, body-dict
    delivery_tag: Any = OK  # OK: a fresh uuid; "<dup>": a tag shared by other entries; else the value
    delivery_info: Any = OK  # OK: {"exchange": "", "routing_key": <its queue>}
    properties: tuple[tuple[str, Any], ...] = ()  # extra or replaced properties
    envelope: tuple[tuple[str, Any], ...] = ()  # envelope fields replaced; the value "<drop>" removes one
    queue: int = 0  # index into the worker's lists (online, bulk, their priority lists)

    @property
    def answerable(self) -> bool:
        """The worker can read a job id and track the message, so it owes the job a terminal record: a
        protocol-2 envelope of kombu's shape whose ``headers`` hold a string id, a fresh string delivery tag,
        its delivery info and a base64 body, nested at most a few levels outside the body. Anything else may
        go in the body and the other header values, and the content type, encoding and compression fields
        may hold any JSON value."""
        return (self.protocol == 2 and self.job_id is OK and self.delivery_tag is OK
                and self.delivery_info is OK and not self.envelope and not self.properties
                and self.body_encoding is OK and not self.body_mangle
                and not _deep((self.headers, self.content_type, self.content_encoding, self.compression)))


def _deep(value: Any) -> bool:
    if isinstance(value, Deep):
        return value.depth > 16
    if isinstance(value, dict):
        return any(_deep(v) for v in value.values())
    if isinstance(value, (list, tuple)):
        return any(_deep(v) for v in value)
    return False


@dataclass(frozen=True)
class Entry:
    raw: bytes
    queue: str
    job_id: str | None  # the id the worker can read, when answerable
    answerable: bool
    must_fail: str  # answerable and never runnable (why): only a typed error will do
    spec: Any

    def describe(self, limit: int = 400) -> str:
        text = repr(self.raw[:limit]) + ("..." if len(self.raw) > limit else "")
        return f"{self.spec!r}\n    raw ({len(self.raw)} bytes) on {self.queue!r}: {text}"


def materialize(spec: Any, *, job_id: str, tag: str, queues: list[str]) -> Entry:
    """The bytes of ``spec`` as LPUSHed onto ``queues[spec.queue % len(queues)]``."""
    if isinstance(spec, Junk):
        return Entry(spec.data, queues[0], None, False, "", spec)
    if isinstance(spec, DeepEntry):
        return Entry(_deep_entry(spec, job_id, tag, queues[0]).encode(), queues[0], None, False, "", spec)
    queue = queues[spec.queue % len(queues)]
    raw, why = _message(spec, job_id, tag, queue)
    answerable = spec.answerable
    return Entry(raw, queue, job_id if answerable else None, answerable, why if answerable else "", spec)


def _envelope(job_id: str, tag: str, queue: str, body: str = '"eyJ4IjogMX0="') -> dict[str, Any]:
    return {"body": body, "content-encoding": "utf-8", "content-type": "application/json",
            "headers": {"lang": "py", "task": TASK_NAME, "id": job_id},
            "properties": {"correlation_id": job_id, "delivery_mode": 2, "delivery_tag": tag, "priority": 0,
                           "body_encoding": "base64", "delivery_info": {"exchange": "", "routing_key": queue}}}


def _deep_entry(spec: DeepEntry, job_id: str, tag: str, queue: str) -> str:
    deep = Deep(spec.depth, spec.objects)
    if spec.where == "entry":
        return deep.json()
    if spec.where == "entry-open":
        return ("[" if not spec.objects else '{"a":') * spec.depth
    envelope = _envelope(job_id, tag, queue)
    if spec.where == "headers":
        envelope["headers"]["stamps"] = deep
    elif spec.where == "properties":
        envelope["properties"]["reply_to"] = deep
    elif spec.where == "delivery_info":
        envelope["properties"]["delivery_info"]["exchange_extra"] = deep
    else:
        envelope["extra"] = deep
    return to_json(envelope)


def _given(value: Any, default: Any) -> Any:
    return default if value is OK else value


def _body(spec: Message, job_id: str) -> tuple[bytes, str, str, str]:
    """(body bytes, content type, content encoding, why it cannot be run or "")"""
    args = _given(spec.args, [["a good text"]])
    kwargs = _given(spec.kwargs, {})
    embed = _given(spec.embed, {"callbacks": None, "errbacks": None, "chain": None, "chord": None})
    canvas_why = ""
    if isinstance(embed, CanvasSpec):
        embed, canvas_why = embed.value(), embed.why if spec.protocol == 2 else ""
    if spec.protocol == 2:
        value: Any = [args, kwargs, embed]
    else:
        value = {"task": _given(spec.task, TASK_NAME), "id": _given(spec.job_id, job_id), "args": args,
                 "kwargs": kwargs, "retries": 0, "eta": None, "expires": None, "utc": True, "callbacks": None,
                 "errbacks": None, "timelimit": [None, None], "taskset": None, "chord": None, **dict(spec.headers)}
    s = spec.serializer
    if s == "json":
        return to_json(value).encode("utf-8", "surrogatepass"), "application/json", "utf-8", canvas_why
    if s == "msgpack":
        return to_msgpack(value), "application/x-msgpack", "binary", canvas_why
    if s == "pickle":
        return pickle.dumps(value), "application/x-python-serialize", "binary", "pickle"
    if s == "yaml":
        return b"- [['a good text']]\n- {}\n- {}\n", "application/x-yaml", "utf-8", "yaml"
    if s == "deep-json":
        return to_json([Deep(5000), {}, {}]).encode(), "application/json", "utf-8", "arguments 5,000 deep"
    if s == "deep-msgpack":
        return to_msgpack([Deep(5000), {}, {}]), "application/x-msgpack", "binary", "arguments 5,000 deep"
    try:
        json.loads(spec.raw_body)
        why = ""
    except ValueError:
        why = "not JSON"
    return spec.raw_body, "application/json", "utf-8", why


def _message(spec: Message, job_id: str, tag: str, queue: str) -> tuple[bytes, str]:
    """(the entry, why an answerable one must end with a typed error, or "")"""
    body, content_type, content_encoding, why = _body(spec, job_id)
    if spec.compression is not OK:
        algorithm = _ALGORITHM.get(spec.compression) if isinstance(spec.compression, str) else None
        if not spec.compression:
            pass  # null, false, 0, "": kombu reads no compression; refusing the header is as right
        elif algorithm is None:
            why = f"unknown compression {spec.compression!r}"
        elif spec.compressed == "bomb":
            body, why = bomb(algorithm), f"a {algorithm} bomb"
        elif spec.compressed == "proper":
            body = _COMPRESSORS[algorithm](body)
        elif spec.compressed == "garbage":
            body, why = b"\x1f\x8b\x08\x00garbage" + body[:32], "garbage compressed body"
        else:
            why = "compression header on a plain body"
    task = _given(spec.task, TASK_NAME)
    if not isinstance(task, str) or task not in EMBEDQ_TASKS:
        why = f"task {task!r}"
    if spec.content_type is not OK and spec.content_type not in ("application/json", "application/x-msgpack"):
        why = f"content type {spec.content_type!r}"
    headers: dict[str, Any] = {
        "lang": "py", "task": task, "id": _given(spec.job_id, job_id), "shadow": None, "eta": None,
        "expires": None, "group": None, "group_index": None, "retries": 0, "timelimit": [None, None],
        "root_id": job_id, "parent_id": None, "argsrepr": "", "kwargsrepr": "", "origin": "fuzz",
        "ignore_result": False,
    } if spec.protocol == 2 else {}
    headers.update(dict(spec.headers) if spec.protocol == 2 else {})
    if spec.compression is not OK:
        headers["compression"] = spec.compression
    if spec.body_encoding is OK:
        body_field: Any = base64.b64encode(body).decode()
    else:
        body_field = body.decode("utf-8", "replace")
    body_field = {"bad-base64": "%%%not base64%%%", "body-int": 12345, "body-list": [body_field],
                  "body-null": None, "body-dict": {"b": body_field}}.get(spec.body_mangle, body_field)
    properties: dict[str, Any] = {
        "correlation_id": job_id, "reply_to": None, "delivery_mode": 2, "priority": 0,
        "delivery_tag": {"<dup>": "fuzz-dup-tag"}.get(spec.delivery_tag, tag) if spec.delivery_tag is OK
        or spec.delivery_tag == "<dup>" else spec.delivery_tag,
        "delivery_info": _given(spec.delivery_info, {"exchange": "", "routing_key": queue}),
    }
    if spec.body_encoding is OK:
        properties["body_encoding"] = "base64"
    elif spec.body_encoding != "<none>":
        properties["body_encoding"] = spec.body_encoding
    properties.update(dict(spec.properties))
    envelope: dict[str, Any] = {
        "body": body_field,
        "content-encoding": _given(spec.content_encoding, content_encoding),
        "content-type": _given(spec.content_type, content_type),
        "headers": headers, "properties": properties,
    }
    for key, value in spec.envelope:
        if value == "<drop>":
            envelope.pop(key, None)
        else:
            envelope[key] = value
    return to_json(envelope).encode("utf-8", "surrogatepass"), why


# -- strategies ----------------------------------------------------------------------------------------------

DEPTHS = st.sampled_from([200, 600, 800, 900, 950, 990, 1_000, 1_500, 3_000, 20_000, 200_000])
deep_values = st.builds(Deep, DEPTHS, st.booleans())
scalars = st.one_of(st.sampled_from(HOSTILE_VALUES), st.integers(), st.floats(), st.text(max_size=12))
hostile = st.one_of(
    scalars,
    st.lists(scalars, max_size=4),
    st.dictionaries(st.text(max_size=8), scalars, max_size=3),
    deep_values,
    st.builds(Huge, st.sampled_from([10_000, 200_000])),
)
text_items = st.one_of(st.just("a good text"), st.text(max_size=30), scalars, deep_values,
                       st.builds(Huge, st.sampled_from([5_000, 120_000])))
args_values = st.one_of(
    st.lists(st.text(min_size=1, max_size=40), min_size=1, max_size=8).map(lambda texts: [texts]),  # any text
    st.lists(text_items, min_size=1, max_size=4).map(lambda texts: [texts]),  # one list of (maybe bad) texts
    st.lists(st.lists(text_items, max_size=3), max_size=3),  # several positional lists
    st.sampled_from([[], [[]], [["q", ["d1", "d2"]]], [["a"] * 3000], [[["a", "b"]] * 3]]),
    hostile,
)
OPTION_NAMES = ("normalize", "truncate", "truncation_side", "prompt", "prompt_name", "dimensions", "encoding",
                "model", "v", "kind", "top_k", "raw_scores", "return_text", "skip_special_tokens", "outputs",
                "long_inputs", "window_overlap", "pool_windows", "nested", "__class__")
kwargs_values = st.one_of(
    st.dictionaries(st.sampled_from(OPTION_NAMES), st.one_of(hostile, st.dictionaries(st.text(max_size=4), hostile,
                                                                                       max_size=2)), max_size=3),
    st.sampled_from([{"dimensions": 10**30}, {"dimensions": 2**63}, {"prompt": Huge(2_000_000)}, {"v": NAN},
                     {"normalize": None}, {"prompt_name": Deep(950)}, {"encoding": ["float32"]},
                     {"long_inputs": "windows", "window_overlap": 10**30},
                     {"long_inputs": "windows", "window_overlap": -1},
                     {"long_inputs": "windows", "pool_windows": "no"}, {"long_inputs": "windows", "truncate": NAN},
                     {"long_inputs": "windows", "prompt": Huge(2_000_000)}, {"long_inputs": ["windows"]}]),
    hostile,
)
HEADER_NAMES = ("expires", "eta", "timelimit", "retries", "shadow", "root_id", "parent_id", "group", "group_index",
                "argsrepr", "kwargsrepr", "origin", "embedq_client", "ignore_result", "redelivered", "embedq_resent",
                "embedq_sent_at", "stamps", "stamped_headers", "replaced_task_nesting", "lang", "priority",
                "reply_to", "correlation_id", "chord", "periodic_task_name")
header_values = st.one_of(
    hostile,
    st.sampled_from(["9999-12-31T23:59:59", "9999-12-31T23:59:59+00:00", "2000-01-01T00:00:00",
                     "1970-01-01T00:00:00+14:00", "0001-01-01T00:00:00", 10**20, 1e300, -1e300, [1e300, 1e300],
                     [NAN, NAN], [-1, -1], [0, 0], 2**64, -(2**64)]),
)
#: Canvases of the shapes embedq bounds, within and beyond each bound (issue 50).
canvas_specs = st.one_of(
    st.builds(CanvasSpec, st.sampled_from(["callbacks", "errbacks"]), st.sampled_from([1, 20, 32, 33, 500])),
    st.builds(CanvasSpec, st.just("chain"), st.sampled_from([1, 16, 17, 3000])),
    st.builds(CanvasSpec, st.just("nested"), st.sampled_from([2, 4, 5, 60])),
    st.builds(CanvasSpec, st.just("group"), st.sampled_from([2, 31, 40])),
    st.builds(CanvasSpec, st.just("chord"), st.sampled_from([3, 10_000, 10_001, 10**9])),
    st.builds(CanvasSpec, st.sampled_from(["callbacks", "chain", "nested", "chord"]), st.just(2),
              st.sampled_from(["user.store", TASK_NAME, "embedq.rerank", "celery.accumulate", "celery.chord_unlock"]),
              st.sampled_from([None, None, "celery", "hostile.queue", ["x"]])),
)
embed_values = st.one_of(
    canvas_specs, canvas_specs,
    hostile,
    st.fixed_dictionaries({"callbacks": st.sampled_from([None, [{"task": "celery.accumulate", "args": [1]}],
                                                         "x", [None]])}),
    st.fixed_dictionaries({"chord": st.sampled_from([None, {"task": "celery.chord_unlock"}, 5]),
                           "chain": st.sampled_from([None, [{"task": "celery.backend_cleanup"}], {}])}),
)
task_names = st.one_of(
    st.just(TASK_NAME), st.sampled_from(EMBEDQ_TASKS), st.sampled_from(BUILTIN_TASKS),
    st.sampled_from(["embedq.embedd", "celery.ping", "celery.backend_cleanup ", "", "os.system", "embedq"]),
    st.text(max_size=20), scalars,
)
QUEUES = 6  # online, bulk, and priority lists of the online queue (see test_fuzz_messages.queue_lists)

#: The hostile value of each part of a message. A message has a few hostile parts (none to four), the rest
#: well-formed, so each part's handling is reached with the others right.
PARTS: dict[str, st.SearchStrategy] = {
    "task": task_names,
    "job_id": hostile,
    "args": args_values,
    "kwargs": kwargs_values,
    "embed": embed_values,
    "headers": st.lists(st.tuples(st.sampled_from(("expires", "eta", "timelimit", "retries", *HEADER_NAMES)),
                                  header_values), min_size=1, max_size=3).map(tuple),
    "serializer": st.sampled_from(["msgpack", "pickle", "yaml", "raw-bytes", "deep-json", "deep-msgpack"]),
    "raw_body": st.binary(max_size=40),
    "content_type": st.one_of(st.sampled_from(["application/json", "application/x-msgpack", "application/data",
                                               "application/x-python-serialize", "application/x-yaml",
                                               "text/plain", ""]), scalars),
    "content_encoding": st.one_of(st.sampled_from(["utf-8", "binary", "latin-1", "rot13", "utf-16", "x-nope"]),
                                  scalars),
    "compression": st.one_of(st.sampled_from(COMPRESSIONS), scalars),
    "compressed": st.sampled_from(["garbage", "bomb", "bomb", "plain"]),
    "body_encoding": st.one_of(st.sampled_from(["<none>", "base32", "none", ""]), scalars),
    "body_mangle": st.sampled_from(["bad-base64", "body-int", "body-list", "body-null", "body-dict"]),
    "delivery_tag": st.one_of(st.just("<dup>"), scalars),
    "delivery_info": st.one_of(
        hostile,
        st.fixed_dictionaries({"exchange": scalars, "routing_key": st.just("embedq.fuzz.elsewhere")}),
        st.fixed_dictionaries({"exchange": st.just(""), "routing_key": scalars}),
        st.fixed_dictionaries({"exchange": st.just(""), "routing_key": st.just("x"), "redelivered": scalars}),
    ),
    "properties": st.lists(st.tuples(st.sampled_from(["priority", "reply_to", "correlation_id", "delivery_mode",
                                                      "body_encoding", "expiration"]), scalars),
                           min_size=1, max_size=2).map(tuple),
    "envelope": st.lists(st.tuples(st.sampled_from(["body", "content-type", "content-encoding", "headers",
                                                    "properties", "extra"]),
                                   st.one_of(st.just("<drop>"), hostile)), min_size=1, max_size=2).map(tuple),
}
#: Parts drawn more often than others: what a job carries (arguments, options, headers) and the task name.
_PART_NAMES = [*PARTS, "args", "args", "kwargs", "kwargs", "headers", "headers", "headers", "task", "compression",
               "embed", "embed", "embed"]  # embed: the canvas shapes of issue 50


@st.composite
def messages(draw: Any) -> Message:
    names = draw(st.lists(st.sampled_from(_PART_NAMES), max_size=4))
    parts = {name: draw(PARTS[name]) for name in dict.fromkeys(names)}
    if "compressed" in parts and "compression" not in parts:
        parts["compression"] = draw(st.sampled_from(COMPRESSIONS[:9]))  # a bomb or garbage needs a known one
    return Message(protocol=draw(st.sampled_from([2, 2, 2, 1])), queue=draw(st.integers(0, QUEUES - 1)), **parts)


junk = st.builds(Junk, st.one_of(
    st.binary(max_size=64),
    st.text(max_size=40).map(lambda t: t.encode("utf-8", "surrogatepass")),
    st.sampled_from([b"", b"null", b"[]", b"{}", b"1e999", b"NaN", b'"x"', b"[1, 2, 3]", b'{"body": "eA=="}',
                     b'{"properties": {}}', b'{"properties": {"delivery_tag": "t"}}', b'{"properties": []}',
                     b'{"body": "eA==", "properties": {"delivery_tag": "t", "delivery_info": {}}}']),
))
deep_entries = st.builds(DeepEntry, DEPTHS,
                         st.sampled_from(["entry", "entry-open", "headers", "properties", "delivery_info", "extra"]),
                         st.booleans())
#: One hostile entry: mostly Celery messages with one or a few bad parts.
entries = st.one_of(junk, deep_entries, *[messages().map(lambda m, _i=i: m) for i in range(6)])


def fresh_id(batch: int, index: int, run: str) -> str:
    """Deterministic per test run, unique across runs (``run``) and entries."""
    return str(uuid.uuid5(uuid.NAMESPACE_URL, f"embedq-fuzz/{run}/{batch}/{index}"))


#: Entries that broke a worker once (issue 35), sent first on every run whatever hypothesis draws.
REGRESSIONS: tuple[Any, ...] = (
    # nesting deeper than the recursion limit in the envelope: RecursionError in the transport stopped the worker
    DeepEntry(20_000, "entry"), DeepEntry(1_500, "properties", objects=True), DeepEntry(200_000, "entry-open"),
    # compression bombs: kombu inflated 512 MiB before any size check
    *(Message(compression=name, compressed="bomb") for name in ("application/x-bz2", "application/x-gzip",
                                                                  "application/x-lzma")),
    # Celery's built-in tasks ran on embedq's queues
    *(Message(task=name) for name in BUILTIN_TASKS),
    # a delivery tag redis-py cannot write (DataError): the consumer dropped its broker connection
    Message(delivery_tag=None), Message(delivery_tag=[]), Message(delivery_tag=True),
    # a far deadline: OverflowError in the inference thread's wait, which died
    Message(headers=(("expires", "9999-12-31T23:59:59"),)), Message(headers=(("eta", "9999-12-31T23:59:59"),)),
    # unhashable task, shadow name and routing key; an id Redis cannot take (a lone surrogate)
    Message(task={}), Message(headers=(("shadow", ["x"]),)), Message(delivery_info={"exchange": "", "routing_key": {}}),
    Message(job_id="\ud800"), Message(job_id="\ud800", compression="x-nope"),
    # a content type or encoding that is not a string, on a message whose id is readable
    Message(content_type=5), Message(content_encoding=0.0),
    # issue 50: a chain of 3,000 embed steps (3,001 jobs), a self-link, a chord part waiting for 1e9 parts, a
    # callback to a queue nobody allowed (a binding key for good)
    Message(embed=CanvasSpec("chain", 3000, TASK_NAME)), Message(embed=CanvasSpec("callbacks", 1, TASK_NAME)),
    Message(embed=CanvasSpec("chord", 10**9)), Message(embed=CanvasSpec("callbacks", 1, queue="hostile.queue")),
)
