"""Queue path: what a job costs embedq's worker and producer with a model that costs nearly nothing (CPU).

    python bench/pipeline.py                          # 4,000 one-text jobs, 1,000 32-text jobs
    python bench/pipeline.py --jobs 500 --texts 3200  # quick
    python bench/pipeline.py --compare-env EMBEDQ_X=2 # the 32-text shape again with that worker setting

The model is a near-free BERT (hidden 32, 1 layer, all-MiniLM-L6-v2's tokenizer, mean pooling +
Normalize), built once under /tmp/embedq-bench-models/nearfree, run on PyTorch's kernels with 1 thread:
what is left is the queue path (message, decode, tokenize, schedule, result, ack). For each shape (one-text
online jobs; 32-text bulk jobs) a private redis-server and one ``embedq worker`` are started and warmed up,
the worker's process group is paused (SIGSTOP), every job is submitted (producer CPU per job), the group
is resumed (SIGCONT, the clock starts) and every result collected (the clock stops at the last one).
Worker CPU is utime+stime of every process of its tree, from /proc. Floors, in the same run: the
tokenizer alone on the same texts, and a plain Celery no-op task on a solo worker (bench/noop_worker.py); and two
rows for the model: transformers' own forward, and embedq's backend forward loaded as the worker loads it (the same
EMBEDQ_* settings: runtime, threads, memory policy), so the worker's CPU beyond that row is the queue path's own.
``--worker-env EMBEDQ_LINEAR_KERNEL=onnxruntime`` runs the runtime ``auto`` usually picks on a CPU.
The last line is the headline ratio: worker CPU per one-text job / no-op task.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import embedq  # noqa: E402
from bench.models import SHAPES, build_sentence_encoder  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.keys import KOMBU_UNACKED  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

CORPUS = ROOT / "data" / "corpus.jsonl"
MODEL_DIR = Path("/tmp/embedq-bench-models/nearfree")
HIDDEN, LAYERS, HEADS, INTERMEDIATE = SHAPES["nearfree"]
MAX_SEQ = 256
TICK = os.sysconf("SC_CLK_TCK")
TIMEOUT = 1800.0
WORKER_ENV = {"EMBEDQ_LINEAR_KERNEL": "torch", "EMBEDQ_TORCH_THREADS": "1"}  # a fixed runtime: no start-up timing
TOKENIZE = dict(padding=False, truncation=True, max_length=MAX_SEQ, return_attention_mask=False,
                return_token_type_ids=False)  # as the worker calls it (embedq/backends/tokenizing.py)


def load_texts(path: Path, n: int) -> list[str]:
    """``n`` texts of the corpus, repeated as often as needed."""
    with path.open() as fh:
        corpus = [json.loads(line)["text"] for line in fh]
    return [corpus[i % len(corpus)] for i in range(n)]


def build_nearfree(out: Path, seed: int = 0) -> Path:
    """The near-free model as a sentence-transformers folder, built once (an existing one is kept)."""
    return build_sentence_encoder(out, shape="nearfree", max_seq_length=MAX_SEQ, seed=seed)


# -- CPU of process trees, from /proc ---------------------------------------------------------------------------

def _stat(path: str) -> tuple[str, list[str]] | None:
    """(comm, fields from the state on) of a /proc stat file; None when the process or thread is gone."""
    try:
        with open(path) as fh:
            data = fh.read()
    except OSError:
        return None
    return data[data.index("(") + 1:data.rindex(")")], data[data.rindex(")") + 2:].split()


def tree_pids(root: int) -> list[int]:
    """``root``, every process of its process group, and all their descendants."""
    parents: dict[int, int] = {}
    members = {root}
    for name in os.listdir("/proc"):
        if name.isdigit() and (found := _stat(f"/proc/{name}/stat")):
            parents[int(name)] = int(found[1][1])
            if int(found[1][2]) == root:
                members.add(int(name))
    grew = True
    while grew:
        new = {pid for pid, ppid in parents.items() if ppid in members} - members
        members |= new
        grew = bool(new)
    return sorted(members)


def tree_times(root: int) -> tuple[float, float]:
    """Seconds of (user, system) CPU of the tree: each live process's own, plus what its reaped children used
    (cutime, cstime), so processes that came and went still count."""
    user = system = 0
    for pid in tree_pids(root):
        if found := _stat(f"/proc/{pid}/stat"):
            utime, stime, cutime, cstime = (int(v) for v in found[1][11:15])
            user, system = user + utime + cutime, system + stime + cstime
    return user / TICK, system / TICK


def tree_cpu(root: int) -> float:
    return sum(tree_times(root))


def device_cpu(root: int) -> float:
    """Seconds of CPU of the tree's device process (``embedq worker --device-process``: workers/device_main.py), its
    own threads only; 0 without one."""
    total = 0.0
    for pid in tree_pids(root):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"embedq.workers.device_main" in cmdline and (found := _stat(f"/proc/{pid}/stat")):
            total += sum(int(v) for v in found[1][11:13]) / TICK
    return total


def thread_cpu(root: int) -> dict[str, float]:
    """Seconds of CPU per thread of the tree, labelled ``pid/main`` or ``pid/tid comm``."""
    out = {}
    for pid in tree_pids(root):
        try:
            tids = os.listdir(f"/proc/{pid}/task")
        except OSError:
            continue
        for tid in tids:
            if found := _stat(f"/proc/{pid}/task/{tid}/stat"):
                label = f"{pid}/main" if tid == str(pid) else f"{pid}/{tid} {found[0]}"
                out[label] = sum(int(v) for v in found[1][11:13]) / TICK
    return out


def self_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)  # every thread of this process
    return usage.ru_utime + usage.ru_stime


def pause(pid: int, stop: bool) -> None:
    os.killpg(os.getpgid(pid), signal.SIGSTOP if stop else signal.SIGCONT)


def idle_rate(pid: int, seconds: float = 2.0) -> float:
    """CPU ms per second the tree spends with nothing to do (timers, polls)."""
    c0, t0 = tree_cpu(pid), time.perf_counter()
    time.sleep(seconds)
    return (tree_cpu(pid) - c0) / (time.perf_counter() - t0) * 1e3


# -- embedq ------------------------------------------------------------------------------------------------------

def producer_api(client: Client, force_loop: bool) -> tuple[str, Callable[..., list], Callable[..., list]]:
    """(name, submit(jobs, traffic_class), collect(handles)): the batch calls when the Client has them."""
    if not force_loop and hasattr(client, "submit_many") and hasattr(client, "collect"):
        return ("Client.submit_many + Client.collect",
                lambda jobs, tc: client.submit_many(jobs, traffic_class=tc, queue=client.settings.queue_for(tc)),
                lambda handles: client.collect(handles, timeout=TIMEOUT))
    return ("loop of Client.submit + JobHandle.result",
            lambda jobs, tc: [client.submit(job, traffic_class=tc) for job in jobs],
            lambda handles: [h.result(timeout=TIMEOUT) for h in handles])


STATS = ("batches", "items", "real_tokens", "padded_tokens", "inference_seconds", "results_seconds", "jobs_succeeded",
         "model_cpu_seconds")


def _stats(client: Client, pid: int) -> dict[str, Any]:
    """The worker's counters; a worker of several processes (``EMBEDQ_WORKER_PROCESSES``): its replicas' summed; a
    split worker's (``--device-process``): its hosts' jobs, and its device process's micro-batches (each host shows
    the same device counters: taken once)."""
    replies = client.workers(2)
    mine = [s for node, s in replies.items() if f"-{pid}@" in node or f"-{pid}-r" in node]
    out = {k: sum(s.get(k, 0) for s in mine) for k in STATS}
    device = next((s["device_process"] for s in mine if s.get("device_process")), None)
    if device is not None:
        out.update({k: device[k] for k in STATS if k in device})
    return out


def run_embedq(texts: list[str], job_size: int, traffic_class: str, worker_env: dict[str, str], log: Path, *,
               force_loop: bool, warmup: int) -> dict[str, Any]:
    """One worker on a private Redis; every job submitted while it is paused, collected once it resumes."""
    jobs = [texts[i:i + job_size] for i in range(0, len(texts), job_size)]
    with RedisServer() as redis_server:
        settings = Settings(broker_url=redis_server.url, model=str(MODEL_DIR))
        # The producer may not refuse (online) or hold back (bulk) jobs queued behind a paused worker.
        room = max(2 * (len(jobs) + warmup) + 64, settings.online_queue_limit, settings.bulk_queue_limit)
        client = Client(settings.model_copy(update={"online_queue_limit": room, "bulk_queue_limit": room}))
        env = {"PYTHONPATH": str(ROOT), **WORKER_ENV, **worker_env}
        proc = start_worker(settings, log_path=log, extra_env=env)
        api, submit, collect = producer_api(client, force_loop)
        try:
            wait_for_worker(client.app, proc, timeout=600, log_path=log,
                            processes=int(env.get("EMBEDQ_WORKER_PROCESSES", 1)))
            collect(submit(jobs[:warmup], traffic_class))  # warm-up: the same shape through the same calls
            idle = idle_rate(proc.pid)
            before = _stats(client, proc.pid)
            pause(proc.pid, True)
            try:
                c0 = self_cpu()
                handles = submit(jobs, traffic_class)
                submit_cpu = self_cpu() - c0
                w0, r0, th0 = tree_times(proc.pid), tree_cpu(redis_server.proc.pid), thread_cpu(proc.pid)
                d0 = device_cpu(proc.pid)
            finally:
                pause(proc.pid, False)
            t0 = time.perf_counter()
            c1 = self_cpu()
            results = collect(handles)
            elapsed = time.perf_counter() - t0
            collect_cpu = self_cpu() - c1
            r1 = tree_cpu(redis_server.proc.pid)
            # The last acks come just after the last result: the window ends once kombu holds no unacked message.
            redis, deadline = client.redis(), time.monotonic() + 10
            while redis.hlen(KOMBU_UNACKED) and time.monotonic() < deadline:
                time.sleep(0.005)
            w1, th1, procs = tree_times(proc.pid), thread_cpu(proc.pid), len(tree_pids(proc.pid))
            d1 = device_cpu(proc.pid)
            after = _stats(client, proc.pid)
            # A split worker's device counters reach its hosts once a second (STATS): read them once they count
            # every text of the run.
            while after["items"] - before["items"] < len(texts) and time.monotonic() < deadline + 10:
                time.sleep(0.1)
                after = _stats(client, proc.pid)
        finally:
            stop_worker(proc)
            client.close()
    rows = sum(len(r) for r in results)
    if rows != len(texts):
        raise SystemExit(f"collected {rows} vectors for {len(texts)} texts")
    threads = sorted(((th1[k] - th0.get(k, 0.0)) * 1e3 / len(jobs), k) for k in th1)[::-1][:4]
    delta = {k: after.get(k, 0) - before.get(k, 0) for k in STATS}
    n, t = len(jobs), len(texts)
    worker, system = sum(w1) - sum(w0), w1[1] - w0[1]
    return {"api": api, "jobs": n, "texts": t, "seconds": elapsed, "jobs_s": n / elapsed, "texts_s": t / elapsed,
            "worker_ms_job": worker * 1e3 / n, "worker_ms_text": worker * 1e3 / t, "worker_sys_share": system / worker,
            "device_ms_text": (d1 - d0) * 1e3 / t,
            "submit_ms_job": submit_cpu * 1e3 / n, "collect_ms_result": collect_cpu * 1e3 / n,
            "redis_ms_job": (r1 - r0) * 1e3 / n, "worker_idle_ms_s": idle, "worker_processes": procs,
            "threads_ms_job": [[label, ms] for ms, label in threads], "worker_stats": delta}


# -- floors ------------------------------------------------------------------------------------------------------

def run_noop(n: int, log: Path, warmup: int) -> dict[str, Any]:
    """A plain Celery task that does nothing, on a solo worker: N sent while it is paused, then collected."""
    from celery import Celery

    with RedisServer() as redis_server:
        env = {**os.environ, "NOOP_BROKER_URL": redis_server.url, "PYTHONPATH": str(ROOT)}
        with log.open("ab") as out:
            proc = subprocess.Popen([sys.executable, "-m", "celery", "-A", "bench.noop_worker", "worker",
                                     "--pool=solo", "-c", "1", "--without-gossip", "--without-mingle",
                                     "--loglevel=WARNING"], env=env, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        app = Celery("noop-producer", broker=redis_server.url, backend=redis_server.url, set_as_current=False)
        app.conf.update(task_serializer="json", result_serializer="json", accept_content=["json"])
        try:
            app.send_task("noop.noop").get(timeout=300)  # the worker is up
            for r in [app.send_task("noop.noop") for _ in range(warmup)]:
                r.get(timeout=60)
            idle = idle_rate(proc.pid)
            pause(proc.pid, True)
            try:
                c0 = self_cpu()
                results = [app.send_task("noop.noop") for _ in range(n)]
                send_cpu = self_cpu() - c0
                w0, r0 = tree_cpu(proc.pid), tree_cpu(redis_server.proc.pid)
            finally:
                pause(proc.pid, False)
            t0 = time.perf_counter()
            c1 = self_cpu()
            for r in results:
                r.get(timeout=TIMEOUT)
            elapsed = time.perf_counter() - t0
            collect_cpu = self_cpu() - c1
            w1, r1 = tree_cpu(proc.pid), tree_cpu(redis_server.proc.pid)
        finally:
            pause(proc.pid, False)
            proc.terminate()
            proc.wait(30)
            app.close()
    return {"jobs": n, "texts": n, "seconds": elapsed, "jobs_s": n / elapsed, "texts_s": n / elapsed,
            "worker_ms_job": (w1 - w0) * 1e3 / n, "worker_ms_text": (w1 - w0) * 1e3 / n,
            "submit_ms_job": send_cpu * 1e3 / n, "collect_ms_result": collect_cpu * 1e3 / n,
            "redis_ms_job": (r1 - r0) * 1e3 / n, "worker_idle_ms_s": idle}


def tokenizer_floor(corpus: Path, n: int, chunk: int) -> dict[str, Any]:
    """CPU ms per text of the fast tokenizer alone, in calls of ``chunk`` texts (this process, every thread)."""
    from transformers import AutoTokenizer

    texts = load_texts(corpus, n)
    tok = AutoTokenizer.from_pretrained(str(MODEL_DIR))
    tok(texts[:chunk], **TOKENIZE)  # warm-up
    c0, t0 = self_cpu(), time.perf_counter()
    for i in range(0, len(texts), chunk):
        tok(texts[i:i + chunk], **TOKENIZE)
    return {"texts": n, "seconds": time.perf_counter() - t0, "ms_text": (self_cpu() - c0) * 1e3 / n}


def budget_batches(rows: list, length: Callable[[Any], int], budget: int) -> list[list]:
    """``rows`` sorted by ``length`` and cut into batches of at most ``budget`` padded tokens (a row longer than the
    budget is a batch of its own)."""
    rows = sorted(rows, key=length)
    batches, start = [], 0
    for end in range(1, len(rows) + 1):  # sorted: the last row of a batch is its longest
        if end == len(rows) or length(rows[end]) * (end + 1 - start) > budget:
            batches.append(rows[start:end])
            start = end
    return batches


def padded_batches(ids: list[list[int]], budget: int) -> list[tuple[Any, Any]]:
    """Token ids cut by :func:`budget_batches` into (input_ids, attention_mask) tensors, right-padded with 0."""
    import torch

    tensors = []
    for batch in budget_batches(ids, len, budget):
        width = len(batch[-1])
        tensors.append((torch.tensor([row + [0] * (width - len(row)) for row in batch]),
                        torch.tensor([[1] * len(row) + [0] * (width - len(row)) for row in batch])))
    return tensors


def model_floor(corpus: Path, n: int, budget: int = 2048) -> dict[str, Any]:
    """CPU ms per text of the model's forward alone (transformers, 1 thread, mean pooling + normalize) on the same
    texts, length-sorted into batches of at most ``budget`` padded tokens; tokenizing not counted."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    torch.set_num_threads(1)
    ids = AutoTokenizer.from_pretrained(str(MODEL_DIR))(load_texts(corpus, n), **TOKENIZE)["input_ids"]
    tensors = padded_batches(ids, budget)
    model = AutoModel.from_pretrained(str(MODEL_DIR)).eval()

    def run(part: list) -> None:
        for input_ids, mask in part:
            hidden = model(input_ids=input_ids, attention_mask=mask).last_hidden_state
            m = mask.unsqueeze(-1).to(hidden.dtype)
            torch.nn.functional.normalize((hidden * m).sum(1) / m.sum(1), dim=-1)

    with torch.inference_mode():
        run(tensors[:8])  # warm-up
        c0, t0 = self_cpu(), time.perf_counter()
        run(tensors)
    return {"texts": n, "seconds": time.perf_counter() - t0, "ms_text": (self_cpu() - c0) * 1e3 / n,
            "batches": len(tensors)}


def backend_floor(corpus: Path, n: int) -> dict[str, Any]:
    """CPU ms per text of embedq's own backend forward, loaded as the worker loads it (its settings from the same
    EMBEDQ_* environment: runtime, threads, memory policy), on the same texts, length-sorted into micro-batches of at
    most ``batch_tokens`` padded tokens; tokenizing not counted. What the model costs the worker's inference thread
    when nothing else runs: the queue path's own cost is the rest."""
    from embedq.settings import Settings
    from embedq.workers import memory

    settings = Settings()
    memory.configure(settings.memory_policy)  # before torch is imported, as the worker does
    from embedq.backends import load_backend
    from embedq.protocol import EmbedOptions

    backend = load_backend(str(MODEL_DIR), settings.backend())
    policy = memory.settle(settings.memory_policy, backend.runtime_facts())
    items = [item for text in load_texts(corpus, n) for item in backend.prepare("embed", [text], EmbedOptions()).items]
    batches = budget_batches(items, lambda item: len(item.ids), settings.batch_tokens)
    for batch in batches[:8]:  # warm-up
        backend.forward(batch)
    c0, t0 = self_cpu(), time.perf_counter()
    for batch in batches:
        backend.forward(batch)
    return {"texts": n, "seconds": time.perf_counter() - t0, "ms_text": (self_cpu() - c0) * 1e3 / n,
            "batches": len(batches), "runtime": backend.info.linear_kernel, "memory_policy": policy}


def run_floor(kind: str, corpus: Path, n: int, chunk: int, parallel: bool = False,
              env_extra: dict[str, str] | None = None) -> dict[str, Any]:
    """A floor in a fresh process: TOKENIZERS_PARALLELISM is read once per process, and this one must not set it
    for the workers it starts."""
    env = {**os.environ, **(env_extra or {}), "TOKENIZERS_PARALLELISM": "true" if parallel else "false"}
    out = subprocess.run([sys.executable, __file__, "--floor-only", kind, "--corpus", str(corpus), "--texts", str(n),
                          "--chunk", str(chunk)], env=env, check=True, capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


# -- report ------------------------------------------------------------------------------------------------------

def median_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Field by field median of the numeric figures of several rounds (the rest from the last round)."""
    out = dict(runs[-1])
    for key, value in runs[-1].items():
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            out[key] = statistics.median(r[key] for r in runs)
    return out


def git_state() -> str:
    def git(*args: str) -> str:
        done = subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True)
        return done.stdout.strip() if done.returncode == 0 else "?"
    dirty = git("status", "--porcelain", "--", "embedq")
    return git("rev-parse", "--short", "HEAD") + (" + uncommitted changes in embedq/" if dirty else "")


def print_report(args: argparse.Namespace, med: dict[str, dict[str, Any]], ratios: list[tuple]) -> None:
    env = " ".join(f"{k}={v}" for k, v in {**WORKER_ENV, **args.worker_env}.items())
    print(f"# embedq queue path  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  cpus={os.cpu_count()}")
    print(f"# CPU: {cpu_summary()}")
    print(f"# embedq {embedq.__version__} from {Path(embedq.__file__).parent} (git {git_state()}); "
          f"worker env: {env}")
    print(f"# model: near-free BERT (hidden {HIDDEN}, {LAYERS} layer, {HEADS} heads, intermediate {INTERMEDIATE}, "
          f"MiniLM's tokenizer, mean + Normalize) at {MODEL_DIR}")
    print(f"# producer API: {med['one']['api']}; rounds: {args.rounds} (medians); corpus {args.corpus}")
    head = (f"{'run':<40} {'jobs':>6} {'texts':>6} {'seconds':>7} {'jobs/s':>8} {'texts/s':>8} {'wkr ms/job':>10} "
            f"{'wkr ms/text':>11} {'submit ms/job':>13} {'collect ms/res':>14} {'redis ms/job':>12}")
    print(head)
    rows = [(f"embedq, 1-text jobs ({args.one_class})", med["one"]), (f"embedq, 32-text jobs ({args.bulk_class})",
                                                                     med["bulk"])]
    if "compare" in med:
        rows.append((f"embedq, 32-text jobs, {' '.join(args.compare_env_raw)}", med["compare"]))
    rows.append(("plain Celery no-op task, solo worker", med["noop"]))
    for name, r in rows:
        print(f"{name:<40} {r['jobs']:>6} {r['texts']:>6} {r['seconds']:>7.2f} {r['jobs_s']:>8.1f} "
              f"{r['texts_s']:>8.1f} {r['worker_ms_job']:>10.3f} {r['worker_ms_text']:>11.4f} "
              f"{r['submit_ms_job']:>13.3f} {r['collect_ms_result']:>14.3f} {r['redis_ms_job']:>12.3f}")
    for key, label in (("tok1", f"tokenizer alone (1 thread, calls of {args.chunk})"),
                       ("tokp", f"tokenizer alone (parallel, calls of {args.chunk})"),
                       ("model", "model forward alone (1 thread, 2048 tok)"),
                       ("backend", f"embedq backend forward alone ({med['backend'].get('runtime', '?')}, "
                                   f"{med['backend'].get('memory_policy', '?')})")):
        t = med[key]
        print(f"{label:<40} {'':>6} {t['texts']:>6} "
              f"{t['seconds']:>7.2f} {'':>8} {t['texts'] / t['seconds']:>8.1f} {'':>10} {t['ms_text']:>11.4f}")
    for key in ("one", "bulk", "compare"):
        if key in med:
            r, s = med[key], med[key]["worker_stats"]
            pad = 1 - s["real_tokens"] / max(s["padded_tokens"], 1)
            top = ", ".join(f"{label} {ms:.3f}" for label, ms in r["threads_ms_job"])
            print(f"# {key}: {r['worker_processes']} worker process(es), {r['worker_sys_share']:.0%} of its CPU in "
                  f"the kernel, idle {r['worker_idle_ms_s']:.1f} CPU ms/s; "
                  f"{s['batches']} micro-batches, padding {pad:.0%}, model "
                  f"{s['inference_seconds']:.2f} s ({s['model_cpu_seconds'] * 1e3 / r['texts']:.4f} CPU ms/text in "
                  f"place), results thread {s['results_seconds']:.2f} s; "
                  f"threads (CPU ms/job): {top}")
    print(f"# noop: worker idle {med['noop']['worker_idle_ms_s']:.1f} CPU ms/s")
    print(f"{'ratio':<62} {'measured':>9} {'target':>8}")
    for name, value, target, ok in ratios:
        mark = "" if ok is None else ("met" if ok else "MISSED")
        print(f"{name:<62} {value:>9.3f} {target:>8} {mark}")
    print(f"worker CPU per 1-text job / no-op task (headline): {ratios[0][1]:.2f}x  (target ≤ 0.6)")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--jobs", type=int, default=4000, help="one-text jobs (and no-op tasks)")
    p.add_argument("--texts", type=int, default=32000, help="texts in 32-text jobs")
    p.add_argument("--job-size", type=int, default=32)
    p.add_argument("--corpus", type=Path, default=CORPUS)
    p.add_argument("--one-class", default="online", choices=["online", "bulk"], help="traffic class, 1-text jobs")
    p.add_argument("--bulk-class", default="bulk", choices=["online", "bulk"], help="traffic class, 32-text jobs")
    p.add_argument("--traffic-class", choices=["online", "bulk"], help="both shapes in this class")
    p.add_argument("--worker-env", action="append", default=[], metavar="KEY=VAL", help="for the embedq worker")
    p.add_argument("--compare-env", action="append", default=[], metavar="KEY=VAL",
                   help="run the 32-text shape again with these too, and print the texts/s ratio")
    p.add_argument("--loop", action="store_true", help="submit and collect one job at a time even if the Client "
                   "has submit_many/collect")
    p.add_argument("--rounds", type=int, default=1)
    p.add_argument("--warmup", type=int, default=16, help="jobs (tasks) after the worker is ready, before pausing")
    p.add_argument("--chunk", type=int, default=1000, help="texts per tokenizer call (floor)")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--floor-only", choices=["tokenizer", "model", "backend"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.floor_only:
        floor = (tokenizer_floor(args.corpus, args.texts, args.chunk) if args.floor_only == "tokenizer" else
                 model_floor(args.corpus, args.texts) if args.floor_only == "model" else
                 backend_floor(args.corpus, args.texts))
        print(json.dumps(floor))
        return
    if args.traffic_class:
        args.one_class = args.bulk_class = args.traffic_class
    args.compare_env_raw = args.compare_env
    args.worker_env = dict(kv.split("=", 1) for kv in args.worker_env)
    compare_env = dict(kv.split("=", 1) for kv in args.compare_env)

    build_nearfree(MODEL_DIR)
    one_texts, bulk_texts = load_texts(args.corpus, args.jobs), load_texts(args.corpus, args.texts)
    logdir = Path(os.environ.get("TMPDIR", "/tmp")) / "embedq-bench"
    logdir.mkdir(exist_ok=True)
    rounds: list[dict[str, Any]] = []
    for i in range(args.rounds):
        r: dict[str, Any] = {
            "tok1": run_floor("tokenizer", args.corpus, args.texts, args.chunk),
            "tokp": run_floor("tokenizer", args.corpus, args.texts, args.chunk, parallel=True),
            "model": run_floor("model", args.corpus, args.texts, args.chunk),
            "backend": run_floor("backend", args.corpus, args.texts, args.chunk,
                                 env_extra={**WORKER_ENV, **args.worker_env}),
            "noop": run_noop(args.jobs, logdir / "pipeline-noop.log", args.warmup),
            "one": run_embedq(one_texts, 1, args.one_class, args.worker_env, logdir / "pipeline-one.log",
                              force_loop=args.loop, warmup=args.warmup),
            "bulk": run_embedq(bulk_texts, args.job_size, args.bulk_class, args.worker_env,
                               logdir / "pipeline-bulk.log", force_loop=args.loop, warmup=args.warmup),
        }
        if compare_env:
            r["compare"] = run_embedq(bulk_texts, args.job_size, args.bulk_class, {**args.worker_env, **compare_env},
                                      logdir / "pipeline-compare.log", force_loop=args.loop, warmup=args.warmup)
        rounds.append(r)
        print(f"# round {i + 1}/{args.rounds}: 1-text {r['one']['jobs_s']:.0f} jobs/s, 32-text "
              f"{r['bulk']['texts_s']:.0f} texts/s, no-op {r['noop']['jobs_s']:.0f} tasks/s", file=sys.stderr)
    med = {key: median_of([r[key] for r in rounds]) for key in rounds[0]}
    one, bulk, noop, tok = med["one"], med["bulk"], med["noop"], med["tok1"]
    ratios = [
        ("worker CPU per 1-text job / no-op task CPU", one["worker_ms_job"] / noop["worker_ms_job"], "≤ 0.6",
         one["worker_ms_job"] / noop["worker_ms_job"] <= 0.6),
        ("1-text jobs/s / no-op tasks/s", one["jobs_s"] / noop["jobs_s"], "≥ 2", one["jobs_s"] / noop["jobs_s"] >= 2),
        ("worker CPU per text, 32-text jobs / tokenizer (1 thread)", bulk["worker_ms_text"] / tok["ms_text"],
         "≤ 2.2", bulk["worker_ms_text"] / tok["ms_text"] <= 2.2),
        ("(worker CPU per text, 32-text jobs - model alone) / tokenizer",
         (bulk["worker_ms_text"] - med["model"]["ms_text"]) / tok["ms_text"], "", None),
        ("(worker CPU per text, 32-text jobs - embedq backend alone) / tokenizer",
         (bulk["worker_ms_text"] - med["backend"]["ms_text"]) / tok["ms_text"], "", None),
        ("(worker CPU per text, 32-text jobs - its model CPU in place) / tokenizer",
         (bulk["worker_ms_text"] - bulk["worker_stats"]["model_cpu_seconds"] * 1e3 / bulk["texts"]) / tok["ms_text"],
         "", None),
        ("producer CPU per submitted 1-text job (ms)", one["submit_ms_job"], "≤ 0.2", one["submit_ms_job"] <= 0.2),
        ("producer CPU per submitted 32-text job (ms)", bulk["submit_ms_job"], "≤ 0.2", bulk["submit_ms_job"] <= 0.2),
        ("producer CPU per collected 1-text result (ms)", one["collect_ms_result"], "", None),
    ]
    if "compare" in med:
        ratios.append((f"32-text texts/s with {' '.join(args.compare_env)} / without",
                       med["compare"]["texts_s"] / bulk["texts_s"], "", None))
        ratios.append((f"worker CPU per text, 32-text jobs, with {' '.join(args.compare_env)} / without",
                       med["compare"]["worker_ms_text"] / bulk["worker_ms_text"], "", None))
        if med["compare"].get("device_ms_text"):  # the split layout: its device process apart (issue 53, a)
            net = med["compare"]["device_ms_text"] - med["backend"]["ms_text"]
            ratios.append(("(device process CPU per text - embedq backend alone) / tokenizer", net / tok["ms_text"],
                           "≤ 0.25", net / tok["ms_text"] <= 0.25))
            own = med["compare"]["worker_stats"]["model_cpu_seconds"] * 1e3 / med["compare"]["texts"]
            ratios.append(("(device process CPU per text - its model CPU in place) / tokenizer",
                           (med["compare"]["device_ms_text"] - own) / tok["ms_text"], "", None))
    print_report(args, med, ratios)
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S %z"), "cpu": cpu_summary(), "git": git_state(),
            "embedq": str(Path(embedq.__file__).parent), "worker_env": {**WORKER_ENV, **args.worker_env},
            "compare_env": compare_env, "args": {k: str(v) for k, v in vars(args).items()}, "rounds": rounds,
            "median": med, "ratios": [{"name": n, "value": v, "target": t, "met": ok} for n, v, t, ok in ratios],
        }, indent=2))


if __name__ == "__main__":
    main()
