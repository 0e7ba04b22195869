"""The ``embedq`` command: ``worker``, ``index`` and ``embed``."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from embedq import __version__, errors
from embedq.settings import Settings


def _embedding_options(ns: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for name in ("prompt", "prompt_name", "dimensions", "truncation_side"):
        value = getattr(ns, name, None)
        if value is not None:
            opts[name] = value
    if getattr(ns, "no_normalize", False):
        opts["normalize"] = False
    return opts


def _add_embedding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="text prepended to every input")
    p.add_argument("--prompt-name", help="a prompt defined by the model (config_sentence_transformers.json)")
    p.add_argument("--dimensions", type=int, help="keep the first N dimensions (matryoshka models)")
    p.add_argument("--truncation-side", choices=["right", "left"])
    p.add_argument("--no-normalize", action="store_true", help="skip the model's Normalize module")


@contextlib.contextmanager
def _broker(settings: Settings, *, quiet: bool):
    """The configured broker, or the embedded default (private redis-server + one worker)."""
    if settings.broker_url:
        yield settings
        return
    from embedq.producers.embedded import embedded_stack

    if not quiet:
        print("embedq: no EMBEDQ_BROKER_URL set; starting a private redis-server and worker", file=sys.stderr)
    with embedded_stack(settings) as live:
        yield live


def cmd_worker(ns: argparse.Namespace, settings: Settings) -> int:
    update = {k: v for k, v in {"device": ns.device, "dtype": ns.dtype, "model": ns.model}.items() if v}
    settings = settings.model_copy(update=update)
    if not settings.broker_url:
        print("embedq worker: set EMBEDQ_BROKER_URL (e.g. redis://127.0.0.1:6379/0)", file=sys.stderr)
        return 2
    from embedq.workers.main import run_worker

    run_worker(settings, hostname=ns.hostname, loglevel=ns.loglevel)
    return 0


def cmd_index(ns: argparse.Namespace, settings: Settings) -> int:
    from embedq.producers.client import Client
    from embedq.producers.indexer import run_index

    with _broker(settings, quiet=ns.quiet) as live, Client(live) as client:
        summary = run_index(client, Path(ns.input), Path(ns.output), chunk_size=ns.chunk_size,
                            max_in_flight=ns.max_in_flight, options=_embedding_options(ns),
                            progress=not ns.quiet)
    print(f"embedq index: {summary.texts} texts, {summary.tokens} tokens in {summary.seconds:.1f}s "
          f"({summary.texts_per_second:.1f} texts/s), {len(summary.failures)} failed -> {ns.output}",
          file=sys.stderr)
    return 1 if summary.failures else 0


def cmd_embed(ns: argparse.Namespace, settings: Settings) -> int:
    from embedq.producers.client import Client

    texts = ns.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    with _broker(settings, quiet=True) as live, Client(live) as client:
        handle = client.submit(texts, **_embedding_options(ns))
        vectors = handle.result(ns.timeout)
    for text, vec in zip(texts, vectors):
        print(json.dumps({"text": text, "embedding": [round(float(x), 7) for x in vec]}))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="embedq", description="Throughput-first text embeddings through Celery and Redis: run a worker, embed a "
        "file into Parquet/NPY, or embed a few texts. Settings come from EMBEDQ_* variables; with no "
        "EMBEDQ_BROKER_URL, index and embed start a private redis-server and worker.")
    parser.add_argument("--version", action="version", version=f"embedq {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    w = sub.add_parser("worker", help="run one worker process for one device")
    w.add_argument("--device", help="cpu or cuda:N (EMBEDQ_DEVICE)")
    w.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], help="(EMBEDQ_DTYPE)")
    w.add_argument("--model", help="model id or local folder (EMBEDQ_MODEL)")
    w.add_argument("--hostname", help="Celery node name")
    w.add_argument("--loglevel", default="INFO")
    w.set_defaults(func=cmd_worker)

    i = sub.add_parser("index", help="embed a JSONL file of {id, text} lines into Parquet or NPY")
    i.add_argument("input")
    i.add_argument("-o", "--output", required=True, help="OUT.parquet or OUT.npy")
    i.add_argument("--chunk-size", type=int, default=64, help="texts per job")
    i.add_argument("--max-in-flight", type=int, default=32, help="jobs submitted but not yet collected")
    i.add_argument("-q", "--quiet", action="store_true")
    _add_embedding_options(i)
    i.set_defaults(func=cmd_index)

    e = sub.add_parser("embed", help="embed texts given as arguments (or stdin lines); prints JSON lines")
    e.add_argument("texts", nargs="*")
    e.add_argument("--timeout", type=float, default=120.0)
    _add_embedding_options(e)
    e.set_defaults(func=cmd_embed)
    return parser


def main(argv: list[str] | None = None) -> int:
    ns = build_parser().parse_args(argv)
    try:
        return ns.func(ns, Settings())
    except errors.EmbedqError as exc:
        print(f"embedq: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
