"""/v1/models with models.list_aliases: each alias listed as its served model's card, renamed;
anything not in the shape SGLang answers passes unchanged."""

from __future__ import annotations

import json

from gateway.front.aliases import card_as, listed_with_aliases

SERVED = "Qwen/Qwen3.5-122B-A10B"
CARD = {"id": SERVED, "object": "model", "created": 1, "owned_by": "sglang", "root": SERVED,
        "parent": None, "max_model_len": 262144}
LISTING = json.dumps({"object": "list", "data": [CARD]}).encode()


def test_each_alias_is_listed_as_a_copy_of_its_served_models_card() -> None:
    listed = json.loads(listed_with_aliases(LISTING, {"gpt-5-codex": SERVED, "other": "not-served",
                                                      SERVED: SERVED}))
    assert listed["data"] == [CARD, {**CARD, "id": "gpt-5-codex"}]
    assert listed["object"] == "list"


def test_an_answer_not_in_sglangs_shape_passes_unchanged() -> None:
    for answer in (b"not json", b'{"object": "list"}', b"[1, 2]", LISTING):
        assert listed_with_aliases(answer, {"x": "not-served"}) == answer
    assert card_as(b"not json", "x") == b"not json"
    assert card_as(b'{"object": "model"}', "x") == b'{"object": "model"}'
    assert json.loads(card_as(json.dumps(CARD).encode(), "claude-opus-4-1")) == {
        **CARD, "id": "claude-opus-4-1"}
