"""How long a worker's watchdog waits, and the exit status of a worker that stopped because it could no longer work.

The stop sequence itself is the worker's (:meth:`embedq.workers.consumer.Worker.check_liveness`, ``fail_stop`` and
``shutdown``): it stops its parts in order, the service, the canvas thread, the held messages (acknowledging what
was stored and handing the rest back: ``workers/held.py``). A split worker's device process uses the same
interval and status (``workers/device_main.py``).
"""

LIVENESS_INTERVAL = 1.0  # seconds between two looks at the service's threads (see Worker.check_liveness)
DRAIN_ON_FAILURE = 5.0  # seconds a failing worker lets its results thread write what it holds
#: Exit status of a worker that stopped because it could no longer do its work (EX_SOFTWARE): restart it.
EXIT_FAILED = 70
#: Exit status of a worker the broker refused (its Redis user lacks a right, or a wrong password; EX_CONFIG): an
#: operator's fix, so never restarted (``workers/refused.py``).
EXIT_REFUSED = 78
