"""The FastAPI app: OpenAI's routes on top of one ``EngineLoop``.

Owns: the routes (/v1/completions, /v1/chat/completions, /v1/models, /health, /metrics),
checks that need the model (name, vocabulary, context window, KV capacity), tokenizing off
the event loop, and turning engine updates into JSON or server-sent events. Never: touching
the engine directly (only the engine thread does), or loading anything a client names.

Every check runs before a request reaches the engine, in this order: API key and body size
(the gate), field validation (400), model name (404), unsupported fields (400), prompt and
length checks (400), capacity (429).

Log-probabilities come with each ``StepUpdate`` (``new_logprobs``: one ``{token id: logprob}``
entry per new token, for requests that asked); the routes turn them into OpenAI's shapes.
"""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from longctx.engine.scheduler import RequestTooLongError
from longctx.entrypoints.server.config import ServerConfig
from longctx.entrypoints.server.engine_loop import (EngineLoop, EngineUnavailableError, QueueFullError,
                                        RequestCancelledError, RequestHandle)
from longctx.entrypoints.server.errors import APIError, bad_request, install_error_handlers
from longctx.entrypoints.server.gate import RequestGate
from longctx.entrypoints.server.protocol import (ChatCompletionRequest, ChatShape, CompletionRequest,
                                     CompletionShape, GenerationRequest, TokenLogprob, usage)
from longctx.entrypoints.server.tokenize import PromptTokenizer, PromptTooLong

COMPLETIONS_DEFAULT_MAX_TOKENS = 16  # OpenAI's default for /v1/completions


def create_app(engine_loop: EngineLoop, config: ServerConfig) -> FastAPI:
    """The ASGI app (FastAPI wrapped in the request gate); ``config`` must be resolved."""
    routes = OpenAIRoutes(engine_loop, config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        engine_loop.start()
        try:
            yield
        finally:
            await asyncio.to_thread(engine_loop.stop)
            routes.prompts.shutdown()

    app = FastAPI(title="longctx", summary="OpenAI-compatible API of the longctx engine",
                  lifespan=lifespan)
    install_error_handlers(app)
    app.include_router(routes.router)
    app.add_middleware(RequestGate, api_key=config.api_key, max_body_bytes=config.max_request_bytes)
    return app


class OpenAIRoutes:
    def __init__(self, engine_loop: EngineLoop, config: ServerConfig) -> None:
        self.engine_loop = engine_loop
        engine = engine_loop.engine
        self.model_name = config.served_model_name
        self.max_model_len = engine.max_model_len
        self.vocab_size = engine.model_config.vocab_size
        self.check_request = engine.check_request  # reads only settings fixed at start (thread-safe)
        self.check_params = engine.check_params  # (the same)
        self.kv_capacity_tokens = engine.kv_capacity_tokens
        # The engine thread decodes with its tokenizer; requests are encoded off the event loop,
        # on a pool whose threads each have a copy, and probed against the window first.
        self.prompts = PromptTokenizer(engine.tokenizer, engine.max_model_len)
        self.created = int(time.time())
        r = self.router = APIRouter()
        r.add_api_route("/v1/completions", self.completions, methods=["POST"])
        r.add_api_route("/v1/chat/completions", self.chat_completions, methods=["POST"])
        r.add_api_route("/v1/models", self.list_models, methods=["GET"])
        r.add_api_route("/v1/models/{model:path}", self.get_model, methods=["GET"])
        r.add_api_route("/health", self.health, methods=["GET"])
        r.add_api_route("/metrics", self.metrics, methods=["GET"])

    # ------------------------------------------------------------------ routes

    async def completions(self, body: CompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_common(body)
        prompt = body.prompt
        if isinstance(prompt, str):
            try:
                prompt_ids = await self.prompts.encode(prompt)
            except PromptTooLong as err:
                raise bad_request(str(err), param="prompt", code="context_length_exceeded") from err
        else:
            self._check_token_ids(prompt)
            prompt_ids = prompt
        return await self._generate(request, body, arrival, prompt_ids, CompletionShape, "prompt",
                                    COMPLETIONS_DEFAULT_MAX_TOKENS)

    async def chat_completions(self, body: ChatCompletionRequest, request: Request) -> Response:
        arrival = time.perf_counter()
        self._check_common(body)
        messages = [m.template_dict() for m in body.messages]
        try:
            prompt_ids = await self.prompts.chat(messages)
        except PromptTooLong as err:
            raise bad_request(str(err), param="messages", code="context_length_exceeded") from err
        except Exception as err:  # noqa: BLE001 - a template refusing the conversation
            raise bad_request(f"the model's chat template rejected the messages: {err}",
                              param="messages") from err
        return await self._generate(request, body, arrival, prompt_ids, ChatShape, "messages", None)

    async def list_models(self) -> dict[str, Any]:
        return {"object": "list", "data": [self._model_card()]}

    async def get_model(self, model: str) -> dict[str, Any]:
        self._check_model(model)
        return self._model_card()

    async def health(self) -> Response:
        if not self.engine_loop.healthy:
            reason = self.engine_loop.unavailable_reason()
            return APIError(503, reason, type="server_error", code="engine_unavailable").response()
        body: dict[str, Any] = {"status": "ok"}
        # thread-safe and never touches the disk; a degraded or stalled disk tier still leaves the
        # server healthy (it is a cache: its misses are recomputed)
        disk = self.engine_loop.engine.disk_state()
        if disk is not None:
            body["disk"] = disk
        return JSONResponse(body)

    async def metrics(self) -> Response:
        data, content_type = self.engine_loop.metrics.render()
        return Response(data, media_type=content_type)

    # ------------------------------------------------------------------ checks

    def _model_card(self) -> dict[str, Any]:
        return {"id": self.model_name, "object": "model", "created": self.created,
                "owned_by": "longctx", "max_model_len": self.max_model_len}

    def _check_model(self, model: str | None) -> None:
        if model is not None and model != self.model_name:
            raise APIError(404, f"the model '{model}' does not exist; this server serves "
                                f"'{self.model_name}'", param="model", code="model_not_found")

    def _check_common(self, body: GenerationRequest) -> None:
        self._check_model(body.model)
        name = body.unsupported_field()
        if name is not None:
            raise bad_request(f"'{name}' is not supported by this server; leave it unset",
                              param=name, code="unsupported_parameter")

    def _check_token_ids(self, ids: list[int]) -> None:
        bad = [t for t in ids if not 0 <= t < self.vocab_size]
        if bad:
            raise bad_request(f"prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}",
                              param="prompt", code="invalid_value")

    def _max_tokens(self, num_prompt: int, requested: int | None, default: int | None,
                    prompt_param: str) -> int:
        """The request's token budget, or a 400 that states the lengths involved."""
        window = self.max_model_len
        if num_prompt < 1:
            raise bad_request("the prompt is empty: give at least one token", param=prompt_param)
        if num_prompt >= window:
            raise bad_request(f"the prompt has {num_prompt} tokens but the model's context window is "
                              f"{window} tokens (the prompt plus at least one new token must fit)",
                              param=prompt_param, code="context_length_exceeded")
        if requested is not None and num_prompt + requested > window:
            raise bad_request(f"the prompt ({num_prompt} tokens) plus max_tokens ({requested}) is "
                              f"{num_prompt + requested} tokens, more than the model's context window "
                              f"of {window}: ask for at most {window - num_prompt} new tokens",
                              param="max_tokens", code="context_length_exceeded")
        max_tokens = requested
        if max_tokens is None:  # as much as the window and the KV pool leave room for
            room = min(window, self.kv_capacity_tokens) - num_prompt
            max_tokens = max(1, room if default is None else min(default, room))
        try:
            self.check_request(num_prompt, max_tokens)
        except RequestTooLongError as err:
            raise bad_request(str(err), param=prompt_param if requested is None else "max_tokens",
                              code="context_length_exceeded") from err
        return max_tokens

    # ------------------------------------------------------------------ generation

    async def _generate(self, request: Request, body: GenerationRequest, arrival: float,
                        prompt_ids: list[int], shape_cls: type[CompletionShape], prompt_param: str,
                        default_max_tokens: int | None) -> Response:
        max_tokens = self._max_tokens(len(prompt_ids), body.requested_max_tokens(),
                                      default_max_tokens, prompt_param)
        try:
            params = body.sampling_params(max_tokens)
        except ValueError as err:
            raise bad_request(str(err)) from err
        try:
            self.check_params(params)
        except ValueError as err:
            raise bad_request(str(err), param="stop") from err
        shape = shape_cls(f"{shape_cls.id_prefix}-{uuid.uuid4().hex}", self.model_name, params.logprobs)
        handle = self._submit(shape.request_id, prompt_ids, params, arrival)

        def close() -> None:
            handle.close()

        if body.stream:
            return EventStreamResponse(self._events(handle, shape, body.include_usage, close),
                                       on_close=close)
        try:
            return await _unless_disconnected(request, self._whole(handle, shape))
        finally:
            close()

    def _submit(self, request_id: str, prompt_ids: list[int], params: Any, arrival: float) -> RequestHandle:
        try:
            return self.engine_loop.submit(request_id, prompt_ids, params, arrival)
        except QueueFullError as err:
            self.engine_loop.metrics.requests_rejected.inc()
            raise APIError(429, str(err), type="rate_limit_error", code="rate_limit_exceeded",
                           headers={"Retry-After": "1"}) from err
        except EngineUnavailableError as err:
            raise APIError(503, str(err), type="server_error", code="engine_unavailable") from err

    async def _whole(self, handle: RequestHandle, shape: CompletionShape) -> Response:
        parts, num_tokens, ids, entries = [], 0, [], []
        try:
            while True:
                update = await handle.next()
                parts.append(update.new_text)
                num_tokens += len(update.new_token_ids)
                if shape.num_logprobs is not None:
                    ids += update.new_token_ids
                    entries += update.new_logprobs or []
                if update.finished:
                    break
        except Exception as err:  # noqa: BLE001 - mapped to an HTTP error
            raise _engine_error(err) from err
        use = usage(handle.num_prompt_tokens, num_tokens)
        logprobs = await self._token_logprobs(ids, entries) if shape.num_logprobs is not None else None
        return JSONResponse(shape.response("".join(parts), update.finish_reason, use, logprobs))

    async def _events(self, handle: RequestHandle, shape: CompletionShape, include_usage: bool,
                      close: Callable[[], None]) -> AsyncIterator[str]:
        try:
            for chunk in shape.opening_chunks():
                yield _sse(chunk)
            num_tokens, ids, entries = 0, [], []  # ids, entries: logprobs not sent yet
            while True:
                update = await handle.next()
                num_tokens += len(update.new_token_ids)
                if shape.num_logprobs is not None:
                    ids += update.new_token_ids
                    entries += update.new_logprobs or []
                if update.new_text or update.finished:
                    logprobs = None
                    if shape.num_logprobs is not None:
                        logprobs = await self._token_logprobs(ids, entries)
                        ids, entries = [], []
                    yield _sse(shape.chunk(update.new_text, update.finish_reason, include_usage, logprobs))
                if update.finished:
                    break
            if include_usage:
                yield _sse(shape.usage_chunk(usage(handle.num_prompt_tokens, num_tokens)))
        except Exception as err:  # noqa: BLE001 - the status line is sent: say it in the stream
            yield _sse(_engine_error(err).body())
        finally:
            close()
        yield "data: [DONE]\n\n"

    async def _token_logprobs(self, ids: list[int], entries: list[dict[int, float]]) -> list[TokenLogprob]:
        """The engine's per-token entries ({token id: logprob}, the chosen token among them)
        with token texts (decoded on the tokenizer's thread), top entries most likely first."""
        def build(tok: Any) -> list[TokenLogprob]:
            out = []
            for token, entry in zip(ids, entries):
                top = sorted(entry.items(), key=lambda item: -item[1])
                out.append(TokenLogprob(tok.decode([token]), entry[token],
                                        tuple((tok.decode([t]), lp) for t, lp in top)))
            return out

        return await self.prompts.run(build)


class EventStreamResponse(StreamingResponse):
    """Server-sent events; ``on_close`` runs however the response ends (done, client gone,
    or cancelled by shutdown), so an abandoned request is aborted at once."""

    def __init__(self, events: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(events, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self.on_close = on_close

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.on_close()


def _sse(payload: dict[str, Any]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _engine_error(err: Exception) -> APIError:
    if isinstance(err, RequestCancelledError):
        return APIError(503, str(err), type="server_error", code="server_shutting_down")
    if isinstance(err, EngineUnavailableError):
        return APIError(503, str(err), type="server_error", code="engine_unavailable")
    if isinstance(err, ValueError):
        return bad_request(str(err))
    return APIError(500, f"internal server error: {type(err).__name__}: {err}", type="server_error")


async def _unless_disconnected(request: Request, work: Any) -> Response:
    """Await ``work``; if the client disconnects first, cancel it (its ``finally`` aborts the
    request) and answer nothing useful: nobody is listening."""
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_disconnected(request))
    try:
        done, _ = await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
    if task in done:
        return task.result()
    return Response(status_code=499)  # nginx's "client closed request"


async def _disconnected(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
