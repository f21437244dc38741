"""The events of a streamed OpenAI response (server-sent events), for tests and benchmarks."""

from __future__ import annotations

import json
from collections.abc import Iterator

import httpx


def data_events(client: httpx.Client, url: str, body: dict, headers: dict | None = None) -> Iterator[dict]:
    """Each ``data: {...}`` event of a streamed POST to ``url``, decoded, as it arrives; RuntimeError
    for a status other than 200. Closing the iterator early closes the response."""
    with client.stream("POST", url, json=body, headers=headers) as r:
        if r.status_code != 200:
            raise RuntimeError(f"{r.status_code}: {r.read()[:300]!r}")
        for line in r.iter_lines():
            if line.startswith("data: {"):
                yield json.loads(line[6:])
