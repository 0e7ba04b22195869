"""A real ``embedq worker`` whose model run kills its own process on any text containing ``POISON``.

Fault injection for tests/faults: the process dies by SIGKILL inside the inference thread, the way an
out-of-memory kill or a segfault in a kernel would take a worker down. Nothing else differs from
``python -m embedq worker``.
"""

from __future__ import annotations

import os
import signal
import sys

from embedq.cli import main
from embedq.workers import hooks

MARKER = "POISON"


class DieOnPoison(hooks.ServiceHooks):
    def before_launch(self, service, keys):  # every micro-batch enters the model here
        if any(isinstance(job.texts, list) and MARKER in job.texts[i] for job, i in keys):
            os.kill(os.getpid(), signal.SIGKILL)


hooks.install(DieOnPoison())

if __name__ == "__main__":
    sys.exit(main(["worker"]))
