"""The sink contract of ``embedq index``: every call the runner (``runner.py``), the CLI and the check before a
private stack (``precheck.py``) make on where a run writes. They call nothing else and probe for nothing.

A :class:`Target` is the place ``-o`` names (a file, a table, a collection), known before anything is embedded; its
:meth:`Target.open` gives the :class:`Sink` the run writes through. Both are ABCs: a subclass writes the abstract
methods; each other method has the default written here, which a sink overrides where it has more to say. What every
output keeps whatever stores it (the manifest, the ids committed before the run, the rows written since the last
commit) is the sink's :class:`~embedq.producers.index.sinks.manifests.Ledger`, handed to it by the target.

A run, in the order of the calls:

1. ``check_input(path)``, ``check()``: refuse what cannot work (an input that is the output, a table of another
   schema, a server that cannot be reached, options the target cannot store) before any text is embedded; ``check``
   is called by the CLI before it starts anything and again by the runner (the second time costs nothing);
   ``refused_shapes()``: the column shapes it cannot store (``IndexKind.fit`` leaves them out or refuses the run);
2. ``lock()``: one writer per target; inside it ``exists()``, then ``open(...)``: a new sink, or one continuing what
   the target holds (its ledger's ``committed`` ids are skipped);
3. ``sink.accept(fingerprint)`` before each write (the first result's embedding space checked against the output's;
   when the output has one already or ``sink.probe_first``, a one-text probe is accepted before any record is read),
   ``sink.write(ids, data, texts[, hashes])``, ``sink.commit()`` at checkpoints, ``sink.rows_by_hash(hashes)`` (rows
   it holds reused for texts it has a vector of already), ``sink.prune(keep)`` at the end of a complete ``--prune``
   run, ``sink.save_manifest()`` after the run's line is added to the manifest's ``runs``, ``sink.close()``;
4. after the run: ``remove()`` when the run was refused before a row and the target did not exist before it,
   ``remove_empty()`` when no record had a usable text, ``build_index()`` for ``--build-index``.

A sink that keeps content hashes (:attr:`Sink.stores_hashes`, ``content.py``) is re-indexed by content: a new output
records the hash scheme in its manifest (``Manifest.content_hash``), every ``write`` gets each row's hash, an id it
holds already is replaced by a write, and it can be pruned and read back (``rows_by_hash``, ``Target.open_reader``
for ``--reuse``). One that keeps none (a plugin's, the NPY and JSONL files) is continued by id alone.

A sink from outside the package subclasses these two and is named in the scheme table (``registry.py``).
"""

from __future__ import annotations

import contextlib
from abc import ABC, abstractmethod
from pathlib import Path
from typing import Any, ClassVar

from embedq import errors
from embedq.producers.index.idset import IdSet
from embedq.producers.index.sinks.manifests import Ledger, Manifest
from embedq.protocol import Fingerprint

#: What a sink's ``write`` returns: the rows its target refuses, each with its error (they become the records' errors).
Refused = list[tuple[str, errors.EmbedqError]]


class Sink(ABC):
    """An open output the runner writes through; its :class:`Ledger` is what it has committed."""

    #: How a kind's columns (a kind other than the plain ``embed``) reach :meth:`write`: one pyarrow table (True), or a
    #: list of :class:`~embedq.producers.index.kinds.ColumnArrays`, decoded numpy arrays to map by shape (False).
    #: The plain ``embed`` kind's rows are a float matrix either way.
    arrow_columns: ClassVar[bool] = True
    #: How messages name the kind of container (``check_space``: "must not share a table").
    container: ClassVar[str] = "output"
    #: Whether it stores a content hash with every row (``content.py``), and so replaces, prunes and reads rows back
    #: (see the module's docstring). Default: no (continued by id alone).
    stores_hashes: ClassVar[bool] = False

    def __init__(self, ledger: Ledger, *, where: str, probe_first: bool = False) -> None:
        self.ledger = ledger
        self.where = where  # the output as messages name it (a path; ``table docs at postgresql://...``)
        #: one probe of the workers' space before any text is embedded even when the ledger has no fingerprint yet
        #: (an existing empty table of someone else's: its vector column checked against the space first)
        self.probe_first = probe_first

    @property
    def manifest(self) -> Manifest:
        return self.ledger.manifest

    @property
    def committed(self) -> IdSet:
        """The ids committed before this run (as :func:`~embedq.producers.index.idset.digest` keys)."""
        return self.ledger.committed

    def accept(self, fingerprint: Fingerprint) -> None:
        """Check a result's embedding space against the output's before anything is written (default: the ledger's
        check alone, :class:`~embedq.errors.OutputMismatch` when it differs)."""
        self.ledger.accept(fingerprint, where=self.where, container=self.container)

    @abstractmethod
    def write(self, ids: list[str], data: Any, texts: list[str] | None = None) -> Refused:
        """Add rows, committed by the next :meth:`commit`: ``data`` holds one row per id (see :attr:`arrow_columns`);
        ``texts`` the texts when the run stores them (``--store-text``), else None. Returns the rows the target
        refuses, ``[(id, EmbedqError)]`` (not written; the runner makes them those records' errors), usually [].

        A sink that :attr:`stores_hashes` takes a fourth argument, ``hashes``: each row's 16-byte content hash when its
        ledger :attr:`~embedq.producers.index.sinks.manifests.Ledger.keeps_hashes` (else None), and *replaces* an id
        its ledger holds committed: the old row is gone once the new one is committed, in the same commit where the
        target can (a re-indexed text that was edited).

        A sink whose target :attr:`~Target.stores_windows` is written, for an output of one row per window
        (``windowed.py``), with the keyword ``windows``: a :class:`~embedq.producers.index.windowed.WindowRows` of
        the rows (``ids`` then repeats a document's id once per window, ``hashes`` its hash, ``texts`` the windows'
        texts); a document's windows always come in one call, and an id it holds committed is replaced whole (all its
        old windows go). What it refuses of a document, it refuses whole (every window's id in the list)."""

    def commit(self) -> None:
        """Make what was written since the last commit durable (:meth:`flush`), count it, and store the manifest."""
        self.flush()
        self.ledger.commit_rows()
        self.save_manifest()

    @abstractmethod
    def flush(self) -> None:
        """The rows written since the last commit, made durable before the manifest counts them."""

    @abstractmethod
    def save_manifest(self) -> None:
        """Store the ledger's manifest where this sink keeps it (nothing before a result was accepted)."""

    def close(self) -> None:  # noqa: B027 - a default that does nothing
        """Release what the sink holds, after a final :meth:`commit` or without one (uncommitted rows are dropped: the
        next run embeds them again). Default: nothing to release."""

    def prune(self, keep: IdSet) -> int:
        """``--prune``, at the end of a complete run: remove the committed rows whose id (digest) is not in ``keep``,
        durable at the next :meth:`commit`; returns how many. Default: refused (the output cannot remove rows)."""
        raise errors.InvalidOption(f"--prune: {self.where} cannot remove rows")

    def rows_by_hash(self, hashes: list[bytes]) -> tuple[list[bytes], Any]:
        """Committed rows of these content hashes, one per hash found (any of the rows that has it): the hashes
        found and their rows, in :meth:`write`'s form, in the same order. The runner writes them under the ids whose
        texts have those hashes instead of embedding the texts again. Default: none found."""
        return [], None


class Target(ABC):
    """Where a run writes, before it is opened (see the module's docstring for the order of the calls)."""

    #: The output's format as its manifest records it (``parquet``, ``postgresql``, ...): kinds check it (NPY and
    #: JSONL take the plain ``embed`` kind only), and a manifest made in another format is refused.
    format: str

    @abstractmethod
    def describe(self) -> str:
        """The target as the summary and messages show it (a URL with its password masked)."""

    def check(self) -> None:  # noqa: B027 - a default that does nothing
        """Reach the target and check what it holds against the run's options; nothing is written. Default: nothing
        to check before it is opened."""

    def check_input(self, input_path: str) -> None:  # noqa: B027 - a default that does nothing
        """Refuse an input this target would overwrite (``-`` is stdin). Default: none."""

    def refused_shapes(self) -> dict[str, str]:
        """The column shapes (``dense``, ``sparse``, ``ragged``, ``scalar``) it cannot store, each with why. Default:
        it stores every shape."""
        return {}

    @abstractmethod
    def lock(self) -> contextlib.AbstractContextManager[Any]:
        """One writer at a time: entered around the whole run; a second writer is refused at once
        (:class:`~embedq.errors.InvalidOption`)."""

    @abstractmethod
    def exists(self) -> bool:
        """Whether the output exists before the run (after :meth:`check`)."""

    @abstractmethod
    def open(self, *, vector_dtype: str, options: dict[str, Any], shard_rows: int, overwrite: bool) -> Sink:
        """The sink: continuing what the target holds (refused with :class:`~embedq.errors.OutputMismatch`, touching
        nothing, when it was made with another format, vector dtype or options: ``check_manifest``), or a new one
        (``overwrite``: the old one removed first)."""

    @abstractmethod
    def default_errors_path(self) -> Path:
        """Where the failed records go unless ``--errors`` says."""

    def open_reader(self, *, vector_dtype: str, options: dict[str, Any]) -> Sink:
        """``--reuse``: the existing output opened to read rows back (:meth:`Sink.rows_by_hash`) with its ledger's
        committed ids and hashes; nothing is written or locked. Refused with
        :class:`~embedq.errors.OutputMismatch` when it was made with another vector dtype or options (its format may
        differ), :class:`~embedq.errors.InvalidOption` when it does not exist or keeps no content hashes. Default:
        refused (it cannot be read back)."""
        raise errors.InvalidOption(f"--reuse: {self.describe()} cannot be read back")

    def remove(self) -> None:  # noqa: B027 - a default that does nothing
        """A run refused before its first row, on a target it created: leave nothing behind. Default: nothing to
        remove (the target is created by its first commit)."""

    def remove_empty(self) -> bool:
        """A run whose records had no usable text, on a target it created: remove the output made of nothing (its
        errors file stays); True when something was removed. Default: nothing (nothing is made before a row)."""
        return False

    def build_index(self) -> tuple[str, float]:
        """``--build-index``, after a complete run, where :attr:`builds_index`: what was built, and the seconds it
        took."""
        raise errors.InvalidOption(f"--build-index: {self.describe()} has no ANN index to build")

    #: Whether it builds an ANN index after a complete run (``--build-index``: :meth:`build_index`), and whether it
    #: stores each text beside its vectors (``--store-text``: ``Sink.write``'s ``texts``). Default: neither; a run
    #: asking for either is refused before anything starts (:func:`check_flags`).
    builds_index: ClassVar[bool] = False
    stores_text: ClassVar[bool] = False
    #: Whether it stores one row per window of a document (``--long-inputs windows``: ``windowed.py``, ``Sink.write``'s
    #: ``windows``). Default: no; a run asking for it is refused before anything starts (:func:`check_flags`).
    stores_windows: ClassVar[bool] = False
    #: Whether :func:`~embedq.producers.index.precheck.nothing_to_embed` may open it before a private broker and
    #: worker are started, to tell that every id of the input is in it already (the file outputs). Default: no.
    precheck: ClassVar[bool] = False


def check_flags(target: Target, *, build_index: bool, store_text: bool, windows: bool = False) -> None:
    """Refuse ``--build-index``, ``--store-text`` or ``--long-inputs windows`` for a target that does not declare it
    (a file output), before anything starts."""
    if windows and not target.stores_windows:
        raise errors.OutputUnsupported(f"--long-inputs windows writes one row per window, keyed by (id, window), into "
                                       f"Parquet or a database; {target.describe()} cannot store them (a "
                                       f"{target.format} output)")
    if build_index and not target.builds_index:
        raise errors.InvalidOption(f"--build-index is for an output with an ANN index (a database); "
                                   f"{target.describe()} has none")
    if store_text and not target.stores_text:
        raise errors.InvalidOption(f"--store-text is for an output that stores texts (a database); "
                                   f"{target.describe()} stores vectors only")
