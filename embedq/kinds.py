"""The table of job kinds: one :class:`TaskSpec` per kind, and nothing kind-specific anywhere else but its head.

A spec owns what every part of embedq needs to know of a kind that is not model code:

* its Celery task name (what producers send and the worker registers) and its options model;
* how a message's arguments become *items* (what the scheduler packs: a text, a text pair, token ids), and how many
  items a message holds before it is read (the prefetch window counts them);
* how one job's arguments are built from what a producer passes (:attr:`TaskSpec.job_args`), how its result is
  decoded (:attr:`TaskSpec.decode`) and how its arguments are summed up on one line for Celery, Flower and logs
  (:meth:`TaskSpec.summary`: counts, never texts);
* the shape of its outputs for the indexer (:class:`Column`: dense, sparse, ragged or scalar, read from named arrays of
  the result), under the kind's own name (``embedq index --kind <kind>``);
* for a kind from a plugin, the import path of the factory that builds its head from the worker's backend.

The built-in kinds are ``embed``, ``embed_sparse``, ``embed_all``, ``embed_hybrid``, ``rerank``, ``predict``,
``tokenize`` and ``decode``. More come from plugins (:func:`load_plugins`): a module named in ``EMBEDQ_KINDS``
(``package.module`` or ``package.module:NAME``) or an entry point of the group ``embedq.kinds``, holding a
:class:`TaskSpec` (or a list of them), registered with :func:`register`. Every process that meets a plugin's kind —
the worker, a producer, the gateway, the indexer — loads the same plugins (each reads ``EMBEDQ_KINDS``).
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from embedq import errors, plugins
from embedq.protocol import (
    TASK_NAME,
    DecodeOptions,
    EmbedAllOptions,
    EmbedOptions,
    HybridOptions,
    JobOptions,
    PredictOptions,
    RerankOptions,
    SparseOptions,
    TokenizeOptions,
    check_text,
    decode_array,
    decode_hybrid,
    decode_ragged,
    decode_sparse,
    decode_vectors,
    job_list,
    short_options,
    validate_texts,
)

#: One item of a job: a text, a text pair (rerank's (query, text), predict's pairs), or token ids (decode).
Item = str | tuple[str, str] | tuple[int, ...]
#: The entry-point group a package declares its kinds under.
ENTRY_POINT_GROUP = "embedq.kinds"

Shape = Literal["dense", "sparse", "ragged", "scalar"]


@dataclass(frozen=True)
class Column:
    """One output of a kind as the indexer stores it: a column (or, for ``sparse``, two) per text.

    ``arrays`` names the result arrays it is read from, by shape: ``dense`` (rows,) one fixed-size vector per text;
    ``sparse`` (offsets, indices, values) ids and weights per text; ``ragged`` (offsets, rows) a list of fixed-size
    vectors per text; ``scalar`` (values,) one number per text. Each output format maps the four shapes."""

    name: str
    shape: Shape
    arrays: tuple[str, ...]


def _one_arg(args: Any, spec: str) -> Any:
    if not isinstance(args, (list, tuple)) or len(args) != 1:
        raise errors.InvalidType(f"this task takes exactly one positional argument ({spec})")
    return args[0]


def text_items(args: Any, max_texts: int, max_chars: int) -> list[Item]:
    """A job of texts (``args = [texts]``), checked: the items of every kind that takes texts."""
    return list(validate_texts(_one_arg(args, "the list of texts"), max_texts=max_texts, max_chars=max_chars))


def _rerank_items(args: Any, max_texts: int, max_chars: int) -> list[Item]:
    if not isinstance(args, (list, tuple)) or len(args) != 2:
        raise errors.InvalidType("embedq.rerank takes exactly two positional arguments (query, texts)")
    query, texts = args
    query = check_text(query, "query", max_chars, empty_ok=True)
    texts = job_list(texts, max_texts=max_texts, what="strings", one="text", many="texts")
    for i, text in enumerate(texts):  # a (query, text) pair is empty only when both are (TEI)
        texts[i] = check_text(text, f"texts[{i}]", max_chars, empty_ok=True)
        if not query and not texts[i]:
            raise errors.EmptyText(f"the query and texts[{i}] are both empty")
    return [(query, text) for text in texts]


def _predict_items(args: Any, max_texts: int, max_chars: int) -> list[Item]:
    inputs = job_list(_one_arg(args, "the list of inputs: texts or [text, text] pairs"), max_texts=max_texts,
                       what="texts or text pairs", one="text or pair", many="inputs")
    items: list[Item] = []
    for i, entry in enumerate(inputs):
        if isinstance(entry, str):
            items.append(check_text(entry, f"inputs[{i}]", max_chars))
        elif isinstance(entry, (list, tuple)) and len(entry) == 2:
            first, second = (check_text(entry[k], f"inputs[{i}][{k}]", max_chars, empty_ok=True) for k in (0, 1))
            if not first and not second:  # a pair is empty only when both sides are (TEI)
                raise errors.EmptyText(f"inputs[{i}] is a pair of two empty texts")
            items.append((first, second))
        else:
            raise errors.InvalidType(f"inputs[{i}] must be a text or a pair of texts, got "
                                     f"{type(entry).__name__}{f' of {len(entry)}' if isinstance(entry, list) else ''}")
    return items


#: The largest token id a decode job may carry (TEI's ids are u32).
MAX_TOKEN_ID = 2**32 - 1


def id_lists(ids: Any) -> Any:
    """TEI's ``ids`` as a list of id lists: one list of ints is one input, a list of them a batch (anything else
    is left for validation to refuse)."""
    if isinstance(ids, (list, tuple)) and ids and all(isinstance(i, int) for i in ids):
        return [list(ids)]
    return ids


def _check_ids(ids: Any, where: str, max_chars: int) -> tuple[int, ...]:
    """One input of token ids: a non-empty list of at most ``max_chars`` ids, each an integer 0..2^32-1."""
    if not isinstance(ids, (list, tuple)):
        raise errors.InvalidType(f"{where} is {type(ids).__name__}, not a list of token ids")
    if not ids:
        raise errors.EmptyText(f"{where} is empty")
    if len(ids) > max_chars:
        raise errors.TextTooLong(f"{where} has {len(ids)} ids; the limit is {max_chars}")
    for j, token in enumerate(ids):  # bool is an int to Python, never a token id
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token <= MAX_TOKEN_ID:
            raise errors.InvalidType(f"{where}[{j}] is {token!r}, not a token id (an integer 0..2^32-1)")
    return tuple(ids)


def _id_items(args: Any, max_texts: int, max_chars: int) -> list[Item]:
    """A decode job's id lists (:func:`id_lists`), each at most ``max_chars`` ids long."""
    values = id_lists(_one_arg(args, "the list of token-id lists"))
    lists = job_list(values, max_texts=max_texts, what="token-id lists", one="list of token ids", many="id lists")
    return [_check_ids(ids, f"ids[{i}]", max_chars) for i, ids in enumerate(lists)]


def text_or_id_items(args: Any, max_texts: int, max_chars: int) -> list[Item]:
    """A job of texts where an input may also be token ids (TEI's ``Input``: ``embed``, ``embed_sparse``,
    ``embed_all``): each a text, or a list of the model's token ids embedded as they are."""
    inputs = job_list(_one_arg(args, "the list of texts"), max_texts=max_texts, what="strings or token-id lists",
                      one="text", many="texts")
    if all(type(text) is str for text in inputs):
        return list(validate_texts(inputs, max_texts=max_texts, max_chars=max_chars))
    return [check_text(x, f"inputs[{i}]", max_chars) if isinstance(x, str) else
            list(_check_ids(x, f"inputs[{i}]", max_chars)) for i, x in enumerate(inputs)]


def first_len(index: int) -> Callable[[Any], int]:
    """A message's item count, read before validation: the length of its ``index``-th argument (1 if unreadable)."""
    def size(args: Any) -> int:
        try:
            value = args[index]
        except (TypeError, IndexError, KeyError):
            return 1
        return len(value) if isinstance(value, (list, tuple)) else 1
    return size


_first_arg_len = first_len(0)


def as_list(texts: Any) -> Any:
    """A single string is a job of one text; anything else is passed on as sent (validated by the spec)."""
    if isinstance(texts, str):
        return [texts]
    return list(texts) if isinstance(texts, (list, tuple)) else texts


def texts_job(job: Any) -> list[Any]:
    """The task arguments of a job of texts: ``[texts]`` (one string is a list of one)."""
    return [as_list(job)]


def _rerank_job(job: Any) -> list[Any]:
    if not isinstance(job, (list, tuple)) or len(job) != 2:
        raise errors.InvalidType(f"a rerank job is a (query, texts) pair, got {type(job).__name__}")
    return [job[0], as_list(job[1])]


def _predict_job(job: Any) -> list[Any]:
    return [[job] if isinstance(job, str) else [t if isinstance(t, str) else list(t) for t in job]]


def _decode_job(job: Any) -> list[Any]:
    return [[list(x) for x in id_lists(job)]]


def decoded_arrays(payload: dict[str, Any], texts: Sequence[Any] | None = None) -> dict[str, Any]:
    """The default decoding of a result: its encoded arrays as numpy arrays, its plain fields as they are (the
    ``v``/``kind``/``fingerprint``/``usage`` envelope left out)."""
    return {k: decode_array(v) if isinstance(v, dict) and "encoding" in v and "shape" in v else v
            for k, v in payload.items() if k not in ("v", "kind", "fingerprint", "usage")}


def _rerank_output(payload: dict[str, Any], texts: Sequence[Any] | None = None) -> list[dict[str, Any]]:
    scores = decode_array(payload["scores"])
    order = sorted(range(len(scores)), key=lambda i: (-float(scores[i]), i))
    out = [{"index": i, "score": float(scores[i])} for i in order]
    if texts is not None:
        for entry in out:
            entry["text"] = texts[entry["index"]]
    return out


def _predict_output(payload: dict[str, Any], texts: Sequence[Any] | None = None) -> list[list[dict[str, Any]]]:
    scores, labels = decode_array(payload["scores"]), payload["labels"]
    return [sorted(({"label": labels[j], "score": float(row[j])} for j in range(len(labels))),
                   key=lambda e: -e["score"]) for row in scores]


def _tokenize_output(payload: dict[str, Any], texts: Sequence[Any] | None = None) -> list[list[dict[str, Any]]]:
    ids, offsets = decode_array(payload["ids"]), decode_array(payload["offsets"])
    spans, special, tokens = decode_array(payload["spans"]), decode_array(payload["special"]), payload["tokens"]
    return [[{"id": int(ids[t]), "text": tokens[t], "special": bool(special[t]), "start": int(spans[t][0]),
              "stop": int(spans[t][1])} for t in range(int(offsets[i]), int(offsets[i + 1]))]
            for i in range(len(offsets) - 1)]


@dataclass(frozen=True)
class TaskSpec:
    """One kind of job: its Celery task, its options, how its arguments become items, its result."""

    kind: str
    name: str  # Celery task name
    options: type[JobOptions]
    #: (args, max_texts, max_chars) -> the job's validated items; raises a typed error for that job
    items: Callable[[Any, int, int], list[Item]] = text_items
    #: items a message holds, read before validation (the prefetch window counts them)
    size: Callable[[Any], int] = _first_arg_len
    #: the named arrays of its result (plus, for some kinds, plain fields: see decode)
    arrays: tuple[str, ...] = ()
    #: what the worker's task takes, for error messages
    signature: str = "(texts)"
    #: ``job_args(job)``: the task arguments of one job from what the kind's submit takes (texts; a (query, texts)
    #: pair; ...)
    job_args: Callable[[Any], list[Any]] = texts_job
    #: ``decode(payload, texts=None)``: a stored result decoded for a Python caller (what ``JobHandle.result``
    #: returns); ``texts``: the job's texts when the caller asked them back
    decode: Callable[..., Any] = decoded_arrays
    #: how its items are counted on one line: "{} texts", "query, {} texts", ...; ``counted``: which argument
    what: str = "{} texts"
    counted: int = -1
    #: its outputs as the indexer stores them (none: ``embedq index`` does not make this kind)
    columns: tuple[Column, ...] = ()
    #: options an indexing run always sends for this kind (BGE-M3: all three outputs)
    index_options: dict[str, Any] = field(default_factory=dict)
    #: False: the indexer does not ask results in the output's vector dtype (sparse weights stay float32)
    index_dtype: bool = True
    #: other names users know it by (``embedq index --kind multi``, ``bge-m3``, ``sparse``)
    aliases: tuple[str, ...] = ()
    #: a plugin kind's head: "module:factory", ``factory(backend)`` -> the Head that serves it in the worker
    head: str | None = None

    def parse_options(self, kwargs: Any) -> JobOptions:
        return self.options.parse(kwargs)

    def summary(self, args: Any) -> str:
        """The job's arguments on one line (Celery's ``argsrepr``, Flower, logs): counts, never texts."""
        try:
            return "[" + self.what.format(len(args[self.counted])) + "]"
        except Exception:
            return "[?]"


def task_reprs(spec: TaskSpec, args: Sequence[Any], options: dict[str, Any]) -> dict[str, str]:
    """Celery's ``argsrepr``/``kwargsrepr`` for a job: what Celery and Flower show instead of the texts."""
    return {"argsrepr": spec.summary(args), "kwargsrepr": short_options(options)}


def _vectors(payload: dict[str, Any], texts: Sequence[Any] | None = None) -> Any:
    return decode_vectors(payload["vectors"])


EMBED = TaskSpec("embed", TASK_NAME, EmbedOptions, text_or_id_items, arrays=("vectors",), decode=_vectors,
                 columns=(Column("vector", "dense", ("vectors",)),))
EMBED_SPARSE = TaskSpec("embed_sparse", "embedq.embed_sparse", SparseOptions, text_or_id_items,
                        arrays=("offsets", "indices", "values"),
                        decode=lambda payload, texts=None: decode_sparse(payload),
                        columns=(Column("", "sparse", ("offsets", "indices", "values")),), index_dtype=False,
                        aliases=("sparse",))
EMBED_ALL = TaskSpec("embed_all", "embedq.embed_all", EmbedAllOptions, text_or_id_items, arrays=("offsets", "tokens"),
                     decode=lambda payload, texts=None: decode_ragged(payload),
                     columns=(Column("vectors", "ragged", ("offsets", "tokens")),),
                     aliases=("multi", "all"))
EMBED_HYBRID = TaskSpec(
    "embed_hybrid", "embedq.embed_hybrid", HybridOptions,
    arrays=("dense", "lexical_offsets", "lexical_indices", "lexical_values", "colbert_offsets", "colbert"),
    decode=lambda payload, texts=None: decode_hybrid(payload),
    columns=(Column("dense", "dense", ("dense",)),
             Column("lexical_", "sparse", ("lexical_offsets", "lexical_indices", "lexical_values")),
             Column("colbert", "ragged", ("colbert_offsets", "colbert"))),
    index_options={"outputs": ["dense", "lexical", "colbert"]}, aliases=("bge-m3", "hybrid"))
RERANK = TaskSpec("rerank", "embedq.rerank", RerankOptions, _rerank_items, first_len(1), ("scores",),
                  "(query, texts)", _rerank_job, _rerank_output, "query, {} texts")
PREDICT = TaskSpec("predict", "embedq.predict", PredictOptions, _predict_items, arrays=("scores",),
                   signature="(inputs)", job_args=_predict_job, decode=_predict_output, what="{} inputs")
TOKENIZE = TaskSpec("tokenize", "embedq.tokenize", TokenizeOptions, arrays=("ids", "offsets", "spans", "special"),
                    decode=_tokenize_output)
DECODE = TaskSpec("decode", "embedq.decode", DecodeOptions, _id_items, signature="(ids)", job_args=_decode_job,
                  decode=lambda payload, texts=None: list(payload["texts"]), what="{} id lists")

#: Every kind of job by Celery task name (the worker registers one task per entry).
TASKS: dict[str, TaskSpec] = {}
#: The same specs by kind, and by each of their aliases.
KINDS: dict[str, TaskSpec] = {}


def register(spec: TaskSpec) -> TaskSpec:
    """Add a kind to the table (a plugin's, or the built-ins at import). Registering the same spec again does
    nothing; a spec whose task name, kind or alias another spec holds is refused."""
    if not isinstance(spec, TaskSpec):
        raise errors.InvalidOption(f"a kind must be an embedq.kinds.TaskSpec, got {type(spec).__name__}")
    if TASKS.get(spec.name) == spec:
        return spec
    for name in (spec.kind, *spec.aliases):
        if name in KINDS and KINDS[name] != spec:
            raise errors.InvalidOption(f"kind {name!r} is already {KINDS[name].name}; {spec.name} cannot take it")
    if spec.name in TASKS:
        raise errors.InvalidOption(f"task {spec.name!r} is already the {TASKS[spec.name].kind} kind")
    if spec.head is not None and ":" not in spec.head:
        raise errors.InvalidOption(f"{spec.name}: head {spec.head!r} must be 'module:factory'")
    TASKS[spec.name] = spec
    for name in (spec.kind, *spec.aliases):
        KINDS[name] = spec
    return spec


for _spec in (EMBED, EMBED_SPARSE, EMBED_ALL, EMBED_HYBRID, RERANK, PREDICT, TOKENIZE, DECODE):
    register(_spec)
#: The kinds embedq itself defines (the rest came from plugins).
BUILT_IN = frozenset(TASKS)


def kind(name: Any) -> TaskSpec:
    """The spec of a kind by its name or an alias; :class:`~embedq.errors.InvalidOption` naming the kinds else."""
    spec = KINDS.get(name) if isinstance(name, str) else None
    if spec is None:
        raise errors.InvalidOption(f"unknown job kind {name!r}; use one of {', '.join(kind_names())}")
    return spec


def kind_names() -> list[str]:
    """Every kind's own name (aliases left out), built-ins first."""
    return [spec.kind for spec in TASKS.values()]


def load_plugins(paths: Iterable[str] = (), *, entry_point_group: str | None = ENTRY_POINT_GROUP) -> list[TaskSpec]:
    """Import and register kinds: each of ``paths`` is ``module`` (its ``KINDS`` list) or ``module:NAME`` (a spec
    or a list of specs); then every entry point of ``entry_point_group``. Returns the specs loaded. A path that
    cannot be imported or holds no spec raises :class:`~embedq.errors.InvalidOption` naming it."""
    loaded = plugins.load(paths, kind=TaskSpec, attr="KINDS", group=entry_point_group, what="kind plugin")
    for spec in loaded:
        register(spec)
    return loaded


def resolve_head(spec: TaskSpec) -> Callable[[Any], Any]:
    """A plugin kind's head factory (``spec.head``, "module:factory"), imported."""
    assert spec.head is not None
    module_name, _, name = spec.head.partition(":")
    try:
        return getattr(importlib.import_module(module_name), name)
    except (ImportError, AttributeError) as exc:
        raise errors.UnsupportedModel(f"{spec.name}: cannot import its head {spec.head!r}: {exc}") from exc
