"""One writer per output of ``embedq index``: :class:`OutputLock`, an ``flock`` on a file beside what it guards (a
file output, a LanceDB folder, a Milvus Lite file; a Milvus server's in the temp folder); :func:`writable`, whether
a folder takes new files."""

from __future__ import annotations

import contextlib
import os
import tempfile
from pathlib import Path
from typing import Any

from embedq import errors


class OutputLock:
    """One writer per output: a second ``embedq index`` on the same output fails at once.

    An ``flock`` on a sibling ``.embedq.lock`` file; the kernel drops it when the holder dies. The holder deletes the
    file when it is done (no empty file left beside every output); a writer that locked a file deleted meanwhile
    (its path now names another file, or none) opens the path again, so two writers never hold "the" lock.
    """

    def __init__(self, path: Path, names: str | None = None) -> None:
        self.output = names or str(path)  # what a refusal names (a LanceDB table: ``<db>?table=docs``)
        self.path = path.with_name(path.name + ".embedq.lock")  # ``<path>.embedq.lock``
        self._fh: Any = None

    def __enter__(self) -> OutputLock:
        import fcntl

        self.path.parent.mkdir(parents=True, exist_ok=True)
        while True:
            fh = open(self.path, "a+")
            try:
                fcntl.flock(fh.fileno(), fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                fh.close()
                raise errors.InvalidOption(f"another embedq index is writing {self.output}; "
                                           "wait for it or stop it first") from None
            try:
                same = os.stat(self.path).st_ino == os.fstat(fh.fileno()).st_ino
            except FileNotFoundError:
                same = False
            if same:
                self._fh = fh
                return self
            fh.close()  # the last holder deleted the file after this one opened it: lock the path's file

    def __exit__(self, *exc: object) -> None:
        with contextlib.suppress(OSError):
            self.path.unlink()  # still held: a writer that opened it meanwhile finds it gone and opens anew
        self._fh.close()


def writable(folder: Path) -> str | None:
    """Why files cannot be created in ``folder`` (None: they can): tried, not guessed from the mode bits."""
    if not folder.exists():
        return "does not exist"
    if not folder.is_dir():
        return "is not a folder"
    try:
        with tempfile.TemporaryFile(dir=folder, prefix=".embedq-probe-"):
            pass
    except OSError as exc:
        return f"is not writable ({exc.strerror or exc})"
    return None
