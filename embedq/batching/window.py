"""How many more messages a worker may take: a prefetch window counted in texts, not only messages.

Celery (through kombu's QoS) bounds a worker by *messages* held unacknowledged. For embedding jobs that
is the wrong unit: 64 one-text jobs give the scheduler too little to pack (measured: 27 % padding),
while 64 jobs of 2,048 texts would buffer 131,072 texts — far more than drains before Redis's
visibility timeout redelivers them. :class:`PrefetchWindow` keeps both bounds: at most
``max_messages`` messages and, once ``max_texts`` texts are held, no new message until some are
done. The worker turns :meth:`PrefetchWindow.limit` into the channel's prefetch count.

With traffic classes, a share of the window (``online_reserve``) is kept for online jobs: bulk jobs may
fill the rest, so a saturating bulk run never leaves an online job waiting in Redis for room. The
worker's transport asks :meth:`PrefetchWindow.admits` which queues to fetch from, online first.

Online jobs may also go past ``max_texts``, by up to ``online_overflow`` texts (issue 50): a small online job that
waits in Redis behind one client's flood is then fetched, and the worker's fair scheduler puts its texts in the
next micro-batch, instead of leaving it in the queue until the flood's jobs are done. The overflow is a hard bound
like the rest (what reaches past it waits in Redis); what keeps a queue from holding more than that is admission
at the producers.
"""

from __future__ import annotations

#: How fast the size estimate of a class's large messages fades, per message (after 100 one-text jobs, a 100-text
#: job counts as 13).
SIZE_FADE = 0.98


class PrefetchWindow:
    """Texts and messages held by a worker; not thread-safe (the consumer thread owns it)."""

    def __init__(self, *, max_messages: int, max_texts: int, online_reserve: float = 0.0,
                 online_overflow: int = 0) -> None:
        if max_messages < 1 or max_texts < 1:
            raise ValueError("max_messages and max_texts must be positive")
        if online_overflow < 0:
            raise ValueError("online_overflow must not be negative")
        if not 0.0 <= online_reserve < 1.0:
            raise ValueError("online_reserve must be at least 0 and less than 1")
        self.max_messages = max_messages
        self.max_texts = max_texts
        self.online_texts = max_texts + online_overflow  # what online jobs may fill
        # What bulk jobs may hold at most (at least one message, so bulk always makes progress).
        self.bulk_messages = max(int(max_messages * (1 - online_reserve)), 1)
        self.bulk_texts = max(int(max_texts * (1 - online_reserve)), 1)
        self.messages = 0
        self.texts = 0
        self.bulk_held = [0, 0]  # messages, texts of bulk jobs
        self.peak_messages = 0
        self.peak_texts = 0
        # The size of a large message of each class (online, bulk) lately: the largest seen, fading by
        # SIZE_FADE a message. Sizes a fetch of many messages (fetch_room).
        self._large = [1.0, 1.0]

    def received(self, texts: int, *, bulk: bool = False) -> None:
        self._large[bulk] = max(float(max(texts, 1)), self._large[bulk] * SIZE_FADE)
        self.messages += 1
        self.texts += max(texts, 1)
        if bulk:
            self.bulk_held[0] += 1
            self.bulk_held[1] += max(texts, 1)
        self.peak_messages = max(self.peak_messages, self.messages)
        self.peak_texts = max(self.peak_texts, self.texts)

    def received_more(self, texts: int, *, bulk: bool = False) -> None:
        """A held message turned out to hold ``texts`` more items than it was counted for (long texts in windows):
        they are held too, and :meth:`released` with its message."""
        self.texts += texts
        if bulk:
            self.bulk_held[1] += texts
        self.peak_texts = max(self.peak_texts, self.texts)

    def released(self, texts: int, *, bulk: bool = False) -> None:
        self.messages = max(self.messages - 1, 0)
        self.texts = max(self.texts - max(texts, 1), 0)
        if bulk:
            self.bulk_held[0] = max(self.bulk_held[0] - 1, 0)
            self.bulk_held[1] = max(self.bulk_held[1] - max(texts, 1), 0)

    def admits(self, *, bulk: bool) -> bool:
        """May one more job of this class be fetched now? Online may use the whole window and its overflow; bulk
        only its share of the window (counting the bulk jobs held)."""
        if self.messages >= self.max_messages:
            return False
        if not bulk:
            return self.texts < self.online_texts
        return (self.texts < self.max_texts and self.bulk_held[0] < self.bulk_messages
                and self.bulk_held[1] < self.bulk_texts)

    def fetch_room(self, *, bulk: bool, most: int) -> int:
        """How many messages of this class one fetch may take at once now (at most ``most``): the messages the
        window has room for, and the texts it has room for at the size of a large message of this class lately.
        The estimate only sizes the fetch: the transport hands back, unseen, what arrives once :meth:`admits` says
        no (see ``workers/transport.py``), so the window's bounds hold whatever the messages hold."""
        if not self.admits(bulk=bulk):
            return 0
        messages, texts = self.max_messages - self.messages, self.online_texts - self.texts
        if bulk:
            texts = self.max_texts - self.texts
            messages = min(messages, self.bulk_messages - self.bulk_held[0])
            texts = min(texts, self.bulk_texts - self.bulk_held[1])
        return max(min(most, messages, int(texts / self._large[bulk])), 1)

    def limit(self) -> int:
        """The prefetch count to apply now: messages held plus those that may still come (≥ 1).

        Each new message brings at least one text, so ``max_texts - texts`` more may come (plus the online
        overflow); while the text budget is spent, the limit equals what is held and nothing new is delivered. A message
        can overshoot the text budget by its own size less one (bounded by the texts-per-job cap).
        """
        room = min(self.max_messages - self.messages, self.online_texts - self.texts)
        return max(self.messages + max(room, 0), 1)
