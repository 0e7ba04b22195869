"""``embedq verify``: are the vectors a server gives the model's own? Any server: embedq's queue, embedq's gateway,
a TEI server or a hosted OpenAI-style API serving the same model.

The reference is sentence-transformers on the model folder, in float32, one text at a time (``batch_size=1``: no
padding, nothing shared with other texts). The served vectors come from the queue (a :class:`Client`; with no
``EMBEDQ_BROKER_URL``, a private redis-server and worker) or from ``--endpoint`` (TEI's ``POST /embed`` or OpenAI's
``POST /v1/embeddings``). Each text gets a cosine and a max |Δ|; the run passes when every text is over the
thresholds. The defaults: cosine ≥ 0.99999 and max |Δ| ≤ 1e-5 when the server says it computes in float32 (what
embedq promises); cosine ≥ 0.999 (and |Δ| reported, not judged) when it computes in float16/bfloat16 or does not
say, as a hosted API does not. The migration that lost a team its search results measured cosines of 0.30.

On a failure the report says what the served vectors do match, where it can tell: the same folder with another
pooling, without the prompt, or normalised differently. That covers the usual silent changes (docs/FIDELITY.md).
"""

from __future__ import annotations

import base64
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from embedq import errors

#: What ``verify`` embeds when given no texts: queries, passages, a text over any model's limit, non-ASCII text,
#: code and odd whitespace. Every text is non-empty (TEI refuses empty inputs).
SAMPLE_TEXTS = [
    "what is the capital of france",
    "how do I reset my password?",
    "Paris is the capital and most populous city of France, on the Seine river in the north of the country.",
    "The mitochondrion is the powerhouse of the cell: it produces most of the chemical energy the cell needs.",
    "Les modèles d'embedding transforment un texte en vecteur.",
    "Übermäßige Großschreibung und Umlaute: ÄÖÜ äöü ß.",
    "日本語の文章も同じように埋め込まれる。",
    "def add(a, b):\n    return a + b  # a tiny function",
    "  leading and trailing spaces, \t tabs and\nnew lines  ",
    "A",
    "emoji 🚀🔥 and symbols ∑ ∫ ≤ ≥ →",
    " ".join(["A long text that goes on and on so that every model has to truncate it at its limit."] * 120),
]
STRICT = (0.99999, 1e-5)  # float32, as sentence-transformers
HALF_COSINE = 0.999  # float16 / bfloat16, or a server that does not say


# -- texts ------------------------------------------------------------------------------------------------------
def read_texts(path: str | None, *, input_format: str | None = None, text_field: str = "text",
               id_field: str | None = None, limit: int | None = None) -> tuple[list[str], list[str]]:
    """(ids, texts) of a file the indexer reads (JSONL, CSV/TSV, Parquet, text, ``-``), or the built-in sample."""
    if path is None:
        texts = SAMPLE_TEXTS[:limit] if limit else list(SAMPLE_TEXTS)
        return [str(i) for i in range(len(texts))], texts
    from embedq.producers.index.sources import Source

    ids: list[str] = []
    texts: list[str] = []
    for record in Source(path, input_format, text_field=text_field, id_field=id_field):
        if record.error is not None or not isinstance(record.text, str) or not record.text:
            continue  # verify compares texts; what cannot be a text is not its business
        ids.append(record.id)
        texts.append(record.text)
        if limit and len(texts) >= limit:
            break
    if not texts:
        raise errors.InvalidOption(f"no texts in {path!r} (field {text_field!r})")
    return ids, texts


# -- the reference ------------------------------------------------------------------------------------------------
class Reference:
    """sentence-transformers on the model folder, float32 on the CPU, one text at a time."""

    def __init__(self, folder: Path, *, trust_remote_code: bool = False) -> None:
        try:
            import torch
            from sentence_transformers import SentenceTransformer
        except ImportError as exc:
            raise errors.InvalidOption(f"embedq verify needs sentence-transformers and torch ({exc.name} is "
                                       f"missing): {errors.install_hint('worker')}") from exc
        self.folder = folder
        self.torch = torch
        self.model = SentenceTransformer(str(folder), device="cpu", trust_remote_code=trust_remote_code,
                                         model_kwargs={"dtype": torch.float32})
        modules = [type(m).__name__ for m in self.model]
        self.normalizes = bool(modules) and modules[-1] == "Normalize"
        self.pooling_index = modules.index("Pooling") if "Pooling" in modules else None
        self.max_seq_length = self.model.max_seq_length

    @property
    def pooling(self) -> str:
        if self.pooling_index is None:
            return "unknown"
        mode = self.model[self.pooling_index].pooling_mode
        return "+".join(mode) if isinstance(mode, (list, tuple)) else str(mode)

    def prompt(self, prompt: str | None, prompt_name: str | None) -> str | None:
        """The prompt sentence-transformers prepends (its default_prompt_name when none is given)."""
        if prompt is not None:
            return prompt or None
        name = prompt_name or self.model.default_prompt_name
        if name is None:
            return None
        if name not in self.model.prompts:
            raise errors.InvalidOption(f"prompt_name {name!r} is not defined by the model "
                                       f"(known: {', '.join(sorted(self.model.prompts)) or 'none'})")
        return self.model.prompts[name] or None

    def encode(self, texts: list[str], prompt: str | None, *, model: Any = None, normalize: bool = False,
               ) -> np.ndarray:
        with self.torch.inference_mode():
            out = (model or self.model).encode(texts, batch_size=1, prompt=prompt or "", convert_to_numpy=True,
                                               normalize_embeddings=normalize, show_progress_bar=False)
        return np.asarray(out, dtype=np.float32)

    def _variant(self, modules: list[Any]) -> Any:
        from sentence_transformers import SentenceTransformer

        return SentenceTransformer(modules=modules, device="cpu", prompts=self.model.prompts,
                                   default_prompt_name=self.model.default_prompt_name)

    def alternatives(self, prompt: str | None) -> list[tuple[str, Any, str | None, bool]]:
        """(what is different, model, prompt, normalise) for each usual silent change of this folder."""
        from sentence_transformers.sentence_transformer.modules import Pooling

        out: list[tuple[str, Any, str | None, bool]] = []
        own = self.pooling
        if prompt:
            out.append(("no prompt", None, None, False))
        if self.normalizes:
            out.append(("no Normalize step", self._variant(list(self.model)[:-1]), prompt, False))
        else:
            out.append(("normalised vectors", None, prompt, True))
        if self.pooling_index is not None and not any(type(m).__name__ == "Dense" for m in self.model):
            original = self.model[self.pooling_index]
            for mode in ("cls", "mean", "lasttoken", "max"):
                if mode == own:
                    continue
                modules = list(self.model)
                modules[self.pooling_index] = Pooling(original.embedding_dimension, mode,
                                                      include_prompt=original.include_prompt)
                other = self._variant(modules)
                out.append((f"{mode} pooling instead of {own}", other, prompt, False))
                if prompt:
                    out.append((f"{mode} pooling instead of {own} and no prompt", other, None, False))
        return out


# -- the served vectors ----------------------------------------------------------------------------------------------
@dataclass
class Served:
    vectors: np.ndarray
    where: str
    dtype: str | None = None  # the compute dtype the server reports (None: it does not say)
    weights_sha256: str | None = None
    pooling: str | None = None
    max_input_length: int | None = None


def served_by_queue(settings: Any, texts: list[str], *, prompt: str | None, prompt_name: str | None,
                    chunk: int = 64, timeout: float = 300.0) -> Served:
    """The vectors of the model's queue, as a job without options gets them (the model's own normalisation)."""
    from embedq.producers.client import Client

    options: dict[str, Any] = {}
    if prompt is not None:
        options["prompt"] = prompt
    if prompt_name is not None:
        options["prompt_name"] = prompt_name
    with Client(settings) as client:
        handles = [client.submit(texts[i:i + chunk], **options) for i in range(0, len(texts), chunk)]
        parts = [h.result(timeout) for h in handles]
        fingerprint = handles[0].fingerprint
    served = Served(np.concatenate(parts).astype(np.float32), where=f"queue {settings.queue_name}")
    if fingerprint is not None:
        served.dtype, served.weights_sha256, served.pooling = (fingerprint.dtype, fingerprint.weights_sha256,
                                                                fingerprint.pooling)
        served.where += f" ({fingerprint.model})"
    return served


def _endpoint_urls(url: str, api: str) -> tuple[str, str]:
    """(the embeddings URL, the server's base URL) for ``url`` given as a base or as the route itself."""
    url = url.rstrip("/")
    if api == "openai":
        if url.endswith("/embeddings"):
            route = url
        elif url.endswith("/v1"):
            route = url + "/embeddings"
        else:
            route = url + "/v1/embeddings"
        base = route.removesuffix("/embeddings").removesuffix("/v1")
        return route, base
    route = url if url.endswith("/embed") else url + "/embed"
    return route, route.removesuffix("/embed")


def served_by_endpoint(url: str, texts: list[str], *, api: str, model: str | None, api_key: str | None,
                       prompt: str | None, prompt_name: str | None, normalize: bool, chunk: int = 32,
                       timeout: float = 120.0) -> Served:
    """The vectors of a TEI-style (``POST /embed``) or OpenAI-style (``POST /v1/embeddings``) endpoint."""
    import httpx

    route, base = _endpoint_urls(url, api)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    served = Served(np.zeros((0, 0), np.float32), where=f"{api} endpoint {route}")
    inputs = [prompt + t for t in texts] if prompt else list(texts)  # a prompt text is prepended as ST does
    rows: list[list[float]] = []
    with httpx.Client(timeout=timeout, headers=headers) as http:
        try:  # TEI's /info (embedq's gateway has it too): dtype, weights, pooling, truncation length
            info = http.get(base + "/info")
            if info.status_code == 200:
                data = info.json()
                served.dtype = data.get("model_dtype") or None
                sha = data.get("model_sha")
                served.weights_sha256 = sha if isinstance(sha, str) and len(sha) == 64 else None
                pooling = ((data.get("model_type") or {}).get("embedding") or {}).get("pooling")
                served.pooling = str(pooling).replace("last_token", "lasttoken") if pooling else None
                served.max_input_length = data.get("max_input_length")
        except (httpx.HTTPError, ValueError, AttributeError):
            pass
        for start in range(0, len(inputs), chunk):
            part = inputs[start:start + chunk]
            if api == "openai":
                body: dict[str, Any] = {"input": part, "encoding_format": "base64"}
                if model:
                    body["model"] = model
            else:
                body = {"inputs": part, "truncate": True, "normalize": normalize}
                if prompt_name is not None:
                    body["prompt_name"] = prompt_name
            try:
                response = http.post(route, json=body)
            except httpx.HTTPError as exc:
                raise errors.Unavailable(f"{route}: {exc}") from exc
            if response.status_code != 200:
                raise errors.InvalidOption(f"{route} answered {response.status_code}: {response.text[:500]}")
            data = response.json()
            if api == "openai":
                for item in sorted(data["data"], key=lambda d: d["index"]):
                    vec = item["embedding"]
                    rows.append(np.frombuffer(base64.b64decode(vec), dtype="<f4").tolist() if isinstance(vec, str)
                                else vec)
            else:
                rows.extend(data)
    served.vectors = np.asarray(rows, dtype=np.float32)
    if served.vectors.shape[0] != len(texts):
        raise errors.InvalidOption(f"{route} returned {served.vectors.shape[0]} vectors for {len(texts)} texts")
    return served


# -- the comparison ---------------------------------------------------------------------------------------------------
def cosines(a: np.ndarray, b: np.ndarray) -> np.ndarray:
    """Row-wise cosine in float64; two zero rows are equal (1), one zero row is 0."""
    a, b = a.astype(np.float64), b.astype(np.float64)
    na, nb = np.linalg.norm(a, axis=1), np.linalg.norm(b, axis=1)
    with np.errstate(invalid="ignore", divide="ignore"):
        cos = (a * b).sum(1) / (na * nb)
    return np.where((na == 0) & (nb == 0), 1.0, np.nan_to_num(cos, nan=0.0))


@dataclass
class Report:
    reference: str
    served: Served
    ids: list[str]
    texts: list[str]
    cosine: np.ndarray
    delta: np.ndarray
    min_cosine: float
    max_delta: float | None  # None: reported, not judged
    threshold_reason: str
    prompt: str | None
    diagnosis: list[tuple[str, float]] = field(default_factory=list)  # (what, min cosine) best first
    problems: list[str] = field(default_factory=list)  # shape mismatches: nothing to compare
    notes: list[str] = field(default_factory=list)  # what the server reports unlike the folder

    def failing(self) -> np.ndarray:
        bad = self.cosine < self.min_cosine
        if self.max_delta is not None:
            bad |= self.delta > self.max_delta
        return bad

    @property
    def passed(self) -> bool:
        return not self.problems and not bool(self.failing().any())

    def as_dict(self) -> dict[str, Any]:
        bad = self.failing()
        return {
            "passed": self.passed, "reference": self.reference, "served": self.served.where,
            "served_dtype": self.served.dtype, "served_weights_sha256": self.served.weights_sha256,
            "served_pooling": self.served.pooling, "prompt": self.prompt, "texts": len(self.texts),
            "thresholds": {"min_cosine": self.min_cosine, "max_abs_delta": self.max_delta,
                           "why": self.threshold_reason},
            "min_cosine": float(self.cosine.min()) if len(self.cosine) else None,
            "mean_cosine": float(self.cosine.mean()) if len(self.cosine) else None,
            "max_abs_delta": float(self.delta.max()) if len(self.delta) else None,
            "failed_texts": int(bad.sum()), "problems": self.problems,
            "diagnosis": [{"differs_by": what, "min_cosine": cos} for what, cos in self.diagnosis],
            "notes": self.notes,
            "per_text": [{"id": i, "cosine": float(c), "max_abs_delta": float(d), "ok": not bool(b)}
                         for i, c, d, b in zip(self.ids, self.cosine, self.delta, bad)],
        }

    def render(self, show: int = 20) -> str:
        bad = self.failing()
        lines = [f"reference: {self.reference}", f"served:    {self.served.where}"
                 + (f", {self.served.dtype}" if self.served.dtype else ", dtype not reported")]
        if self.prompt:
            lines.append(f"prompt:    {self.prompt!r}")
        judged = f"max |Δ| ≤ {self.max_delta:g}" if self.max_delta is not None else "max |Δ| reported only"
        lines.append(f"threshold: cosine ≥ {self.min_cosine:g}, {judged} ({self.threshold_reason})")
        order = np.lexsort((-self.delta, self.cosine))  # worst first
        shown = order if show <= 0 else order[:show]
        if len(self.cosine):
            lines.append("")
            lines.append(f"{'id':>8}  {'cosine':>10}  {'max |Δ|':>9}  text")
            for i in shown:
                text = self.texts[i].replace("\n", " ").replace("\t", " ")
                text = text if len(text) <= 60 else text[:57] + "..."
                mark = "  FAIL" if bad[i] else ""
                lines.append(f"{self.ids[i]:>8}  {self.cosine[i]:10.7f}  {self.delta[i]:9.2e}  {text}{mark}")
            if len(shown) < len(order):
                lines.append(f"  ({len(order) - len(shown)} more texts; --show 0 prints all, --json gives every one)")
            lines.append("")
            lines.append(f"{len(self.texts)} texts: min cosine {self.cosine.min():.7f}, mean {self.cosine.mean():.7f}, "
                         f"max |Δ| {self.delta.max():.2e}; {int(bad.sum())} below the threshold")
        lines += [f"problem: {p}" for p in self.problems]
        lines += [f"note: {n}" for n in self.notes]
        if not self.passed:
            if self.diagnosis and self.diagnosis[0][1] >= self.min_cosine:
                what, cos = self.diagnosis[0]
                lines.append(f"diagnosis: the served vectors match the reference with {what} "
                             f"(min cosine {cos:.7f}): the server is configured differently from the folder")
            elif self.diagnosis:
                lines.append("diagnosis: no usual mis-configuration explains the difference (tried: "
                             + "; ".join(f"{w} {c:.4f}" for w, c in self.diagnosis[:6]) + ")")
        lines.append("PASS" if self.passed else "FAIL")
        return "\n".join(lines)


def thresholds(dtype: str | None, min_cosine: float | None, max_delta: float | None) -> tuple[float, float | None, str]:
    """(min cosine, max |Δ| or None, why): the caller's, else by the dtype the server reports."""
    if dtype == "float32":
        why = "the server computes in float32"
        default_cos, default_delta = STRICT
    elif dtype:
        why, default_cos, default_delta = f"the server computes in {dtype}", HALF_COSINE, None
    else:
        why, default_cos, default_delta = "the server does not report its dtype", HALF_COSINE, None
    if min_cosine is not None or max_delta is not None:
        why = "given"
    return (min_cosine if min_cosine is not None else default_cos,
            max_delta if max_delta is not None else default_delta, why)


def compare(reference: Reference, served: Served, ids: list[str], texts: list[str], *, prompt: str | None,
            normalized_by_api: bool, min_cosine: float | None, max_delta: float | None, diagnose: int = 16,
            ) -> Report:
    expected = reference.encode(texts, prompt, normalize=normalized_by_api)
    where = f"sentence-transformers on {reference.folder}, float32, batch_size=1"
    if normalized_by_api and not reference.normalizes:
        where += ", normalised (the API returns unit vectors)"
    cos_min, delta_max, why = thresholds(served.dtype, min_cosine, max_delta)
    problems: list[str] = []
    if served.vectors.shape != expected.shape:
        problems.append(f"the served vectors are {served.vectors.shape}, the reference's {expected.shape}")
        n = len(texts)
        report = Report(where, served, ids, texts, np.zeros(n), np.full(n, math.inf), cos_min, delta_max, why, prompt,
                        problems=problems)
        return report
    cos = cosines(served.vectors, expected)
    delta = np.abs(served.vectors - expected).max(axis=1) if expected.size else np.zeros(len(texts))
    from embedq.backends.folder import weights_sha256

    notes: list[str] = []
    if served.weights_sha256 and served.weights_sha256 != weights_sha256(reference.folder):
        notes.append("the server's weights hash differs from the reference folder's: another copy or revision of "
                     "the model (or other configuration files)")
    if served.pooling and served.pooling != reference.pooling:
        notes.append(f"the server reports {served.pooling} pooling; the folder says {reference.pooling}")
    if served.max_input_length and served.max_input_length != reference.max_seq_length:
        notes.append(f"the server truncates at {served.max_input_length} tokens; the folder's max_seq_length is "
                     f"{reference.max_seq_length}")
    report = Report(where, served, ids, texts, cos, delta, cos_min, delta_max, why, prompt, problems=problems,
                    notes=notes)
    if not report.passed and diagnose:
        report.diagnosis = _diagnose(reference, served, texts, prompt, normalized_by_api, diagnose)
    return report


def _diagnose(reference: Reference, served: Served, texts: list[str], prompt: str | None, normalized_by_api: bool,
              n: int) -> list[tuple[str, float]]:
    """Which usual mis-configuration reproduces the served vectors (on the first ``n`` texts), best first."""
    found: list[tuple[str, float]] = []
    sample, got = texts[:n], served.vectors[:n]
    for what, model, alt_prompt, normalize in reference.alternatives(prompt):
        try:
            alt = reference.encode(sample, alt_prompt, model=model, normalize=normalize or normalized_by_api)
        except Exception:  # a hypothesis that cannot even run explains nothing
            continue
        if alt.shape == got.shape:
            found.append((what, float(cosines(got, alt).min())))
    return sorted(found, key=lambda x: -x[1])
