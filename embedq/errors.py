"""One error tree for embedq, and the one table of what each error means over HTTP.

Each error class carries a stable ``code`` (what clients branch on), ``retryable``, the HTTP ``http_status`` the
gateway answers and TEI's ``error_type`` (the ``{"error", "error_type"}`` body's). Where TEI defines a status
(400 empty input, 413, 422 validation, 424 backend or a route the model does not serve, 429 overloaded, 503
unhealthy) it is TEI's, since clients are written against TEI. The gateway renders TEI's and OpenAI's error
bodies from these attributes alone (:func:`table` is every class, walked from the tree), and README's table is
tested against it. Errors travel through the Celery result backend as ``{"exc_type", "exc_message",
"exc_module"}``; they are rebuilt from their message alone, so every subclass takes exactly one positional
argument. The message always starts with ``[code]`` so a JSON-only client can read the code without importing
this module.

The tree (class, ``code``, HTTP status, ``error_type``; ``*``: retryable)::

    EmbedqError                  internal_error       424 Backend     a failure without a class of its own
    ├── ValidationError          invalid_request      422 Validation  the job was wrong: never retried
    │   ├── EmptyInput           empty_input          400 Empty       no inputs (TEI's 400)
    │   ├── EmptyText            empty_text           400 Empty       an empty text (""), or a blank indexer record
    │   ├── InvalidType          invalid_type         422 Validation
    │   ├── InvalidOption        invalid_option       422 Validation
    │   ├── UnknownPromptName    unknown_prompt_name  422 Validation
    │   ├── InvalidDimensions    invalid_dimensions   422 Validation
    │   ├── UnknownModel         unknown_model        422 Validation
    │   ├── TooLong              too_many_tokens      422 Validation
    │   ├── UnsupportedTask      unsupported_task     424 Backend     TEI: a route the model does not serve
    │   ├── InvalidText          invalid_text         422 Validation
    │   ├── InvalidMessage       invalid_message      422 Validation
    │   ├── InvalidRecord        invalid_record       422 Validation
    │   ├── DuplicateId          duplicate_id         422 Validation
    │   ├── OutputMismatch       output_mismatch      422 Validation
    │   ├── OutputUnsupported    output_unsupported   422 Validation  indexer: the target lacks what it needs
    │   ├── TooManyInputs        too_many_inputs      422 Validation  TEI: batch size over the client limit
    │   ├── JobNotFound          job_not_found        404 NotFound    gateway: GET/DELETE /jobs/{id}
    │   └── ModelNotFound        model_not_found      404 NotFound    gateway: a model it does not serve
    ├── PayloadTooLarge          payload_too_large    413 Validation
    │   ├── TooManyTexts         too_many_texts       413 Validation
    │   ├── TextTooLong          text_too_long        413 Validation
    │   ├── MessageTooLarge      message_too_large    413 Validation
    │   ├── TooManyWindows       too_many_windows     413 Validation  a text needs more windows than max_windows
    │   └── ResultTooLarge       result_too_large     413 Backend
    ├── DeadLetter               dead_letter          424 Backend     the job crashed its worker, every time
    ├── BackendError           * backend_error        424 Backend
    ├── UnsupportedModel         unsupported_model    424 Backend
    ├── Overloaded             * overloaded           429 Overloaded
    ├── Expired                * expired              504 Timeout
    ├── Cancelled                cancelled            409 Cancelled
    └── Unavailable            * unavailable          503 Unhealthy
        ├── BrokerUnavailable  * unavailable          503 Unhealthy
        ├── BrokerForbidden      broker_forbidden     503 Unhealthy   the broker refused this process's Redis user
        ├── NoWorker           * no_worker            503 Unhealthy   no live worker serves the job's queue
        ├── JobTimeout         * timeout              504 Timeout     no result in time: a gateway timeout
        └── JobLost            * job_lost             503 Unhealthy

``Cancelled`` is 409 Conflict, not nginx's 499 "client closed request": a client that reads this status is one
still connected whose job someone else cancelled (``DELETE /jobs/{id}``, ``JobHandle.cancel()``, a Celery revoke),
which is a conflict with the job's state, not a request it closed; 409 is a registered status every HTTP client
knows (the openai SDK raises ``ConflictError``), 499 is not. A request whose own client left is answered to no
one; the gateway counts those in ``embedq_gateway_disconnects_total``.

``BrokerForbidden`` is 503, not 403, and not retryable: the HTTP client's request and credentials are fine; it is the
gateway's own Redis user that lacks a right (or its password is wrong), an operator's fix. A 403 would tell the client
that *its* key is refused (the openai SDK raises ``PermissionDeniedError``) and send it looking in the wrong place; the
service is unavailable until the ACL is fixed, and trying again before that changes nothing.
"""

from __future__ import annotations


def install_hint(extra: str) -> str:
    """How to add an optional part of embedq: it installs from its checkout (it is on no package index), so the hint
    names the checkout, not a ``pip install 'embedq[...]'`` that would find nothing."""
    return f"pip install -e '.[{extra}]' in embedq's checkout (README: Install)"


class EmbedqError(Exception):
    """Base of every embedq error."""

    code: str = "internal_error"
    retryable: bool = False
    #: the gateway's status for it (TEI's where TEI defines one)
    http_status: int = 424
    #: TEI's ``error_type`` (``ErrorType``: Validation, Empty, Tokenizer, Backend, Overloaded, Unhealthy; and the
    #: gateway's own NotFound, Timeout, Cancelled where TEI has no such error)
    error_type: str = "Backend"

    def __init__(self, message: str = "") -> None:
        prefix = f"[{self.code}] "
        if not message.startswith(prefix):
            message = prefix + message
        super().__init__(message)

    @property
    def message(self) -> str:
        return str(self.args[0])

    def to_dict(self) -> dict[str, object]:
        return {"code": self.code, "message": self.message, "retryable": self.retryable}


# -- the job was wrong: never retried --------------------------------------------------------------
class ValidationError(EmbedqError):
    code = "invalid_request"
    http_status = 422
    error_type = "Validation"


class EmptyInput(ValidationError):
    code = "empty_input"
    http_status = 400
    error_type = "Empty"


class EmptyText(ValidationError):
    code = "empty_text"
    http_status = 400
    error_type = "Empty"


class InvalidType(ValidationError):
    code = "invalid_type"


class InvalidOption(ValidationError):
    code = "invalid_option"


class UnknownPromptName(ValidationError):
    code = "unknown_prompt_name"


class InvalidDimensions(ValidationError):
    code = "invalid_dimensions"


class UnknownModel(ValidationError):
    code = "unknown_model"


class TooLong(ValidationError):
    """A text has more tokens than the model takes and the job asked not to truncate."""

    code = "too_many_tokens"


class UnsupportedTask(ValidationError):
    """The job's kind (rerank, predict, embed, ...) is not one the worker's model serves; the message names
    the kinds it does serve."""

    code = "unsupported_task"
    http_status = 424  # TEI: a route the model's type does not serve is a Backend error
    error_type = "Backend"


class InvalidText(ValidationError):
    """A text that is not valid Unicode (a lone surrogate cannot be encoded as UTF-8)."""

    code = "invalid_text"


class InvalidMessage(ValidationError):
    """A task message the worker cannot read: undecodable, refused content type (pickle), wrong
    structure or an unknown task name. It is never executed."""

    code = "invalid_message"


class InvalidRecord(ValidationError):
    """An input record the indexer cannot use: not JSON, no text field, a bad or missing id."""

    code = "invalid_record"


class DuplicateId(ValidationError):
    """The indexer met an id it has already seen in the same input."""

    code = "duplicate_id"


class OutputMismatch(ValidationError):
    """An existing output was made by another pipeline (model, options, format): never mixed."""

    code = "output_mismatch"


class OutputUnsupported(ValidationError):
    """An output cannot take embedq's rows until its operator adds something (pgvector's extension on a server that
    lacks it): a run again as it is would fail the same way."""

    code = "output_unsupported"


class PayloadTooLarge(EmbedqError):
    code = "payload_too_large"
    http_status = 413
    error_type = "Validation"


class TooManyTexts(PayloadTooLarge):
    code = "too_many_texts"


class TooManyInputs(ValidationError):
    """An HTTP request with more inputs than the gateway takes at once (EMBEDQ_MAX_CLIENT_BATCH_SIZE)."""

    code = "too_many_inputs"


class JobNotFound(ValidationError):
    """The gateway has no async job by this id (unknown, deleted, or older than EMBEDQ_RESULT_TTL)."""

    code = "job_not_found"
    http_status = 404
    error_type = "NotFound"


class ModelNotFound(ValidationError):
    """A gateway of several models was asked for one it does not serve."""

    code = "model_not_found"
    http_status = 404
    error_type = "NotFound"


class TextTooLong(PayloadTooLarge):
    code = "text_too_long"


class MessageTooLarge(PayloadTooLarge):
    code = "message_too_large"


class TooManyWindows(PayloadTooLarge):
    """A text of a ``long_inputs="windows"`` job needs more windows than the worker's ``max_windows``: that text
    fails alone (the job's result lists it under ``failed``); the job's other texts are answered."""

    code = "too_many_windows"


class ResultTooLarge(PayloadTooLarge):
    """The job's result would be larger than the worker stores (``max_result_bytes``): send fewer inputs
    per job, or ask for a compact encoding."""

    code = "result_too_large"
    error_type = "Backend"


class DeadLetter(EmbedqError):
    """A job that crashed the worker on each of its last deliveries: it is not delivered again."""

    code = "dead_letter"
    http_status = 424  # failed in its worker, as TEI's Backend errors; not retryable
    error_type = "Backend"


# -- the system was wrong: may be retried ----------------------------------------------------------
class BackendError(EmbedqError):
    code = "backend_error"
    retryable = True
    http_status = 424
    error_type = "Backend"


class UnsupportedModel(EmbedqError):
    """The model folder uses a module embedq does not implement (raised at load, never per job)."""

    code = "unsupported_model"
    http_status = 424
    error_type = "Backend"


class Overloaded(EmbedqError):
    """Refused at once, nothing sent: the queue is full or the job would wait too long (embedq/admission.py).
    ``retry_after``: seconds after which trying again may succeed (the gateway's ``Retry-After``)."""

    code = "overloaded"
    retryable = True
    http_status = 429
    error_type = "Overloaded"
    retry_after: float = 1.0


class Expired(EmbedqError):
    """The job's deadline passed before it ran: dropped before it cost compute (send it again with a new
    deadline, or none)."""

    code = "expired"
    retryable = True
    http_status = 504
    error_type = "Timeout"


class Cancelled(EmbedqError):
    """The job was cancelled (``JobHandle.cancel()``, or revoked through Celery) before it ran."""

    code = "cancelled"
    http_status = 409  # not 499: see the module's docstring
    error_type = "Cancelled"


class Unavailable(EmbedqError):
    code = "unavailable"
    retryable = True
    http_status = 503
    error_type = "Unhealthy"


class BrokerUnavailable(Unavailable):
    """A producer could not reach the broker (Redis down, refusing connections, TLS failure); a wrong password is
    :class:`BrokerForbidden`."""


class BrokerForbidden(Unavailable):
    """The broker refused this process's Redis user: a command, key or channel outside its ACL rules (``NOPERM``), or
    a wrong user name or password. Not retryable: the same call fails the same way until an operator fixes the user
    (``embedq acl`` prints each role's rules). The message names the refused operation and the user."""

    code = "broker_forbidden"
    retryable = False


class NoWorker(Unavailable):
    """No live worker serves the queue a producer sends to (a model no worker serves, a typo in it, or every
    worker down); the message names the queue and what the live workers do serve. Raised before anything is sent,
    by the gateway's synchronous routes, ``embedq index`` and ``Client(require_worker=True)``."""

    code = "no_worker"


class JobTimeout(Unavailable):
    code = "timeout"
    http_status = 504  # the gateway waited for the job's result in vain: a gateway timeout
    error_type = "Timeout"


class JobLost(Unavailable):
    """The broker lost the job (Redis restarted without its data) and it could not be resent."""

    code = "job_lost"


def table() -> list[type[EmbedqError]]:
    """Every error class, walked from :class:`EmbedqError` (depth first, in definition order): a new class cannot
    be missed."""
    out: list[type[EmbedqError]] = []

    def walk(cls: type[EmbedqError]) -> None:
        out.append(cls)
        for sub in cls.__subclasses__():
            walk(sub)

    walk(EmbedqError)
    return out


#: HTTP status for each code (classes that share a code share its status), for the gateway and the docs.
HTTP_STATUS: dict[str, int] = {cls.code: cls.http_status for cls in table()}
