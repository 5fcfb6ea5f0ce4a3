"""What cannot be continued faithfully, each rule from SGLang 0.5.23's source (paths under
``sglang/srt/``; the table with these lines is in docs/compat.md).

A continuation asks the next server for the original request with the answer so far as a
prefix it does not generate again: a chat ``continue_final_message`` (the prefix is the final
assistant message's *content*, tokenized and appended to the prompt,
entrypoints/openai/serving_chat.py:519-548 and :560-575), or a prompt followed by the text.
Whatever of the answer that prefix cannot carry, or whatever the server decides from the
output alone, makes the continued answer differ from one generated in one go.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from gateway.apis import CHAT, COMPLETIONS, GENERATE, MESSAGES, RESPONSES
from gateway.continuation.convert import Unconvertible, messages_as_chat, responses_as_chat
from gateway.continuation.transcript import Relayed

SAMPLES = "samples"  # n > 1
BATCH = "batch"  # a list of prompts
LOGPROBS = "logprobs"
GRAMMAR = "grammar"  # a JSON schema, regex, EBNF, structural tag or forced tool call
STOP_REGEX = "stop_regex"
STOP_AT_SEAM = "stop_at_seam"  # the text so far ends with the start of a stop string
TOOL_CALL = "tool_call"
REASONING = "reasoning"
FINISHED = "finished"  # the finish went out already: nothing is left to generate
ERRORED = "errored"  # the client has the stream's error already
STORED_HISTORY = "stored_history"  # Responses previous_response_id: on one server only
ECHO = "echo"
ASSISTANT_LAST = "assistant_last"  # the request ends with an assistant message of its own
SHAPE = "shape"  # a Messages/Responses request the chat conversion does not cover

_GRAMMAR_FIELDS = ("regex", "ebnf", "json_schema", "structural_tag")


def refusal(path: str, body: Mapping[str, Any], relayed: Relayed) -> str | None:
    """Why the stream cannot be continued faithfully; None when it can."""
    for reason in _reasons(path, body, relayed):
        return reason
    return None


def _reasons(path: str, body: Mapping[str, Any], relayed: Relayed) -> Iterable[str]:
    if relayed.errored:
        yield ERRORED
    if relayed.finished:
        yield FINISHED
    # Only content is carried: tool calls and reasoning of the final assistant message are
    # not part of the prefix (serving_chat.py:540-545 takes messages[-1]["content"]).
    if relayed.tool_calls:
        yield TOOL_CALL
    if relayed.reasoning:
        yield REASONING
    params = body.get("sampling_params") if path == GENERATE else body
    params = params if isinstance(params, Mapping) else {}
    # Every sample of n > 1 is a request with a fresh random rid (tokenizer_manager.py:2174):
    # their chunks interleave on one stream and no one of them can be aborted by name.
    if _int(params.get("n"), 1) > 1 or _int(body.get("best_of"), 1) > 1:
        yield SAMPLES
    if _is_batch(path, body):
        yield BATCH
    if _wants_logprobs(path, body):
        yield LOGPROBS
    if _constrained(path, body, params):
        yield GRAMMAR
    if params.get("stop_regex"):
        yield STOP_REGEX
    if _stop_may_span(_stops(path, body, params), relayed.text):
        yield STOP_AT_SEAM
    if path == COMPLETIONS and body.get("echo"):
        yield ECHO
    if path == RESPONSES and (body.get("previous_response_id") or body.get("conversation")):
        yield STORED_HISTORY
    if path == CHAT and _ends_with_assistant(body.get("messages")) \
            and not body.get("continue_final_message"):
        yield ASSISTANT_LAST
    if path in (MESSAGES, RESPONSES):
        # The adapters never set continue_final_message: a final assistant turn of the
        # client's is made a user one (serving_chat.py:546-548), which chat cannot say.
        given = body.get("messages") if path == MESSAGES else body.get("input")
        if _ends_with_assistant(given):
            yield ASSISTANT_LAST
        try:
            (messages_as_chat if path == MESSAGES else responses_as_chat)(body)
        except Unconvertible:
            yield SHAPE


def _int(value: Any, default: int) -> int:
    return value if isinstance(value, int) and not isinstance(value, bool) else default


def _is_batch(path: str, body: Mapping[str, Any]) -> bool:
    """io_struct.py:764 runs a list of prompts as rid_0, rid_1, ... on one stream."""
    if path == COMPLETIONS:
        prompt = body.get("prompt")
        return isinstance(prompt, list) and bool(prompt) and isinstance(prompt[0], str | list)
    if path == GENERATE:
        text, ids = body.get("text"), body.get("input_ids")
        return isinstance(text, list) or (isinstance(ids, list) and bool(ids)
                                          and isinstance(ids[0], list))
    return False


def _wants_logprobs(path: str, body: Mapping[str, Any]) -> bool:
    """The prefix is the text re-encoded (serving_chat.py:572), not the sampled ids: the
    logprobs of the whole answer would not be those of one sampling."""
    if path == GENERATE:
        return bool(body.get("return_logprob"))
    if path == COMPLETIONS:
        return body.get("logprobs") is not None
    if path == RESPONSES:
        return bool(body.get("top_logprobs")) or "message.output_text.logprobs" in (
            body.get("include") or ())
    return bool(body.get("logprobs")) or bool(body.get("top_logprobs"))


def _constrained(path: str, body: Mapping[str, Any], params: Mapping[str, Any]) -> bool:
    """A grammar starts at the first generated token and accepts only the output
    (batch_result_processor.py:722, :865): continued, it would start over mid-answer.
    A forced tool call is a grammar too (protocol.py:1257-1286)."""
    if any(params.get(name) for name in _GRAMMAR_FIELDS):
        return True
    if path in (CHAT, COMPLETIONS):
        fmt = body.get("response_format")
        if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
            return True
    if path == CHAT:
        choice = body.get("tool_choice")
        if choice == "required" or isinstance(choice, Mapping):
            return True
    if path == MESSAGES:
        config = body.get("output_config")
        choice = body.get("tool_choice")
        if isinstance(config, Mapping) and config.get("format") is not None:
            return True  # anthropic/serving.py:619-627: a json_schema response_format
        if isinstance(choice, Mapping) and choice.get("type") in ("any", "tool"):
            return True  # anthropic/serving.py:707-727: required / a named function
    if path == RESPONSES:
        text = body.get("text")
        fmt = text.get("format") if isinstance(text, Mapping) else None
        if isinstance(fmt, Mapping) and fmt.get("type") not in (None, "text"):
            return True
        choice = body.get("tool_choice")
        if choice == "required" or isinstance(choice, Mapping):
            return True
    return False


def _stops(path: str, body: Mapping[str, Any], params: Mapping[str, Any]) -> list[str]:
    value = body.get("stop_sequences") if path == MESSAGES else params.get("stop")
    if isinstance(value, str):
        return [value]
    return [s for s in value if isinstance(s, str) and s] if isinstance(value, list) else []


def _stop_may_span(stops: list[str], text: str) -> bool:
    """A stop string is matched in the decoded output only (schedule_batch.py:1819-1828), so
    one begun before the seam and ended after it would be missed. SGLang holds a stream's
    output back while it ends with the start of a stop string
    (scheduler_components/output_streamer.py:472-473), so the relayed text rarely does."""
    return any(text.endswith(stop[:i]) for stop in stops for i in range(1, len(stop) + 1))


def _ends_with_assistant(messages: Any) -> bool:
    """Without continue_final_message SGLang makes a final assistant message a user one
    (serving_chat.py:546-548): a continuation cannot say the same."""
    return (isinstance(messages, list) and bool(messages) and isinstance(messages[-1], Mapping)
            and messages[-1].get("role") == "assistant")
