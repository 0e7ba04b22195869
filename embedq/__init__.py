"""embedq: throughput-first asynchronous text embeddings on Celery and Redis.

The producer API lives here (``embedq.Client``); importing it never imports torch,
transformers or tokenizers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from embedq.version import __version__

__all__ = ["Client", "JobHandle", "Settings", "__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from embedq.producers.client import Client, JobHandle
    from embedq.settings import Settings


def __getattr__(name: str) -> Any:
    # Lazy, so `import embedq.batching` stays free of Celery.
    if name in ("Client", "JobHandle"):
        from embedq.producers import client

        return getattr(client, name)
    if name == "Settings":
        from embedq.settings import Settings

        return Settings
    raise AttributeError(name)
