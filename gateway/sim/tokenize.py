"""The other endpoints a generation model answers: /tokenize and /detokenize (words as tokens),
Anthropic's /v1/messages/count_tokens, and the 400 of /v1/embeddings and /v1/classify."""

from __future__ import annotations

from typing import Any

from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from gateway.sim.context import ServerContext
from gateway.sim.parsing import JobParser
from gateway.sim.replies import anthropic_refusal, json_response, openai_error, openai_refusal
from gateway.sim.requests import RequestError, read_json
from gateway.sim.text import chat_prompt_text, token_ids

NOT_AN_EMBEDDING_MODEL = ("This model does not appear to be an embedding model by default. Please add "
                          "`--is-embedding` when launching the server or try another model.")  # fmt: skip


class Vocabulary:
    """Word <-> token id of /tokenize and /detokenize, ids given in order of first sight."""

    def __init__(self) -> None:
        self._ids: dict[str, int] = {}
        self._words: list[str] = []

    def encode(self, text: str) -> list[int]:
        ids = []
        for word in text.split():
            if word not in self._ids:
                self._ids[word] = len(self._words)
                self._words.append(word)
            ids.append(self._ids[word])
        return ids

    def decode(self, ids: list[int]) -> str:
        return " ".join(self._words[i] if 0 <= i < len(self._words) else "" for i in ids)



class Tokenization:
    def __init__(self, context: ServerContext, parser: JobParser) -> None:
        self.profile = context.profile
        self.parser = parser
        self.vocabulary = Vocabulary()

    def routes(self) -> list[Route]:
        post = ["POST"]
        return [
            Route("/v1/messages/count_tokens", self.count_tokens, methods=post),
            Route("/v1/embeddings", self.not_an_embedding_model, methods=post),
            Route("/v1/classify", self.not_an_embedding_model, methods=post),
            Route("/v1/tokenize", self.tokenize, methods=post),
            Route("/tokenize", self.tokenize, methods=post),
            Route("/v1/detokenize", self.detokenize, methods=post),
            Route("/detokenize", self.detokenize, methods=post),
        ]

    async def not_an_embedding_model(self, request: Request) -> Response:
        """Embeddings and classification run as EmbeddingReqInput, which a generation model
        refuses (tokenizer_manager.py:1381) with a ValueError: 400 (serving_embedding.py:259)."""
        try:
            await read_json(request)
        except RequestError as exc:
            return openai_refusal(exc)
        return openai_error(400, NOT_AN_EMBEDDING_MODEL, "BadRequestError")

    async def tokenize(self, request: Request) -> Response:
        """serving_tokenize.py: ``prompt`` (a string or strings) or chat ``messages``; the
        simulator's tokens are words, numbered as they are first seen (so detokenize inverts)."""
        try:
            body = await read_json(request)
            prompt, messages = body.get("prompt"), body.get("messages")
            if messages is not None:
                tokens: Any = self.vocabulary.encode(chat_prompt_text(messages, body.get("tools")))
            elif isinstance(prompt, str):
                tokens = self.vocabulary.encode(prompt)
            elif isinstance(prompt, list) and all(isinstance(p, str) for p in prompt):
                tokens = [self.vocabulary.encode(p) for p in prompt]
            else:
                raise RequestError("Either 'prompt' or 'messages' must be provided")
        except (RequestError, ValueError) as exc:
            return openai_refusal(exc if isinstance(exc, RequestError) else RequestError(str(exc)))
        count = len(tokens) if isinstance(prompt, str) or messages is not None else [len(t) for t in tokens]
        return json_response({"tokens": tokens, "count": count, "max_model_len": self.profile.context_length})

    async def detokenize(self, request: Request) -> Response:
        try:
            body = await read_json(request)
            tokens = body.get("tokens")
            if isinstance(tokens, list) and all(type(t) is int for t in tokens):
                text: Any = self.vocabulary.decode(tokens)
            elif isinstance(tokens, list) and all(isinstance(t, list) for t in tokens):
                text = [self.vocabulary.decode(t) for t in tokens]
            else:
                raise RequestError("tokens: Input should be a list of integers or of lists of integers",
                                   err_type="Bad Request")  # fmt: skip
        except RequestError as exc:
            return openai_refusal(exc)
        return json_response({"text": text})

    async def count_tokens(self, request: Request) -> Response:
        """anthropic/serving.py:1439: the converted prompt's length."""
        try:
            body = await read_json(request)
            if not body.get("model"):
                raise RequestError("model: Field required")
            text, _, _ = self.parser.anthropic_prompt(body)
        except RequestError as exc:
            return anthropic_refusal(exc)
        return json_response({"input_tokens": len(token_ids(text))})
