"""``embedq acl``: the Redis users of embedq's roles (:mod:`embedq.acl`), as ``ACL SETUSER`` lines or an ACL file."""

from __future__ import annotations

import argparse
import sys
from typing import Any

from embedq import acl
from embedq.settings import Settings


def add_parser(sub: Any) -> None:
    """The ``acl`` subcommand on ``sub`` (the ``embedq`` parser's subparsers)."""
    a = sub.add_parser("acl", help="print the Redis ACL users of embedq's roles (producer, gateway, worker, flower, "
                       "monitor)", description="Print one Redis user per role, with only the commands, keys and "
                       "channels that role uses: ACL SETUSER lines for redis-cli, or (--file) the lines of an ACL file "
                       "for redis.conf's aclfile. Each password is a placeholder that Redis refuses until it is "
                       "replaced (docs/OPERATIONS.md, \"Redis users per role\").")
    a.add_argument("roles", nargs="*", metavar="ROLE",
                   help=f"the roles to print (default: all): {', '.join(acl.ROLES)}")
    a.add_argument("--file", action="store_true",
                   help="ACL file lines (`user NAME ...`; Redis allows no comments there), not ACL SETUSER lines")
    a.add_argument("--queue", action="append", metavar="NAME", help="a queue the roles use (repeatable; its bulk queue "
                   "and priority lists included); default every queue, embedq.*. Naming them keeps other embedq.* keys "
                   "out of the queue rights")
    a.add_argument("--callback-queue", action="append", metavar="NAME",
                   help="a queue workers send a job's Celery canvas to (default: celery, EMBEDQ_CALLBACK_QUEUE's)")
    a.add_argument("--redis", type=int, choices=[6, 7], default=6,
                   help="the oldest Redis the lines must load on: 6 (6.2, the default) or 7 (adds read-only %%R~ keys)")
    a.add_argument("--db", type=int, default=0, help="the database number of the broker URL (default 0)")
    a.set_defaults(func=cmd_acl)


def cmd_acl(ns: argparse.Namespace, settings: Settings) -> int:
    unknown = [role for role in ns.roles if role not in acl.ROLES]
    if unknown:
        print(f"embedq acl: no role {', '.join(unknown)} (roles: {', '.join(acl.ROLES)})", file=sys.stderr)
        return 2
    text = acl.render(ns.roles or None, form="file" if ns.file else "setuser", queues=ns.queue or acl.DEFAULT_QUEUES,
                      callback_queues=ns.callback_queue or acl.DEFAULT_CALLBACK_QUEUES, redis=ns.redis, db=ns.db)
    print(text, end="")
    return 0
