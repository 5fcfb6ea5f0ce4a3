"""The simulator serves continuation requests as SGLang 0.5.23 does: a chat final assistant
message with continue_final_message is a prefix of the answer (serving_chat.py:519-548,
:560-575), without the flag a user message (:546-548); an Anthropic final assistant message
is never continued (anthropic/serving.py never sets the flag). The continued prompt is the
original one followed by the prefix's tokens: its prefill hits the prefix cache."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

USER = [{"role": "user", "content": "tell me about the gateway"}]


async def _chat(client: httpx.AsyncClient, url: str, messages: list[dict[str, Any]],
                **extra: Any) -> dict[str, Any]:
    response = await client.post(url + "/v1/chat/completions", json={
        "model": "m", "messages": messages, "max_tokens": 20, **extra})
    assert response.status_code == 200, response.text
    return response.json()


@pytest.mark.timeout(30)
async def test_a_final_assistant_message_is_continued_only_with_the_flag(pair):
    url = pair.servers["mtp"].url
    async with httpx.AsyncClient(timeout=20) as client:
        whole = await _chat(client, url, USER)
        prefix = " ".join(whole["choices"][0]["message"]["content"].split()[:5])
        prefill = {"role": "assistant", "content": prefix}
        continued = await _chat(client, url, [*USER, prefill], continue_final_message=True)
        as_user = await _chat(client, url, [*USER, prefill])
        user_turn = await _chat(client, url, [*USER, {"role": "user", "content": prefix}])
    # The prefix's 5 tokens follow the prompt; the answer does not say them again.
    assert continued["usage"]["prompt_tokens"] == whole["usage"]["prompt_tokens"] + 5
    assert not continued["choices"][0]["message"]["content"].startswith(prefix)
    # Without the flag the assistant message is a user one: the same prompt, the same answer.
    assert as_user["usage"]["prompt_tokens"] == user_turn["usage"]["prompt_tokens"]
    assert as_user["choices"][0]["message"] == user_turn["choices"][0]["message"]


@pytest.mark.timeout(30)
async def test_an_anthropic_final_assistant_message_is_a_user_message(pair):
    url = pair.servers["mtp"].url
    body = {"model": "m", "max_tokens": 20}
    async with httpx.AsyncClient(timeout=20) as client:
        prefill = await client.post(url + "/v1/messages", json={**body, "messages": [
            *USER, {"role": "assistant", "content": [{"type": "text", "text": "Sure, the"}]}]})
        user = await client.post(url + "/v1/messages", json={**body, "messages": [
            *USER, {"role": "user", "content": "Sure, the"}]})
    assert prefill.json()["usage"] == user.json()["usage"]
    assert prefill.json()["content"] == user.json()["content"]


@pytest.mark.timeout(30)
async def test_the_continued_prompt_hits_the_prefix_cache(pair):
    server = pair.servers["mtp"]
    long_user = [{"role": "user", "content": " ".join(["word"] * 400)}]
    async with httpx.AsyncClient(timeout=20) as client:
        whole = await _chat(client, server.url, long_user)
        stats = server.app.context.live.engine.stats
        cached_before = stats.cached_tokens
        prefix = " ".join(whole["choices"][0]["message"]["content"].split()[:5])
        await _chat(client, server.url, [*long_user, {"role": "assistant", "content": prefix}],
                    continue_final_message=True)
    assert stats.cached_tokens - cached_before >= whole["usage"]["prompt_tokens"] - 64


@pytest.mark.timeout(30)
async def test_a_continued_answer_goes_on_after_a_space(pair):
    """A real model's next token after a word starts with its space: the prefix and the
    continuation join as words."""
    url = pair.servers["mtp"].url
    async with httpx.AsyncClient(timeout=20) as client:
        continued = await _chat(client, url, [*USER, {"role": "assistant", "content": "so the"}],
                                continue_final_message=True)
        fresh = await _chat(client, url, USER)
    assert continued["choices"][0]["message"]["content"].startswith(" ")
    assert not fresh["choices"][0]["message"]["content"].startswith(" ")


@pytest.mark.timeout(30)
async def test_a_text_prompt_ending_in_a_word_is_continued_after_a_space(pair):
    """Completions and /generate continue from prompt + text: the output's first word is
    spaced from the prompt's last one, as a model's next token after a word is."""
    url = pair.servers["mtp"].url
    async with httpx.AsyncClient(timeout=20) as client:
        after_word = await client.post(url + "/v1/completions", json={
            "model": "m", "prompt": "once upon a", "max_tokens": 5})
        after_space = await client.post(url + "/v1/completions", json={
            "model": "m", "prompt": "once upon a ", "max_tokens": 5})
        generated = await client.post(url + "/generate", json={
            "text": "once upon a", "sampling_params": {"max_new_tokens": 5}})
    assert after_word.json()["choices"][0]["text"].startswith(" ")
    assert not after_space.json()["choices"][0]["text"].startswith(" ")
    assert generated.json()["text"].startswith(" ")
