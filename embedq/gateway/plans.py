"""What each route asks of the queue: a request body becomes a :class:`Plan` (the kind of its jobs, its items, the
job options, how the jobs' payloads become the route's answer). One planner per kind, each a plain function of
``(body, settings)``. :data:`ROUTE_PLANS` holds the kinds whose bodies are TEI's (and ``similarity``, TEI's route
of embed jobs); :func:`planner` finds the plan of any kind of the kinds table (``embedq/kinds.py``), a plugin's
included, for ``/jobs``: its body is ``{"inputs": ..., <the kind's options>}`` and its answer the decoded results."""

from __future__ import annotations

import base64
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel
from pydantic import ValidationError as PydanticValidationError

from embedq import errors
from embedq.gateway.schemas import (
    DecodeRequest,
    EmbedRequest,
    JobInputs,
    OpenAIEmbeddingRequest,
    PredictRequest,
    RerankRequest,
    SimilarityParameters,
    SimilarityRequest,
    TextsRequest,
    TokenizeRequest,
    WindowFields,
)
from embedq.gateway.windowed import guarded, window_json, windows_of
from embedq.kinds import KINDS, TaskSpec, id_lists, kind_names
from embedq.protocol import decode_result
from embedq.settings import Settings


def _as_job(items: list[Any]) -> Any:
    return items


@dataclass
class Plan:
    """What a request asks for: the kind of its jobs (``Client.submit_many``'s ``kind``), its items (split into
    jobs), the job options, how the jobs' result payloads become the route's answer, and how a slice of the items
    becomes one job's input (rerank: the query with it)."""

    kind: str
    items: list[Any]
    options: dict[str, Any]
    answer: Callable[[list[dict[str, Any]]], Any]
    job: Callable[[list[Any]], Any] = _as_job
    single: bool = False  # one input, not a batch (TEI's te_request_count method label)
    extra_characters: int = 0  # characters each job adds to its items (rerank: the query, per text)

    @property
    def characters(self) -> int:
        """Characters of the inputs, as TEI counts them (``x-compute-characters``): a token id counts one."""
        return _characters(self.items) + self.extra_characters


def _characters(value: Any) -> int:
    if isinstance(value, str):
        return len(value)
    if isinstance(value, (list, tuple)):
        return sum(_characters(v) for v in value)
    return 1


#: Why token ids are refused, and the client switch that avoids them: LangChain's ``OpenAIEmbeddings`` (and other
#: OpenAI clients that count context with tiktoken) send tiktoken's ids, which are not this model's ids; read as
#: them they would embed other tokens silently.
TOKEN_IDS_REFUSED = (
    "token-id inputs are not supported by this gateway: they are another tokenizer's ids (tiktoken's, from an "
    "OpenAI client that splits texts by tokens), not this model's, so read as them they would embed other tokens; "
    "send the texts. LangChain: OpenAIEmbeddings(..., check_embedding_ctx_length=False)"
)


def _texts(inputs: Any) -> list[str]:
    """Strings as a list; token-id arrays are refused (never read as text): the OpenAI route's and /tokenize's."""
    if isinstance(inputs, str):
        return [inputs]
    if any(not isinstance(x, str) for x in inputs):
        raise errors.InvalidType(TOKEN_IDS_REFUSED)
    return list(inputs)


def _inputs(inputs: Any) -> list[Any]:
    """TEI's ``Input`` as a list of inputs: a text, or one list of token ids (the model's: embedded as they are),
    is one input; any other list a batch of texts and id lists."""
    return [inputs] if _single(inputs) else list(inputs)


def _options(**options: Any) -> dict[str, Any]:
    return {k: v for k, v in options.items() if v is not None}


def decoded(kind: str) -> Callable[[list[dict[str, Any]]], list[Any]]:
    spec = KINDS[kind]
    return lambda payloads: [spec.decode(p) for p in payloads]


def _vectors(payloads: list[dict[str, Any]]) -> tuple[np.ndarray, int]:
    vectors = [decode_result(p)[0] for p in payloads]
    return (np.concatenate(vectors) if len(vectors) > 1 else vectors[0]), _tokens(payloads)


def _tokens(payloads: list[dict[str, Any]]) -> int:
    return sum(int((p.get("usage") or {}).get("tokens", 0)) for p in payloads)


def embed_plan(texts: list[str], answer: Callable[[np.ndarray, int], Any], **options: Any) -> Plan:
    return Plan("embed", texts, _options(**options), lambda payloads: answer(*_vectors(payloads)))


def _tei_options(body: EmbedRequest | TextsRequest) -> dict[str, Any]:
    """A TEI embedding body's job options: TEI's, or with ``long_inputs`` the window options in place of
    ``truncate`` (which then only agrees with it: :meth:`~embedq.gateway.schemas.WindowFields.window_options`)."""
    options = body.job_options()
    windows = body.window_options(body.truncate)
    if windows:
        del options["truncate"]
    return {**options, **windows}


def _windowed(plan: Plan, body: WindowFields, settings: Settings,
              per_window: Callable[[list[dict[str, Any]]], Any]) -> Plan:
    """``plan`` for a body with ``long_inputs="windows"``: its answer refused while an input failed alone (413
    ``too_many_windows``, :func:`~embedq.gateway.windowed.guarded`), and ``per_window`` with ``pool_windows:
    false``."""
    if body.long_inputs != "windows":
        return plan
    if body.per_window:
        plan.answer = per_window
    plan.answer = guarded(plan.answer, settings.max_texts_per_job)
    return plan


def _tei_windows(kind: str, render: Callable[[Any], Any]) -> Callable[[list[dict[str, Any]]], Any]:
    """A TEI route's per-window answer: per input the list of its windows, ``render`` writing one's output."""
    spec = KINDS[kind]
    return lambda payloads: [[window_json(w, render(w.output)) for w in text]
                             for text in windows_of(payloads, spec.decode)]


def _same(output: Any) -> Any:
    return output


def plan_embed(body: EmbedRequest, settings: Settings) -> Plan:
    plan = embed_plan(_inputs(body.inputs), lambda vectors, tokens: vectors, normalize=body.normalize,
                      dimensions=body.dimensions, prompt_name=body.prompt_name, **_tei_options(body))
    plan.single = _single(body.inputs)
    return _windowed(plan, body, settings, _tei_windows("embed", _same))


def _single(inputs: Any) -> bool:
    """TEI's ``Input`` holds one input: a text, or one list of token ids."""
    return isinstance(inputs, str) or (bool(inputs) and all(isinstance(x, int) for x in inputs))


def plan_sparse(body: TextsRequest, settings: Settings) -> Plan:
    answer = decoded("embed_sparse")
    plan = Plan("embed_sparse", _inputs(body.inputs), _options(prompt_name=body.prompt_name, **_tei_options(body)),
                lambda payloads: [v.to_tei() for chunk in answer(payloads) for v in chunk],
                single=_single(body.inputs))
    return _windowed(plan, body, settings, _tei_windows("embed_sparse", lambda v: v.to_tei()))


def plan_all(body: TextsRequest, settings: Settings) -> Plan:
    answer = decoded("embed_all")
    plan = Plan("embed_all", _inputs(body.inputs), _options(prompt_name=body.prompt_name, **_tei_options(body)),
                lambda payloads: [m for chunk in answer(payloads) for m in chunk], single=_single(body.inputs))
    return _windowed(plan, body, settings, _tei_windows("embed_all", _same))


def plan_rerank(body: RerankRequest, settings: Settings) -> Plan:
    def answer(payloads: list[dict[str, Any]]) -> Any:
        size = settings.max_texts_per_job
        ranked = [{"index": e["index"] + n * size, "score": e["score"]}
                  for n, chunk in enumerate(decoded("rerank")(payloads)) for e in chunk]
        ranked.sort(key=lambda e: (-e["score"], e["index"]))
        if body.return_text:
            ranked = [{"index": e["index"], "text": body.texts[e["index"]], "score": e["score"]} for e in ranked]
        return ranked

    return Plan("rerank", body.texts, _options(raw_scores=body.raw_scores, **body.job_options()), answer,
                lambda texts: (body.query, texts), extra_characters=len(body.query) * len(body.texts))


def plan_predict(body: PredictRequest, settings: Settings) -> Plan:
    inputs = body.inputs  # TEI's PredictInput: a text, or [a] / [a, b], is one input; [[...], ...] a batch
    single = isinstance(inputs, str) or not inputs or isinstance(inputs[0], str)
    rows: list[Any] = [inputs] if isinstance(inputs, str) else [inputs] if single else list(inputs)
    items: list[Any] = []
    for row in rows:
        if isinstance(row, list) and len(row) not in (1, 2):
            raise errors.InvalidType(f"Input validation error: a /predict input is a text or a pair of texts "
                                     f"[string, string], got {len(row)} texts")
        items.append(row if isinstance(row, str) else row[0] if len(row) == 1 else list(row))

    def answer(payloads: list[dict[str, Any]]) -> Any:
        scores = [row for chunk in decoded("predict")(payloads) for row in chunk]
        return scores[0] if single else scores

    return Plan("predict", items, _options(raw_scores=body.raw_scores, **body.job_options()), answer,
                single=single)


def plan_tokenize(body: TokenizeRequest, settings: Settings) -> Plan:
    texts = _texts(body.inputs)

    def answer(payloads: list[dict[str, Any]]) -> Any:
        size, out = settings.max_texts_per_job, []
        for n, payload in enumerate(payloads):  # TEI: byte offsets into the prompted text, its slice as the token's
            for text, tokens in zip(texts[n * size:(n + 1) * size], KINDS["tokenize"].decode(payload)):
                seen = (payload.get("prompt") or "") + text  # text (the vocabulary's string only for specials)
                for t in tokens:
                    if t["special"]:
                        t["start"] = t["stop"] = None
                    else:
                        t["text"] = seen[t["start"]:t["stop"]]
                        t["start"] = len(seen[:t["start"]].encode())
                        t["stop"] = t["start"] + len(t["text"].encode())
                out.append(tokens)
        return out

    # TEI's /tokenize never truncates: every token of the text, however many the model would read
    return Plan("tokenize", texts, _options(add_special_tokens=body.add_special_tokens,
                                            prompt_name=body.prompt_name, truncate=False), answer)


def plan_decode(body: DecodeRequest, settings: Settings) -> Plan:
    lists = id_lists(body.ids)
    return Plan("decode", lists, {"skip_special_tokens": body.skip_special_tokens},
                lambda payloads: [t for p in payloads for t in KINDS["decode"].decode(p)])


def plan_similarity(body: SimilarityRequest, settings: Settings) -> Plan:
    params = body.parameters or SimilarityParameters()
    if not body.inputs.sentences:
        raise errors.EmptyInput("Input validation error: `sentences` cannot be empty")

    def answer(vectors: np.ndarray, tokens: int) -> list[float]:
        v = vectors.astype(np.float64)
        norms = np.linalg.norm(v, axis=1)
        return [float(c) for c in v[1:] @ v[0] / np.maximum(norms[1:] * norms[0], 1e-300)]

    return embed_plan([body.inputs.source_sentence, *body.inputs.sentences], answer, normalize=False,
                      prompt_name=params.prompt_name, **params.job_options())


def plan_openai(body: OpenAIEmbeddingRequest, settings: Settings, name: str) -> Plan:
    """OpenAI's embeddings: normalized vectors, as floats or base64 of little-endian float32, under ``name``; with
    ``pool_windows: false`` each entry's ``embedding`` is null and its ``windows`` hold the vectors."""

    def encode(vectors: np.ndarray) -> list[Any]:
        vectors = np.ascontiguousarray(vectors, dtype="<f4")
        if body.encoding_format == "base64":
            return [base64.b64encode(v.tobytes()).decode("ascii") for v in vectors]
        return list(vectors)

    def response(data: list[dict[str, Any]], tokens: int) -> dict[str, Any]:
        return {"object": "list", "model": name, "usage": {"prompt_tokens": tokens, "total_tokens": tokens},
                "data": [{"object": "embedding", "index": i, **entry} for i, entry in enumerate(data)]}

    def per_window(payloads: list[dict[str, Any]]) -> dict[str, Any]:
        texts = windows_of(payloads, lambda p: decode_result(p)[0])
        data = [{"embedding": None, "windows": [window_json(w, e) for w, e in zip(text, encode(
            np.asarray([w.output for w in text], np.float32).reshape(len(text), -1)))]} for text in texts]
        return response(data, _tokens(payloads))

    plan = embed_plan(_texts(body.input), lambda vectors, tokens: response(
        [{"embedding": e} for e in encode(vectors)], tokens), normalize=True, dimensions=body.dimensions,
        **body.window_options(None))
    return _windowed(plan, body, settings, per_window)


#: The request body and planner of each kind a TEI route serves (and ``similarity``): the TEI routes', ``POST /``'s
#: and ``/jobs``'.
ROUTE_PLANS: dict[str, tuple[type[BaseModel], Callable[[Any, Settings], Plan]]] = {
    "embed": (EmbedRequest, plan_embed),
    "embed_sparse": (TextsRequest, plan_sparse),
    "embed_all": (TextsRequest, plan_all),
    "rerank": (RerankRequest, plan_rerank),
    "predict": (PredictRequest, plan_predict),
    "tokenize": (TokenizeRequest, plan_tokenize),
    "decode": (DecodeRequest, plan_decode),
    "similarity": (SimilarityRequest, plan_similarity),
}


def plan_any(spec: TaskSpec) -> Callable[[Any, Settings], Plan]:
    """The planner of a kind no TEI route serves: ``inputs`` split into jobs, the body's other fields as the kind's
    options (its options model checks them at the edge), the answer each job's decoded result (numpy arrays and
    dataclasses as :class:`~embedq.gateway.schemas.JSONResponse` writes them) — one list in input order when every
    job's result is a list or an array of one entry per input."""

    def plan(body: JobInputs, settings: Settings) -> Plan:
        inputs = body.inputs if isinstance(body.inputs, list) else [body.inputs]

        def answer(payloads: list[dict[str, Any]]) -> Any:
            out = [spec.decode(p) for p in payloads]
            sequences = all(isinstance(p, (list, np.ndarray)) for p in out)
            return [entry for part in out for entry in part] if sequences else out

        return Plan(spec.kind, inputs, dict(body.model_extra or {}), answer)

    return plan


def planner(kind: str) -> tuple[type[BaseModel], Callable[[Any, Settings], Plan]]:
    """The body model and planner of ``kind`` for ``/jobs``: a TEI route's, else the generic one of the kinds
    table; :class:`~embedq.errors.InvalidOption` naming what is known else."""
    if kind in ROUTE_PLANS:
        return ROUTE_PLANS[kind]
    if kind in KINDS:
        return JobInputs, plan_any(KINDS[kind])
    known = list(ROUTE_PLANS) + [k for k in kind_names() if k not in ROUTE_PLANS]
    raise errors.InvalidOption(f"unknown job kind {kind!r} (known: {', '.join(known)})")


def job_plan(record: dict[str, Any], settings: Settings) -> Plan:
    """The plan of a stored async job (``/jobs``): its kind's planner on its validated body."""
    model, plan = planner(record["kind"])
    return plan(model.model_validate(record["body"]), settings)


def parse(model: type[BaseModel], payload: Any) -> Any:
    """A body read by hand (``/jobs``, ``POST /``) validated like a route's own, with the same 422."""
    try:
        return model.model_validate(payload)
    except PydanticValidationError as exc:
        raise RequestValidationError(exc.errors()) from None
