"""Delivery bookkeeping in Redis: attempts, graceful returns, dead letters and message leases.

Celery on Redis delivers at least once: a message a worker received sits in kombu's ``unacked`` hash
until it is acknowledged, and comes back to the queue when its worker is gone. Three things make that
safe for embedq:

* **Leases.** kombu redelivers a message once its timestamp in the ``unacked_index`` sorted set is older
  than ``visibility_timeout``, whether or not its worker is still busy with it. A worker therefore
  renews the timestamps of every message it holds (:func:`renew_leases`, every visibility_timeout/4),
  so a held message is never redelivered while its worker lives, and a dead worker's messages come back
  after ``visibility_timeout`` however long the buffer is.
* **Attempts.** A redelivered message is checked before it is run (:meth:`Ledger.check`): a job whose
  result is already stored is acknowledged without running again (the crash came between store and
  ack); a job that may have taken a worker down runs *alone*, counted while it runs, so after
  ``max_attempts`` crashes it is dead-lettered (a terminal ``dead_letter`` error and an entry in
  :data:`DEAD_LETTERS`) instead of killing workers forever. Jobs that merely sat in a dying worker's
  buffer are never counted, and jobs a stopping worker hands back on SIGTERM are marked returned, so
  neither is ever mistaken for a poison job.
* **Idempotence.** Every record is keyed by the job id: running a job twice stores the same record.

Keys are declared here once; every one has a TTL.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from typing import Any

from celery import states

from embedq.keys import ATTEMPTS_KEY, CANVAS_KEY, DEAD_LETTERS, RETURNED_KEY

log = logging.getLogger(__name__)

DEAD_LETTERS_KEPT = 10_000
BOOKKEEPING_TTL = 7 * 24 * 3600


@dataclass(frozen=True)
class Verdict:
    """What a redelivered message's history says about it."""

    stored: bool = False  # a terminal record exists: acknowledge, do not run
    canvas_pending: bool = False  # stored, and its canvas work may not have been sent (results.py's marker)
    record: dict[str, Any] | None = None  # the stored record (decoded) when stored
    suspect: bool = False  # it may have killed a worker: run it alone, counting the run
    crashes: int = 0  # worker deaths it may have caused so far


class Ledger:
    """Per-job delivery records, in the result backend's Redis (``backend.client``)."""

    def __init__(self, backend: Any, *, max_attempts: int) -> None:
        self.backend = backend
        self.max_attempts = max_attempts

    @property
    def client(self) -> Any:
        return self.backend.client

    def check(self, job_id: str, *, redelivered: bool = True) -> Verdict:
        """Consumer thread, for a redelivered or resent message only (first deliveries cost no round trip).

        A copy a producer resent (``redelivered=False``: after a broker restart, or after ``resend_after``)
        is no evidence of a crash by itself; but a job that is already a suspect stays one, whichever copy
        comes: a resent copy of a poison job run in a batch would take the worker down uncounted."""
        pipe = self.client.pipeline(transaction=False)
        pipe.get(RETURNED_KEY.format(job_id))
        pipe.delete(RETURNED_KEY.format(job_id))
        pipe.get(ATTEMPTS_KEY.format(job_id))
        pipe.get(self.backend.get_key_for_task(job_id))
        pipe.exists(CANVAS_KEY.format(job_id))
        returned, _, attempts, meta, canvas = pipe.execute()
        if meta is not None:
            try:
                record = self.backend.decode_result(meta)
                if record.get("status") in states.READY_STATES:
                    return Verdict(stored=True, canvas_pending=bool(canvas), record=record)
            except Exception:  # an unreadable record is overwritten by running the job again
                log.warning("job %s has an unreadable stored record; running it again", job_id)
        if attempts is None:
            if returned or not redelivered:  # handed back by a stopping worker, or resent: a plain delivery
                return Verdict()
            # Its last delivery ended with the worker gone (it may have been in the running micro-batch):
            # from now on it runs alone. The key's existence is the mark.
            self.client.set(ATTEMPTS_KEY.format(job_id), 0, ex=BOOKKEEPING_TTL, nx=True)
            return Verdict(suspect=True, crashes=1)
        # Each counted run that did not finish is a crash, plus the presumed one that made it a suspect.
        return Verdict(suspect=True, crashes=int(attempts) + 1)

    def count_run(self, job_id: str, delta: int = 1) -> None:
        """Inference thread: +1 before a suspect job runs alone, -1 once its run is over (so only a run
        the worker died in stays counted)."""
        pipe = self.client.pipeline(transaction=False)
        pipe.incrby(ATTEMPTS_KEY.format(job_id), delta)
        pipe.expire(ATTEMPTS_KEY.format(job_id), BOOKKEEPING_TTL)
        pipe.execute()

    def returned(self, job_ids: list[str]) -> None:
        """A stopping worker hands these jobs back: their next delivery is not a suspect one."""
        if not job_ids:
            return
        pipe = self.client.pipeline(transaction=False)
        for job_id in job_ids:
            pipe.set(RETURNED_KEY.format(job_id), 1, ex=BOOKKEEPING_TTL)
        pipe.execute()

    def dead_letter(self, job_id: str, *, queue: str, crashes: int, worker: str, texts: int) -> None:
        record = {"id": job_id, "queue": queue, "crashes": crashes, "worker": worker, "texts": texts,
                  "time": time.time(), "reason": f"the worker died during {crashes} deliveries of this job"}
        pipe = self.client.pipeline(transaction=False)
        pipe.lpush(DEAD_LETTERS, json.dumps(record))
        pipe.ltrim(DEAD_LETTERS, 0, DEAD_LETTERS_KEPT - 1)
        pipe.delete(ATTEMPTS_KEY.format(job_id))
        pipe.execute()


def dead_letters(client: Any, limit: int = 100) -> list[dict[str, Any]]:
    """The newest dead-letter records (for operators and tests)."""
    return [json.loads(raw) for raw in client.lrange(DEAD_LETTERS, 0, limit - 1)]


#: Renew the lease of each held message (ARGV[2..]) whose record is in kombu's unacked hash (KEYS[1]): its timestamp in
#: the index (KEYS[2]) becomes ARGV[1]. Returns the tags without a record (after a failover to a replica that had not
#: received it yet): the caller records them again.
_RENEW = """
local missing = {}
for i = 2, #ARGV do
  if redis.call('HEXISTS', KEYS[1], ARGV[i]) == 1 then
    redis.call('ZADD', KEYS[2], ARGV[1], ARGV[i])
  else
    missing[#missing + 1] = ARGV[i]
  end
end
return missing
"""


def renew_leases(channel: Any, messages: list[Any]) -> tuple[int, int]:
    """Reset the unacked-index timestamps of held messages (kombu messages with ``delivery_tag``), and record again
    the held messages whose record Redis does not have: a failover to a replica that had not yet received a message's
    record (replication is asynchronous) would otherwise leave it nowhere but in this worker's memory, so the death
    of this worker would lose it. Recorded exactly as kombu's ``QoS.append`` records a delivery. Returns (renewed,
    recorded again)."""
    if not messages:
        return 0, 0
    from kombu.utils.json import dumps

    now = time.time()
    renewed = recorded = 0
    by_tag = {m.delivery_tag: m for m in messages}
    tags = list(by_tag)
    with channel.conn_or_acquire() as client:
        script = client.register_script(_RENEW)
        for start in range(0, len(tags), 1000):
            chunk = tags[start:start + 1000]
            missing = [t.decode() if isinstance(t, bytes) else t
                       for t in script(keys=[channel.unacked_key, channel.unacked_index_key], args=[now, *chunk],
                                       client=client)]
            renewed += len(chunk) - len(missing)
            if missing:
                pipe = client.pipeline()
                for tag in missing:
                    message = by_tag[tag]
                    info = message.delivery_info
                    pipe.hset(channel.unacked_key, tag,
                              dumps([message._raw, info["exchange"], info["routing_key"]]))
                    pipe.zadd(channel.unacked_index_key, {tag: now})
                pipe.execute()
                recorded += len(missing)
    if recorded:
        log.warning("recorded %d held messages again: the broker had lost their delivery records (a failover)",
                    recorded)
    return renewed, recorded
