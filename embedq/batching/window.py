"""How many more messages a worker may take: a prefetch window counted in texts, not only messages.

Celery (through kombu's QoS) bounds a worker by *messages* held unacknowledged. For embedding jobs that
is the wrong unit: 64 one-text jobs give the scheduler too little to pack (measured: 27 % padding),
while 64 jobs of 2,048 texts would buffer 131,072 texts — far more than drains before Redis's
visibility timeout redelivers them. :class:`PrefetchWindow` keeps both bounds: at most
``max_messages`` messages and, once ``max_texts`` texts are held, no new message until some are
done. The worker turns :meth:`PrefetchWindow.limit` into the channel's prefetch count.
"""

from __future__ import annotations


class PrefetchWindow:
    """Texts and messages held by a worker; not thread-safe (the consumer thread owns it)."""

    def __init__(self, *, max_messages: int, max_texts: int) -> None:
        if max_messages < 1 or max_texts < 1:
            raise ValueError("max_messages and max_texts must be positive")
        self.max_messages = max_messages
        self.max_texts = max_texts
        self.messages = 0
        self.texts = 0
        self.peak_messages = 0
        self.peak_texts = 0

    def received(self, texts: int) -> None:
        self.messages += 1
        self.texts += max(texts, 1)
        self.peak_messages = max(self.peak_messages, self.messages)
        self.peak_texts = max(self.peak_texts, self.texts)

    def released(self, texts: int) -> None:
        self.messages = max(self.messages - 1, 0)
        self.texts = max(self.texts - max(texts, 1), 0)

    def limit(self) -> int:
        """The prefetch count to apply now: messages held plus those that may still come (≥ 1).

        Each new message brings at least one text, so ``max_texts - texts`` more may come; while the
        text budget is spent, the limit equals what is held and nothing new is delivered. A message
        can overshoot the text budget by its own size less one (bounded by the texts-per-job cap).
        """
        room = min(self.max_messages - self.messages, self.max_texts - self.texts)
        return max(self.messages + max(room, 0), 1)
