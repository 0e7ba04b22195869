"""The bounds of a job's canvas, checked at the edge: when the worker reads the message, before it is tokenized.

A task message's canvas (``callbacks``, ``errbacks``, ``chain``, ``chord`` of its ``embed`` part, and every signature
nested in them: a group's or chain's ``tasks``, a chord's ``header`` and ``body``, each signature's own
``options.link``/``options.link_error``/``options.chain``) is walked once, iteratively (a hostile nesting cannot
recurse Python's stack) and never past the first bound it breaks, so the walk costs at most
``canvas_max_signatures`` signatures whatever the message holds. :meth:`CanvasRules.check` returns the typed
``invalid_message`` of a message that breaks a rule (the worker stores it for the job and acknowledges the message;
nothing of its canvas is sent), else None. The rules:

* at most ``canvas_max_signatures`` signatures, nested at most ``canvas_max_depth`` deep, chains of at most
  ``canvas_max_chain`` steps; a chord body's ``chord_size`` at most ``canvas_max_chord_size``; the message's group
  id (a chord part's) a string of at most :data:`MAX_GROUP_ID` characters, its ``group_index`` an int;
* every signature goes to a queue the operator allowed: ``callback_queue`` or one of ``callback_queues`` (a
  signature's ``queue``, and an ``exchange``/``routing_key``, must each name one of them), so no hostile name ever
  reaches kombu's binding table (Redis) or Celery's queue table (the worker's memory);
* embedq's own kinds (``kinds.TASKS``) run only where ``callback_kinds`` names them, and then only on the online
  queue (where they pass the producer's admission when sent, ``workers/canvas.py``); of Celery's built-in tasks only
  the containers ``celery.group``, ``celery.chain`` and ``celery.chord`` may appear;
* a field that is not the shape Celery gives it (a signature that is no object, a task name that is no string) is
  refused as well: Celery would fail on it only after the job ran.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from embedq import errors
from embedq.kinds import TASKS
from embedq.settings import Settings

#: Characters a chord part's group id may have (Celery's are UUIDs; the Redis keys of a chord are named after it).
MAX_GROUP_ID = 256
#: Celery's canvas containers: allowed in a canvas (their tasks are checked like any other signature).
CONTAINERS = frozenset({"celery.group", "celery.chain", "celery.chord"})
#: The fields of a protocol-2 message's ``embed`` that hold canvas work.
FIELDS = ("callbacks", "errbacks", "chain", "chord")


class Refused(Exception):
    """A rule the canvas breaks (its message is the reason)."""


@dataclass(frozen=True)
class CanvasRules:
    """What one message's canvas may hold (from the settings; see the module's docstring)."""

    max_signatures: int
    max_depth: int
    max_chain: int
    max_chord_size: int
    queues: frozenset[str]  # where any task may go (callback_queue + callback_queues)
    online_queue: str  # where an allowed embedq kind goes
    kinds: frozenset[str]  # task names of the embedq kinds allowed as callbacks

    @classmethod
    def from_settings(cls, settings: Settings) -> CanvasRules:
        named = settings.callback_kind_names
        kinds = frozenset(name for name, spec in TASKS.items() if name in named or spec.kind in named)
        return cls(max_signatures=settings.canvas_max_signatures, max_depth=settings.canvas_max_depth,
                   max_chain=settings.canvas_max_chain, max_chord_size=settings.canvas_max_chord_size,
                   queues=settings.callback_queue_names, online_queue=settings.queue_name, kinds=kinds)

    def check(self, embed: Any, headers: Any) -> errors.InvalidMessage | None:
        """The ``invalid_message`` of a message whose canvas (``embed``: the third part of a protocol-2 body;
        ``headers``: its headers) breaks a rule, or None."""
        try:
            self._check(embed, headers if isinstance(headers, dict) else {})
        except Refused as exc:
            return errors.InvalidMessage(f"the message's canvas is refused: {exc}")
        return None

    def _check(self, embed: Any, headers: dict[str, Any]) -> None:
        if embed is None:
            return
        if not isinstance(embed, dict):
            raise Refused("its canvas part is not an object")
        if not any(embed.get(name) for name in FIELDS):
            return
        group = headers.get("group")
        if group is not None and not (isinstance(group, str) and 0 < len(group) <= MAX_GROUP_ID):
            raise Refused(f"its group id must be a string of 1 to {MAX_GROUP_ID} characters")
        index = headers.get("group_index")
        if index is not None and (not isinstance(index, int) or isinstance(index, bool) or not 0 <= index < 2**31):
            raise Refused("its group_index must be a small non-negative integer")
        # (value, depth): a value holding signatures, at the nesting depth of the signatures it holds
        stack: list[tuple[Any, int]] = []
        for name in ("callbacks", "errbacks"):
            if embed.get(name):
                stack.append((_as_list(embed[name], name), 1))
        if embed.get("chain"):
            steps = _as_list(embed["chain"], "chain")
            self._chain(len(steps))
            stack.append((steps, 1))
        if embed.get("chord"):
            stack.append(([embed["chord"]], 1))
        seen = 0
        while stack:
            values, depth = stack.pop()
            if depth > self.max_depth:
                raise Refused(f"signatures are nested more than {self.max_depth} deep (EMBEDQ_CANVAS_MAX_DEPTH)")
            for sig in values:
                seen += 1
                if seen > self.max_signatures:
                    raise Refused(f"it holds more than {self.max_signatures} signatures "
                                  "(EMBEDQ_CANVAS_MAX_SIGNATURES)")
                stack.extend((children, depth + 1) for children in self._signature(sig))

    def _chain(self, steps: int) -> None:
        if steps > self.max_chain:
            raise Refused(f"a chain has {steps} steps; at most {self.max_chain} (EMBEDQ_CANVAS_MAX_CHAIN)")

    def _signature(self, sig: Any) -> Iterator[list[Any]]:
        """Check one signature; yields the lists of signatures nested in it."""
        if not isinstance(sig, dict):
            raise Refused("a signature is not an object")
        task = sig.get("task")
        if not isinstance(task, str):
            raise Refused("a signature has no task name")
        options = sig.get("options") or {}
        if not isinstance(options, dict):
            raise Refused(f"signature {task[:100]!r} has options that are not an object")
        self._destination(task, options)
        size = sig.get("chord_size")
        if size is not None and (not isinstance(size, int) or isinstance(size, bool)
                                 or not 0 <= size <= self.max_chord_size):
            raise Refused(f"a chord_size must be an integer of at most {self.max_chord_size} "
                          "(EMBEDQ_CANVAS_MAX_CHORD_SIZE)")
        kwargs = sig.get("kwargs") or {}
        if task in CONTAINERS:
            if not isinstance(kwargs, dict):
                raise Refused(f"{task} has kwargs that are not an object")
            for name in ("tasks", "header", "body"):
                value = kwargs.get(name)
                if value:
                    children = _signatures(value, f"{task}'s {name}")
                    if task == "celery.chain" and name == "tasks":
                        self._chain(len(children))
                    yield children
        for name in ("link", "link_error", "chain", "chord"):
            value = options.get(name)
            if value:
                children = _signatures(value, f"a signature's {name}")
                if name == "chain":
                    self._chain(len(children))
                yield children

    def _destination(self, task: str, options: dict[str, Any]) -> None:
        """Where the signature's task would go: an allowed queue, for a task this worker lets a canvas send."""
        if task in TASKS:
            if task not in self.kinds:
                raise Refused(f"embedq's own task {task!r} as a callback (allow it with EMBEDQ_CALLBACK_KINDS)")
            allowed: frozenset[str] = frozenset({self.online_queue})
        elif task.startswith("celery.") and task not in CONTAINERS:
            raise Refused(f"Celery's built-in task {task[:100]!r} as a callback")
        else:
            allowed = self.queues
        for name in ("queue", "exchange", "routing_key"):
            value = options.get(name)
            if value is None or (name == "exchange" and value == ""):  # "": the default exchange (routing key's queue)
                continue
            if isinstance(value, dict):  # a kombu Queue or Exchange serialised: its name
                value = value.get("name")
            if not isinstance(value, str) or value not in allowed:
                shown = value[:100] if isinstance(value, str) else type(value).__name__
                raise Refused(f"signature {task[:100]!r} names the {name} {shown!r}, which is not an allowed queue "
                              "(EMBEDQ_CALLBACK_QUEUE, EMBEDQ_CALLBACK_QUEUES)")


def _as_list(value: Any, what: str) -> list[Any]:
    if not isinstance(value, (list, tuple)):
        raise Refused(f"its {what} is not a list")
    return list(value) if isinstance(value, tuple) else value


def _signatures(value: Any, what: str) -> list[Any]:
    """One signature or a list of them (Celery takes either in a link, a group's tasks, a chord's header)."""
    if isinstance(value, dict):
        return [value]
    return _as_list(value, what)
