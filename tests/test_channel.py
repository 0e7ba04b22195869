"""The channel between a worker's host processes and its device process (embedq/workers/channel.py): records and
rows through it unchanged, and the end of a peer, SIGKILL included, seen as EOFError at once."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

from embedq.workers import channel
from embedq.workers.channel import CANCEL, ITEM, ITEMS, ROWS, SLOT, ChannelError, pack_rows, unpack_rows

ROOT = Path(__file__).resolve().parents[1]


def _items(n: int) -> np.ndarray:
    records = np.zeros(n, dtype=ITEM)
    records["slot"] = np.arange(n) // 3
    records["item"] = np.arange(n) % 3
    records["offset"] = np.arange(n) * 40
    records["length"] = records["cost"] = 40
    records["traffic"] = np.arange(n) % 2
    records["client"] = 2**63 + 5
    records["head"] = np.arange(n) % 2
    records["prompt"] = 3
    records["types"] = np.arange(n) % 3 == 0
    records["deadline"] = np.where(np.arange(n) % 2, np.nan, 1.5e9)
    return records


def test_records_and_rows_go_through_unchanged():
    a, b = channel.pair()
    try:
        a.send_hello({"arena": "psm_1234", "pid": 77, "heads": ["mean", "tokens"]})
        assert b.recv_hello() == {"arena": "psm_1234", "pid": 77, "heads": ["mean", "tokens"]}
        items = _items(7)
        a.send(ITEMS, items)
        got = b.recv()
        assert got.kind == ITEMS and not len(got.payload)
        assert got.records.tobytes() == items.tobytes()  # (NaN deadlines included)
        a.send(CANCEL, np.array([(3,), (9,)], dtype=SLOT))
        assert b.recv().records["slot"].tolist() == [3, 9]
        rng = np.random.default_rng(0)
        rows = [rng.standard_normal(384).astype(np.float32),  # a dense vector
                rng.standard_normal((11, 384)).astype(np.float16),  # per-token states
                (rng.standard_normal(8).astype(np.float32), np.array([5, 9, 700], np.int32),  # BGE-M3's parts
                 rng.standard_normal(3).astype(np.float32), rng.standard_normal((4, 8)).astype(np.float32)),
                np.float32(0.25).reshape(()),  # a score
                np.zeros((0, 384), np.float32)]  # (an item with no rows of its own)
        records, payload = pack_rows([1, 1, 2, 7, 8], [0, 1, 0, 4, 0], rows)
        b.send(ROWS, records, payload)
        message = a.recv()
        back = unpack_rows(message.records, message.payload)
        assert [(s, i) for s, i, _ in back] == [(1, 0), (1, 1), (2, 0), (7, 4), (8, 0)]
        for (_, _, got_row), want in zip(back, rows):
            if isinstance(want, tuple):
                assert isinstance(got_row, tuple) and len(got_row) == len(want)
                pairs = list(zip(got_row, want))
            else:
                pairs = [(got_row, want)]
            for g, w in pairs:
                assert g.dtype == w.dtype and g.shape == w.shape and np.array_equal(g, w)
        # Rows of one dtype and shape (a dense model's vectors) take pack_rows' one-step path: the same records.
        dense = [rng.standard_normal(384).astype(np.float32) for _ in range(5)]
        records, payload = pack_rows([4, 4, 4, 9, 9], [0, 1, 2, 0, 1], dense)
        assert records.tobytes() == pack_rows([4, 4, 4, 9, 9], [0, 1, 2, 0, 1], [*dense[:4], (dense[4],)])[0].tobytes()
        b.send(ROWS, records, payload)
        back = unpack_rows(*(lambda m: (m.records, m.payload))(a.recv()))
        assert [(s, i) for s, i, _ in back] == [(4, 0), (4, 1), (4, 2), (9, 0), (9, 1)]
        assert all(g.dtype == np.float32 and np.array_equal(g, w) for (_, _, g), w in zip(back, dense))
        with pytest.raises(ChannelError):
            a.send(ITEMS, np.zeros(2, dtype=SLOT))  # records of another kind
        with pytest.raises(ChannelError):
            pack_rows([0], [0], [np.zeros((2, 2, 2), np.float32)])
    finally:
        a.close()
        b.close()


def test_a_malformed_message_is_a_channel_error_not_a_wrong_read():
    a, b = channel.pair()
    try:
        a.conn.send_bytes(b"\x01\x05\x00\x00\x00" + bytes(8) + bytes(10))  # 5 items announced, 10 bytes sent
        with pytest.raises(ChannelError, match="announces 5 records"):
            b.recv()
        a.conn.send_bytes(b"\x63" + bytes(12))
        with pytest.raises(ChannelError, match="unknown message kind"):
            b.recv()
        a.send(CANCEL, np.zeros(1, dtype=SLOT))
        with pytest.raises(ChannelError, match="before HELLO"):
            b.recv_hello()
        records, payload = pack_rows([0], [0], [np.zeros(4, np.float32)])
        records["nbytes"] = 64
        with pytest.raises(ChannelError, match="outside"):
            unpack_rows(records, memoryview(payload))
    finally:
        a.close()
        b.close()


PEER = textwrap.dedent("""
    import sys
    from multiprocessing.connection import Connection
    import numpy as np
    from embedq.workers.channel import Channel, ITEMS, ROWS, pack_rows
    ch = Channel(Connection(int(sys.argv[1])))
    while True:
        message = ch.recv()
        if message.kind == ITEMS:  # answer each item with a row of its offset, then wait for more
            r = message.records
            rows = [np.full(4, float(o), np.float32) for o in r["offset"]]
            ch.send(ROWS, *pack_rows(r["slot"].tolist(), r["item"].tolist(), rows))
""")


@pytest.mark.integration
def test_another_process_answers_through_it_and_its_sigkill_is_an_eof_at_once():
    mine, theirs = channel.pair()
    fd = theirs.fileno()
    peer = subprocess.Popen([sys.executable, "-c", PEER, str(fd)], pass_fds=[fd],
                            env={**os.environ, "PYTHONPATH": str(ROOT)})
    theirs.close()  # the child holds its own copy: its death closes the last one
    try:
        items = _items(5)
        mine.send(ITEMS, items)
        rows = unpack_rows(*(lambda m: (m.records, m.payload))(mine.recv()))
        assert [(s, i) for s, i, _ in rows] == list(zip(items["slot"].tolist(), items["item"].tolist()))
        assert [float(r[0]) for _, _, r in rows] == items["offset"].astype(float).tolist()
        peer.send_signal(signal.SIGKILL)
        assert peer.wait(30) == -signal.SIGKILL
        assert mine.poll(30)  # readable: the end of the channel, no timeout needed to see it
        with pytest.raises(EOFError):
            mine.recv()
    finally:
        peer.kill()
        peer.wait()
        mine.close()
