"""One peer embedding library, run for bench/peers.py inside that peer's own virtual environment.

    <venv>/bin/python bench/_peer_runner.py st --model DIR --texts texts.json --out OUT --threads 2
    <venv>/bin/python bench/_peer_runner.py export --model DIR --out WORK/st-onnx-model

Peers: st (sentence-transformers, torch), st-onnx (sentence-transformers backend="onnx"), infinity
(infinity-emb, torch engine), fastembed (ONNX Runtime), ort (a raw ONNX Runtime loop with ORT's transformer
fusions). ``export`` writes the ONNX files the ONNX peers load (sentence-transformers' own export, plain and
O3) into --out. Imports only what the peer's venv has (never embedq). Every peer loads the model from a local
folder, warms up on the first 64 texts, times the whole embedding call for all texts (best of --repeat) and
writes OUT.npy (float32 vectors in text order) and OUT.json (seconds, library versions, details).
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import os
import sys
import time
from pathlib import Path

WARMUP = 64
BATCH_SIZE = 32  # what every library peer is called with, as sentence-transformers' reference is


def _threads_env(threads: int) -> None:
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


def _versions(*names: str) -> dict[str, str]:
    from importlib import metadata

    found = {}
    for name in names:
        with contextlib.suppress(metadata.PackageNotFoundError):
            found[name] = metadata.version(name)
    return found


def _timed(encode, texts: list[str], repeat: int):
    """Warm up on the first texts, then the whole call ``repeat`` times: (best seconds, all, vectors)."""
    import numpy as np

    encode(texts[:WARMUP])
    runs, vecs = [], None
    for _ in range(max(1, repeat)):
        t0 = time.perf_counter()
        vecs = encode(texts)
        runs.append(time.perf_counter() - t0)
    return min(runs), runs, np.asarray(vecs, dtype=np.float32)


def _session_options(ort, threads: int):
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    options.inter_op_num_threads = 1
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
    return options


# --- the peers ---------------------------------------------------------------------------------------


def peer_st(args, texts):
    import torch
    from sentence_transformers import SentenceTransformer

    torch.set_num_threads(args.threads)
    model = SentenceTransformer(args.model, device="cpu")
    best, runs, vecs = _timed(lambda xs: model.encode(xs, batch_size=BATCH_SIZE, convert_to_numpy=True),
                              texts, args.repeat)
    details = {"torch_threads": torch.get_num_threads(), "batch_size": BATCH_SIZE,
               "max_seq_length": model.max_seq_length}
    return best, runs, vecs, details, _versions("sentence-transformers", "transformers", "torch", "tokenizers")


def peer_st_onnx(args, texts):
    import onnxruntime as ort
    from sentence_transformers import SentenceTransformer

    kwargs = {"file_name": args.file_name, "provider": "CPUExecutionProvider",
              "session_options": _session_options(ort, args.threads)}
    model = SentenceTransformer(args.model, backend="onnx", device="cpu", model_kwargs=kwargs)
    best, runs, vecs = _timed(lambda xs: model.encode(xs, batch_size=BATCH_SIZE, convert_to_numpy=True),
                              texts, args.repeat)
    details = {"file_name": args.file_name, "batch_size": BATCH_SIZE, "ort_intra_op_threads": args.threads}
    return best, runs, vecs, details, _versions("sentence-transformers", "optimum", "optimum-onnx", "onnxruntime",
                                                "transformers", "torch")


def peer_infinity(args, texts):
    import asyncio

    import numpy as np
    import torch
    from infinity_emb import AsyncEmbeddingEngine, EngineArgs

    torch.set_num_threads(args.threads)
    engine = AsyncEmbeddingEngine.from_args(EngineArgs(
        model_name_or_path=args.model, engine="torch", device="cpu", dtype="float32", batch_size=BATCH_SIZE,
        # BetterTransformer needs optimum < 2, which no longer fits this transformers: off, as it would be anyway.
        # Infinity's own start-up warm-up (model_warmup, untimed) stays on, as it is by default.
        bettertransformer=False))

    async def go():
        async with engine:
            async def encode(xs):
                embeddings, _usage = await engine.embed(sentences=xs)
                return np.stack(embeddings)

            await encode(texts[:WARMUP])
            runs, vecs = [], None
            for _ in range(max(1, args.repeat)):
                t0 = time.perf_counter()
                vecs = await encode(texts)
                runs.append(time.perf_counter() - t0)
            return min(runs), runs, vecs

    best, runs, vecs = asyncio.run(go())
    details = {"torch_threads": torch.get_num_threads(), "batch_size": BATCH_SIZE,
               "bettertransformer": engine.engine_args.bettertransformer}
    return best, runs, np.asarray(vecs, np.float32), details, _versions(
        "infinity-emb", "sentence-transformers", "transformers", "torch", "optimum")


def peer_fastembed(args, texts):
    import numpy as np
    from fastembed import TextEmbedding

    # fastembed's own entry for this model (PooledNormalizedEmbedding: mean pooling over the attention mask,
    # L2 normalisation, model.onnx), pointed at a local folder instead of its download: specific_model_path
    # makes download_model return that folder as is. If a later fastembed drops the entry, the same thing is
    # registered as a custom model.
    name = "sentence-transformers/all-MiniLM-L6-v2"
    how = "built-in entry + specific_model_path"
    if not any(m["model"].lower() == name.lower() for m in TextEmbedding.list_supported_models()):
        from fastembed.common.model_description import ModelSource, PoolingType

        name = "embedq-bench/all-MiniLM-L6-v2-local"
        TextEmbedding.add_custom_model(name, pooling=PoolingType.MEAN, normalization=True,
                                       sources=ModelSource(hf=name), dim=384, model_file="model.onnx")
        how = "add_custom_model + specific_model_path"
    model = TextEmbedding(name, specific_model_path=args.model, threads=args.threads,
                          providers=["CPUExecutionProvider"], cache_dir=args.cache_dir)
    best, runs, vecs = _timed(lambda xs: np.stack(list(model.embed(xs, batch_size=BATCH_SIZE))), texts,
                              args.repeat)
    details = {"batch_size": BATCH_SIZE, "threads": args.threads, "model": name, "loaded_via": how}
    return best, runs, vecs, details, _versions("fastembed", "onnxruntime", "tokenizers", "numpy")


class OrtLoop:
    """Tokenize, length-sorted micro-batches of at most ``budget`` padded tokens, one ORT run each, mean pooling
    over the attention mask, L2 normalisation: what ONNX Runtime alone does with no library around it."""

    def __init__(self, session, tokenizer, budget: int) -> None:
        self.session, self.tokenizer, self.budget = session, tokenizer, budget
        self.inputs = [i.name for i in session.get_inputs()]
        self.output = session.get_outputs()[0].name

    def __call__(self, texts: list[str]):
        import numpy as np

        encodings = self.tokenizer.encode_batch(texts)
        lengths = np.fromiter((len(e.ids) for e in encodings), dtype=np.int64, count=len(encodings))
        order = np.argsort(-lengths, kind="stable")
        out = None
        i = 0
        while i < len(order):
            width = int(lengths[order[i]])
            rows = order[i:i + max(1, min(self.budget // width, len(order) - i))]
            ids = np.zeros((len(rows), width), np.int64)
            types = np.zeros_like(ids)
            mask = np.zeros_like(ids)
            for r, j in enumerate(rows):
                e, n = encodings[j], int(lengths[j])
                ids[r, :n] = e.ids
                types[r, :n] = e.type_ids
                mask[r, :n] = 1
            feeds = {"input_ids": ids, "attention_mask": mask, "token_type_ids": types}
            hidden = self.session.run([self.output], {k: feeds[k] for k in self.inputs})[0]
            pooled = np.einsum("btd,bt->bd", hidden, mask.astype(hidden.dtype))
            pooled /= lengths[rows, None].astype(hidden.dtype)
            if out is None:
                out = np.empty((len(texts), hidden.shape[-1]), np.float32)
            out[rows] = pooled / np.linalg.norm(pooled, axis=1, keepdims=True)
            i += len(rows)
        return out


def peer_ort(args, texts):
    import logging

    import onnxruntime as ort
    from tokenizers import Tokenizer

    model_dir = Path(args.model)
    config = json.loads((model_dir / "config.json").read_text())
    max_len = json.loads((model_dir / "sentence_bert_config.json").read_text()).get("max_seq_length", 256)
    tokenizer = Tokenizer.from_file(str(model_dir / "tokenizer.json"))
    tokenizer.no_padding()
    tokenizer.enable_truncation(max_length=max_len)
    plain = Path(args.onnx)
    cache = Path(args.cache_dir)
    cache.mkdir(parents=True, exist_ok=True)

    # Fused graphs are cached per plain graph, ORT version and CPU (opt_level 99 may be hardware specific).
    cpu = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "") \
        if Path("/proc/cpuinfo").is_file() else ""
    stat = plain.stat()
    key = hashlib.sha256(json.dumps([str(plain), stat.st_size, stat.st_mtime, ort.__version__, cpu]).encode())
    candidates: dict[str, Path] = {}
    fusions: dict[str, dict] = {}
    for level in (int(x) for x in args.ort_opt_levels.split(",") if x.strip()):
        path = cache / f"fused-o{level}-{key.hexdigest()[:16]}.onnx"
        stats_path = path.with_suffix(".json")
        try:
            if not (path.is_file() and stats_path.is_file()):
                from onnxruntime.transformers.optimizer import optimize_model

                for name in list(logging.root.manager.loggerDict):  # the optimizer logs every step at INFO
                    if name.startswith(("fusion", "onnx_model")):
                        logging.getLogger(name).setLevel(logging.WARNING)
                optimized = optimize_model(str(plain), model_type="bert", num_heads=config["num_attention_heads"],
                                           hidden_size=config["hidden_size"], opt_level=level, use_gpu=False)
                optimized.save_model_to_file(str(path))
                stats = {k: v for k, v in optimized.get_fused_operator_statistics().items() if v}
                stats_path.write_text(json.dumps(stats))
            fusions[f"o{level}"] = json.loads(stats_path.read_text())
            candidates[f"fused opt_level={level}"] = path
        except Exception as exc:
            fusions[f"o{level}"] = {"failed": f"{type(exc).__name__}: {exc}"}

    if not candidates:  # no fusion worked: ORT's own graph optimisations on the plain export
        candidates["plain"] = plain
    # The fastest graph on the warm-up texts (warm once, best of 2) is the one timed on all texts.
    trials: dict[str, float] = {}
    loops = {}
    for label, path in candidates.items():
        try:
            session = ort.InferenceSession(str(path), _session_options(ort, args.threads),
                                           providers=["CPUExecutionProvider"])
            loop = OrtLoop(session, tokenizer, args.max_batch_tokens)
            loop(texts[:WARMUP])
            best = float("inf")
            for _ in range(2):
                t0 = time.perf_counter()
                loop(texts[:WARMUP])
                best = min(best, time.perf_counter() - t0)
            trials[label], loops[label] = best, loop
        except Exception as exc:
            fusions.setdefault("errors", {})[label] = f"{type(exc).__name__}: {exc}"
    if not loops:
        raise RuntimeError(f"no ONNX graph ran: {fusions.get('errors')}")
    chosen = min(trials, key=trials.get)
    best, runs, vecs = _timed(loops[chosen], texts, args.repeat)
    details = {"graph": chosen, "trial_seconds_64_texts": trials, "fusions": fusions,
               "max_batch_tokens": args.max_batch_tokens, "threads": args.threads, "max_seq_length": max_len}
    return best, runs, vecs, details, _versions("onnxruntime", "onnx", "tokenizers", "numpy")


def export(args) -> None:
    """sentence-transformers' own ONNX export of the local model (onnx/model.onnx), then its O3 optimisation
    (onnx/model_O3.onnx), into --out; --out/export.json says what worked."""
    import shutil

    import sentence_transformers
    from sentence_transformers import SentenceTransformer

    out = Path(args.out)
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    t0 = time.perf_counter()
    model = SentenceTransformer(args.model, backend="onnx", device="cpu")
    model.save_pretrained(str(tmp))
    if not (tmp / "onnx" / "model.onnx").is_file():
        raise RuntimeError(f"the export wrote no onnx/model.onnx under {tmp}")
    try:
        from sentence_transformers import export_optimized_onnx_model
    except ImportError:
        from sentence_transformers.backend import export_optimized_onnx_model
    try:
        export_optimized_onnx_model(model, "O3", str(tmp))
        o3 = "ok" if (tmp / "onnx" / "model_O3.onnx").is_file() else "no onnx/model_O3.onnx written"
    except Exception as exc:
        o3 = f"{type(exc).__name__}: {exc}"
    info = {"o3": o3, "seconds": time.perf_counter() - t0, "sentence_transformers": sentence_transformers.__version__,
            "versions": _versions("sentence-transformers", "optimum", "optimum-onnx", "onnxruntime", "onnx",
                                  "transformers", "torch")}
    (tmp / "export.json").write_text(json.dumps(info, indent=2))
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    print(json.dumps(info))


PEERS = {"st": peer_st, "st-onnx": peer_st_onnx, "infinity": peer_infinity, "fastembed": peer_fastembed,
         "ort": peer_ort}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("peer", choices=[*PEERS, "export"])
    p.add_argument("--model", required=True, help="local model folder (sentence-transformers, or fastembed's)")
    p.add_argument("--texts", help="JSON list of texts")
    p.add_argument("--out", required=True, help="export: the folder; peers: OUT.npy and OUT.json")
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--repeat", type=int, default=1)
    p.add_argument("--file-name", default="model.onnx", help="st-onnx: the ONNX file under onnx/")
    p.add_argument("--onnx", help="ort: the plain ONNX graph")
    p.add_argument("--cache-dir", help="ort: fused graphs; fastembed: its cache_dir")
    p.add_argument("--ort-opt-levels", default="1,2,99", help="ort: optimize_model opt_levels to try")
    p.add_argument("--max-batch-tokens", type=int, default=2048, help="ort: padded tokens per micro-batch")
    args = p.parse_args()
    _threads_env(args.threads)

    if args.peer == "export":
        export(args)
        return
    import numpy as np

    texts = json.loads(Path(args.texts).read_text())
    t0 = time.perf_counter()
    best, runs, vecs, details, versions = PEERS[args.peer](args, texts)
    out = Path(args.out)
    np.save(out.with_suffix(".npy"), vecs)
    info = {"peer": args.peer, "seconds": best, "all_seconds": runs, "n": len(texts), "threads": args.threads,
            "details": details, "versions": versions, "python": sys.version.split()[0],
            "wall_seconds": time.perf_counter() - t0}
    out.with_suffix(".json").write_text(json.dumps(info, indent=2))


if __name__ == "__main__":
    main()
