"""What this CPU is (model, instruction sets: named beside every benchmark figure), and CPU features that are
advertised but do not work.

Some virtual machines advertise Intel AMX (in cpuid, and the kernel grants the tile state) but fault on
AMX instructions. oneDNN, inside PyTorch, picks its AMX kernels for bfloat16/float16 matrix products
there and the process dies of SIGILL; fp32 never takes that path. :func:`guard_amx` runs one bfloat16
product in a child process and, if the child dies, caps oneDNN below AMX (``ONEDNN_MAX_CPU_ISA``) for
this process and its children. It must run before the process' first oneDNN call (oneDNN reads the
cap once); ``load_backend`` calls it before it loads anything on CPU. Imports no torch.
"""

from __future__ import annotations

import contextlib
import logging
import os
import platform
import subprocess
import sys
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

ISA_ENV = "ONEDNN_MAX_CPU_ISA"
BELOW_AMX = "AVX512_CORE_FP16"
_PROBE = ("import torch; torch.set_num_threads(1); a = torch.ones(64, 64, dtype=torch.bfloat16); "
          "torch.nn.functional.linear(a, a)")
_checked = False


def cpu_flags() -> set[str]:
    return set(cpu_description()["flags"])


def cpu_description() -> dict[str, Any]:
    """The CPU as /proc/cpuinfo tells it: model name, family/model numbers, flags, cores."""
    info: dict[str, Any] = {"model_name": platform.processor() or platform.machine(), "family": None,
                            "model": None, "flags": [], "cores": os.cpu_count()}
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text(errors="replace").splitlines():
            key, _, value = (part.strip() for part in line.partition(":"))
            if key == "model name":
                info["model_name"] = value
            elif key == "cpu family":
                info["family"] = value
            elif key == "model":
                info["model"] = value
            elif key == "flags":
                info["flags"] = sorted(value.split())
                break
    return info


#: The instruction sets that decide which kernels a runtime can use (what docs and benches print).
ISA_FLAGS = ("avx2", "fma", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16", "avx512_fp16",
             "avx_vnni", "amx_tile", "amx_bf16", "amx_int8")


def cpu_summary() -> str:
    """One line for a benchmark's header: ``AMD EPYC (family 25 model 1), 2 cores, avx2 fma``."""
    cpu = cpu_description()
    flags = [f for f in ISA_FLAGS if f in set(cpu["flags"])]
    numbers = f" (family {cpu['family']} model {cpu['model']})" if cpu["family"] else ""
    return f"{cpu['model_name']}{numbers}, {cpu['cores']} cores, {' '.join(flags) or 'no AVX2'}"


def guard_amx() -> str | None:
    """Cap oneDNN below AMX when AMX is advertised but faults; returns the cap it set, if any.

    Runs the probe once per process, only on CPUs that advertise AMX and only when ``ONEDNN_MAX_CPU_ISA``
    is not already set (an operator's setting always wins).
    """
    global _checked
    if _checked or os.environ.get(ISA_ENV) or not cpu_flags() & {"amx_tile", "amx_bf16"}:
        return None
    _checked = True
    try:
        probe = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if probe.returncode == 0:
        return None
    os.environ[ISA_ENV] = BELOW_AMX
    log.warning("this CPU advertises AMX but a bfloat16 product with it failed (exit %s); oneDNN is capped "
                "at %s (set %s to override)", probe.returncode, BELOW_AMX, ISA_ENV)
    return BELOW_AMX
