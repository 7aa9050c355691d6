"""`n` > 1: the n choices of one chat or completion request as n generations through the same model, run
concurrently (choice i samples with `seed + i` when a seed is given) and their responses merged as they arrive."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import AsyncGenerator, Callable
from contextlib import aclosing

from ...inference import InferenceRequest, InferenceResponse
from .request import Generation

QUEUE_PER_CHOICE = 4  # responses each choice may have waiting for the writer before its generation waits


def choice_generations(gen: Generation) -> list[Generation]:
    """The settings of each choice: the request's own, with seed + i for choice i when a seed is given (so choices
    differ, and the same request gives the same choices again)."""
    if gen.n == 1:
        return [gen]
    return [gen if gen.seed is None else dataclasses.replace(gen, seed=gen.seed + i) for i in range(gen.n)]


def choice_request_id(request_id: str, index: int) -> str:
    """Choice 0 keeps the response's id; the others get it with their index."""
    return request_id if index == 0 else f"{request_id}-{index}"


Iterate = Callable[[InferenceRequest], AsyncGenerator[InferenceResponse, None]]


async def merged(
    iterate: Iterate, requests: list[InferenceRequest]
) -> AsyncGenerator[tuple[int, InferenceResponse | None], None]:
    """(choice index, response) as each model response arrives, and (index, None) once that choice's responses
    have ended. One request is iterated in place; several each in a task of their own, feeding a bounded queue (a
    slow reader holds the generations back), and all of them are cancelled when the caller stops early or one of
    them fails (its error is raised here)."""
    resp: InferenceResponse | None
    if len(requests) == 1:
        async with aclosing(iterate(requests[0])) as responses:
            async for resp in responses:
                yield 0, resp
        yield 0, None
        return
    queue: asyncio.Queue[tuple[int, InferenceResponse | None, BaseException | None]] = asyncio.Queue(
        maxsize=QUEUE_PER_CHOICE * len(requests)
    )

    async def pump(index: int, req: InferenceRequest) -> None:
        try:
            async with aclosing(iterate(req)) as responses:
                async for resp in responses:
                    await queue.put((index, resp, None))
        except Exception as exc:  # handed to the reader, which raises it and cancels the other choices
            await queue.put((index, None, exc))
            return
        await queue.put((index, None, None))

    tasks = [asyncio.create_task(pump(i, req)) for i, req in enumerate(requests)]
    try:
        running = len(tasks)
        while running:
            index, resp, exc = await queue.get()
            if exc is not None:
                raise exc
            if resp is None:
                running -= 1
            yield index, resp
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
