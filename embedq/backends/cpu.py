"""CPU features that are advertised but do not work.

Some virtual machines advertise Intel AMX (in cpuid, and the kernel grants the tile state) but fault on
AMX instructions. oneDNN, inside PyTorch, picks its AMX kernels for bfloat16/float16 matrix products
there and the process dies of SIGILL; fp32 never takes that path. :func:`guard_amx` runs one bfloat16
product in a child process and, if the child dies, caps oneDNN below AMX (``ONEDNN_MAX_CPU_ISA``) for
this process and its children. It must run before the process' first oneDNN call (oneDNN reads the
cap once); ``load_backend`` calls it before it loads anything on CPU. Imports no torch.
"""

from __future__ import annotations

import logging
import os
import subprocess
import sys

log = logging.getLogger(__name__)

ISA_ENV = "ONEDNN_MAX_CPU_ISA"
BELOW_AMX = "AVX512_CORE_FP16"
_PROBE = ("import torch; torch.set_num_threads(1); a = torch.ones(64, 64, dtype=torch.bfloat16); "
          "torch.nn.functional.linear(a, a)")
_checked = False


def cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo", encoding="ascii", errors="replace") as fh:
            for line in fh:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


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
