"""What one gateway process shares between its requests (:class:`Gateway`, on ``app.state.gateway``): the served
models, the producer :class:`~embedq.producers.client.Client`, the result waiter, the live-worker registry and the
metrics; and how a request's :class:`~embedq.gateway.plans.Plan` is sent as jobs and awaited."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import re
from typing import Any

from fastapi import Request

from embedq import admission, errors, monitor
from embedq.batching.traffic import BULK, ONLINE
from embedq.broker import async_redis_client
from embedq.gateway.admit import GatewayAdmission, identity
from embedq.gateway.middleware import GatewayMetrics
from embedq.gateway.plans import Plan
from embedq.gateway.results import MAX_CONNECTIONS, POOL_WAIT, AsyncResults
from embedq.gateway.tei_meta import TeiMetrics
from embedq.gateway.windowed import renumber
from embedq.producers.client import Client
from embedq.producers.handle import DEADLINE_GRACE, DEFAULT_RESULT_TIMEOUT
from embedq.protocol import MAX_DEADLINE_SECONDS
from embedq.settings import Settings

log = logging.getLogger(__name__)

#: Seconds between looks, while requests wait, at whether Redis restarted or lost its data (then: resend).
EPOCH_CHECK = 1.0


def served_models(settings: Settings) -> dict[str, Settings]:
    """The models a gateway serves, by the name a request gives (OpenAI's ``model``, ``X-Embedq-Model``): the
    settings' own model, then each entry of ``EMBEDQ_GATEWAY_MODELS`` (``name`` or ``name=queue``; a bare name is
    a model id and its queue the one a worker of that model consumes by default)."""
    models = {settings.model: settings}
    for entry in (e.strip() for e in (settings.gateway_models or "").split(",") if e.strip()):
        name, _, queue = (part.strip() for part in entry.partition("="))
        if not name:
            raise errors.InvalidOption(f"EMBEDQ_GATEWAY_MODELS: an entry has no name ({entry!r})")
        models[name] = settings.model_copy(update={"model": name, "queue": queue or None, "bulk_queue": None})
    return models


class Gateway:
    """The client, the result waiter and the registry reads one gateway process shares between requests."""

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.models = served_models(settings)
        self.client = Client(settings, follow_results=False)
        self.results: AsyncResults | None = None
        self.meter = GatewayMetrics()
        self.tei = TeiMetrics(self.meter.registry)  # TEI's metric names, beside the gateway's own
        self.admission = GatewayAdmission(self.client)  # per-identity texts in flight; the fast 429
        self._cancelling: set[asyncio.Future[Any]] = set()  # cancels of jobs sent for requests gone meanwhile
        self._watch: asyncio.Task[None] | None = None

    async def start(self) -> None:
        url = self.settings.result_url or self.settings.broker_url
        redis = async_redis_client(self.settings, url, max_connections=MAX_CONNECTIONS, pool_wait=POOL_WAIT)
        self.results = AsyncResults(self.client.app, redis, url)
        await self.results.start()
        self._watch = asyncio.create_task(self._watch_broker(), name="embedq-gateway-broker-epoch")

    async def close(self) -> None:
        if self._watch is not None:
            self._watch.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watch
        if self.results is not None:
            await self.results.close()
        self.client.close()

    async def _watch_broker(self) -> None:
        """While requests wait: has Redis restarted or lost its data since their jobs were sent? Then the jobs
        still waiting are sent again under their ids (``Client.resend_lost``; a worker that holds or has stored
        a job takes the copy as the same job), as a blocking ``JobHandle.result`` does for its own."""
        while True:
            await asyncio.sleep(EPOCH_CHECK)
            if not self.client.pending:
                continue
            try:
                epoch = await asyncio.to_thread(self.client.epoch, refresh=True)
                await asyncio.to_thread(self.client.resend_lost, epoch)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis is away: the next look tries again
                log.warning("cannot check the broker for lost jobs (%s: %s)", type(exc).__name__, exc)

    def target(self, request: Request, model: str | None = None) -> tuple[str, Settings]:
        """The model a request is for, and its settings (its queues): ``model`` (OpenAI's field), else the
        ``X-Embedq-Model`` header, else the gateway's own model; the name is the served one (TEI answers
        ``/v1/embeddings`` with its ``--served-model-name``, whatever the request's ``model``). A gateway of one
        model takes any name; a gateway of several refuses a name it does not serve (404)."""
        name = model or request.headers.get("x-embedq-model") or self.settings.model
        if name in self.models:
            return name, self.models[name]
        if len(self.models) == 1:
            return self.settings.model, self.settings
        short = {k.rstrip("/").rsplit("/", 1)[-1]: k for k in self.models}  # "all-MiniLM-L6-v2" for a repo id
        if name in short:
            return short[name], self.models[short[name]]
        raise errors.ModelNotFound(f"The model `{name}` is not served here (served: {', '.join(self.models)})")

    async def workers(self, target: Settings | None = None) -> list[dict[str, Any]]:
        """Live, ready workers serving ``target``'s online queue (default: the gateway's own model). The registry
        read is the client's, shared with the check of every synchronous request (``Client.check_worker``) and
        re-read at most once a second."""
        registry = self.client.registry
        records = registry.fresh()
        if records is None:
            records = await asyncio.to_thread(registry.records, self.client.redis())
        return monitor.serving(records, (target or self.settings).queue_name).ready

    def queue_size(self) -> int:
        """Messages waiting in the served models' queues, online and bulk (TEI's ``te_queue_size``)."""
        queues = {q for target in self.models.values() for q in (target.queue_name, target.bulk_queue_name)}
        return sum(monitor.waiting(self.client.redis(), queue) for queue in sorted(queues))

    async def send(self, request: Request, plan: Plan, model: str | None = None, *,
                   require_worker: bool = False, held: list[tuple[str, str, int]] | None = None) -> list[Any]:
        """``plan``'s items as jobs of at most ``max_texts_per_job`` items, sent to the queue of the request's
        model (:meth:`target`) together (``Client.submit_many``: one round trip, nothing sent unless every job
        is valid and admitted): their handles, in order. ``require_worker``: refuse them with
        :class:`~embedq.errors.NoWorker` (503) when no live worker serves that queue (the registry the client
        re-reads at most once a second), after they are found valid. Every job carries the request's identity
        (:func:`~embedq.gateway.admit.identity`). ``held``: online jobs are admitted here, on the event loop
        (:class:`~embedq.gateway.admit.GatewayAdmission`: Overloaded at once, nothing sent), their texts reserved
        as the identity's in flight and ``(queue, identity, texts)`` appended for the caller to release."""
        if not plan.items:
            raise errors.EmptyInput("Input validation error: `inputs` cannot be empty")
        cap = self.settings.max_client_batch_size
        if len(plan.items) > cap:  # TEI's wording and status (422)
            raise errors.TooManyInputs(f"Input validation error: batch size {len(plan.items)} > maximum allowed batch "
                                       f"size {cap} (EMBEDQ_MAX_CLIENT_BATCH_SIZE)")
        traffic_class = BULK if request.headers.get("x-embedq-class", "").lower() == BULK else ONLINE
        deadline = _deadline(request)
        queue = self.target(request, model)[1].queue_for(traffic_class)
        size = self.settings.max_texts_per_job
        jobs = [plan.job(plan.items[i:i + size]) for i in range(0, len(plan.items), size)]
        who = identity(request)
        with contextlib.ExitStack() as stack:
            if held is not None and traffic_class == ONLINE:
                await self.admission.admit(queue, len(jobs), len(plan.items), who)
                held.append((queue, who, len(plan.items)))
                stack.enter_context(admission.admitted())  # the Client's own check passes: admitted here
            sending = asyncio.ensure_future(asyncio.to_thread(
                self.client.submit_many, jobs, kind=plan.kind, queue=queue, traffic_class=traffic_class,
                deadline=deadline, require_worker=require_worker, client=who, **plan.options))
        try:
            return await asyncio.shield(sending)
        except asyncio.CancelledError:
            # the thread sends the jobs all the same: cancel them once it has, nobody will read them
            sending.add_done_callback(self._cancel_sent)
            raise

    def _cancel_sent(self, sending: asyncio.Future[Any]) -> None:
        if sending.cancelled() or sending.exception() is not None:
            return
        cancelling = asyncio.ensure_future(asyncio.gather(*(self._forget(h) for h in sending.result())))
        self._cancelling.add(cancelling)
        cancelling.add_done_callback(self._cancelling.discard)

    async def payloads(self, request: Request, plans: list[Plan], model: str | None = None) -> list[list[Any]]:
        """``plans`` sent (each as its jobs) and awaited together: each plan's result payloads, in order. 503 at
        once when no live worker serves their queue (``gateway_require_worker``), where the request would wait for
        a worker with nobody to say so."""
        assert self.results is not None
        held: list[tuple[str, str, int]] = []
        try:
            return await self._run(request, plans, model, held)
        finally:  # answered, failed or abandoned: its texts are no longer in flight
            for reservation in held:
                self.admission.release(*reservation)

    async def _run(self, request: Request, plans: list[Plan], model: str | None,
                   held: list[tuple[str, str, int]]) -> list[list[Any]]:
        assert self.results is not None
        sent: list[list[Any]] = []
        try:
            for plan in plans:
                sent.append(await self.send(request, plan, model, require_worker=self.settings.gateway_require_worker,
                                            held=held))
        except BaseException:  # a later plan refused: the jobs of those sent already must not run
            await asyncio.gather(*(self._forget(h) for handles in sent for h in handles))
            raise
        handles = [h for part in sent for h in part]
        deadline = _deadline(request)
        # past its deadline (and a grace for a job that started just in time) no result will come
        timeout = DEFAULT_RESULT_TIMEOUT if deadline is None else deadline + DEADLINE_GRACE
        waiting = asyncio.ensure_future(asyncio.gather(*(self.results.wait(h.id, timeout) for h in handles),
                                                       return_exceptions=True))
        # The body has been read, so the server's next message for this request is its client leaving: one
        # waiter per request, woken at once, instead of a look every so often.
        gone = asyncio.ensure_future(_disconnected(request))
        try:
            await asyncio.wait({waiting, gone}, return_when=asyncio.FIRST_COMPLETED)
            if not waiting.done():
                self.meter.disconnects.inc()  # nobody reads the answer: the jobs must not cost compute
                raise errors.Cancelled("the client disconnected; its jobs were cancelled")
            outcomes = waiting.result()
        except BaseException:
            waiting.cancel()
            waiting.add_done_callback(_retrieve)  # its cancellation is expected: not "never retrieved"
            await asyncio.gather(*(self._forget(h) for h in handles))
            raise
        finally:
            gone.cancel()
        for handle in handles:  # answered: nothing to send again if Redis restarts now
            self.client.pending.discard(handle)
        out, start = [], 0
        for part in sent:
            out.append(list(outcomes[start:start + len(part)]))
            start += len(part)
        size = self.settings.max_texts_per_job
        for outcome in outcomes:
            if isinstance(outcome, errors.JobTimeout) and deadline is not None:
                await asyncio.gather(*(self._forget(h) for h in handles))
                raise errors.Expired(f"the request's jobs did not run within its deadline ({deadline:g}s)")
        for part in out:  # job n of a plan holds its inputs from n * size: an error names them by that index
            for n, outcome in enumerate(part):
                if isinstance(outcome, BaseException):
                    raise renumber(outcome, n * size)
        return out

    async def _forget(self, handle: Any) -> None:
        self.client.pending.discard(handle)
        with contextlib.suppress(Exception):
            await asyncio.to_thread(self.client.cancel, handle.id)


def _retrieve(future: asyncio.Future[Any]) -> None:
    if not future.cancelled():
        future.exception()


async def _disconnected(request: Request) -> None:
    """Returns when the request's client has gone (the ASGI server's ``http.disconnect``)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


#: Headers in which clients say how long they will wait: the OpenAI SDKs' (Python: its read timeout; Node).
CLIENT_TIMEOUT_HEADERS = ("x-stainless-read-timeout", "x-stainless-timeout")
#: Seconds as a header gives them: a plain decimal number (no sign, no "inf", "nan" or "1_0", which float() takes).
_SECONDS = re.compile(r"\s*(\d+\.?\d*|\.\d+)([eE][+-]?\d+)?\s*")


def _seconds(value: str | None) -> float | None:
    """A header's seconds (``inf`` when it overflows a float), or None when it is not a plain number."""
    return float(value) if value is not None and _SECONDS.fullmatch(value) else None


def _deadline(request: Request) -> float | None:
    """Seconds the request's jobs may wait to start: ``X-Embedq-Deadline`` (more than 0, at most
    :data:`~embedq.protocol.MAX_DEADLINE_SECONDS`, else 422), else the client's own timeout when it sends it (past
    it the client has given up, and its SDK may be retrying: the first jobs would be wasted)."""
    value = request.headers.get("x-embedq-deadline")
    if value is None or value == "":
        for name in CLIENT_TIMEOUT_HEADERS:
            seconds = _seconds(request.headers.get(name))
            if seconds is not None and seconds > 0:  # else absent or not a number: not ours to refuse
                return min(seconds, DEFAULT_RESULT_TIMEOUT)  # clamped: a huge (or inf) one reaches no clock
        return None
    seconds = _seconds(value)
    if seconds is None or not 0 < seconds <= MAX_DEADLINE_SECONDS:
        raise errors.InvalidOption(f"X-Embedq-Deadline must be seconds, more than 0 and at most "
                                   f"{MAX_DEADLINE_SECONDS} (one week), got {value[:40]!r}")
    return seconds


def gateway_of(request: Request) -> Gateway:
    """The :class:`Gateway` of the app serving ``request`` (``create_app`` puts it on ``app.state``)."""
    gateway: Gateway = request.app.state.gateway
    return gateway
