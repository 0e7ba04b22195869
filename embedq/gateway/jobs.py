"""Async jobs: a web app that should not wait posts (``POST /jobs``), then polls (``GET /jobs/{id}``) or deletes
(``DELETE /jobs/{id}``), or names a webhook called once the job is done (:mod:`embedq.gateway.webhooks`). An async
job is a record in Redis (``GATEWAY_JOB_KEY``: its kind, validated body, embedq job ids, model) kept for
``EMBEDQ_RESULT_TTL``; its answer is planned again from the record once every embedq job has an outcome."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from embedq import errors
from embedq.gateway.errors import http_status
from embedq.gateway.plans import job_plan, parse, planner
from embedq.gateway.schemas import JOB_HEADERS, TEI_ERRORS, JobRequest, JSONResponse, TeiError, responses
from embedq.gateway.state import Gateway, gateway_of
from embedq.gateway.webhooks import Webhooks, check_url
from embedq.gateway.windowed import renumber
from embedq.keys import GATEWAY_JOB_KEY

router = APIRouter()


def _webhooks(request: Request) -> Webhooks:
    hooks: Webhooks = request.app.state.webhooks  # the lifespan's
    return hooks


async def stored_record(gateway: Gateway, job_id: str) -> dict[str, Any] | None:
    raw = await gateway.results.redis.get(GATEWAY_JOB_KEY.format(job_id))
    return None if raw is None else json.loads(raw)


async def save_record(gateway: Gateway, job_id: str, record: dict[str, Any]) -> None:
    await gateway.results.redis.set(GATEWAY_JOB_KEY.format(job_id), json.dumps(record), keepttl=True)


async def job_record(gateway: Gateway, job_id: str) -> dict[str, Any]:
    record = await stored_record(gateway, job_id)
    if record is None:
        raise errors.JobNotFound(f"no job {job_id!r} (unknown, deleted, or older than EMBEDQ_RESULT_TTL)")
    return record


async def wait_record(gateway: Gateway, record: dict[str, Any]) -> None:
    """Until every embedq job of an async job has an outcome (kept in Redis for GET /jobs)."""
    await asyncio.gather(*(gateway.results.wait(j, gateway.settings.result_ttl, forget=False)
                           for j in record["jobs"]), return_exceptions=True)


async def job_state(gateway: Gateway, job_id: str, record: dict[str, Any]) -> dict[str, Any]:
    """What ``GET /jobs/{id}`` answers (and a webhook is sent)."""
    results = gateway.results
    stored = await results.redis.mget([results.key(j) for j in record["jobs"]])
    hook = {"webhook": record["webhook"]} if "webhook" in record else {}
    if any(raw is None for raw in stored):
        done = sum(raw is not None for raw in stored)
        return {"id": job_id, "status": "queued", "done_jobs": done, "jobs": len(stored), **hook}
    size = gateway.settings.max_texts_per_job
    try:
        payloads = []
        for n, raw in enumerate(stored):
            try:
                payloads.append(results.decode(raw))
            except errors.EmbedqError as exc:  # named by the request's index of its input (windows)
                raise renumber(exc, n * size) from None
        result = job_plan(record, gateway.settings).answer(payloads)
    except errors.EmbedqError as exc:
        status, error_type = http_status(exc)
        return {"id": job_id, "status": "failed", "code": status,
                "error": {"error": str(exc), "error_type": error_type}, **hook}
    return {"id": job_id, "status": "done", "result": result, **hook}


@router.post("/jobs", status_code=202, summary="Start a job of any kind; answers at once with its id (and calls "
             "its webhook, if it names one, once it is done)", responses=TEI_ERRORS, openapi_extra=JOB_HEADERS)
async def create_job(request: Request, body: JobRequest) -> Response:
    gateway = gateway_of(request)
    settings = gateway.settings
    model, plan = planner(body.kind)
    # the URL normalised (dot segments, escapes, case, default port): the one checked is the one called
    webhook = check_url(body.webhook, settings.webhook_allow) if body.webhook is not None else None
    parsed = parse(model, body.body)
    handles = await gateway.send(request, plan(parsed, settings), body.model)
    job_id = uuid.uuid4().hex  # random: a job id cannot be guessed
    # the validated request, not the raw body: fields the route does not know are dropped (as every route
    # ignores them), so they cost no Redis memory for EMBEDQ_RESULT_TTL
    stored = parsed.model_dump(mode="json", exclude_unset=True)
    record: dict[str, Any] = {"kind": body.kind, "body": stored, "jobs": [h.id for h in handles],
                              "model": gateway.target(request, body.model)[0], "created": time.time()}
    if webhook is not None:
        record["webhook"] = {"url": webhook, "state": "pending"}
    pipe = gateway.results.redis.pipeline(transaction=False)
    pipe.set(GATEWAY_JOB_KEY.format(job_id), json.dumps(record), ex=settings.result_ttl)
    wait = settings.replica_wait()
    if wait is not None:  # the record on as many replicas as the jobs' messages (replica_acks)
        pipe.execute_command(*wait)
    replies = await pipe.execute()
    if wait is not None:
        settings.replicated(replies[-1], f"the record of job {job_id}")
    if webhook is not None:
        await _webhooks(request).owe(job_id)
    return JSONResponse({"id": job_id, "status": "queued"}, status_code=202, headers={"Location": f"/jobs/{job_id}"})


@router.get("/jobs/{job_id}", summary="A job's status, and its answer once done",
            responses=responses(TeiError, 401, 404, 503))
async def get_job(request: Request, job_id: str) -> Response:
    gateway = gateway_of(request)
    return JSONResponse(await job_state(gateway, job_id, await job_record(gateway, job_id)))


@router.delete("/jobs/{job_id}", summary="Cancel a job (its work is dropped unrun) and delete its results",
               responses=responses(TeiError, 401, 404, 503))
async def delete_job(request: Request, job_id: str) -> Response:
    gateway = gateway_of(request)
    record = await job_record(gateway, job_id)
    if "webhook" in record:  # nothing is owed for a deleted job
        hooks = _webhooks(request)
        hooks.cancel(job_id)
        await hooks.settle(job_id)
    cancelled = [await asyncio.to_thread(gateway.client.cancel, j) for j in record["jobs"]]
    await gateway.results.redis.delete(GATEWAY_JOB_KEY.format(job_id),
                                       *[gateway.results.key(j) for j in record["jobs"]])
    return JSONResponse({"id": job_id, "status": "cancelled" if any(cancelled) else "deleted"})
