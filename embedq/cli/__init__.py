"""The ``embedq`` command: ``worker``, ``index``, ``embed``, ``verify``, ``status``, ``serve``, ``flower``, ``acl``."""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from embedq import errors
from embedq.cli import acl, flower
from embedq.producers.index.sinks.registry import schemes_help, sink_schemes
from embedq.settings import Settings
from embedq.version import __version__


def _embedding_options(ns: argparse.Namespace) -> dict[str, Any]:
    opts: dict[str, Any] = {}
    for name in ("prompt", "prompt_name", "dimensions", "truncation_side"):
        value = getattr(ns, name, None)
        if value is not None:
            opts[name] = value
    if getattr(ns, "no_normalize", False):
        opts["normalize"] = False
    if getattr(ns, "no_truncate", False):
        opts["truncate"] = False
    return opts


def _positive(kind: type) -> Any:
    def parse(text: str) -> Any:
        value = kind(text)
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be positive, got {text}")
        return value

    parse.__name__ = kind.__name__
    return parse


def _seconds(text: str) -> float:
    value = float(text)
    if not value >= 0:  # NaN too
        raise argparse.ArgumentTypeError(f"must be 0 or more seconds (or inf), got {text}")
    return value


def _add_embedding_options(p: argparse.ArgumentParser) -> None:
    p.add_argument("--prompt", help="text prepended to every input")
    p.add_argument("--prompt-name", help="a prompt defined by the model (config_sentence_transformers.json)")
    p.add_argument("--dimensions", type=_positive(int), help="keep the first N dimensions (matryoshka models)")
    p.add_argument("--truncation-side", choices=["right", "left"])
    p.add_argument("--no-normalize", action="store_true", help="skip the model's Normalize module")
    p.add_argument("--no-truncate", action="store_true", help="a text over the model's limit fails instead")
    p.add_argument("--model", help="model id or local folder; picks the queue (EMBEDQ_MODEL)")


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
    update = {k: v for k, v in {"device": ns.device, "dtype": ns.dtype, "model": ns.model,
                                "trust_remote_code": ns.trust_remote_code}.items() if v}
    if ns.pooling:  # through the validator: TEI's spelling (last-token) is accepted
        try:
            update["pooling"] = Settings.model_validate({"pooling": ns.pooling}).pooling
        except ValueError:
            print(f"embedq worker: unknown --pooling {ns.pooling!r}", file=sys.stderr)
            return 2
    settings = settings.model_copy(update=update)
    if not settings.broker_url:
        print("embedq worker: set EMBEDQ_BROKER_URL (e.g. redis://127.0.0.1:6379/0)", file=sys.stderr)
        return 2
    if ns.processes is not None:
        settings = settings.model_copy(update={"worker_processes": ns.processes})
    if ns.device_process:
        settings = settings.model_copy(update={"device_process": True})
    from embedq.workers import replicas
    from embedq.workers.main import default_hostname

    count = replicas.processes_for(settings)
    if settings.device_process and not replicas.is_replica():
        from embedq.workers.split import run_split

        return run_split(settings, count, hostname=ns.hostname or default_hostname(settings), loglevel=ns.loglevel)
    if count > 1:
        return replicas.run_replicas(settings, count, hostname=ns.hostname or default_hostname(settings),
                                     loglevel=ns.loglevel)
    from embedq.workers.main import run_worker

    run_worker(settings, hostname=ns.hostname, loglevel=ns.loglevel)
    return 0


def cmd_index(ns: argparse.Namespace, settings: Settings) -> int:
    import signal

    from embedq.producers.client import Client
    from embedq.producers.index import IndexConfig, run_index
    from embedq.producers.index.precheck import nothing_to_embed
    from embedq.producers.index.sinks.contract import check_flags
    from embedq.producers.index.sinks.registry import load_sinks, output_target
    from embedq.producers.index.sources import Source
    from embedq.producers.index.windowed import per_window, window_options

    if ns.model:
        settings = settings.model_copy(update={"model": ns.model})
    options = _embedding_options(ns)
    if ns.no_truncate and ns.long_inputs not in (None, "error"):
        raise errors.InvalidOption(f"--no-truncate is --long-inputs error: not with --long-inputs {ns.long_inputs}")
    options.update(window_options(ns.long_inputs or "truncate", ns.window_overlap))
    config = IndexConfig(
        chunk_size=ns.chunk_size, max_in_flight=ns.max_in_flight, options=options,
        vector_dtype=ns.vector_dtype, job_timeout=ns.job_timeout, checkpoint_seconds=ns.checkpoint_seconds,
        shard_rows=ns.shard_rows, overwrite=ns.overwrite, progress=not ns.quiet, kind=ns.kind, outputs=ns.outputs,
        wait_for_worker=ns.wait_for_worker, connect_timeout=settings.broker_timeout,
        errors_file=Path(ns.errors) if ns.errors else None, ann_index=ns.build_index, store_text=ns.store_text,
        prune=ns.prune, reuse=list(ns.reuse or []),
    )
    # the input and a database output are checked before anything starts (a private stack included): a refused run
    # leaves nothing
    source = Source(ns.input, ns.input_format, text_field=ns.text_field, id_field=ns.id_field)
    source.check()
    load_sinks(settings.sink_plugins)  # a plugin's scheme (EMBEDQ_SINKS, entry points embedq.sinks)
    target = output_target(ns.output, ns.output_format, config)
    check_flags(target, build_index=ns.build_index, store_text=ns.store_text, windows=per_window(options))
    target.check()

    def _stop(signum: int, frame: Any) -> None:  # SIGTERM (systemd, kill): stop like Ctrl-C (the run's own
        raise KeyboardInterrupt  # handler, once it runs, commits first)

    signal.signal(signal.SIGTERM, _stop)
    summary = None
    if not settings.broker_url and ns.input != "-":  # the embedded default: start nothing if nothing is missing
        summary = nothing_to_embed(source, target, ns.output_format, config, settings.model, settings.max_chars)
    if summary is None:
        with _broker(settings, quiet=ns.quiet) as live, Client(live) as client:
            summary = run_index(client, source, target, config=config)
    print(summary.render(), file=sys.stderr)
    if ns.json:
        print(json.dumps(summary.as_dict()))
    if summary.interrupted:
        return 130
    return 1 if summary.failed else 0


def cmd_embed(ns: argparse.Namespace, settings: Settings) -> int:
    from embedq.producers.client import Client

    if ns.model:
        settings = settings.model_copy(update={"model": ns.model})
    texts = ns.texts or [line.rstrip("\n") for line in sys.stdin if line.strip()]
    with _broker(settings, quiet=False) as live, Client(live) as client:  # says so on stderr when it starts one
        handle = client.submit(texts, traffic_class=ns.traffic_class, deadline=ns.deadline, **_embedding_options(ns))
        vectors = handle.result(ns.timeout)
    for text, vec in zip(texts, vectors):
        print(json.dumps({"text": text, "embedding": [round(float(x), 7) for x in vec]}))
    return 0


def cmd_verify(ns: argparse.Namespace, settings: Settings) -> int:
    from embedq.backends import resolve_model_path
    from embedq.cli import verify

    if ns.model:
        settings = settings.model_copy(update={"model": ns.model})
    folder = Path(ns.reference) if ns.reference else resolve_model_path(settings.model)
    if not folder.is_dir():
        raise errors.InvalidOption(f"--reference {folder} is not a model folder")
    ids, texts = verify.read_texts(ns.texts, input_format=ns.input_format, text_field=ns.text_field,
                                   id_field=ns.id_field, limit=ns.limit)
    reference = verify.Reference(folder.resolve(), trust_remote_code=ns.trust_remote_code or settings.trust_remote_code)
    prompt = reference.prompt(ns.prompt, ns.prompt_name)
    api = ns.api or ("openai" if "/v1" in (ns.endpoint or "") or (ns.endpoint or "").endswith("/embeddings")
                     else "tei")
    if ns.endpoint:
        key = ns.api_key or (settings.api_key.get_secret_value() if settings.api_key else None)
        served = verify.served_by_endpoint(ns.endpoint, texts, api=api, model=ns.endpoint_model or settings.model,
                                           api_key=key, prompt=ns.prompt, prompt_name=ns.prompt_name,
                                           normalize=reference.normalizes, timeout=ns.timeout)
    else:
        with _broker(settings, quiet=ns.json) as live:
            served = verify.served_by_queue(live, texts, prompt=ns.prompt, prompt_name=ns.prompt_name,
                                            timeout=ns.timeout)
    report = verify.compare(reference, served, ids, texts, prompt=prompt,
                            normalized_by_api=bool(ns.endpoint) and api == "openai",
                            min_cosine=ns.min_cosine, max_delta=ns.max_delta)
    if ns.json:
        print(json.dumps(report.as_dict()))
    else:
        print(report.render(show=ns.show))
    return 0 if report.passed else 1


def cmd_status(ns: argparse.Namespace, settings: Settings) -> int:
    from embedq.producers.status import show_status

    if not settings.broker_url:
        print("embedq status: set EMBEDQ_BROKER_URL (e.g. redis://127.0.0.1:6379/0)", file=sys.stderr)
        return 2
    return show_status(settings, queues=ns.queue or [], as_json=ns.json, watch=ns.watch, wide=ns.wide,
                       worker=ns.worker)


def cmd_serve(ns: argparse.Namespace, settings: Settings) -> int:
    if not settings.broker_url:
        print("embedq serve: set EMBEDQ_BROKER_URL (e.g. redis://127.0.0.1:6379/0)", file=sys.stderr)
        return 2
    try:
        import uvicorn

        from embedq.gateway.app import create_app
    except ImportError as exc:
        print(f"embedq serve: the gateway is not installed ({exc.name}): {errors.install_hint('gateway')}",
              file=sys.stderr)
        return 2
    if ns.model:
        settings = settings.model_copy(update={"model": ns.model})
    key = settings.api_key.get_secret_value() if settings.api_key else None
    if key is None and ns.host not in ("127.0.0.1", "localhost", "::1"):
        print(f"embedq serve: warning: no EMBEDQ_API_KEY, and listening on {ns.host}", file=sys.stderr)
    uvicorn.run(create_app(settings, api_key=key), host=ns.host, port=ns.port, log_level=ns.loglevel.lower(),
                access_log=ns.access_log, lifespan="on",  # "on": a gateway that cannot start its waiter exits
                loop=ns.loop, http=ns.http)
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
    w.add_argument("--pooling", help="override an embedding model's pooling, as TEI's --pooling: cls, mean, "
                   "last-token, max, weightedmean, mean_sqrt_len_tokens; or splade for a bare masked-LM folder "
                   "(EMBEDQ_POOLING). Another pooling is another embedding space: its fingerprint says so")
    w.add_argument("--trust-remote-code", action="store_true",
                   help="run the code a model folder ships (auto_map), from the folder only (EMBEDQ_TRUST_REMOTE_CODE)")
    w.add_argument("--processes", type=int, metavar="N",
                   help="worker processes (replicas) for the device, each with its own model copy, under one "
                   "supervisor (EMBEDQ_WORKER_PROCESSES; default: one per four cores on a GPU, at most four; one on "
                   "the CPU)")
    w.add_argument("--device-process", action="store_true", default=None,
                   help="the split layout: one device process runs the model and schedules the items of every host "
                   "process; the hosts (--processes of them) receive, tokenize, encode and store "
                   "(EMBEDQ_DEVICE_PROCESS; docs/ARCHITECTURE.md *Processes*)")
    w.add_argument("--hostname", help="Celery node name (replica i of several: NAME-r<i>)")
    w.add_argument("--loglevel", default="INFO")
    w.set_defaults(func=cmd_worker)

    *outputs, last = ["Parquet", "NPY", "JSONL", *(s.name for s in sink_schemes())]
    i = sub.add_parser(
        "index", help=f"embed a file (JSONL, CSV, Parquet, text or stdin) into {', '.join(outputs)} or {last}; "
        "resumable",
        description="Embed every record of INPUT into OUTPUT. Run the same command again after an "
        "interruption and it embeds only the ids missing from OUTPUT; an OUTPUT made with another model or "
        "other options is refused. Input, broker and a live worker on the queue are checked before OUTPUT is "
        "created. Ctrl-C or SIGTERM stops it at once, committing what has arrived. Exit code: 0 all embedded, 1 some "
        "records failed (see the errors file), 2 refused or broken, 130 interrupted (Ctrl-C or SIGTERM).")
    i.add_argument("input", help="a .jsonl/.csv/.tsv/.parquet/.txt file (.gz for line formats) or - for stdin")
    i.add_argument("-o", "--output", required=True,
                   help="OUT.parquet (a directory of shards), OUT.npy (+ OUT.ids.txt), OUT.jsonl, or a database: "
                   f"{schemes_help()}; docs/INDEXING.md")
    i.add_argument("--input-format", choices=["jsonl", "csv", "tsv", "parquet", "text"],
                   help="default: from the input's suffix; stdin: jsonl if its first line is a JSON object, else text")
    i.add_argument("--output-format", choices=["parquet", "npy", "jsonl"], help="default: from the output's suffix")
    i.add_argument("--text-field", default="text", help="field or column holding the text (default: text)")
    i.add_argument("--id-field", help="field or column holding the id (default: id when present, else the line "
                   "or row number)")
    i.add_argument("--kind", default="embed",
                   help="what to store, any kind with index outputs: dense vectors (embed), SPLADE weights "
                   "(embed_sparse or sparse: indices + values), per-token vectors (embed_all or multi), BGE-M3's dense "
                   "+ lexical + ColBERT (embed_hybrid or bge-m3), or a plugin's kind (EMBEDQ_KINDS); all but embed "
                   "write Parquet or a database")
    i.add_argument("--outputs", type=lambda text: [o.strip() for o in text.split(",") if o.strip()],
                   metavar="A,B", help="a kind with several outputs (bge-m3: dense,lexical,colbert): which to make and "
                   "store (default: all, or all the database stores, saying which it leaves out)")
    i.add_argument("--vector-dtype", choices=["float32", "float16"], default="float32",
                   help="how vectors are stored (float16 also halves what crosses Redis)")
    i.add_argument("--chunk-size", type=_positive(int), default=64, help="texts per job (default 64)")
    i.add_argument("--max-in-flight", type=_positive(int), default=32,
                   help="jobs submitted and not yet collected (default 32)")
    i.add_argument("--job-timeout", type=_positive(float), default=600.0,
                   help="seconds the oldest job may go without a result before it is resubmitted (default 600)")
    i.add_argument("--checkpoint-seconds", type=_positive(float), default=60.0,
                   help="commit the output at least this often (default 60; what a crash can cost)")
    i.add_argument("--shard-rows", type=_positive(int), default=100_000, help="rows per Parquet shard at most")
    i.add_argument("--wait-for-worker", type=_seconds, default=10.0, metavar="SECONDS",
                   help="before sending anything, wait this long for a live worker on the queue, then refuse "
                   "(exit 2, naming the queue and what the live workers serve); inf waits for ever, for workers "
                   "that scale up from zero (default 10)")
    i.add_argument("--overwrite", action="store_true", help="delete an existing output and start afresh")
    i.add_argument("--errors", metavar="FILE", help="where the failed records go (default: OUTPUT.errors.jsonl "
                   "beside a file output; for a database, in the current folder, named after the table and a hash "
                   "of the URL)")
    i.add_argument("--build-index", action="store_true", help="a database output: build its ANN index (pgvector: HNSW; "
                   "LanceDB: IVF_HNSW_SQ; cosine) after the load; its time is reported on its own line")
    i.add_argument("--store-text", action="store_true", help="a database or Parquet output: store each text (with "
                   "--long-inputs windows, each window's text) beside its vectors")
    i.add_argument("--prune", action="store_true", help="after a complete run, remove the ids the output holds "
                   "that the input no longer has (re-indexing a corpus into the same output: unchanged texts are kept, "
                   "edited ones replaced, new ids added)")
    i.add_argument("--reuse", action="append", metavar="OUTPUT", help="take the vectors of texts another output of the "
                   "same model and options holds (by content hash) instead of embedding them again, e.g. last night's "
                   "Parquet into tonight's pgvector table; may be given more than once")
    i.add_argument("--long-inputs", choices=["truncate", "error", "windows"],
                   help="a text longer than the model reads: truncate it (default), fail it (error: --no-truncate), "
                   "or cut it into windows of the model's length and write one row per window (Parquet or a "
                   "database: id, window, start, end, the kind's columns; --store-text: the window's text); a text "
                   "over the worker's EMBEDQ_MAX_WINDOWS fails alone (too_many_windows)")
    i.add_argument("--window-overlap", type=int, metavar="N",
                   help="--long-inputs windows: tokens each window shares with the one before it (default 0)")
    i.add_argument("--json", action="store_true", help="also print the summary as JSON on stdout")
    i.add_argument("-q", "--quiet", action="store_true", help="no progress bar")
    _add_embedding_options(i)
    i.set_defaults(func=cmd_index)

    e = sub.add_parser("embed", help="embed texts given as arguments (or stdin lines); prints JSON lines")
    e.add_argument("texts", nargs="*", help="the texts to embed, one argument each (none: one text per line of stdin, "
                   "blank lines skipped)")
    e.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS",
                   help="how long to wait for the vectors (default 120); past it: exit 2, [timeout]")
    e.add_argument("--traffic-class", choices=["online", "bulk"], default="online",
                   help="online (default: served first) or bulk (fills the rest of each micro-batch)")
    e.add_argument("--deadline", type=_positive(float), metavar="SECONDS",
                   help="drop the job unrun if it has not started within SECONDS (error: expired)")
    _add_embedding_options(e)
    e.set_defaults(func=cmd_embed)

    v = sub.add_parser(
        "verify", help="check a server's vectors against sentence-transformers on the same model folder",
        description="Embed TEXTS (a file the indexer reads, or a built-in sample) through embedq's queue (or, with "
        "--endpoint, any TEI- or OpenAI-style HTTP endpoint: embedq's gateway, a TEI server, a hosted API) and "
        "with sentence-transformers on the model folder (float32, batch_size=1), and print each text's cosine and "
        "max |delta|, a summary, and what the served vectors match instead when they fail. Thresholds: cosine >= "
        "0.99999 and max |delta| <= 1e-5 when the server computes in float32; cosine >= 0.999 in float16/bfloat16 "
        "or when it does not say. Exit code: 0 pass, 1 fail, 2 could not run.")
    v.add_argument("texts", nargs="?", help="a .jsonl/.csv/.tsv/.parquet/.txt file or - (default: a built-in "
                   "sample of queries, passages, non-ASCII, code and a text over every model's limit)")
    v.add_argument("--model", help="the served model (EMBEDQ_MODEL): its queue, and the reference folder")
    v.add_argument("--reference", metavar="FOLDER", help="the model folder sentence-transformers loads (default: "
                   "the folder of --model)")
    v.add_argument("--endpoint", metavar="URL", help="an HTTP endpoint instead of the queue: a base URL, or the "
                   "route itself (.../embed, .../v1/embeddings)")
    v.add_argument("--api", choices=["tei", "openai"], help="the endpoint's API (default: openai when the URL has "
                   "/v1 or ends in /embeddings, else tei)")
    v.add_argument("--endpoint-model", help="the model name an OpenAI-style endpoint is asked for (default: --model)")
    v.add_argument("--api-key", help="bearer token for the endpoint (default: EMBEDQ_API_KEY)")
    v.add_argument("--prompt", help="text prepended to every input (as sentence-transformers' prompt=)")
    v.add_argument("--prompt-name", help="a prompt defined by the model (default: its default_prompt_name)")
    v.add_argument("--input-format", choices=["jsonl", "csv", "tsv", "parquet", "text"])
    v.add_argument("--text-field", default="text")
    v.add_argument("--id-field")
    v.add_argument("--limit", type=_positive(int), default=200, help="texts to compare at most (default 200)")
    v.add_argument("--min-cosine", type=float, help="fail below this cosine (default: by the served dtype)")
    v.add_argument("--max-delta", type=float, help="fail above this max |delta| (default: 1e-5 in float32)")
    v.add_argument("--trust-remote-code", action="store_true",
                   help="let sentence-transformers run the folder's own code (EMBEDQ_TRUST_REMOTE_CODE)")
    v.add_argument("--timeout", type=_positive(float), default=300.0, help="seconds to wait for the vectors")
    v.add_argument("--show", type=int, default=20, help="per-text lines printed, worst first (0: all)")
    v.add_argument("--json", action="store_true", help="print one JSON object (every text) instead")
    v.set_defaults(func=cmd_verify)

    s = sub.add_parser("status", help="queues and their depths, live workers, recent throughput",
                       description="Read the broker's queues (waiting + unacknowledged messages) and the live-worker "
                       "registry (workers report every 5 s) and print them as tables. Exit code 2 when the broker "
                       "cannot be reached.")
    s.add_argument("--queue", action="append", help="also show this queue (repeatable); by default every queue "
                   "declared on the broker")
    s.add_argument("--json", action="store_true", help="print one JSON object instead of tables")
    s.add_argument("--wide", action="store_true", help="every column of the live workers (dtype, queues, rates, "
                   "padding, ...) and the online/bulk table; for a terminal wider than 100 columns")
    s.add_argument("--worker", metavar="NAME", help="one worker's whole record: its node name, part of it, or its "
                   "pid (with --json: its records as JSON)")
    s.add_argument("--watch", type=_positive(float), metavar="SECONDS", help="refresh every SECONDS until Ctrl-C")
    s.set_defaults(func=cmd_status)

    g = sub.add_parser("serve", help="the HTTP gateway: TEI's and OpenAI's embedding APIs over the queue",
                       description="Serve OpenAI's POST /v1/embeddings and TEI's routes (/embed, /rerank, /predict, "
                       "/embed_sparse, /tokenize, /decode, ...), async /jobs, GET /info and /health for the model of "
                       "EMBEDQ_MODEL (its queue) and those of EMBEDQ_GATEWAY_MODELS, through the broker of "
                       "EMBEDQ_BROKER_URL. Stateless: run as many as you like. EMBEDQ_API_KEY turns on bearer auth.")
    g.add_argument("--host", default="127.0.0.1")
    g.add_argument("--port", type=int, default=8080)
    g.add_argument("--model", help="the served model (EMBEDQ_MODEL): its queue, and the name /info reports")
    g.add_argument("--loglevel", default="INFO")
    g.add_argument("--access-log", action="store_true", help="log every request (never its Authorization header)")
    g.add_argument("--loop", choices=["auto", "uvloop", "asyncio"], default="auto",
                   help="uvicorn's event loop (auto: uvloop when installed, as the gateway extra does)")
    g.add_argument("--http", choices=["auto", "httptools", "h11"], default="auto",
                   help="uvicorn's HTTP parser (auto: httptools when installed)")
    g.set_defaults(func=cmd_serve)

    flower.add_parser(sub)
    acl.add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    ns, extra = parser.parse_known_args(argv)
    if extra and not getattr(ns, "passthrough", False):
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    try:
        settings = Settings()
    except ValidationError as exc:  # a setting from the environment that cannot be right: name it, no traceback
        for problem in exc.errors():
            name = "EMBEDQ_" + "_".join(str(p) for p in problem["loc"]).upper()
            print(f"embedq: {name}: {problem['msg'].removeprefix('Value error, ')}", file=sys.stderr)
        return 2
    try:
        if getattr(ns, "passthrough", False):
            return ns.func(ns, settings, extra)
        return ns.func(ns, settings)
    except errors.EmbedqError as exc:
        print(f"embedq: {exc.message}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
