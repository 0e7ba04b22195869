"""Webhooks of async jobs: ``POST /jobs`` with ``"webhook": "<url>"`` calls that URL once the job is done.

The call is a ``POST`` of the same JSON ``GET /jobs/{id}`` answers then (``status`` ``done`` with its
``result``, or ``failed`` with its ``error``), with the headers ``X-Embedq-Job: <id>`` and, when
``EMBEDQ_WEBHOOK_SECRET`` is set, ``X-Embedq-Signature: t=<unix time>,v1=<hex>``: HMAC-SHA256 of
``"<t>." + body`` under the secret (verify it, and refuse an old ``t``, to know the call is the gateway's).

Safe by default: a webhook is refused unless its URL is under a prefix of ``EMBEDQ_WEBHOOK_ALLOW`` (same scheme
and host, the path under the prefix's), so no caller can make the gateway call an address of its choosing;
redirects are not followed. The URL is first brought to one form (:func:`normalize`: dot segments removed, also
percent-encoded ones, slashes merged, scheme and host lower-case, default port dropped), which is both checked and
called; a URL that parsers could read two ways (control characters, spaces, backslashes, encoded slashes or backslashes
in its path, ``..;`` segments) is refused with a 422.

Each call is bounded: ``EMBEDQ_WEBHOOK_TIMEOUT`` seconds in all (connecting, sending, and reading the answer), and
at most ``EMBEDQ_WEBHOOK_RESPONSE_LIMIT`` bytes of the answer's body are read (only its status is used; past the
limit the connection is closed, the rest never read). A network error, a call past its deadline, a 5xx or a 429 is
tried again (``EMBEDQ_WEBHOOK_ATTEMPTS`` calls, pauses doubling from 1 s); another status, or a call the HTTP client
refuses (a URL it cannot send), ends it. The outcome is kept in the job's record (``webhook`` in
``GET /jobs/{id}``): its state, calls, status code and the error's kind, never what the receiver answered, so a
webhook cannot be used to read other addresses.

The gateway keeps no state of its own: a webhook owed is the job's id in the Redis set :data:`WEBHOOKS_KEY`,
and the replica delivering it holds a lease (:data:`WEBHOOK_LEASE_KEY`, renewed while it works). A replica that stops
or dies leaves the id in the set and its lease lapses; any replica's sweep (three a lease) claims it and
delivers it. A call can therefore come twice (a replica killed between the call and its record):
receivers should treat ``X-Embedq-Job`` as an idempotency key.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import logging
import re
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import Any
from urllib.parse import quote, urlsplit

import orjson

from embedq import errors
from embedq.keys import WEBHOOK_LEASE_KEY, WEBHOOKS_KEY
from embedq.version import __version__

log = logging.getLogger(__name__)

#: Characters of a webhook URL (it is stored with its job for EMBEDQ_RESULT_TTL).
MAX_URL_LENGTH = 2048
#: Seconds one call of a webhook may take in all, and bytes of its answer read, unless configured
#: (``EMBEDQ_WEBHOOK_TIMEOUT``, ``EMBEDQ_WEBHOOK_RESPONSE_LIMIT``).
CALL_TIMEOUT = 10.0
RESPONSE_LIMIT = 65536

_DEFAULT_PORTS = {"http": 80, "https": 443}
_UNRESERVED = frozenset("ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-._~")
#: What RFC 3986 lets stand unescaped in a path and in a query; anything else is percent-encoded (as UTF-8).
_PATH_SAFE = "!$&'()*+,;=:@/-._~%"
_QUERY_SAFE = _PATH_SAFE + "?"
_ESCAPE = re.compile(r"%([0-9A-Fa-f]{2})")


def _path_escape(match: re.Match[str]) -> str:
    char = chr(int(match.group(1), 16))
    if char in _UNRESERVED:  # RFC 3986 6.2.2.2: %2e is "." (so "%2e%2e" is a dot segment like "..")
        return char
    if char in "/\\" or ord(char) < 0x20 or ord(char) == 0x7F:
        # an encoded separator is one segment to some servers and two to others, which decode it before
        # routing: "/hooks/..%2fadmin" would reach /admin there
        raise ValueError(f"its path has an encoded {char!r}")
    return match.group(0).upper()


def _remove_dot_segments(path: str) -> str:
    """RFC 3986 5.2.4 on an absolute path."""
    segments = path.split("/")[1:]
    out: list[str] = []
    for i, segment in enumerate(segments):
        last = i == len(segments) - 1
        if segment == "..":
            if out:
                out.pop()
        elif segment != ".":
            out.append(segment)
            continue
        if last:  # "/a/b/.." is "/a/"
            out.append("")
    return "/" + "/".join(out)


def normalize(url: str) -> str:
    """The one form of a webhook URL that is checked against the allow-list and called: scheme and host in lower
    case, the default port dropped, percent-encoded unreserved characters decoded (``%2e`` is ``.``) and other
    escapes in upper case, runs of ``/`` merged, dot segments removed, characters outside RFC 3986's sets
    percent-encoded, the fragment dropped (it is never sent). Raises ValueError (saying why) for a URL that
    parsers could read two ways: control characters or spaces (also percent-encoded ones in the path), a
    backslash, an encoded ``/`` or ``\\`` in the path, a ``..;`` segment, a stray ``%``, a host that is empty or
    escaped, or a URL that httpx would send elsewhere than it reads here."""
    if len(url) > MAX_URL_LENGTH:
        raise ValueError(f"it is longer than {MAX_URL_LENGTH} characters")
    bad = next((c for c in url if ord(c) <= 0x20 or ord(c) == 0x7F), None)
    if bad is not None:  # urlsplit silently drops tabs and newlines; httpx refuses them
        raise ValueError(f"it has a control character or a space ({bad!r})")
    if "\\" in url:  # browsers read it as "/", urlsplit as a character of the host or path
        raise ValueError("it has a backslash")
    parts = urlsplit(url)
    scheme, host, port = parts.scheme, parts.hostname, parts.port  # .port raises on a port that is not a number
    if scheme not in _DEFAULT_PORTS:
        raise ValueError("it is not an http(s) URL")
    if not host or "%" in host or "[" in host or "]" in host:
        raise ValueError("its host is empty or escaped")
    if not host.isascii():
        try:
            host = host.encode("idna").decode()
        except UnicodeError:
            raise ValueError("its host is not a valid name") from None
    userinfo, _, _ = parts.netloc.rpartition("@")
    netloc = (f"{userinfo}@" if userinfo else "") + (f"[{host}]" if ":" in host else host)
    if port is not None and port != _DEFAULT_PORTS[scheme]:
        netloc += f":{port}"
    path, query = parts.path or "/", parts.query
    if re.search(r"%(?![0-9A-Fa-f]{2})", path + query):
        raise ValueError("it has a '%' that starts no escape")
    path = quote(_ESCAPE.sub(_path_escape, path), safe=_PATH_SAFE)
    path = _remove_dot_segments(re.sub(r"/{2,}", "/", path))  # "/hooks//../x": some servers merge first
    if any(segment.split(";", 1)[0] in (".", "..") for segment in path.split("/")):
        raise ValueError("its path has a '..;' segment")  # a dot segment to servlet containers
    normal = f"{scheme}://{netloc}{path}" + (f"?{quote(query, safe=_QUERY_SAFE)}" if query else "")
    _same_for_httpx(normal)
    return normal


def _same_for_httpx(url: str) -> None:
    """What is checked is what is called: httpx must send ``url`` as it is written."""
    import httpx

    try:
        sent = str(httpx.URL(url))
    except httpx.InvalidURL as exc:
        raise ValueError(f"the HTTP client refuses it ({exc})") from None
    if sent != url:
        raise ValueError(f"the HTTP client would send it as {sent!r}")


def _under(url: str, prefix: str) -> bool:
    """Whether normalised ``url`` is under normalised ``prefix``: same scheme, host and port, and its path the
    prefix's or below it (segment-wise: prefix ``/hooks`` takes ``/hooks/x``, not ``/hooks-admin``)."""
    have, want = urlsplit(url), urlsplit(prefix)
    if (have.scheme, have.hostname, have.port) != (want.scheme, want.hostname, want.port):
        return False
    return have.path == want.path or have.path.startswith(want.path if want.path.endswith("/") else want.path + "/")


def check_url(url: str, prefixes: str | None) -> str:
    """``url`` normalised (:func:`normalize`) if it may be called, else the 422 that says why: it must be under one
    of the comma-separated ``prefixes`` (normalised alike; ``*`` allows any http(s) URL)."""
    if not prefixes:
        raise errors.InvalidOption("webhooks are off on this gateway (EMBEDQ_WEBHOOK_ALLOW is not set)")
    shown = url if len(url) <= 200 else url[:200] + "..."
    try:
        normal = normalize(url)
    except ValueError as exc:
        raise errors.InvalidOption(f"webhook {shown!r} is refused: {exc}") from None
    for prefix in (p.strip() for p in prefixes.split(",") if p.strip()):
        if prefix == "*":
            return normal
        try:
            if _under(normal, normalize(prefix)):
                return normal
        except ValueError:
            continue
    raise errors.InvalidOption(f"webhook {shown!r} is not under an allowed prefix (EMBEDQ_WEBHOOK_ALLOW)")


def allowed(url: str, prefixes: str | None) -> bool:
    """Whether ``url`` may be called (:func:`check_url`)."""
    try:
        check_url(url, prefixes)
    except errors.InvalidOption:
        return False
    return True


def signature(secret: bytes, timestamp: int, body: bytes) -> str:
    """``X-Embedq-Signature``'s value for ``body`` sent at ``timestamp``."""
    mac = hmac.new(secret, f"{timestamp}.".encode() + body, hashlib.sha256).hexdigest()
    return f"t={timestamp},v1={mac}"


class Webhooks:
    """Delivery of the webhooks owed (see the module's docstring).

    ``record(id)`` reads a job's record (None once deleted or expired), ``wait(record)`` returns once every
    embedq job of it has an outcome, ``state(id, record)`` is the JSON ``GET /jobs/{id}`` answers, and
    ``save(id, record)`` stores the record again (its TTL kept). ``allow`` is ``EMBEDQ_WEBHOOK_ALLOW``: a URL is
    checked again when it is called (a record stored before the allow-list changed), ``timeout`` the seconds of
    one call in all, ``response_limit`` the bytes of an answer read."""

    def __init__(self, redis: Any, *, secret: bytes | None, attempts: int, lease: float,
                 record: Callable[[str], Awaitable[dict[str, Any] | None]],
                 wait: Callable[[dict[str, Any]], Awaitable[None]],
                 state: Callable[[str, dict[str, Any]], Awaitable[dict[str, Any]]],
                 save: Callable[[str, dict[str, Any]], Awaitable[None]],
                 on_outcome: Callable[[str], None] = lambda outcome: None, allow: str | None = "*",
                 timeout: float = CALL_TIMEOUT, response_limit: int = RESPONSE_LIMIT) -> None:
        self.redis = redis
        self.secret = secret
        self.attempts = attempts
        self.lease_ms = max(1, int(lease * 1000))
        self.allow, self.timeout, self.response_limit = allow, timeout, response_limit
        self._record, self._wait, self._state, self._save = record, wait, state, save
        self._on_outcome = on_outcome
        self.owner = uuid.uuid4().hex  # this replica, as its leases name it
        self._tasks: dict[str, asyncio.Task[None]] = {}
        self._loop: asyncio.Task[None] | None = None
        self._http: Any = None

    async def start(self) -> None:
        self._client()
        self._loop = asyncio.create_task(self._sweep_and_renew(), name="embedq-webhooks")

    def _client(self) -> Any:
        if self._http is None:
            import httpx

            self._http = httpx.AsyncClient(timeout=self.timeout, follow_redirects=False,
                                           headers={"User-Agent": f"embedq-gateway/{__version__}"})
        return self._http

    async def close(self) -> None:
        """Stop: webhooks not yet delivered stay owed (their leases lapse; another replica takes them)."""
        tasks = [*self._tasks.values(), *([self._loop] if self._loop else [])]
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
        if self._http is not None:
            await self._http.aclose()

    async def owe(self, job_id: str) -> None:
        """Record that ``job_id``'s webhook is owed and start delivering it from this replica."""
        await self.redis.sadd(WEBHOOKS_KEY, job_id)
        if await self.redis.set(WEBHOOK_LEASE_KEY.format(job_id), self.owner, nx=True, px=self.lease_ms):
            self._start(job_id)

    def cancel(self, job_id: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    def _start(self, job_id: str) -> None:
        task = asyncio.create_task(self._deliver(job_id), name=f"embedq-webhook-{job_id}")
        self._tasks[job_id] = task
        task.add_done_callback(lambda _: self._tasks.pop(job_id, None))

    async def _sweep_and_renew(self) -> None:
        while True:
            try:
                await self._sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis away: the next sweep tries again
                log.warning("cannot look at the owed webhooks (%s: %s)", type(exc).__name__, exc)
            await asyncio.sleep(self.lease_ms / 3000)

    async def _sweep(self) -> None:
        for job_id in list(self._tasks):  # leases of the deliveries under way: renewed
            await self.redis.pexpire(WEBHOOK_LEASE_KEY.format(job_id), self.lease_ms)
        for raw in await self.redis.smembers(WEBHOOKS_KEY):
            job_id = raw.decode() if isinstance(raw, bytes) else str(raw)
            if job_id in self._tasks:
                continue
            if await self.redis.set(WEBHOOK_LEASE_KEY.format(job_id), self.owner, nx=True, px=self.lease_ms):
                log.info("delivering the webhook of job %s (owed, no replica held it)", job_id)
                self._start(job_id)

    async def _deliver(self, job_id: str) -> None:
        try:
            record = await self._record(job_id)
            if record is None or "webhook" not in record:  # deleted or expired: nothing is owed any more
                await self.settle(job_id)
                return
            await self._wait(record)
            record = await self._record(job_id)
            if record is None:
                await self.settle(job_id)
                return
            try:  # checked again: the record may predate the allow-list (or this check)
                url = check_url(record["webhook"]["url"], self.allow)
            except errors.InvalidOption as exc:
                outcome, detail = "failed", {"attempts": 0, "error": str(exc)}
            else:
                outcome, detail = await self._call(job_id, url, await self._state(job_id, record))
            record["webhook"].update(state=outcome, **detail)
            await self._save(job_id, record)
            self._on_outcome(outcome)
            await self.settle(job_id)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # the lease lapses and a sweep tries again
            log.warning("webhook of job %s not delivered (%s: %s); it stays owed", job_id, type(exc).__name__, exc)

    async def settle(self, job_id: str) -> None:
        """Nothing is owed for ``job_id`` any more."""
        await self.redis.srem(WEBHOOKS_KEY, job_id)
        await self.redis.delete(WEBHOOK_LEASE_KEY.format(job_id))

    async def _call(self, job_id: str, url: str, state: dict[str, Any]) -> tuple[str, dict[str, Any]]:
        """Calls of ``url`` until one is answered below 300, or with another status that is not retried, or the
        attempts are spent: ``(outcome, detail)``; detail holds the status code and the error's kind, never what
        the receiver sent (``GET /jobs/{id}`` shows it)."""
        import httpx

        body = orjson.dumps(state, option=orjson.OPT_SERIALIZE_NUMPY)
        pause, last = 1.0, ""
        for attempt in range(1, self.attempts + 1):
            headers = {"Content-Type": "application/json", "X-Embedq-Job": job_id}
            if self.secret is not None:
                headers["X-Embedq-Signature"] = signature(self.secret, int(time.time()), body)
            try:
                status = await asyncio.wait_for(self._post(url, body, headers), self.timeout)
            except asyncio.TimeoutError:
                last = f"no answer within {self.timeout:g} s (EMBEDQ_WEBHOOK_TIMEOUT)"
            except (httpx.InvalidURL, httpx.UnsupportedProtocol, httpx.LocalProtocolError) as exc:
                return self._refused(job_id, attempt, exc)  # calling again would fail again
            except httpx.HTTPError as exc:  # network, timeout, a peer that does not speak HTTP: tried again
                log.info("webhook of job %s: call %d failed (%s: %s)", job_id, attempt, type(exc).__name__, exc)
                last = type(exc).__name__  # not its message: h11's quotes the bytes the peer sent
            except Exception as exc:  # anything else the client raises is not a network error
                return self._refused(job_id, attempt, exc)
            else:
                if status < 300:
                    return "delivered", {"attempts": attempt, "status_code": status}
                last = f"HTTP {status}"
                if status < 500 and status != 429:
                    return "failed", {"attempts": attempt, "status_code": status, "error": last}
            if attempt < self.attempts:
                await asyncio.sleep(pause)
                pause = min(pause * 2, 60.0)
        log.warning("webhook of job %s given up after %d calls (%s)", job_id, self.attempts, last)
        return "failed", {"attempts": self.attempts, "error": last}

    async def _post(self, url: str, body: bytes, headers: dict[str, str]) -> int:
        """One call: its status code. At most ``response_limit`` bytes of the answer are read (raw: nothing is
        decompressed); past them the connection is closed, not drained."""
        async with self._client().stream("POST", url, content=body, headers=headers) as response:
            if self.response_limit > 0:
                read = 0
                async for chunk in response.aiter_raw():
                    read += len(chunk)
                    if read >= self.response_limit:
                        break
            return response.status_code

    @staticmethod
    def _refused(job_id: str, attempt: int, exc: BaseException) -> tuple[str, dict[str, Any]]:
        log.warning("webhook of job %s failed for good (%s: %s)", job_id, type(exc).__name__, exc)
        return "failed", {"attempts": attempt, "error": f"the HTTP client refused the call ({type(exc).__name__})"}
