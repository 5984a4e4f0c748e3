"""The path from an engine request to its chunks, shared by every HTTP API: start it on an engine
replica (waiting for its first output, so errors surface before any byte is sent, and retrying
elsewhere when a replica could not take it), read its chunks, and merge several requests' chunks
(a list of prompts) into one stream."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from typing import Any

from ray.serve.handle import DeploymentHandle

from cb_serve import EngineDeadError, EngineShutdownError, EngineUnavailableError
from cb_serve.serve.api_error import engine_error, root_cause
from cb_serve.serve.engine_chunk import EngineChunk
from cb_serve.serve.engine_request import EngineRequest
from cb_serve.serve.replica_health import mark_unavailable

logger = logging.getLogger("cb_serve.serve.router")
# A request a replica refused (its engine dead or closing) or cut by a shutdown before its first
# output is sent again, to another replica: nothing of it reached the client. One whose engine
# died while running it is not (it may be what killed the engine).
ROUTE_ATTEMPTS = 3


class Started:
    """A request running on an engine replica: its first output (a list of chunks, None when it
    ended with none) and the stream of the rest."""

    def __init__(self, gen: Any, first: list[EngineChunk] | None) -> None:
        self.gen, self.first = gen, first

    @property
    def replica(self) -> str | None:
        return self.first[0].replica if self.first else None

    async def chunks(self) -> AsyncIterator[EngineChunk]:
        """The engine replica's chunks one by one (it sends them a step's worth at a time)."""
        try:
            for chunk in self.first or []:
                yield chunk
            async for step in self.gen:
                for chunk in step:
                    yield chunk
        finally:
            self.gen.cancel()  # a client that went away aborts the engine request (no-op once finished)

    def cancel(self) -> None:
        self.gen.cancel()


async def start(engine: DeploymentHandle, payload: EngineRequest) -> Started:
    """Sends ``payload`` to an engine replica and waits for its first output (``ROUTE_ATTEMPTS``)."""
    for attempt in range(1, ROUTE_ATTEMPTS + 1):
        gen = engine.options(stream=True).generate.remote(payload)
        try:
            return Started(gen, await gen.__anext__())
        except StopAsyncIteration:
            return Started(gen, None)
        except Exception as e:  # noqa: BLE001
            cause = root_cause(e)
            replica = getattr(cause, "replica", None)
            if replica and isinstance(cause, (EngineDeadError, EngineUnavailableError, EngineShutdownError)):
                mark_unavailable(replica)
            retry = isinstance(cause, (EngineUnavailableError, EngineShutdownError))
            if not retry or attempt == ROUTE_ATTEMPTS:
                raise engine_error(e, payload.request_id) from None
            logger.warning("request %s: replica %s unavailable; retrying", payload.request_id, replica)
    raise AssertionError("unreachable")


async def start_all(engine: DeploymentHandle, payloads: list[EngineRequest]) -> list[Started]:
    """Starts the payloads one after another (each once the previous has its first output: Ray
    Serve's request router keys requests in flight by the HTTP request's internal id, which every
    call made while serving one HTTP request shares); if one fails, the started ones are cancelled."""
    started: list[Started] = []
    try:
        for payload in payloads:
            started.append(await start(engine, payload))
    except BaseException:
        for s in started:
            s.cancel()
        raise
    return started


async def merged(streams: list[Started], index_offsets: list[int]) -> AsyncIterator[EngineChunk]:
    """The chunks of several requests as they come, each chunk's ``index`` shifted by its request's
    offset (the choices of prompt i are ``offset_i .. offset_i + n - 1``)."""
    if len(streams) == 1 and not index_offsets[0]:
        async for chunk in streams[0].chunks():
            yield chunk
        return
    queue: asyncio.Queue = asyncio.Queue()

    async def pump(stream: Started, offset: int) -> None:
        try:
            async for chunk in stream.chunks():
                await queue.put(chunk.replace(index=chunk.index + offset))
        except BaseException as e:  # noqa: BLE001 - handed to the reader
            await queue.put(e)
        finally:
            await queue.put(None)

    tasks = [asyncio.ensure_future(pump(s, o)) for s, o in zip(streams, index_offsets)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
