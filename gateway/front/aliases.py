"""What /v1/models says of the model aliases (models.aliases, with models.list_aliases): each
alias listed as a copy of its served model's card under the alias's name. Pure functions over
the backend's answer; any answer not in the shape SGLang gives passes unchanged."""

from __future__ import annotations

import json
from typing import Any


def listed_with_aliases(listing: bytes, aliases: dict[str, str]) -> bytes:
    """The backend's `/v1/models` list, each alias after the cards: the card of the model it
    maps to, renamed. An alias of a name the backend does not list is not listed."""
    try:
        data = json.loads(listing)
    except ValueError:
        return listing
    cards = data.get("data") if isinstance(data, dict) else None
    if not isinstance(cards, list):
        return listing
    by_id = {card.get("id"): card for card in cards if isinstance(card, dict)}
    added = [{**by_id[served], "id": alias} for alias, served in aliases.items()
             if served in by_id and alias not in by_id]
    if not added:
        return listing
    return json.dumps({**data, "data": [*cards, *added]}).encode()


def card_as(card: bytes, name: str) -> bytes:
    """The backend's `/v1/models/{served}` card under the name the client asked for."""
    try:
        data: Any = json.loads(card)
    except ValueError:
        return card
    if not isinstance(data, dict) or "id" not in data:
        return card
    return json.dumps({**data, "id": name}).encode()
