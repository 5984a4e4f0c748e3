"""HTTP side of the batch inspector: the live page (``/inspect``), its event stream, per-request timelines
and Chrome trace export. Every view comes from one engine replica (``inspector_client.Inspector``, the
pipeline's); the routes answer 404 when ``router.inspector`` is false and need the API key when one is set.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from importlib import resources
from typing import Any

from fastapi import APIRouter, Depends, Query, Request
from fastapi.responses import HTMLResponse, JSONResponse, StreamingResponse

from cb_serve.serve.api_error import APIError
from cb_serve.serve.inspector_client import STEPS_PER_VIEW
from cb_serve.serve.pipeline import RequestPipeline, pipeline_of

debug_routes = APIRouter()

MAX_STREAM_S = 600.0  # an event stream ends after this (EventSource reconnects by itself)
MAX_TRACE_S = 600.0
MAX_STEPS_PER_VIEW = 2000


def _page() -> str:
    return resources.files("cb_serve.serve").joinpath("static/inspect.html").read_text(encoding="utf-8")


@debug_routes.get("/inspect")
async def inspect_page(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> HTMLResponse:
    """The live batch inspector (self-contained HTML, CSS and JS)."""
    pipeline.inspector.authorize(request)
    return HTMLResponse(_page(), headers={"Cache-Control": "no-store"})


@debug_routes.get("/debug/replicas")
async def debug_replicas(request: Request, pipeline: RequestPipeline = Depends(pipeline_of)) -> dict[str, Any]:
    pipeline.inspector.authorize(request)
    return {"replicas": await pipeline.inspector.replicas()}


@debug_routes.get("/debug/state")
async def debug_state(
    request: Request,
    replica: str | None = None,
    after_step: int = Query(-1, ge=-1),
    limit: int = Query(STEPS_PER_VIEW, ge=1, le=MAX_STEPS_PER_VIEW),
    pipeline: RequestPipeline = Depends(pipeline_of),
) -> dict[str, Any]:
    """One replica's recent steps (the last ``limit`` after ``after_step``), KV block map and queues."""
    inspector = pipeline.inspector
    inspector.authorize(request)
    return await inspector.state(await inspector.replica_or_first(replica), after_step, limit)


@debug_routes.get("/debug/events")
async def debug_events(
    request: Request,
    replica: str | None = None,
    interval: float = Query(0.5, ge=0.1, le=10),
    pipeline: RequestPipeline = Depends(pipeline_of),
) -> StreamingResponse:
    """Server-sent events: one ``state`` snapshot per ``interval`` (new steps only)."""
    inspector = pipeline.inspector
    inspector.authorize(request)
    replica = await inspector.replica_or_first(replica)
    first = await inspector.state(replica, -1)

    async def events() -> AsyncIterator[str]:
        state, deadline = first, time.monotonic() + MAX_STREAM_S
        while True:
            yield f"data: {json.dumps(state)}\n\n"
            if time.monotonic() > deadline:
                return
            await asyncio.sleep(interval)
            last = state["steps"][-1]["step"] if state["steps"] else -1
            try:
                state = await inspector.state(replica, last)
            except APIError as e:  # the replica went away: say so, and end (the page reconnects)
                yield f"event: error\ndata: {json.dumps({'message': e.message})}\n\n"
                return

    headers = {"Cache-Control": "no-store", "X-Accel-Buffering": "no"}
    return StreamingResponse(events(), media_type="text/event-stream", headers=headers)


@debug_routes.get("/debug/trace")
async def debug_trace(
    request: Request,
    seconds: float = Query(10.0, gt=0, le=MAX_TRACE_S),
    replica: str | None = None,
    pipeline: RequestPipeline = Depends(pipeline_of),
) -> JSONResponse:
    """Chrome trace-event JSON of the last ``seconds``: one process per replica (all replicas
    merged unless ``replica`` is given). Opens in Perfetto UI and chrome://tracing."""
    inspector = pipeline.inspector
    inspector.authorize(request)
    replicas = [await inspector.replica_or_first(replica)] if replica else await inspector.replicas()
    since = time.time() - seconds
    parts: list[Any] = []
    for i, r in enumerate(replicas):
        try:
            parts.append(await inspector.view(r, "trace", since=since, pid=i + 1))
        except APIError as e:
            parts.append(e)
    events = [e for part in parts if isinstance(part, list) for e in part]
    missing = {r: repr(part) for r, part in zip(replicas, parts) if not isinstance(part, list)}
    meta = {"replicas": replicas, "missing": missing, "seconds": seconds}
    return JSONResponse({"traceEvents": events, "displayTimeUnit": "ms", "otherData": meta})


@debug_routes.get("/v1/requests/{request_id}/timeline")
async def request_timeline(
    request: Request, request_id: str, pipeline: RequestPipeline = Depends(pipeline_of)
) -> dict[str, Any]:
    """A recent request's timeline, from the replica that served it."""
    inspector = pipeline.inspector
    inspector.authorize(request)
    replicas = await inspector.replicas()
    known = inspector.served_by.get(request_id)
    order = [known] if known in replicas else replicas  # another Router replica served it: ask all
    for replica in order:
        timeline = await inspector.view(replica, "timeline", request_id=request_id)
        if timeline is not None:
            return {**timeline, "replica": replica}
    message = f"No timeline of request {request_id!r} (only recent requests are kept)."
    raise APIError(404, message, "not_found_error")
