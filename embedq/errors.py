"""One error tree for embedq.

Each error has a stable ``code`` (what clients branch on), a ``retryable`` flag and the HTTP status
the gateway maps it to. Errors travel through the Celery result backend as
``{"exc_type", "exc_message", "exc_module"}``; they are rebuilt from their message alone, so every
subclass takes exactly one positional argument. The message always starts with ``[code]`` so a
JSON-only client can read the code without importing this module.
"""

from __future__ import annotations


class EmbedqError(Exception):
    """Base of every embedq error."""

    code: str = "internal_error"
    retryable: bool = False
    http_status: int = 500

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


class EmptyInput(ValidationError):
    code = "empty_input"


class EmptyText(ValidationError):
    code = "empty_text"


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


class PayloadTooLarge(EmbedqError):
    code = "payload_too_large"
    http_status = 413


class TooManyTexts(PayloadTooLarge):
    code = "too_many_texts"


class TooManyInputs(ValidationError):
    """An HTTP request with more inputs than the gateway takes at once (EMBEDQ_MAX_CLIENT_BATCH_SIZE)."""

    code = "too_many_inputs"


class TextTooLong(PayloadTooLarge):
    code = "text_too_long"


class MessageTooLarge(PayloadTooLarge):
    code = "message_too_large"


class ResultTooLarge(PayloadTooLarge):
    """The job's result would be larger than the worker stores (``max_result_bytes``): send fewer inputs
    per job, or ask for a compact encoding."""

    code = "result_too_large"


class DeadLetter(EmbedqError):
    """A job that crashed the worker on each of its last deliveries: it is not delivered again."""

    code = "dead_letter"
    http_status = 500


# -- the system was wrong: may be retried ----------------------------------------------------------
class BackendError(EmbedqError):
    code = "backend_error"
    retryable = True
    http_status = 424


class UnsupportedModel(EmbedqError):
    """The model folder uses a module embedq does not implement (raised at load, never per job)."""

    code = "unsupported_model"
    http_status = 424


class Overloaded(EmbedqError):
    code = "overloaded"
    retryable = True
    http_status = 429


class Expired(EmbedqError):
    """The job's deadline passed before it ran: dropped before it cost compute (send it again with a new
    deadline, or none)."""

    code = "expired"
    retryable = True
    http_status = 504


class Cancelled(EmbedqError):
    """The job was cancelled (``JobHandle.cancel()``, or revoked through Celery) before it ran."""

    code = "cancelled"
    http_status = 409


class Unavailable(EmbedqError):
    code = "unavailable"
    retryable = True
    http_status = 503


class BrokerUnavailable(Unavailable):
    """A producer could not reach the broker (Redis down, refused, wrong password, TLS failure)."""


class JobTimeout(Unavailable):
    code = "timeout"


class JobLost(Unavailable):
    """The broker lost the job (Redis restarted without its data) and it could not be resent."""

    code = "job_lost"


#: HTTP status for each code, for the gateway and the docs.
HTTP_STATUS: dict[str, int] = {
    cls.code: cls.http_status
    for cls in (
        EmbedqError, ValidationError, EmptyInput, EmptyText, InvalidType, InvalidOption, UnknownPromptName,
        InvalidDimensions, UnknownModel, UnsupportedTask, TooLong, InvalidText, InvalidMessage, InvalidRecord,
        DuplicateId, OutputMismatch, PayloadTooLarge, TooManyTexts, TextTooLong, MessageTooLarge, ResultTooLarge,
        DeadLetter, BackendError, UnsupportedModel, Overloaded, Expired, Cancelled, Unavailable, JobTimeout, JobLost,
    )
}
