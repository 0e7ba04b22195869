"""Content hashes: what tells ``embedq index`` that a row's text is the one it has a vector for already.

Every row an output that keeps them (``Sink.stores_hashes``) writes carries a 16-byte *content hash* beside its id:
BLAKE2b-128 of the text (UTF-8), keyed with a digest of the options that change the vector (the output's storage
options: kind, prompt, dimensions, normalization, truncation, ..., and its vector dtype; :func:`scope`). So:

* the same text under the same options has the same hash in every output (a Parquet dataset's rows can be reused
  in a pgvector table: ``--reuse``), and the same text under other options never does;
* the model is not in the key: an output's embedding-space fingerprint (model, revision, dimension, pooling, ...)
  is checked as a whole before any row is written or reused (``manifests.check_space``), so a hash is only ever
  compared within one space. A collision could at most give one text another text's vector of the same space; at
  128 bits the chance is about 1e-20 for a billion distinct texts, and no hash of one space meets another's.

:data:`SCHEME` names this choice in every manifest that has hashes; an output made before hashes (no scheme) is
continued by id, as before.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

#: The content-hash scheme, as manifests record it (``Manifest.content_hash``).
SCHEME = "blake2b-128:text-utf8:keyed-by-options-1"


def scope(options: dict[str, Any], vector_dtype: str) -> bytes:
    """The key of a run's content hashes: a digest of the options that change its vectors (canonical JSON)."""
    canonical = json.dumps({"options": options, "vector_dtype": vector_dtype}, sort_keys=True, separators=(",", ":"),
                           ensure_ascii=True, default=str)
    return hashlib.blake2b(canonical.encode("ascii"), digest_size=32).digest()


class ContentHasher:
    """The content hash of a text under one run's options (:func:`scope`)."""

    def __init__(self, options: dict[str, Any], vector_dtype: str) -> None:
        self.key = scope(options, vector_dtype)

    def __call__(self, text: str) -> bytes:
        return hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=16, key=self.key).digest()
