"""How a client writes its jobs' messages (:class:`JobWriter`, the :class:`~embedq.producers.client.Client`'s
``writer``): straight into kombu's Redis lists, the message ``app.send_task`` would write, field for field, so a job
costs the producer little CPU; where the app is configured in a way it does not reproduce (:func:`direct_route` says
None), and for a job sent again under its id, through ``send_task``."""

from __future__ import annotations

import base64
import datetime as dt
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from celery import Celery

from embedq import errors
from embedq.kinds import TaskSpec, task_reprs
from embedq.protocol import CLIENT_HEADER, RESENT_HEADER, SENT_HEADER, check_message_size
from embedq.settings import Settings

#: Messages per LPUSH command of a batch, and the bytes after which a command is closed: one round trip sends
#: many jobs, and no single command grows past what Redis reads comfortably at once.
PUSH_MESSAGES = 1000
PUSH_BYTES = 8 * 1024 * 1024
#: The third part of a Celery protocol-2 body (no callbacks, errbacks, chain or chord).
_EMBED = {"callbacks": None, "errbacks": None, "chain": None, "chord": None}


@dataclass(frozen=True)
class Route:
    """Where and how ``app.send_task`` publishes a task to a queue on kombu's Redis transport."""

    key: str  # the Redis list: the queue's list for priority 0
    routing_key: str  # delivery_info's (the anonymous exchange routes by queue name)
    delivery_mode: int
    binding: tuple[str, str, str] | None  # kombu's binding set, its permanent copy, the member; None: no declare


def direct_route(app: Celery, name: str, queue: str, broker_url: str | None) -> Route | None:
    """The route of ``name`` to ``queue`` if this client can write the message ``app.send_task`` would send
    straight into Redis; None where send_task would do something else (another transport, protocol, serializer
    or compression, sent events, a key prefix, a route with options of its own, a queue bound otherwise than
    kombu's direct default or that expires, a task registered here with options): then jobs go through
    ``send_task``."""
    from bisect import bisect

    from kombu.entity import maybe_delivery_mode
    from kombu.transport import redis as kombu_redis

    conf = app.conf
    url = conf.broker_write_url or conf.broker_url
    if (conf.task_protocol != 2 or conf.task_send_sent_event or conf.task_compression
            or conf.task_serializer not in ("json", "msgpack") or not isinstance(url, str) or url != broker_url
            or not url.startswith(("redis://", "rediss://", "sentinel://")) or name in getattr(app, "_tasks", {})):
        return None
    options = conf.broker_transport_options or {}
    if options.get("global_keyprefix"):
        return None
    try:
        routed = app.amqp.router.route({"queue": queue}, name, (), {}, None)
    except Exception:  # whatever it is, send_task will say it
        return None
    target = routed.get("queue")
    if set(routed) != {"queue"} or getattr(target, "name", None) != queue:
        return None
    exchange = target.exchange
    if (getattr(exchange, "type", None) != "direct" or target.bindings or target.expires is not None
            or "x-expires" in (target.queue_arguments or {})):
        return None
    sep = options.get("sep", kombu_redis.Channel.sep)
    steps = options.get("priority_steps", kombu_redis.PRIORITY_STEPS)
    priority = steps[bisect(steps, 0) - 1]  # kombu's list for a message of priority 0
    binding = None
    if not target.no_declare and exchange.name:
        binding = (kombu_redis.Channel.keyprefix_queue % exchange.name,
                   kombu_redis.Channel.keyprefix_binding_permanent % exchange.name,
                   sep.join([target.routing_key or "", "", queue]))
    return Route(key=f"{queue}{sep}{priority}" if priority else queue, routing_key=queue,
                  delivery_mode=maybe_delivery_mode(exchange.delivery_mode or conf.task_default_delivery_mode),
                  binding=binding)


class JobWriter:
    """A client's writes of job messages: its routes (worked out once per task and queue), the pipelined LPUSH of many
    jobs' messages, and ``send_task`` where no route is found or a job is sent again."""

    def __init__(self, app: Celery, settings: Settings, *, follow_results: bool, redis: Callable[[], Any]) -> None:
        """``follow_results``: the messages' ``ignore_result`` header (see the client's); ``redis``: the client's
        connection to the broker."""
        self.app = app
        self.settings = settings
        self.follow_results = follow_results
        self._redis = redis
        #: (task name, queue) -> where its messages go when written directly (None: through send_task)
        self.routes: dict[tuple[str, str], Route | None] = {}
        #: (queue binding, broker epoch) pairs already declared (kombu declares once per connection)
        self._declared: set[tuple[Any, str]] = set()

    def route(self, name: str, queue: str) -> Route | None:
        """Where ``app.send_task(name, queue=queue)`` would put a job, when this client can write that message
        itself (else None: see :func:`direct_route`); worked out once per task and queue."""
        key = (name, queue)
        if key not in self.routes:
            self.routes[key] = direct_route(self.app, name, queue, self.settings.broker_url)
        return self.routes[key]

    def send_task(self, spec: TaskSpec, args: list[Any], wire: dict[str, Any], queue: str | None,
                  expires: dt.datetime | None, client: str | None, *, job_id: str | None = None,
                  resent: int = 0) -> str:
        """One job through ``app.send_task`` (where :meth:`route` finds no direct route, or to send it again under
        its id ``job_id``, ``resent`` times now): its id."""
        job_id = job_id or str(uuid.uuid4())  # random: job ids cannot be guessed
        headers: dict[str, Any] = {RESENT_HEADER: resent} if resent else {}
        headers[SENT_HEADER] = time.time()
        if client:
            headers[CLIENT_HEADER] = client
        self.app.send_task(spec.name, args=args, kwargs=wire, queue=queue, task_id=job_id, expires=expires,
                           ignore_result=not self.follow_results, headers=headers, **task_reprs(spec, args, wire))
        return job_id

    def direct_now(self) -> bool:
        """What ``send_task`` does per call that a direct write would miss: a parent task (called from inside a
        Celery task, its ids go in the message) and publish signals someone listens to."""
        from celery import signals

        if self.app.current_worker_task is not None:
            return False
        return not any(getattr(getattr(signals, name, None), "receivers", None)
                       for name in ("before_task_publish", "after_task_publish", "task_sent"))

    def body(self, args: list[Any], wire: dict[str, Any], index: int, count: int) -> tuple[str, str, bytes]:
        """A job's message body as kombu's Redis transport stores it: (content type, content encoding, base64
        of the serialized ``(args, kwargs, embed)``), checked against ``max_message_bytes``."""
        from kombu.serialization import dumps

        serializer = self.app.conf.task_serializer
        content_type, encoding, body = dumps((args, wire, _EMBED), serializer=serializer)
        limit = self.settings.max_message_bytes
        if len(body) > limit:  # the error check_message_size raises, from the body it measures
            try:
                check_message_size(args, wire, serializer=serializer, limit=limit)
                raise errors.MessageTooLarge(f"the job's message would have {len(body)} bytes; the limit is {limit}")
            except errors.MessageTooLarge as exc:
                if count > 1 and hasattr(exc, "add_note"):
                    exc.add_note(f"job {index} of the {count} submitted together; none was sent")
                raise
        raw = body.encode("utf-8") if isinstance(body, str) else body
        return content_type, encoding, base64.b64encode(raw)

    def push(self, route: Route, spec: TaskSpec, argses: list[list[Any]], bodies: list[tuple[str, str, bytes]],
              wire: dict[str, Any], expires: dt.datetime | None, epoch: str, client: str) -> list[str]:
        """Write the jobs' messages into their queue's Redis list, in one pipeline: the messages
        ``app.send_task`` would publish (Celery's protocol 2 on kombu's Redis transport: headers, properties,
        base64 body; see ``celery.app.amqp.AMQP.as_task_v2`` and ``kombu.transport.redis.Channel._put``), and
        the queue's binding as kombu declares it before its first publish (again after Redis lost its data), each
        with the producer identity ``client`` (``embedq_client``). Returns the job ids."""
        from celery.utils.nodenames import anon_nodename
        from kombu.utils.json import dumps

        ids = [str(uuid.uuid4()) for _ in argses]  # random: job ids cannot be guessed
        origin, reply_to = anon_nodename(), self.app.thread_oid
        ignore_result = not self.follow_results
        sent_at = time.time()
        expires_at = expiration = None
        if expires is not None:
            expires_at = expires.isoformat()
            left = max((expires - dt.datetime.now(dt.timezone.utc)).total_seconds(), 0)  # as send_task clamps it
            expiration = str(int(left * 1000))
        reprs: dict[int, dict[str, str]] = {}
        messages = []
        for job_id, args, (content_type, encoding, body) in zip(ids, argses, bodies):
            items = len(args[-1])  # the reprs say how many texts: made once per count
            if items not in reprs:
                reprs[items] = task_reprs(spec, args, wire)
            argsrepr, kwargsrepr = reprs[items]["argsrepr"], reprs[items]["kwargsrepr"]
            headers = {"lang": "py", "task": spec.name, "id": job_id, "shadow": None, "eta": None,
                       "expires": expires_at, "group": None, "group_index": None, "retries": 0,
                       "timelimit": [None, None], "root_id": job_id, "parent_id": None, "argsrepr": argsrepr,
                       "kwargsrepr": kwargsrepr, "origin": origin, "ignore_result": ignore_result,
                       "replaced_task_nesting": 0, "stamped_headers": None, "stamps": {}, SENT_HEADER: sent_at,
                       CLIENT_HEADER: client}
            properties: dict[str, Any] = {"correlation_id": job_id, "reply_to": reply_to, "argsrepr": argsrepr,
                                          "kwargsrepr": kwargsrepr, "delivery_mode": route.delivery_mode}
            if expiration is not None:
                properties["expiration"] = expiration
            properties["delivery_info"] = {"exchange": "", "routing_key": route.routing_key}
            properties["priority"] = 0
            properties["body_encoding"] = "base64"
            properties["delivery_tag"] = str(uuid.uuid4())
            # the body first, as kombu writes it: base64 needs no escaping, so it is not run through the encoder
            rest = dumps({"content-encoding": encoding, "content-type": content_type, "headers": headers,
                          "properties": properties})
            messages.append(b'{"body": "' + body + b'", ' + rest[1:].encode("utf-8"))
        commands: list[tuple[str, ...]] = []
        declared = (route.binding, epoch)
        if route.binding is not None and declared not in self._declared:
            commands += [("SADD", key, route.binding[2]) for key in route.binding[:2]]
        # LPUSH of several values is several LPUSHes in a row: the list ends in the same order
        start, size = 0, 0
        for i, message in enumerate(messages):
            size += len(message)
            if i + 1 - start >= PUSH_MESSAGES or size >= PUSH_BYTES or i + 1 == len(messages):
                commands.append(("LPUSH", route.key, *messages[start:i + 1]))
                start, size = i + 1, 0
        wait = self.settings.replica_wait()
        if wait is not None:  # on the same connection as the writes (a pipeline): WAIT covers that connection's
            commands.append(wait)
        if len(commands) == 1:
            self._redis().execute_command(*commands[0])
        else:
            pipe = self._redis().pipeline(transaction=False)
            for command in commands:
                pipe.execute_command(*command)
            replies = pipe.execute()
            if wait is not None:
                self.settings.replicated(replies[-1], f"{len(ids)} job message(s)")
        self._declared.add(declared)
        return ids
