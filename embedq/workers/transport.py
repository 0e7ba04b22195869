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
in steps, never past :attr:`FetchPolicy.max_body_bytes`: kombu itself inflates the whole body before anyone can
look at its size, so a 400-byte bz2 entry could take gigabytes. A body that would inflate further, or a compression
this module cannot bound, reaches the consumer as :attr:`Message.refusal` (a typed error for the job's id).

It also decides which of its queues a BRPOP asks, and in which order: :attr:`FetchPolicy.order` (the worker's)
names the queues the prefetch window admits now, online before bulk. kombu's own order is a
round robin, under which a worker saturated with bulk jobs would take an online job only every other
fetch, and only once a bulk job freed room.

**Many messages per round trip.** kombu takes one message per BRPOP and records it in the ``unacked`` hash with
a second round trip; at a few hundred microseconds of client CPU each, that alone bounded a worker to a few
thousand one-text jobs a second. Once a BRPOP has brought a message, :meth:`Channel._fetch_more` takes up to
:attr:`FetchPolicy.plan` more (the worker sizes it from its prefetch window, online queues first) with one Lua script
that pops each and records it in ``unacked`` and its index *in the same atomic step*, exactly as kombu's
``QoS.append`` would (so kombu's visibility timeout, ``restore_visible`` and ``restore_by_tag`` see them like any
other delivered message, and a SIGKILL between the pop and the record cannot lose one). Acknowledgements go in
batches too (:func:`ack_many`: one pipeline for many tags).

What the worker decides reaches the channel as one :class:`FetchPolicy`, given to :func:`install` (which makes
``redis://``, ``rediss://`` and ``sentinel://`` URLs use a transport that carries it): no module state is set from
outside. :class:`SentinelChannel` is the same channel on the primary Redis Sentinel names (kombu's Sentinel channel
makes its connection pool).
"""

from __future__ import annotations

import bz2
import contextlib
import logging
import lzma
import time
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from queue import Empty
from typing import Any

from kombu.transport import TRANSPORT_ALIASES, virtual
from kombu.transport import redis as kombu_redis
from kombu.utils.json import loads

from embedq import errors
from embedq.broker import sentinel_retry

log = logging.getLogger(__name__)

# JSON, UTF-8 and envelope errors; RecursionError: nesting deeper than the interpreter's limit.
_UNREADABLE = (ValueError, TypeError, KeyError, AttributeError, IndexError, RecursionError)

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
    its transport's :attr:`FetchPolicy.max_body_bytes`. ``refusal``: the typed error of a body that could not be
    read that way (the consumer answers the job with it and acknowledges the message)."""

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
                                compression, _policy(channel).max_body_bytes)
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


@dataclass(frozen=True)
class FetchPolicy:
    """What the worker tells its transport (:func:`install`). The defaults are kombu's own behaviour: its queue
    order, one message per round trip."""

    #: Given a channel's queues, those to fetch from now, in the order to ask them (None: all, kombu's order).
    order: Callable[[list[str]], list[str]] | None = None
    #: Given a channel's queues, how many more messages to take right after a BRPOP brought one: (queues, most)
    #: groups in the order to take them (each group's queues share its count). None or empty: one message per
    #: round trip.
    plan: Callable[[list[str]], list[tuple[list[str], int]]] | None = None
    #: May one more message from this queue be taken now (the prefetch window's admits)? Asked before each message
    #: of a fetch of many is delivered; the rest of the fetch goes back when it says no.
    admits: Callable[[str], bool] | None = None
    #: Called once the messages of a fetch have all been delivered (the worker tokenizes them together then).
    after_fetch: Callable[[], None] | None = None
    #: The most bytes a message body may have once inflated (``EMBEDQ_MAX_MESSAGE_BYTES``).
    max_body_bytes: int = 16 * 1024 * 1024
    #: The most bytes of queue entries one fetch of many may bring (``EMBEDQ_MAX_MESSAGE_BYTES``, so a fetch holds
    #: at most about one largest message beyond the BRPOP's), whatever its count allows.
    fetch_bytes: int = 16 * 1024 * 1024


def _policy(channel: Any) -> FetchPolicy:
    """The policy of the transport ``channel`` belongs to (kombu's default one where it is not ours)."""
    return getattr(getattr(channel, "connection", None), "policy", None) or FetchPolicy()


class _FetchOrder:
    """Stands in for kombu's queue cycle: ``consume`` returns what the policy's ``order`` admits now."""

    def __init__(self, channel: Channel) -> None:
        self.channel = channel

    def update(self, queues: Any) -> None:
        pass

    def consume(self, n: int) -> list[str]:
        return self.channel.fetchable()

    def rotate(self, last_used: Any) -> None:
        pass


class QoS(kombu_redis.QoS):
    def append(self, message: Any, delivery_tag: str) -> None:
        recorded = getattr(self.channel, "_recorded", None)
        if recorded and delivery_tag in recorded:  # _FETCH_MORE recorded it with the pop
            recorded.discard(delivery_tag)
            virtual.QoS.append(self, message, delivery_tag)
            return
        super().append(message, delivery_tag)

    def can_consume(self) -> bool:
        if not super().can_consume():
            return False
        channel = self.channel
        return not channel.active_queues or bool(channel.fetchable())


#: Pop entries from the lists KEYS[3..], in order, and record each in kombu's unacked hash (KEYS[1]) and index
#: (KEYS[2]) at time ARGV[1], as kombu's QoS.append does. ARGV[2] = the most bytes of entries to take (an entry that
#: would pass it goes back where it was, unread, and the fetch ends: the next BRPOP takes it), ARGV[3] = G groups,
#: ARGV[4..3+G] = the most each group may take, then one group number per list (a queue's priority lists, or a
#: class's queues, share a group). The record is the one kombu writes: [envelope, exchange, routing key]. An entry
#: without a string delivery tag and delivery info is returned unrecorded (the worker drops it, as it drops one from
#: BRPOP). Returns key, entry, tag-or-"" triples.
_FETCH_MORE = """
local out = {}
local room = tonumber(ARGV[2])
local groups = tonumber(ARGV[3])
local left = {}
for g = 1, groups do left[g] = tonumber(ARGV[3 + g]) end
for i = 3, #KEYS do
  local g = tonumber(ARGV[groups + i + 1])
  while left[g] > 0 do
    local item = redis.call('RPOP', KEYS[i])
    if not item then break end
    if #item > room then
      redis.call('RPUSH', KEYS[i], item)
      return out
    end
    room = room - #item
    left[g] = left[g] - 1
    local tag = ''
    local ok, env = pcall(cjson.decode, item)
    if ok and type(env) == 'table' and type(env.properties) == 'table' then
      local props = env.properties
      local info = props.delivery_info
      if type(props.delivery_tag) == 'string' and props.delivery_tag ~= '' and type(info) == 'table'
          and type(info.exchange) == 'string' and type(info.routing_key) == 'string' then
        tag = props.delivery_tag
        redis.call('ZADD', KEYS[2], ARGV[1], tag)
        redis.call('HSET', KEYS[1], tag,
                   '[' .. item .. ',' .. cjson.encode(info.exchange) .. ',' .. cjson.encode(info.routing_key) .. ']')
      end
    end
    out[#out + 1] = KEYS[i]
    out[#out + 1] = item
    out[#out + 1] = tag
  end
end
return out
"""


class Channel(kombu_redis.Channel):
    QoS = QoS
    Message = Message

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._queue_cycle = _FetchOrder(self)
        self._recorded: set[str] = set()  # tags _FETCH_MORE already put in the unacked hash (see QoS.append)
        self._fetch_script: Any = None
        self.policy = _policy(self)

    def fetchable(self) -> list[str]:
        queues, order = self.active_queues, self.policy.order
        return queues if order is None or not queues else order(queues)

    def _brpop_read(self, **options: Any) -> Any:
        try:
            delivered = super()._brpop_read(**options)
        except _UNREADABLE as exc:
            log.warning("dropped a queue entry that is not a task message (%s)", type(exc).__name__)
            raise Empty() from None
        policy = self.policy
        if delivered and policy.plan is not None and self.active_queues:
            self._fetch_more(policy.plan(list(self.active_queues)))
        if delivered and policy.after_fetch is not None:
            policy.after_fetch()
        return delivered

    def _fetch_more(self, plan: list[tuple[list[str], int]]) -> int:
        """Take up to ``plan``'s counts more messages in one round trip, recorded as delivered, and deliver them
        (each goes through the consumer's handler, as one from BRPOP does). Returns how many were delivered."""
        plan = [(queues, n) for queues, n in plan if n > 0 and queues]
        keys: list[str] = []
        group_of: list[int] = []
        for g, (queues, _) in enumerate(plan, start=1):
            for pri in self.priority_steps:  # kombu's BRPOP order within a class: priority first, then queue
                for queue in queues:
                    keys.append(self._q_for_pri(queue, pri))
                    group_of.append(g)
        if not keys:
            return 0
        most = [len(plan), *(n for _, n in plan), *group_of]
        try:
            with self.conn_or_acquire() as client:
                if self._fetch_script is None:
                    self._fetch_script = client.register_script(_FETCH_MORE)
                reply = self._fetch_script(keys=[self.unacked_key, self.unacked_index_key, *keys],
                                           args=[time.time(), self.policy.fetch_bytes, *most], client=client)
        except (*self.connection_errors, kombu_redis.redis.exceptions.ResponseError) as exc:
            # Either nothing was taken (the script is atomic), or the reply was lost with the connection: what it
            # took is in the unacked hash and comes back after visibility_timeout. kombu reconnects at the next
            # BRPOP.
            log.warning("could not fetch more messages at once (%s)", type(exc).__name__)
            return 0
        delivered = 0
        entries = [tuple(_text(x) for x in reply[i:i + 3]) for i in range(0, len(reply), 3)]
        admits = self.policy.admits
        for n, (key, item, tag) in enumerate(entries):
            dest = key.rsplit(self.sep, 1)[0] if self.sep in key else key
            if admits is not None and not admits(dest):
                # The window is full (the burst held more than its estimate): the rest goes back, unseen.
                self._put_back(entries[n:])
                break
            if tag:
                self._recorded.add(tag)
            try:
                self.connection._deliver(loads(item), dest)
                delivered += 1
            except _UNREADABLE as exc:
                log.warning("dropped a queue entry that is not a task message (%s)", type(exc).__name__)
                if tag:  # recorded, but kombu cannot read it: nothing would ever acknowledge it
                    self._recorded.discard(tag)
                    with contextlib.suppress(*self.connection_errors), self.conn_or_acquire() as client:
                        client.pipeline().zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag).execute()
        return delivered


    def _put_back(self, entries: list[tuple[str, str, str]]) -> None:
        """Return fetched entries to the heads of their lists, in their order and as they came (not marked
        redelivered: no worker ran them), and withdraw their records, in one transaction. If that fails they stay
        recorded and come back after visibility_timeout."""
        try:
            with self.conn_or_acquire() as client:
                pipe = client.pipeline(transaction=True)
                for key, item, tag in reversed(entries):  # RPUSH the newest first: the oldest ends next to pop
                    if tag:
                        pipe.rpush(key, item)
                        pipe.zrem(self.unacked_index_key, tag).hdel(self.unacked_key, tag)
                pipe.execute()
        except self.connection_errors as exc:
            log.warning("could not hand %d fetched messages back at once (%s); they come back after the visibility "
                        "timeout", len(entries), type(exc).__name__)
        dropped = sum(1 for _, _, tag in entries if not tag)
        if dropped:
            log.warning("dropped %d queue entries that are not task messages", dropped)


def _text(value: Any) -> str:
    return value.decode("utf-8", "surrogateescape") if isinstance(value, bytes) else value


def ack_many(messages: list[Any]) -> list[Any]:
    """Acknowledge kombu Redis messages in one pipeline per channel (kombu sends one per message). Returns the
    messages it could not acknowledge (their channel is gone or the broker is away): the caller acknowledges those
    one by one through the current channel, or leaves them to be redelivered."""
    by_channel: dict[int, tuple[Any, list[Any]]] = {}
    for message in messages:
        if not message.acknowledged:
            by_channel.setdefault(id(message.channel), (message.channel, []))[1].append(message)
    failed: list[Any] = []
    for channel, batch in by_channel.values():
        qos = channel.qos
        try:
            with channel.conn_or_acquire() as client:
                pipe = client.pipeline()
                for message in batch:
                    pipe.zrem(qos.unacked_index_key, message.delivery_tag).hdel(qos.unacked_key, message.delivery_tag)
                pipe.execute()
        except Exception:
            failed.extend(batch)
            continue
        for message in batch:
            virtual.QoS.ack(qos, message.delivery_tag)
            message._state = "ACK"
    return failed


class SentinelChannel(Channel, kombu_redis.SentinelChannel):
    """The same channel on a primary found through Redis Sentinel (``sentinel://`` URLs): kombu's Sentinel channel
    builds the connection pool (asking the sentinels for the primary at each connection), this module's does the
    rest. Its commands retry as embedq's own Sentinel clients do (:func:`embedq.broker.sentinel_retry`), but not the
    event loop's reads (``asynchronous``: the BRPOP and the broadcast subscription), which keep redis-py's default of
    no retry, as on a plain Redis: redis-py's retry of a subscription's read reconnects and then *waits* for the next
    message, so once the retry reached a promoted primary (the sentinels name it within the tries) the event loop sat
    in that read, holding every delivery and ack of the worker, until a broadcast came. A lost connection there goes
    to Celery instead, which reconnects the whole consumer
    (:meth:`~embedq.workers.tasks.EmbedqConsumer.ensure_connected`)."""

    def _connparams(self, asynchronous: bool = False) -> dict[str, Any]:
        params = super()._connparams(asynchronous)
        return params if asynchronous else {**params, "retry": sentinel_retry()}


class Transport(kombu_redis.Transport):
    Channel = Channel
    policy = FetchPolicy()


class SentinelTransport(Transport):
    Channel = SentinelChannel
    default_port = kombu_redis.SentinelTransport.default_port


def install(policy: FetchPolicy | None = None) -> type[Transport]:
    """Make ``redis://``, ``rediss://`` and ``sentinel://`` URLs use this module's transports in this process (workers
    only), their channels following ``policy`` (None: kombu's own order, one message per round trip). Returns the
    Redis transport class."""
    from kombu import transport as kombu_transport

    attrs = {"policy": policy or FetchPolicy(), "__module__": __name__}
    plain = type("Transport", (Transport,), attrs)
    sentinel = type("SentinelTransport", (SentinelTransport,), attrs)
    for scheme, transport in (("redis", plain), ("rediss", plain), ("sentinel", sentinel)):
        # kombu calls a callable alias for the class (bound now: each scheme its own)
        TRANSPORT_ALIASES[scheme] = lambda transport=transport: transport
        kombu_transport._transport_cache.pop(scheme, None)  # kombu caches what a name resolved to
    return plain
