"""The worker: Celery app, coalescing consumer and the embedding service."""
