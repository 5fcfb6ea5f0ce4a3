"""A generation request's body to a :class:`formats.Job`, per API, as SGLang validates it
(everything a request can be refused for before the engine sees it)."""

from __future__ import annotations

import dataclasses
import time
import uuid
from typing import Any

from gateway.sim import formats
from gateway.sim.context import ServerContext
from gateway.sim.requests import (
    RequestError,
    anthropic_chosen_tool,
    anthropic_thinking,
    anthropic_tools,
    choices_of,
    chosen_tool,
    max_tokens_of,
    responses_chosen_tool,
)
from gateway.sim.requests import last_is_user as _last_is_user
from gateway.sim.responses_store import STORE_DISABLED
from gateway.sim.text import (
    chat_prompt_text,
    content_text,
    continued_prompt,
    final_assistant_turn,
    plan_output,
    responses_prompt_text,
    thinking_requested,
    token_ids,
)


class JobParser:
    """Parses each API's body; raises RequestError (its status, type and param) on bad input."""

    def __init__(self, context: ServerContext) -> None:
        self.identity = context.identity
        self.profile = context.profile
        self.responses_store = context.responses_store

    def _job(
        self, body: dict[str, Any], text: str, prompt_ids: list[int], max_tokens: int | None,
        thinking: bool = False, tool_name: str | None = None, n: int = 1,
        continues: bool = False, **extra: Any,
    ) -> formats.Job:  # fmt: skip
        room = self.profile.context_length - len(prompt_ids)
        if not prompt_ids:
            raise RequestError("The prompt is empty.")
        ignore_eos = bool(body.get("ignore_eos"))
        plan = plan_output(self.identity.seed, text, max_tokens, ignore_eos, thinking, room,
                           continues)
        samples = tuple(plan_output(self.identity.seed, f"{text}#{i}", max_tokens, ignore_eos, thinking, room)
                        for i in range(n)) if n > 1 else ()  # fmt: skip
        options = body.get("stream_options") or {}
        model = str(body.get("model") or "default")
        return formats.Job(
            rid=extra.pop("rid", None) or self._rid_of(body),
            model=model,
            created=int(time.time()),
            prompt_ids=prompt_ids,
            plan=plan,
            greedy=body.get("temperature") == 0,
            include_usage=bool(isinstance(options, dict) and options.get("include_usage")),
            tool_name=tool_name,
            tool_id=formats.new_tool_call_id() if tool_name else "",
            start_error=self._lora_error(model) or self._length_error(len(prompt_ids), max_tokens),
            samples=samples,
            **extra,
        )

    @staticmethod
    def _rid_of(body: dict[str, Any]) -> str:
        rid = body.get("rid")
        if rid is not None and not isinstance(rid, str):
            raise RequestError("'rid' must be a string")
        return rid or formats.new_rid()

    def _lora_error(self, model: str) -> str | None:
        """serving_base.py:40 reads `base:adapter` as a LoRA adapter; with LoRA off (as here)
        generate_request raises (tokenizer_manager.py:3729). No other check of the name."""
        served = self.profile.served_model_name
        if ":" not in model or model == served:
            return None
        adapter = model[len(served) + 1 :] if model.startswith(served + ":") else model.split(":", 1)[1]
        if not adapter.strip():
            return None
        return (f"LoRA adapter '{adapter.strip()}' was requested, but LoRA is not enabled. Please "
                "launch the server with --enable-lora flag and preload adapters using --lora-paths "
                "or /load_lora_adapter endpoint.")  # fmt: skip

    def _length_error(self, prompt_tokens: int, max_tokens: int | None) -> str | None:
        """tokenizer_manager.py:1337-1378 (validate_total_tokens is always on): the prompt must
        be shorter than the context, and prompt + max_new_tokens must fit in it. Raised inside
        generate_request, so a Messages or Responses stream reports it inside its 200."""
        context = self.profile.context_length
        if prompt_tokens >= context:
            return (f"The input ({prompt_tokens} tokens) is longer than the model's context length "
                    f"({context} tokens).")  # fmt: skip
        if max_tokens is not None and prompt_tokens + max_tokens > context:
            return (f"Requested token count exceeds the model's maximum context length of {context} "
                    f"tokens. You requested a total of {prompt_tokens + max_tokens} tokens: "
                    f"{prompt_tokens} tokens from the input messages and {max_tokens} tokens for the "
                    "completion. Please reduce the number of tokens in the input messages or the "
                    "completion to fit within the limit.")  # fmt: skip
        return None

    def chat(self, body: dict[str, Any]) -> formats.Job:
        tools = body.get("tools")
        try:
            messages, prefix = final_assistant_turn(body.get("messages"),
                                                    bool(body.get("continue_final_message")))
            text = continued_prompt(chat_prompt_text(messages, tools), prefix)
            tool = chosen_tool(tools, body.get("tool_choice"), _last_is_user(body.get("messages")))
            thinking = thinking_requested(body)
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        max_tokens = max_tokens_of(body, "max_completion_tokens", "max_tokens")
        return self._job(body, text, token_ids(text), max_tokens, thinking, tool, choices_of(body),
                         continues=bool(prefix.strip()))

    def generate(self, body: dict[str, Any]) -> formats.Job:
        """One prompt (``text`` or ``input_ids``) with ``sampling_params``
        (managers/io_struct.py GenerateReqInput; max_new_tokens defaults to 128)."""
        text, ids = body.get("text"), body.get("input_ids")
        if isinstance(text, str):
            prompt_text, prompt_ids = text, token_ids(text)
        elif isinstance(ids, list) and ids and all(type(t) is int for t in ids):
            prompt_text, prompt_ids = " ".join(map(str, ids)), ids
        elif text is None and ids is None:
            raise RequestError("Either text, input_ids or input_embeds should be provided.")
        else:
            raise RequestError("The simulator takes one prompt per /generate request (no batches).")
        params = body.get("sampling_params") or {}
        if not isinstance(params, dict):
            raise RequestError("sampling_params must be an object")
        limit = max_tokens_of({"max_new_tokens": params.get("max_new_tokens", 128)}, "max_new_tokens")
        merged = {**body, "ignore_eos": params.get("ignore_eos"), "temperature": params.get("temperature")}
        return self._job(merged, prompt_text, prompt_ids, limit,
                         continues=isinstance(text, str) and _ends_in_a_word(text))

    def completion(self, body: dict[str, Any]) -> formats.Job:
        prompt = body.get("prompt")
        if isinstance(prompt, str):
            text, ids = prompt, token_ids(prompt)
        elif isinstance(prompt, list) and all(type(t) is int for t in prompt):
            text, ids = " ".join(map(str, prompt)), prompt
        else:
            raise RequestError("'prompt' must be a string or a list of token ids")
        return self._job(body, text, ids, max_tokens_of(body, "max_tokens"), n=choices_of(body),
                         continues=isinstance(prompt, str) and _ends_in_a_word(prompt))

    def messages(self, body: dict[str, Any]) -> formats.Job:
        """Anthropic requests carry no rid SGLang reads (anthropic/protocol.py:370): each
        gets a fresh one, so only a disconnect can abort it."""
        if not body.get("model"):
            raise RequestError("model: Model is required")
        max_tokens = max_tokens_of(body, "max_tokens")
        if max_tokens is None:
            raise RequestError("max_tokens: Field required")
        text, tool, thinking = self.anthropic_prompt(body)
        return self._job({**body, "rid": None}, text, token_ids(text), max_tokens, thinking, tool)

    def anthropic_prompt(self, body: dict[str, Any]) -> tuple[str, str | None, bool]:
        """(prompt text, the tool to call or None, thinking) of a Messages request, as
        anthropic/serving.py:218 converts it; conversion errors are 400s."""
        try:
            system = content_text(body.get("system"))
            messages = body.get("messages")
            tools = anthropic_tools(body.get("tools"))
            converted, _ = final_assistant_turn(messages, False, text_block=True)
            text = chat_prompt_text(converted, tools or None)
            tool = anthropic_chosen_tool(tools, body.get("tool_choice"), _last_is_user(messages))
            thinking = anthropic_thinking(body.get("thinking"))
        except ValueError as exc:
            raise RequestError(str(exc)) from exc
        return (f"{system}\n{text}" if system else text), tool, thinking

    def responses(self, body: dict[str, Any]) -> formats.Job:
        previous = body.get("previous_response_id")
        if previous is not None and not self.responses_store.enabled:
            raise RequestError(STORE_DISABLED, err_type="invalid_request_error", param="previous_response_id")
        self._check_responses_model(body.get("model"))
        tools = body.get("tools") or []
        try:
            tool = responses_chosen_tool(tools, body.get("tool_choice", "auto"), body.get("input"))
            text = responses_prompt_text(body.get("input"))
        except ValueError as exc:
            raise RequestError(str(exc), param=getattr(exc, "param", None)) from exc
        if previous is not None:
            text = self.responses_store.history(previous) + "\n" + text
        if body.get("instructions"):
            text = f"{body['instructions']}\n{text}"
        rid = body.get("request_id") or f"resp_{uuid.uuid4().hex}"  # protocol.py:1973
        if not isinstance(rid, str):
            raise RequestError("request_id: Input should be a valid string", err_type="Bad Request")
        echo = {key: body[key] for key in formats.RESPONSES_ECHO if key in body}
        store = self.responses_store.enabled and body.get("store", True) is not False
        job = self._job(body, text, token_ids(text), max_tokens_of(body, "max_output_tokens"),
                        thinking_requested(body), tool, rid=rid, echo=echo, store=store,
                        prompt_text=text if store else "")  # fmt: skip
        return dataclasses.replace(job, model=body.get("model") or self.profile.served_model_name)

    def _check_responses_model(self, model: Any) -> None:
        """serving_responses.py:297: None is whatever is loaded; else the served name, or
        `served:adapter`."""
        served = self.profile.served_model_name
        if model is None or model == served or str(model).split(":", 1)[0] == served:
            return
        raise RequestError(f"The model '{model}' does not exist", 404, "invalid_request_error", "model")


def _ends_in_a_word(prompt: str) -> bool:
    """A text prompt that ends in a word: a model's next token carries its space."""
    return bool(prompt) and not prompt[-1].isspace()
