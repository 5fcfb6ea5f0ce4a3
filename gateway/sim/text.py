"""Words instead of a tokenizer: one whitespace-separated word is one token.

Prompts become token ids (so the prefix cache works for chat text too) and outputs are
readable words drawn from a generator seeded by the server seed and the prompt, so the same
request gives the same text whether streamed or not, and token counts are exact.
"""

from __future__ import annotations

import random
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

# Lowercase ASCII only: chunks embed them in JSON strings without escaping.
WORDS = tuple(
    """the model reads each token and writes the next one while the batch runs on four devices
    a server keeps many requests in flight so every step decodes a little for all of them
    draft heads guess ahead and the target checks their guesses in one pass when they agree
    several tokens arrive together otherwise only one comes out quiet hours favour the fast
    path busy hours favour the wide path and a gateway in front picks the right one for you
    cache prefix prompt reply agent tool code file test build patch review plan step think
    check again simple clear short small fast slow wide narrow queue slot device stream chunk
    """.split()
)
IM_END_TOKEN_ID = 151645  # Qwen's <|im_end|>, what SGLang reports as matched_stop on "stop"
NATURAL_MIN_TOKENS = 24
NATURAL_SPREAD_TOKENS = 233


def token_ids(text: str) -> list[int]:
    # hash() differs between processes but is stable within one, which is all the cache needs.
    return [hash(word) for word in text.split()]


def chat_prompt_text(messages: Any, tools: Any = None) -> str:
    """Render chat messages the way a chat template would; raises ValueError on bad input."""
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    parts = []
    if tools:
        parts.append(f"<|im_start|>system tools: {tools}<|im_end|>")
    for message in messages:
        if not isinstance(message, dict) or not isinstance(message.get("role"), str):
            raise ValueError("each message needs a 'role'")
        body = content_text(message.get("content"))
        calls = message.get("tool_calls") or []
        if not isinstance(calls, list):
            raise ValueError("'tool_calls' must be a list")
        for call in calls:
            body += f" {call}"
        parts.append(f"<|im_start|>{message['role']} {body}<|im_end|>")
    parts.append("<|im_start|>assistant")
    return "\n".join(parts)


def final_assistant_turn(messages: Any, continue_final: bool, *,
                         text_block: bool = False) -> tuple[Any, str]:
    """(messages, assistant prefix) as serving_chat.py:513-548 handles a final assistant
    message with string content: with ``continue_final_message`` it leaves the messages and its
    content is appended to the prompt after the generation prompt (:560-575); without, it
    becomes a user message. ``text_block``: Messages, whose adapter makes a single text block
    a string first (anthropic/serving.py:552-553) and never sets the flag."""
    if not isinstance(messages, list) or not messages or not isinstance(messages[-1], dict):
        return messages, ""
    last = messages[-1]
    content = last.get("content")
    if text_block and isinstance(content, list) and len(content) == 1 \
            and isinstance(content[0], dict) and content[0].get("type") == "text":
        content = content[0].get("text")
    if last.get("role") != "assistant" or not isinstance(content, str) \
            or not isinstance(last.get("tool_calls") or [], list):
        return messages, ""  # as given: a malformed message is refused as it is (a 400)
    if continue_final:
        return messages[:-1], content
    return [*messages[:-1], {"role": "user", "content": content}], ""


def continued_prompt(prompt: str, prefix: str) -> str:
    """The prompt with an assistant prefix: its tokens follow the generation prompt's."""
    return f"{prompt} {prefix}" if prefix.strip() else prompt


def content_text(content: Any) -> str:
    """Text of a message content: a string, None, or a list of typed parts."""
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict):
                raise ValueError("content parts must be objects")
            texts.append(str(part.get("text", f"<{part.get('type', 'part')}>")))
        return " ".join(texts)
    raise ValueError("'content' must be a string or a list of parts")


@dataclass(frozen=True)
class Plan:
    """The whole answer to one request, decided up front; the engine decides its pace."""

    words: Sequence[str]
    reasoning_tokens: int  # the leading words that are reasoning_content
    finish_reason: str  # "stop" or "length", when generation runs to the end
    continues: bool = False  # it goes on from an assistant prefix: its first word is spaced


def plan_output(
    seed: int,
    prompt_text: str,
    max_tokens: int | None,
    ignore_eos: bool,
    thinking: bool,
    room: int,
    continues: bool = False,
) -> Plan:
    """Decide the output. ``room`` is what the context length leaves after the prompt."""
    key = zlib.crc32(prompt_text.encode(), seed & 0xFFFFFFFF)
    natural = NATURAL_MIN_TOKENS + key % NATURAL_SPREAD_TOKENS  # where the model would stop
    limit = min(max_tokens, room) if max_tokens is not None else room
    length = limit if ignore_eos else min(natural, limit)
    finish = "stop" if not ignore_eos and natural <= limit else "length"
    words = random.Random(key).choices(WORDS, k=length)
    reasoning = max(1, length // 4) if thinking and length > 1 else 0
    return Plan(words, reasoning, finish, continues)


class TextCursor:
    """Cuts a plan's words into per-chunk text, keeping the spacing of the whole answer."""

    def __init__(self, plan: Plan) -> None:
        self._words = plan.words
        self._reasoning = plan.reasoning_tokens
        self._continues = plan.continues
        self.position = 0

    def take(self, n: int) -> list[tuple[str, str]]:
        """The next ``n`` tokens as ("reasoning" | "content", text) segments."""
        start, end = self.position, min(self.position + n, len(self._words))
        self.position = end
        segments = []
        if start < self._reasoning:
            segments.append(("reasoning", self._join(start, min(end, self._reasoning), 0)))
        if end > self._reasoning:
            segments.append(("content", self._join(max(start, self._reasoning), end, self._reasoning)))
        return segments

    def _join(self, start: int, end: int, part_start: int) -> str:
        text = " ".join(self._words[start:end])
        first = start == part_start and not (self._continues and part_start == self._reasoning)
        return text if first else " " + text

    @property
    def at_end(self) -> bool:
        return self.position >= len(self._words)


def split_answer(plan: Plan, generated: int) -> tuple[str, str]:
    """(reasoning, content) of the first ``generated`` tokens, as a non-stream answer has them."""
    reasoning, content = "", ""
    for kind, text in TextCursor(plan).take(generated):
        if kind == "reasoning":
            reasoning = text
        else:
            content = text
    return reasoning, content


def thinking_requested(body: Mapping[str, Any]) -> bool:
    kwargs = body.get("chat_template_kwargs") or {}
    if not isinstance(kwargs, dict):
        raise ValueError("'chat_template_kwargs' must be an object")
    return bool(kwargs.get("enable_thinking") or kwargs.get("thinking"))


def responses_prompt_text(given: Any) -> str:
    """A Responses ``input``: a string, or items (messages, function calls and their outputs)."""
    if isinstance(given, str):
        return given
    if not isinstance(given, list) or not given:
        raise ValueError("input: Field required (a string or a non-empty list of items)")
    parts = []
    for item in given:
        if not isinstance(item, dict):
            raise ValueError("input: each item must be an object")
        if "role" in item:
            parts.append(f"<|im_start|>{item['role']} {content_text(item.get('content'))}<|im_end|>")
        elif item.get("type") == "function_call_output":
            parts.append(f"<|im_start|>tool {item.get('output', '')}<|im_end|>")
        else:
            call = f"{item.get('type', 'item')} {item.get('arguments', '')}"
            parts.append(f"<|im_start|>assistant {call}<|im_end|>")
    parts.append("<|im_start|>assistant")
    return "\n".join(parts)
