"""Inputs longer than the model on the gateway's embedding routes (issue 58): how the results of jobs with
``long_inputs="windows"`` become the route's answer. The request fields ``long_inputs``, ``window_overlap`` and
``pool_windows`` of ``/v1/embeddings``, ``/embed``, ``/embed_sparse`` and ``/embed_all`` are
:class:`~embedq.gateway.schemas.WindowFields`; the plans that use both are :mod:`embedq.gateway.plans`'.

A request that names none of the fields is sent as before, with the job options it always had (TEI's ``truncate``:
absent means cut). ``long_inputs`` given, TEI's ``truncate`` may only agree with it (``true``: ``truncate``;
``false``: ``error`` or ``windows``, which never cuts); anything else is a 422 ``invalid_option``.

Pooled windows (``pool_windows`` absent or true) answer in the route's own shape: one output per input. With
``pool_windows: false`` each input's answer is the list of its windows, each ``{"window", "start", "end",
"tokens", "embedding"}`` (``text[start:end]`` is the window's text, ``tokens`` the tokens the model read, special
tokens included, ``embedding`` the route's output for that window). HTTP has no per-input errors on these routes: an
input over the worker's ``max_windows`` fails the request (413 ``too_many_windows``, naming the input by its index in
the request), where the Python client keeps the other inputs' outputs as the error's ``partial``.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from embedq import errors
from embedq.windows import TextWindow, failures, split_windows

_INPUT = re.compile(r"inputs\[(\d+)\]")


def renumber(exc: BaseException, offset: int) -> BaseException:
    """A job's :class:`~embedq.errors.TooManyWindows` naming its input by the request's index (the worker names it by
    its index in the job; the request's job ``n`` starts at input ``offset``); any other error as it is."""
    if not offset or not isinstance(exc, errors.TooManyWindows):
        return exc
    return type(exc)(_INPUT.sub(lambda m: f"inputs[{int(m[1]) + offset}]", exc.message, count=1))


def check_failed(payloads: list[dict[str, Any]], size: int) -> None:
    """Raise the first failed input's error (by the request's index, the others counted) when a job's result lists
    inputs that failed alone; ``size``: the inputs of each job but the last."""
    failed: dict[int, BaseException] = {}
    for n, payload in enumerate(payloads):
        for index, error in failures(payload).items():
            failed[n * size + index] = renumber(error, n * size)
    if failed:
        first = min(failed)
        error = failed[first]
        if len(failed) > 1:
            more = ", ".join(str(i) for i in sorted(failed)[1:])
            error = type(error)(f"{error}; inputs {more} failed too")
        raise error


def guarded(answer: Callable[[list[dict[str, Any]]], Any], size: int) -> Callable[[list[dict[str, Any]]], Any]:
    """``answer`` once no input of the jobs failed alone (else their error, :func:`check_failed`)."""

    def checked(payloads: list[dict[str, Any]]) -> Any:
        check_failed(payloads, size)
        return answer(payloads)

    return checked


def windows_of(payloads: list[dict[str, Any]], decode: Callable[[dict[str, Any]], Any]) -> list[list[TextWindow]]:
    """Per input of the request, its windows (``pool_windows: false`` results; ``decode``: one job's output, an
    entry per window)."""
    return [text for payload in payloads for text in split_windows(payload, decode(payload))]


def window_json(window: TextWindow, embedding: Any) -> dict[str, Any]:
    """One window as the gateway answers it."""
    return {"window": window.window, "start": window.start, "end": window.end, "tokens": window.tokens,
            "embedding": embedding}
