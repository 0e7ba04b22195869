"""Celery's ``sentinel://`` URLs, read once: the sentinels to ask, the database, the Redis servers' credentials.

``sentinel://[user:password@]host:port[;sentinel://[user:password@]host:port...][/db]`` names the sentinels (port
26379 when left out), not a Redis server: every client asks them for the address of the primary they watch under
``EMBEDQ_SENTINEL_MASTER`` and asks again after a failover (embedq/broker.py builds the clients). As in Celery and
kombu, the user and password of the URL are the Redis servers' (the primary's and its replicas'); the sentinels' own
are ``EMBEDQ_SENTINEL_USERNAME`` and ``EMBEDQ_SENTINEL_PASSWORD``. This module imports nothing of embedq (the
settings read URLs with it).
"""

from __future__ import annotations

from dataclasses import dataclass
from urllib.parse import unquote, urlsplit

SCHEME = "sentinel://"
#: Sentinel's own port, where a URL gives none.
DEFAULT_PORT = 26379


def is_sentinel(url: str | None) -> bool:
    return bool(url) and str(url).startswith(SCHEME)


@dataclass(frozen=True)
class SentinelURL:
    """What a ``sentinel://`` URL says."""

    hosts: tuple[tuple[str, int], ...]
    db: int
    username: str | None
    password: str | None

    def connection_kwargs(self) -> dict[str, object]:
        """redis-py's arguments of a connection to the primary (database and credentials)."""
        out: dict[str, object] = {"db": self.db}
        if self.username:
            out["username"] = self.username
        if self.password:
            out["password"] = self.password
        return out


def parse(url: str) -> SentinelURL:
    """Read a ``sentinel://`` URL (raises ValueError naming what is wrong, never echoing a password)."""
    hosts: list[tuple[str, int]] = []
    dbs: set[int] = set()
    username = password = None
    for part in (p.strip() for p in url.split(";")):
        if not part:
            continue
        if not part.startswith(SCHEME):
            raise ValueError("every address of a sentinel URL must start with sentinel:// "
                             "(sentinel://host:26379;sentinel://host2:26379/0)")
        try:
            split = urlsplit(part)
            port = split.port or DEFAULT_PORT
        except ValueError:
            raise ValueError("a sentinel address has a port that is not a number") from None
        if not split.hostname:
            raise ValueError("a sentinel address has no host (sentinel://host:26379)")
        hosts.append((split.hostname, port))
        path = split.path.strip("/")
        if path:
            if not path.isdigit():
                raise ValueError("the database of a sentinel URL must be a number (sentinel://host:26379/0)")
            dbs.add(int(path))
        if split.password is not None or split.username:
            username = unquote(split.username) if split.username else username
            password = unquote(split.password) if split.password is not None else password
    if not hosts:
        raise ValueError("a sentinel URL names no sentinel")
    if len(dbs) > 1:
        raise ValueError("the addresses of a sentinel URL name different databases")
    return SentinelURL(hosts=tuple(hosts), db=dbs.pop() if dbs else 0, username=username, password=password)
