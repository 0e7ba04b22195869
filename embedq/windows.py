"""A ``long_inputs="windows"`` job's result as a Python caller reads it (producer side: no torch, no tokenizer).

The worker (:mod:`embedq.backends.windowing`) cuts each text into windows of the model's length. A result with
windows carries, beside the kind's own arrays:

* ``window_offsets`` (int32, inputs + 1): input ``i``'s windows are ``window_offsets[i]:window_offsets[i+1]``
  (a text that failed has none);
* with ``pool_windows=False``, the kind's arrays hold one entry per *window* (in input order), and
  ``window_spans`` (int32, windows × 2: ``start``, ``end`` in characters of the input, ``text[start:end]`` being
  the window's text) and ``window_tokens`` (int32, windows: the tokens the model read, special tokens and prompt
  included); with ``pool_windows=True`` (the default) one entry per input, pooled over its windows;
* ``failed`` (only when a text failed): ``[{"index", "code", "message", "retryable"}]``, one per text that failed
  alone (``too_many_windows``); a pooled output of such a text is zeros (dense) or empty (sparse, per-token);
* ``usage.windows``: the windows embedded; ``fingerprint.window_overlap`` and ``fingerprint.pool_windows``.

:func:`decode_windows` turns that into the kind's output (pooled), or per input the list of its
:class:`TextWindow` (per window); a result with failed texts raises the first one's typed error, which carries
that output as ``partial`` and every failure as ``failed`` (index → error).
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

from embedq import errors
from embedq.protocol import HybridEmbedding, decode_array


@dataclass(frozen=True)
class TextWindow:
    """One window of an input: its number within the input, its characters ``[start, end)``, the tokens the model
    read, and the kind's output for it (a vector, a :class:`~embedq.protocol.SparseVector`, a per-token array, a
    :class:`~embedq.protocol.HybridEmbedding` of one window)."""

    window: int
    start: int
    end: int
    tokens: int
    output: Any


def has_windows(payload: Any) -> bool:
    return isinstance(payload, dict) and "window_offsets" in payload


def _take(decoded: Any, k: int) -> Any:
    if isinstance(decoded, HybridEmbedding):
        return HybridEmbedding(None if decoded.dense is None else decoded.dense[k],
                               None if decoded.lexical is None else decoded.lexical[k],
                               None if decoded.colbert is None else decoded.colbert[k])
    return decoded[k]


def failures(payload: dict[str, Any]) -> dict[int, errors.EmbedqError]:
    """The texts of a result that failed alone, by input index, as typed errors."""
    classes = {cls.code: cls for cls in errors.table()}
    return {int(entry["index"]): classes.get(entry.get("code"), errors.EmbedqError)(str(entry.get("message", "")))
            for entry in payload.get("failed") or ()}


def split_windows(payload: dict[str, Any], decoded: Any) -> list[list[TextWindow]]:
    """A per-window result (``pool_windows=False``): per input, its windows with ``decoded``'s entries (the kind's
    output decoded over every window)."""
    offsets = decode_array(payload["window_offsets"]).tolist()
    spans = decode_array(payload["window_spans"]).reshape(-1, 2).tolist()
    tokens = decode_array(payload["window_tokens"]).tolist()
    return [[TextWindow(k - a, spans[k][0], spans[k][1], tokens[k], _take(decoded, k)) for k in range(a, b)]
            for a, b in itertools.pairwise(offsets)]


def decode_windows(spec: Any, payload: dict[str, Any], texts: Any = None) -> Any:
    """A windows result for a Python caller (see the module's docstring): ``spec`` is the job's kind."""
    decoded = spec.decode(payload, None)
    out = decoded if payload["fingerprint"].get("pool_windows", True) else split_windows(payload, decoded)
    failed = failures(payload)
    if failed:
        first = failed[min(failed)]
        more = f" (and {len(failed) - 1} more inputs)" if len(failed) > 1 else ""
        error = type(first)(f"{first.message}{more}; the job's other inputs are in this error's `partial`")
        error.partial = out  # type: ignore[attr-defined]
        error.failed = failed  # type: ignore[attr-defined]
        raise error
    return out
