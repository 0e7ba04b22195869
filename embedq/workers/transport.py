"""kombu's Redis transport, hardened for a worker that consumes queues anyone with Redis access can write.

A queue is a plain Redis list. An entry that is not a kombu envelope (``LPUSH embedq.x garbage``) makes
kombu's ``_brpop_read`` raise inside the event loop, which Celery treats as an unrecoverable error: one
bad entry would stop every worker of the queue in turn. This channel drops such an entry with a warning
that names only the reason (the entry may hold users' texts) and goes on. It carries no job id, so there
is no one to answer; well-formed messages with bad contents are answered with typed errors by
:mod:`embedq.workers.consumer`.

Everything an entry carries is read within bounds before kombu sees it (:class:`Message`): the envelope
must have kombu's shape (a non-empty string delivery tag, mappings where kombu expects them), nesting deeper
than Python's recursion limit is an unreadable entry like any other, and a compressed body is inflated here,
in steps, never past :data:`max_body_bytes`: kombu itself inflates the whole body before anyone can look at
its size, so a 400-byte bz2 entry could take gigabytes. A body that would inflate further, or a compression
this module cannot bound, reaches the consumer as :attr:`Message.refusal` (a typed error for the job's id).

It also decides which of its queues a BRPOP asks, and in which order: :data:`fetch_order` (set by the
worker) names the queues the prefetch window admits now, online before bulk. kombu's own order is a
round robin, under which a worker saturated with bulk jobs would take an online job only every other
fetch, and only once a bulk job freed room.
"""

from __future__ import annotations

import bz2
import logging
import lzma
import zlib
from collections.abc import Callable
from queue import Empty
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.transport import redis as kombu_redis

from embedq import errors

log = logging.getLogger(__name__)

# JSON, UTF-8 and envelope errors; RecursionError: nesting deeper than the interpreter's limit.
_UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)

#: Set by the worker: the most bytes a message body may have once inflated (``EMBEDQ_MAX_MESSAGE_BYTES``).
max_body_bytes: int = 16 * 1024 * 1024

#: Compressions a message may use (kombu's names and aliases), each with an incremental decompressor.
_DECOMPRESSORS: dict[str, Callable[[], Any]] = {
    **dict.fromkeys(("application/x-gzip", "gzip", "zlib"), lambda: zlib.decompressobj(zlib.MAX_WBITS | 32)),
    **dict.fromkeys(("application/x-bz2", "bzip2", "bzip"), bz2.BZ2Decompressor),
    **dict.fromkeys(("application/x-lzma", "lzma", "xz"), lzma.LZMADecompressor),
}
_STEP = 1 << 20  # bytes inflated per step


class _Unreadable(ValueError):
    """An entry that is not a kombu envelope: dropped with a warning."""


def inflate(body: bytes, compression: str, limit: int) -> bytes:
    """``body`` decompressed with ``compression``, refusing (:class:`~embedq.errors.MessageTooLarge`) before
    more than ``limit`` bytes are allocated. Raises :class:`~embedq.errors.InvalidMessage` for a compression
    it does not know or a body that is not valid for it."""
    factory = _DECOMPRESSORS.get(compression)
    if factory is None:
        raise errors.InvalidMessage(
            f"compression {compression[:40]!r} is not accepted (accepted: gzip/zlib, bz2, lzma)")
    out = bytearray()
    try:
        while True:  # one stream (gzip member, bz2 stream) after another, as the one-shot decompressors read them
            decompressor = factory()
            chunk = decompressor.decompress(body, _STEP)
            while True:
                out += chunk
                if len(out) > limit:
                    raise errors.MessageTooLarge(
                        f"the message body inflates to more than {limit} bytes (EMBEDQ_MAX_MESSAGE_BYTES)")
                if _finished(decompressor):
                    break
                chunk = decompressor.decompress(getattr(decompressor, "unconsumed_tail", b""), _STEP)
                if not chunk:
                    break
            body = decompressor.unused_data if decompressor.eof else b""
            if not body:
                break
    except (zlib.error, OSError, EOFError, lzma.LZMAError, ValueError) as exc:
        raise errors.InvalidMessage(
            f"the {compression[:40]} body cannot be decompressed ({type(exc).__name__})") from None
    return bytes(out)


def _finished(decompressor: Any) -> bool:
    if isinstance(decompressor, (bz2.BZ2Decompressor, lzma.LZMADecompressor)):
        return decompressor.eof or decompressor.needs_input
    return decompressor.eof or not decompressor.unconsumed_tail


class Message(virtual.Message):
    """kombu's message, built only from an envelope of kombu's shape, with a compressed body inflated within
    :data:`max_body_bytes`. ``refusal``: the typed error of a body that could not be read that way (the consumer
    answers the job with it and acknowledges the message)."""

    refusal: errors.EmbedqError | None = None

    def __init__(self, payload: Any, channel: Any = None, **kwargs: Any) -> None:
        if not isinstance(payload, dict):
            raise _Unreadable("the entry is not a mapping")
        properties = payload.get("properties")
        if not isinstance(properties, dict):
            raise _Unreadable("no properties")
        tag = properties.get("delivery_tag")
        if not isinstance(tag, str) or not tag:
            raise _Unreadable("no delivery tag")
        for key in ("delivery_info",):
            if properties.get(key) is not None and not isinstance(properties[key], dict):
                raise _Unreadable(f"{key} is not a mapping")
        headers = payload.get("headers")
        if headers is not None and not isinstance(headers, dict):
            raise _Unreadable("headers is not a mapping")
        for key in ("body_encoding",):
            if properties.get(key) is not None and not isinstance(properties[key], str):
                raise _Unreadable(f"{key} is not a string")
        refusal = None
        for key in ("content-type", "content-encoding"):  # a job that can be named is answered (below)
            if payload.get(key) is not None and not isinstance(payload[key], str):
                refusal = errors.InvalidMessage(f"the message's {key} is not a string")
                payload = {**payload, key: None}
        body = payload.get("body")
        if body is not None and not isinstance(body, (str, bytes)):
            raise _Unreadable("the body is not a string")
        compression = headers.get("compression") if headers else None
        if refusal is not None:
            super().__init__({**payload, "body": None}, channel=channel, **kwargs)
            self._raw = payload
        elif compression is not None:
            # Inflate here, within bounds, and hand kombu the plain body (without the header: it would inflate
            # it again). The envelope is left as it came, so a message handed back keeps its compressed body.
            try:
                if not isinstance(compression, str):
                    raise errors.InvalidMessage("the compression header is not a string")
                raw = channel.decode_body(body, properties.get("body_encoding")) if body else b""
                plain = inflate(raw if isinstance(raw, bytes) else raw.encode("utf-8", "surrogateescape"),
                                compression, max_body_bytes)
            except errors.EmbedqError as exc:
                refusal, plain = exc, b""
            except Exception as exc:  # a bad base64 body, say: the job gets a typed error
                refusal, plain = errors.InvalidMessage(f"cannot read the compressed body ({type(exc).__name__})"), b""
            payload = {**payload, "body": None, "headers": {k: v for k, v in headers.items() if k != "compression"}}
            super().__init__(payload, channel=channel, **kwargs)
            self._raw = {**payload, "body": body, "headers": headers}
            self.body = plain
        else:
            super().__init__(payload, channel=channel, **kwargs)
        self.refusal = refusal


#: Set by the worker: given a channel's queues, those to fetch from now, in the order to ask them.
fetch_order: Callable[[list[str]], list[str]] | None = None


class _FetchOrder:
    """Stands in for kombu's queue cycle: ``consume`` returns what :data:`fetch_order` admits now."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def update(self, queues: Any) -> None:
        pass

    def consume(self, n: int) -> list[str]:
        return self.channel.fetchable()

    def rotate(self, last_used: Any) -> None:
        pass


class QoS(kombu_redis.QoS):
    def can_consume(self) -> bool:
        if not super().can_consume():
            return False
        channel = self.channel
        return not channel.active_queues or bool(channel.fetchable())


class Channel(kombu_redis.Channel):
    QoS = QoS
    Message = Message

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue_cycle = _FetchOrder(self)

    def fetchable(self) -> list[str]:
        queues = self.active_queues
        return queues if fetch_order is None or not queues else fetch_order(queues)

    def _brpop_read(self, **options: Any) -> Any:
        try:
            return super()._brpop_read(**options)
        except _UNREADABLE as exc:
            log.warning("dropped a queue entry that is not a task message (%s)", type(exc).__name__)
            raise Empty() from None


class Transport(kombu_redis.Transport):
    Channel = Channel


def install() -> None:
    """Make ``redis://`` and ``rediss://`` URLs use this transport in this process (workers only)."""
    for scheme in ("redis", "rediss"):
        TRANSPORT_ALIASES[scheme] = f"{__name__}:Transport"
