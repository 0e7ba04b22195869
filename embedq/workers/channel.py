"""Messages between a worker's host processes and its device process (issue 53, step 2): framed byte strings over a
socket pair, each a kind, a numpy structured array of fixed-size records and raw bytes, never a pickle.

The layout issue 53 builds: host processes receive, check and tokenize jobs and write their token ids into their
:class:`~embedq.workers.arena.IdsArena`; one device process per device schedules and launches. Between them go
small records:

* host to device, :data:`HELLO` once, first (no records; its payload a small JSON object: the host's arena, its
  process id, the head names its items' ``head`` codes index); :data:`ITEMS`: one :data:`ITEM` record per item (its
  job's slot on that host, its index in the job, where its ids lie in the host's arena, with its segment ids right
  after them for a pair, its head, prompt length, token cost, traffic class, client and deadline: ``time.monotonic``
  is one clock for every process of a Linux host); :data:`CANCEL`: the slots of jobs whose items the device drops
  unrun;
* device to host, :data:`ROWS`: one :data:`ROW` record per array of a finished item's row (a row is one array, or a
  tuple of them: BGE-M3's dense, lexical and per-token parts), the arrays' bytes one after the other in the
  message's payload; the host reads them as views of the payload (:func:`unpack_rows`), nothing copied;
  :data:`FAILED`: the slots of jobs that failed in the model or were dropped (cancelled, expired), their errors'
  codes and messages as a JSON list in the payload (rare: not the hot path); :data:`STARTED`: the slots of jobs whose
  first micro-batch starts now, sent before it is launched (one message per micro-batch and host), so a host knows
  which of its jobs were in the model if the device process dies (they are blamed, as a worker's are); :data:`STATS`:
  once a second, the device process's counters as JSON (micro-batches, items, tokens, model time), which each host
  shows beside its own (``embedq status``, ``embedq_stats``: one worker with its parts); :data:`ENDED`: the slot of a
  suspect job whose run alone has ended, sent before the device runs anything else (its rows follow from the rows
  thread), so that a later death of the device is not counted against it.

:class:`multiprocessing.connection.Connection` frames the messages (a length before each) over a
:func:`socket.socketpair`, and its ``recv`` raises :class:`EOFError` once the peer's end is closed, which the kernel
does when the peer dies, SIGKILL included: the survivor learns of a death from the channel itself, with no timeout.
A :class:`Channel` is sent to a child process as a ``multiprocessing`` argument (its descriptor goes with it).
"""

from __future__ import annotations

import json
import os
import select
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

import numpy as np

#: Message kinds.
HELLO, ITEMS, CANCEL, ROWS, FREE, FAILED, STARTED, STATS, ENDED = 0, 1, 2, 3, 4, 5, 6, 7, 8
KINDS = {HELLO: "hello", ITEMS: "items", CANCEL: "cancel", ROWS: "rows", FREE: "free", FAILED: "failed",
         STARTED: "started", STATS: "stats", ENDED: "ended"}

#: An item handed to the device process: where its ids lie in the sending host's arena (``types``: its segment ids
#: follow them, ``length`` more), which head turns its output into its row (an index into HELLO's head names), the
#: length of a prompt at its start, and what the scheduler needs (cost, class, client, deadline: NaN for none;
#: ``suspect``: its job runs alone).
ITEM = np.dtype([("slot", "<u8"), ("item", "<u4"), ("offset", "<i8"), ("length", "<u4"), ("types", "u1"),
                 ("head", "u1"), ("prompt", "<u2"), ("cost", "<u4"), ("traffic", "u1"), ("suspect", "u1"),
                 ("client", "<u8"), ("deadline", "<f8")])
#: HELLO's records: none (its payload says it all).
NONE = np.dtype([])
#: A job's slot on its host, for CANCEL and FREE.
SLOT = np.dtype([("slot", "<u8")])
#: One array of a finished item's row: ``part`` is its place in the row's tuple (0 for a row that is one array),
#: ``parts`` how many the row has; its bytes are ``nbytes`` at ``offset`` of the payload.
ROW = np.dtype([("slot", "<u8"), ("item", "<u4"), ("part", "u1"), ("parts", "u1"), ("dtype", "S4"), ("ndim", "u1"),
                ("shape", "<u4", (2,)), ("offset", "<u8"), ("nbytes", "<u8")])
RECORDS = {HELLO: NONE, ITEMS: ITEM, CANCEL: SLOT, ROWS: ROW, FREE: SLOT, FAILED: SLOT, STARTED: SLOT, STATS: NONE,
           ENDED: SLOT}

_HEADER = struct.Struct("<BIQ")  # kind, records, payload bytes
#: The array dtypes a row may hold (what the heads return), by their code in ROW's ``dtype``.
ROW_DTYPES = {"f4": np.float32, "f2": np.float16, "i4": np.int32, "i8": np.int64, "u4": np.uint32}


class ChannelError(Exception):
    """A message that does not parse: a bug of the sender, never an input's fault (peers are this worker's own)."""


@dataclass
class Message:
    kind: int
    records: np.ndarray  # of RECORDS[kind]
    payload: memoryview

    def __repr__(self) -> str:
        return f"Message({KINDS.get(self.kind, self.kind)}, {len(self.records)} records, {len(self.payload)} bytes)"


class Channel:
    """One end of a channel (see the module's docstring). ``send`` and ``recv`` may run on two threads at once; two
    threads must not send, or receive, at once."""

    def __init__(self, conn: Connection) -> None:
        self.conn = conn

    def send(self, kind: int, records: np.ndarray, payload: bytes | memoryview = b"") -> None:
        dtype = RECORDS[kind]
        if records.dtype != dtype:
            raise ChannelError(f"{KINDS[kind]} records are {dtype}, not {records.dtype}")
        self.conn.send_bytes(b"".join((_HEADER.pack(kind, len(records), len(payload)),
                                       np.ascontiguousarray(records).data, payload)))

    def recv(self) -> Message:
        """The next message (blocks); :class:`EOFError` once the other end is closed or its process is gone."""
        data = memoryview(self.conn.recv_bytes())
        if len(data) < _HEADER.size:
            raise ChannelError(f"a message of {len(data)} bytes has no header")
        kind, count, size = _HEADER.unpack_from(data)
        dtype = RECORDS.get(kind)
        if dtype is None:
            raise ChannelError(f"unknown message kind {kind}")
        end = _HEADER.size + count * dtype.itemsize
        if end + size != len(data) or (count and not dtype.itemsize):
            raise ChannelError(f"a {KINDS[kind]} message of {len(data)} bytes announces {count} records and {size} "
                               "bytes of payload")
        records = np.frombuffer(data[_HEADER.size:end], dtype=dtype) if dtype.itemsize else np.zeros(0, dtype)
        return Message(kind, records, data[end:])

    def send_hello(self, fields: dict[str, Any]) -> None:
        """The first message of a host: ``fields`` as JSON (a few hundred bytes, once per connection)."""
        self.send(HELLO, np.zeros(0, NONE), json.dumps(fields).encode())

    def recv_hello(self) -> dict[str, Any]:
        """The peer's HELLO, which must come first."""
        message = self.recv()
        if message.kind != HELLO:
            raise ChannelError(f"a {KINDS[message.kind]} message came before HELLO")
        fields = json.loads(bytes(message.payload))
        if not isinstance(fields, dict):
            raise ChannelError("HELLO's payload is not a JSON object")
        return fields

    def poll(self, timeout: float | None = 0.0) -> bool:
        """Whether a message (or the end of the channel) is there to read within ``timeout`` seconds. One ``select``
        (``Connection.poll`` builds a selector per call: ten times the cost, paid at every preemption point of the
        device). :class:`OSError` once this end is closed."""
        if self.conn.closed:
            raise OSError("the channel is closed")
        ready, _, _ = select.select([self.conn.fileno()], [], [], timeout)
        return bool(ready)

    def fileno(self) -> int:
        return self.conn.fileno()

    def shutdown(self) -> None:
        """End the conversation and close this end: the peer's ``recv`` gets :class:`EOFError`, and so does a thread
        of this process blocked in this end's ``recv`` (a plain :meth:`close` would leave it blocked). Not for the
        parent's copy of an end it handed to a child: that ends the child's channel too."""
        if self.conn.closed:
            return
        try:
            with socket.socket(fileno=os.dup(self.conn.fileno())) as sock:
                sock.shutdown(socket.SHUT_RDWR)
        except OSError:  # the peer's end is gone already
            pass
        self.conn.close()

    def close(self) -> None:
        """Close this process's descriptor of this end (the peer sees EOF once no process holds one)."""
        self.conn.close()


def pair() -> tuple[Channel, Channel]:
    """Two connected ends: one for each process."""
    a, b = socket.socketpair()
    return Channel(Connection(a.detach())), Channel(Connection(b.detach()))


def pack_rows(slots: Sequence[int], items: Sequence[int], rows: Sequence[np.ndarray | tuple[np.ndarray, ...]]
              ) -> tuple[np.ndarray, bytes | memoryview]:
    """ROW records and the payload for finished items' rows (each an array of at most two dimensions, or a tuple of
    them). Rows that are all arrays of one dtype and shape (a dense model's vectors: the common case) are packed in
    one step: their records filled column by column, their bytes one copy."""
    uniform = _uniform(rows)
    if uniform is not None:
        code, shape, ndim = uniform
        block = np.stack(rows)  # type: ignore[arg-type]
        size = block.nbytes // len(rows)
        records = np.zeros(len(rows), dtype=ROW)
        records["slot"], records["item"], records["parts"] = slots, items, 1
        records["dtype"], records["ndim"], records["shape"] = code, ndim, shape
        records["offset"], records["nbytes"] = np.arange(len(rows), dtype=np.uint64) * size, size
        return records, memoryview(block.reshape(-1).view(np.uint8))
    parts = [(slot, item, row if isinstance(row, tuple) else (row,)) for slot, item, row in zip(slots, items, rows)]
    records = np.zeros(sum(len(p) for _, _, p in parts), dtype=ROW)
    chunks: list[bytes | memoryview] = []
    offset = k = 0
    for slot, item, arrays in parts:
        for index, array in enumerate(arrays):
            array = np.asarray(array)
            if not array.flags.c_contiguous:
                array = array.copy()
            code = array.dtype.str[1:]
            if code not in ROW_DTYPES or array.ndim > 2:
                raise ChannelError(f"a row's array is {array.dtype} with {array.ndim} dimensions")
            shape = (*array.shape, 1, 1)[:2]
            records[k] = (slot, item, index, len(arrays), code, array.ndim, shape, offset, array.nbytes)
            chunks.append(memoryview(array.reshape(-1).view(np.uint8)))
            offset += array.nbytes
            k += 1
    return records, b"".join(chunks)


def _uniform(rows: Sequence[Any]) -> tuple[str, tuple[int, int], int] | None:
    """(dtype code, shape as two numbers, dimensions) when every row is a little-endian array of at most two
    dimensions of one dtype and shape that a ROW may hold; else None."""
    if not rows or type(rows[0]) is not np.ndarray:
        return None
    first = rows[0]
    dtype, shape = first.dtype, first.shape
    code = dtype.str[1:]
    if code not in ROW_DTYPES or first.ndim > 2 or dtype.byteorder == ">":
        return None
    for row in rows:
        if type(row) is not np.ndarray or row.shape != shape or row.dtype != dtype:
            return None
    return code, (*shape, 1, 1)[:2], first.ndim


def unpack_rows(records: np.ndarray, payload: memoryview) -> list[tuple[int, int, np.ndarray | tuple[np.ndarray, ...]]]:
    """(slot, item, row) for each finished item of a ROWS message, its arrays views of ``payload``."""
    out: list[tuple[int, int, np.ndarray | tuple[np.ndarray, ...]]] = []
    pending: list[np.ndarray] = []
    columns = zip(records["slot"].tolist(), records["item"].tolist(), records["part"].tolist(),
                  records["parts"].tolist(), records["dtype"].tolist(), records["ndim"].tolist(),
                  records["shape"].tolist(), records["offset"].tolist(), records["nbytes"].tolist())
    for slot, item, part, parts, code, ndim, shape, offset, nbytes in columns:
        if offset + nbytes > len(payload):
            raise ChannelError(f"a row's array at {offset}:{offset + nbytes} lies outside {len(payload)} bytes")
        dtype = ROW_DTYPES.get(code.decode())
        if dtype is None:
            raise ChannelError(f"a row's array has dtype {code!r}")
        if ndim > 2:
            raise ChannelError(f"a row's array has {ndim} dimensions")
        pending.append(np.frombuffer(payload[offset:offset + nbytes], dtype=dtype).reshape(shape[:ndim]))
        if part + 1 == parts:
            row = pending[0] if len(pending) == 1 and parts == 1 else tuple(pending)
            out.append((slot, item, row))
            pending = []
    if pending:
        raise ChannelError("a row's last array is missing")
    return out
