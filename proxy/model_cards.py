"""The proxy's ``/v1/models``: one card per served model, with the ``max_model_len`` a node reports.

Registrations do not carry the context length, so the proxy asks one decode node serving
the model (its own ``/v1/models``) the first time and remembers the answer per node.
A node that cannot be asked leaves the field out rather than failing the listing.
"""

from __future__ import annotations

import json
import logging
import time

from proxy.http_client import TransportError, get_json_once
from proxy.registry import ServiceRegistry

logger = logging.getLogger(__name__)
_ASK_TIMEOUT_S = 2.0


class ModelCards:
    """Builds the model list; caches each decode node's ``max_model_len``."""

    def __init__(self, registry: ServiceRegistry, timeout_s: float = _ASK_TIMEOUT_S) -> None:
        self.registry = registry
        self.timeout_s = timeout_s
        self._max_len: dict[str, int] = {}  # decode node http address -> its answer

    async def cards(self, models: list[str]) -> list[dict]:
        decodes = self.registry.nodes("D")
        live = {n.info.http_address for n in decodes}
        for gone in set(self._max_len) - live:
            del self._max_len[gone]
        created = int(time.time())
        cards = []
        for model in models:
            card: dict = {"id": model, "object": "model", "created": created, "owned_by": "pdserve"}
            serving = [n.info.http_address for n in decodes if n.info.model == model]
            max_len = await self._max_model_len(model, serving)
            if max_len is not None:
                card["max_model_len"] = max_len
            cards.append(card)
        return cards

    async def _max_model_len(self, model: str, addresses: list[str]) -> int | None:
        for address in addresses:
            if address not in self._max_len:
                answer = await self._ask(address, model)
                if answer is None:
                    continue  # asked again next time: the node may just be starting
                self._max_len[address] = answer
            return self._max_len[address]
        return None

    async def _ask(self, address: str, model: str) -> int | None:
        try:
            status, body = await get_json_once(address, "/v1/models", self.timeout_s)
            cards = json.loads(body)["data"] if status == 200 else []
        except (TransportError, TimeoutError, ValueError, KeyError, TypeError) as exc:
            logger.warning("could not read max_model_len from decode node %s: %s", address, exc)
            return None
        for card in cards if isinstance(cards, list) else []:
            if isinstance(card, dict) and card.get("id") == model:
                max_len = card.get("max_model_len")
                return max_len if isinstance(max_len, int) else None
        return None
