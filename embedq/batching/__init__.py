"""Pure scheduling logic: token-budget packing and the buffer of waiting items.

Imports no Celery, Redis or torch, so it is table- and property-tested on its own.
"""

from embedq.batching.fair import FairScheduler
from embedq.batching.items import Item, batch_cost
from embedq.batching.packer import plan
from embedq.batching.scheduler import Scheduler
from embedq.batching.window import PrefetchWindow

__all__ = ["FairScheduler", "Item", "PrefetchWindow", "Scheduler", "batch_cost", "plan"]
