"""Redis ACL users per role: what each embedq process may do on the broker, declared once.

One password that opens everything lets a web app that only sends jobs also consume the queues, delete the worker
registry or flush Redis. :data:`ROLES` gives each process kind the commands, keys and pub/sub channels it uses, and
nothing else; :func:`render` writes them as ``ACL SETUSER`` lines (``redis-cli``) or as lines of an ACL file (Redis's
``aclfile``; ``ops/redis-acl.conf`` is this module's output, checked by ``tests/test_acl.py``). ``embedq acl`` prints
them. A process logs in as its role's user through the URL: ``EMBEDQ_BROKER_URL=redis://producer:PASSWORD@host/0``.

The names come from :mod:`embedq.keys` (embedq's own), kombu (queue lists ``<queue>`` and ``<queue>\\x06\\x16<n>`` for
priorities, ``_kombu.binding.<exchange>``, ``unacked``, ``unacked_index``, ``unacked_mutex``, the reply lists
``<uuid>.reply.celery.pidbox``, the fanout channels ``/<db>.celeryev/<event>`` and ``/<db>.celery.pidbox``) and Celery
(``celery-task-meta-<id>``: a job's record and its channel); each role's list was read off a real run (``MONITOR`` and
``ACL LOG`` of a redis-server under the test of this module).

Redis 6.2 has no read-only key patterns: a role's commands apply to every key it may touch. The monitor role is
read-only by its commands (no write command at all; a script it runs is held to the same commands). A role that
writes some keys and only reads others (the producer reads the worker registry; Flower reads queue lengths) gets
Redis 7's read-only selector ``%R~`` for the read-only ones with ``redis=7``. Queue names share the ``embedq.``
prefix with embedq's own keys, so with the default queue pattern ``embedq.*`` a producer's queue rights cover the
registry too: name the queues (``embedq acl --queue embedq.my-model``) and Redis 7 keeps the registry read-only.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from urllib.parse import urlparse

from redis.exceptions import AuthenticationError, AuthenticationWrongNumberOfArgsError, NoPermissionError, ResponseError

from embedq import errors, keys

#: The queues of the default rendering: every ``embedq.<model slug>`` queue, its bulk queue and priority lists.
DEFAULT_QUEUES = ("embedq.*",)
#: Queues a job's Celery canvas may be sent to (``EMBEDQ_CALLBACK_QUEUE``'s default): workers write them.
DEFAULT_CALLBACK_QUEUES = ("celery",)
#: The password of a rendered line unless one is given: not a valid password hash, so Redis refuses a file or a
#: command that still holds it (an unedited file never opens a user with a known password).
PLACEHOLDER = "#<{role}-password-sha256>"

#: What any client sends on connecting (redis-py: ``HELLO``, a ``PING`` health check; ``SELECT`` for a URL's db).
_CONNECT = ("ping", "hello", "auth", "select")
#: A reply list, a worker's mailbox lists and the bindings of Celery's remote control, as kombu names them.
_PIDBOX = "*.celery.pidbox*"
_RESULTS = "celery-task-meta-*"  # Celery's Redis backend: a job's record, and the channel it is published on


@dataclass(frozen=True)
class Keys:
    """A key pattern of a role. ``{queue}`` stands for each queue pattern, ``{callback}`` for each callback queue;
    ``read_only``: the role only reads it (Redis 7 renders ``%R~``; 6.2 cannot say so)."""

    pattern: str
    read_only: bool = False
    why: str = ""


@dataclass(frozen=True)
class Role:
    """One process kind's rights: its Redis commands (besides connecting: :data:`_CONNECT`), key patterns and pub/sub
    channels (``{db}``: the URL's db)."""

    name: str
    process: str
    commands: tuple[str, ...]
    keys: tuple[Keys, ...]
    channels: tuple[str, ...] = ()


_PRODUCER_COMMANDS = (
    "lpush", "sadd", "smembers",  # a job's message into its queue, the queue's kombu binding (and its lookup)
    "llen",  # queue depths: bulk backpressure, online admission
    "get", "mget", "del", "subscribe", "unsubscribe",  # results: read, wait on their channels, delete once read
    "eval", "publish",  # a cancelled job's record (results.py's store-once script: SET and PUBLISH)
    "xadd",  # a cancellation for the workers
    "set", "info",  # the broker's epoch: embedq.epoch, and run_id from INFO server
    "scan",  # the live-worker registry (SCAN + MGET)
)
_PRODUCER_KEYS = (
    Keys("{queue}", why="push jobs; read queue depths"),
    Keys("_kombu.binding.{queue}", why="kombu's binding of each queue (declared when sending)"),
    Keys("_kombu.binding_permanent.{queue}"),
    Keys(_RESULTS, why="read, wait for and delete results; store a cancelled job's record"),
    Keys(keys.EPOCH_KEY, why="the broker's epoch (set once, then read)"),
    Keys(keys.CANCELLED_STREAM, why="announce cancellations"),
    Keys(keys.WORKER_KEY.format("*"), read_only=True, why="the live-worker registry"),
)

ROLES: dict[str, Role] = {role.name: role for role in (
    Role("producer", "the Python Client, embedq index, embedq embed", _PRODUCER_COMMANDS,
         _PRODUCER_KEYS, channels=(_RESULTS,)),
    Role("gateway", "embedq serve", (*_PRODUCER_COMMANDS, "srem", "pexpire"),
         (*_PRODUCER_KEYS, Keys("embedq.gateway.*", why="async jobs, webhooks owed and their leases")),
         channels=(_RESULTS,)),
    Role("worker", "embedq worker", (
        "brpop", "rpop", "lpush", "rpush", "llen", "lrange", "ltrim",  # consume; requeue; dead letters
        "hset", "hget", "hdel", "hvals", "zadd", "zrem", "zrange", "zrangebyscore", "zrevrangebyscore",  # unacked
        "get", "set", "mget", "del", "exists", "incrby", "expire", "pexpire",  # records, attempts, registry
        "sadd", "srem", "smembers", "scan",  # kombu's bindings
        "eval", "evalsha", "script|load", "script|exists",  # embedq's fetch and store scripts, kombu's, redis-py's lock
        "multi", "exec", "discard", "watch", "unwatch",  # kombu's restore of unacked messages
        "publish", "subscribe", "unsubscribe", "psubscribe", "punsubscribe",  # results, events, remote control
        "xread", "time",  # the cancellation stream
    ), (
        Keys("{queue}", why="consume its queues; restore unacked messages into them"),
        Keys("{callback}", why="send a job's Celery canvas (callbacks) to the callback queue"),
        Keys("unacked", why="kombu: received, not yet acknowledged messages"),
        Keys("unacked_index"),
        Keys("unacked_mutex"),
        Keys(_RESULTS, why="store results"),
        Keys(keys.ATTEMPTS_KEY.format("*"), why="delivery records (workers/delivery.py)"),
        Keys(keys.RETURNED_KEY.format("*")),
        Keys(keys.CANVAS_KEY.format("*")),
        Keys(keys.DEAD_LETTERS),
        Keys(keys.CANCELLED_STREAM, read_only=True, why="follow cancellations"),
        Keys(keys.WORKER_KEY.format("*"), why="its registry record"),
        Keys(keys.DEPTHS_KEY, why="queue depths shared between workers"),
        Keys("_kombu.binding.*", why="kombu's bindings: its queues, remote control, replies"),
        Keys("_kombu.binding_permanent.*"),
        Keys("_kombu.binding_deadlines"),
        Keys(_PIDBOX, why="its remote-control mailbox; replies to Flower and Client.workers()"),
    ), channels=(_RESULTS, "/{db}.celeryev/*", "/{db}.celery.pidbox")),
    Role("flower", "embedq flower", (
        "psubscribe", "punsubscribe", "subscribe", "unsubscribe",  # Celery events
        "publish",  # remote control broadcasts (inspect, revoke, shut down)
        "brpop", "llen", "del",  # its reply list; queue lengths
        "sadd", "srem", "smembers", "zadd", "zrem", "zrangebyscore", "time",  # kombu's expiring reply bindings
        "eval", "evalsha", "script|load", "script|exists", "multi", "exec", "discard",
    ), (
        Keys(_PIDBOX, why="its reply lists"),
        Keys("celeryev.*", why="its event receiver's queue"),
        Keys("_kombu.binding.*", why="the bindings of its reply and event queues"),
        Keys("_kombu.binding_permanent.*"),
        Keys("_kombu.binding_deadlines"),
        Keys("{queue}", read_only=True, why="queue lengths (the Broker page)"),
    ), channels=("/{db}.celeryev/*", "/{db}.celery.pidbox")),
    Role("monitor", "embedq status", (
        "scan", "smembers", "llen", "mget", "eval", "hvals",  # eval: monitor.py's count of unacked (HVALS)
    ), (
        Keys("{queue}", read_only=True, why="queue depths"),
        Keys("_kombu.binding.*", read_only=True, why="which queues are declared"),
        # not read_only: Redis 7 counts the keys an EVAL declares as written (and refuses them under %R~); the monitor
        # writes nothing anyway, its commands are all reads
        Keys("unacked", why="messages received and not acknowledged, per queue (read by a script: HVALS)"),
        Keys(keys.WORKER_KEY.format("*"), read_only=True, why="the live-worker registry"),
        Keys(keys.DEAD_LETTERS, read_only=True, why="the dead-letter count"),
    )),
)}


def _queue_pattern(queue: str) -> str:
    """A queue name covers its priority lists and bulk queue (``NAME*``); a pattern stays as it is."""
    return queue if queue.endswith("*") else queue + "*"


def rules(role: str | Role, *, queues: Sequence[str] = DEFAULT_QUEUES,
          callback_queues: Sequence[str] = DEFAULT_CALLBACK_QUEUES, redis: int = 6, db: int = 0) -> list[str]:
    """The ACL rules of ``role`` (no user name, no password), for Redis ``redis`` (6: 6.2 and later; 7: read-only
    keys as ``%R~``). ``queues``: the queue names or patterns the role's processes use; ``db``: the database number
    of the broker URL (kombu's fanout channels carry it)."""
    spec = ROLES[role] if isinstance(role, str) else role
    out = ["reset", "on"]
    seen: set[str] = set()
    for entry in spec.keys:
        if "{queue}" in entry.pattern:
            patterns = [entry.pattern.replace("{queue}", _queue_pattern(q)) for q in queues]
        elif "{callback}" in entry.pattern:
            patterns = [entry.pattern.replace("{callback}", q) for q in callback_queues]
        else:
            patterns = [entry.pattern]
        for pattern in patterns:
            rule = (f"%R~{pattern}" if entry.read_only and redis >= 7 else f"~{pattern}")
            if rule not in seen:
                seen.add(rule)
                out.append(rule)
    out.append("resetchannels")  # Redis 6.2 gives a new user every channel (acl-pubsub-default allchannels)
    out += [f"&{channel.format(db=db)}" for channel in spec.channels]
    out += ["-@all", *(f"+{command}" for command in (*_CONNECT, *spec.commands))]
    return out


def render(roles: Iterable[str] | None = None, *, form: str = "setuser", passwords: dict[str, str] | None = None,
           **options: object) -> str:
    """``ACL SETUSER`` lines (``form="setuser"``) or ACL file lines (``form="file"``) for ``roles`` (default: all),
    one a line. A role's password is ``passwords[role]`` (as ``>password``), else :data:`PLACEHOLDER`. ``options``:
    those of :func:`rules`."""
    lines = []
    for name in roles or ROLES:
        secret = (passwords or {}).get(name)
        password = f">{secret}" if secret is not None else PLACEHOLDER.format(role=name)
        words = rules(name, **options)  # type: ignore[arg-type]
        words.insert(2, password)  # after "reset on": a reset user has no password
        prefix = "ACL SETUSER" if form == "setuser" else "user"
        lines.append(" ".join([prefix, name, *words]))
    return "\n".join(lines) + "\n"


def setuser_args(role: str, password: str, **options: object) -> list[str]:
    """The arguments of ``ACL SETUSER`` for ``role`` with ``password`` (what a test or a script sends)."""
    words = rules(role, **options)  # type: ignore[arg-type]
    words.insert(2, f">{password}")
    return ["ACL", "SETUSER", role, *words]


def placeholders(text: str) -> list[str]:
    """The password placeholders left in rendered ``text``."""
    return re.findall(r"#<[a-z]+-password-sha256>", text)


# -- refusals ----------------------------------------------------------------------------------------------------------
#: What redis-py raises when the broker refuses this process's user: ``NOPERM`` (a command, key or channel outside its
#: rules), a wrong user or password (``WRONGPASS``), or a user name sent to a Redis without ACLs.
REFUSED = (NoPermissionError, AuthenticationError, AuthenticationWrongNumberOfArgsError)
#: What to catch to find a refusal (:func:`refusal` tells): a script's refused command is a plain ``ResponseError``.
CAUGHT = (*REFUSED, ResponseError)
#: A command a script runs is refused with a plain script error (Redis 6.2: "The user executing the script can't run
#: this command or subcommand"; 7: "... NOPERM ...").
_SCRIPT_REFUSED = re.compile(r"user executing the script can't|NOPERM")
_PIPELINE = re.compile(r"^Command # \d+ \((\S+)[^)]*?\) of pipeline caused error: (.*)$", re.S)


def refusal(exc: BaseException | None) -> BaseException | None:
    """The broker's refusal behind ``exc`` (itself, or its cause: kombu raises its own errors from redis-py's), or
    None when ``exc`` is something else (Redis away, a bug)."""
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        seen.add(id(exc))
        if isinstance(exc, REFUSED) or (isinstance(exc, ResponseError) and _SCRIPT_REFUSED.search(str(exc))):
            return exc
        exc = exc.__cause__ or exc.__context__
    return None


def describe(refused: BaseException) -> str:
    """The refusal's reason without the refused command's arguments (a pipeline's error quotes a whole message,
    users' texts included): ``SET: this user has no permissions to run the 'set' command``."""
    text = str(refused).strip()
    found = _PIPELINE.match(text)
    return f"{found.group(1).upper()}: {found.group(2).strip()}" if found else text[:300]


def forbidden(exc: BaseException, url: str | None) -> errors.BrokerForbidden:
    """:class:`~embedq.errors.BrokerForbidden` for a refusal (``exc`` or its cause), naming the user of ``url``."""
    from kombu.utils.url import maybe_sanitize_url

    refused = refusal(exc) or exc
    try:
        user = urlparse(url or "").username or "default"
    except ValueError:
        user = "?"
    what = "the user lacks a right this process needs"
    if isinstance(refused, AuthenticationError):
        what = "it does not accept the user's password, or the user is disabled"
    shown = ";".join(maybe_sanitize_url(part) for part in (url or "").split(";"))  # every sentinel's password too
    return errors.BrokerForbidden(
        f"the broker at {shown} refused Redis user {user!r} ({describe(refused)}): {what}. "
        "`embedq acl` prints each role's rules (docs/OPERATIONS.md, \"Redis users per role\")")
