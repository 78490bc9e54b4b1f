"""Server-sent events: one `data:` line per JSON item, an error item on failure, then [DONE]."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator

from fastapi.responses import StreamingResponse

from radixserve.server.errors import APIError


def sse(items: AsyncIterator[dict]) -> StreamingResponse:
    """Stream `items`; an APIError raised mid-stream becomes an OpenAI error event."""

    async def body():
        try:
            async for item in items:
                yield f"data: {json.dumps(item)}\n\n"
        except APIError as exc:
            yield f"data: {json.dumps(exc.body())}\n\n"
        yield "data: [DONE]\n\n"

    return StreamingResponse(body(), media_type="text/event-stream")
