"""``embedq flower``: Flower (Celery's web monitor) on the configured broker, on this machine only unless told.

Flower's pages show every worker, queue and task and let a visitor shut workers down, so it listens on 127.0.0.1
unless an address is given (``--address`` or ``EMBEDQ_FLOWER_ADDRESS``), and it refuses to listen anywhere else
without authentication: HTTP basic auth (``EMBEDQ_FLOWER_BASIC_AUTH``, or ``--basic-auth``), or Flower's own
``--auth``/``--basic_auth`` passed through.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import sys
from typing import Any

from embedq import errors
from embedq.settings import Settings

#: Flower's own options that make its pages ask who is there (passed through as they are).
_FLOWER_AUTH_OPTIONS = ("--basic_auth", "--auth")


def is_loopback(address: str) -> bool:
    """Whether a listening address reaches this machine only. A host name other than ``localhost`` and the empty
    address (every interface, to Tornado) do not."""
    if address.strip().lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(address.strip().strip("[]")).is_loopback
    except ValueError:
        return False


def _passes_auth(extra: list[str]) -> bool:
    return any(arg.split("=", 1)[0] in _FLOWER_AUTH_OPTIONS for arg in extra)


def add_parser(sub: Any) -> None:
    """The ``flower`` subcommand on ``sub`` (the ``embedq`` parser's subparsers)."""
    f = sub.add_parser("flower", help="start Flower (Celery's web monitor) against the configured broker",
                       description="Start Flower on the broker of EMBEDQ_BROKER_URL (TLS settings included). Other "
                       "options are passed to Flower as they are (e.g. --max_tasks=50000 --persistent=True).")
    f.add_argument("--port", type=int, default=5555)
    f.add_argument("--address", default=None,
                   help="address to listen on (EMBEDQ_FLOWER_ADDRESS; default 127.0.0.1: this machine only); any "
                   "other than a loopback address needs basic auth")
    f.add_argument("--basic-auth", metavar="USER:PASSWORD[,USER:PASSWORD]",
                   help="HTTP basic auth (EMBEDQ_FLOWER_BASIC_AUTH); prefer the variable, argv is visible to others")
    f.set_defaults(func=cmd_flower, passthrough=True)


def cmd_flower(ns: argparse.Namespace, settings: Settings, extra: list[str]) -> int:
    if not settings.broker_url:
        print("embedq flower: set EMBEDQ_BROKER_URL (e.g. redis://127.0.0.1:6379/0)", file=sys.stderr)
        return 2
    address = settings.flower_address if ns.address is None else ns.address
    auth = ns.basic_auth or (settings.flower_basic_auth.get_secret_value() if settings.flower_basic_auth else None)
    if not auth and not _passes_auth(extra) and not is_loopback(address):
        # Before Flower is imported: nothing listens, not even for a moment.
        print(f"embedq flower: refusing to listen on {address!r} without basic auth: its pages show every task and "
              "can shut workers down. Set EMBEDQ_FLOWER_BASIC_AUTH=user:password (or --basic-auth), or listen on "
              "127.0.0.1 (the default) and reach it through an SSH tunnel or an authenticating proxy",
              file=sys.stderr)
        return 2
    try:
        import flower  # noqa: F401
    except ImportError:
        print(f"embedq flower: Flower is not installed: {errors.install_hint('flower')}", file=sys.stderr)
        return 2
    from embedq.broker import make_app

    if auth:  # through Flower's environment, not argv: a password on a command line is visible to every user
        os.environ["FLOWER_BASIC_AUTH"] = auth
    argv = ["flower", f"--port={ns.port}", f"--address={address}", *extra]
    return make_app(settings).start(argv) or 0
