"""The OpenAI wire format: request bodies (validated) and the JSON of responses and chunks.

Owns: which fields a request may carry and their checks (each error names its field), the
``SamplingParams`` a request asks for, and the exact shape of completion / chat responses,
stream chunks and usage. Never: tokenizing, the engine, or HTTP status codes.

Field names follow OpenAI's API; ``top_k`` and ``ignore_eos`` are vLLM's extensions. Types are
strict (``"5"`` is not a number) and unknown fields are ignored, as OpenAI and vLLM do, except
the ones listed in ``UNSUPPORTED``: those change the output, so setting them is an error.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from longctx.sampling_params import SamplingParams

# Fields with a meaning this server does not implement, and the values that ask for nothing
# (their defaults): any other value is refused rather than silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "logprobs": (None, False), "top_logprobs": (None, 0), "prompt_logprobs": (None,),
    "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""), "logit_bias": (None, {}),
    "presence_penalty": (None, 0, 0.0), "frequency_penalty": (None, 0, 0.0),
    "repetition_penalty": (None, 1, 1.0), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: Any = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False

    @field_validator("n")
    @classmethod
    def _one_choice(cls, n: int) -> int:
        if n != 1:
            raise ValueError(f"only n=1 is supported (one choice per request), got {n}")
        return n

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, stop: Any) -> tuple[str, ...]:
        stop = [] if stop is None else [stop] if isinstance(stop, str) else stop
        if not isinstance(stop, list) or not all(isinstance(s, str) and s for s in stop):
            raise ValueError("stop must be a non-empty string or a list of non-empty strings")
        return tuple(stop)

    @field_validator("stream_options")
    @classmethod
    def _options_need_stream(cls, options: StreamOptions | None,
                             info: ValidationInfo) -> StreamOptions | None:
        if options is not None and not info.data.get("stream", False):
            raise ValueError("stream_options is only allowed with stream: true")
        return options

    def unsupported_field(self) -> str | None:
        """The first field this server cannot honour that the request sets."""
        extra = self.model_extra or {}
        return next((name for name, defaults in UNSUPPORTED.items() if name in extra and not any(
            type(extra[name]) is type(ok) and extra[name] == ok for ok in defaults)), None)

    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=1.0 if self.temperature is None else self.temperature,
            top_p=1.0 if self.top_p is None else self.top_p,
            top_k=self.top_k or 0, seed=self.seed, max_tokens=max_tokens, stop=self.stop,
            ignore_eos=self.ignore_eos)

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    prompt: Any  # str | [str] | [int] | [[int]], normalised to str or list[int]

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            return prompt
        if isinstance(prompt, list) and prompt and all(
                isinstance(t, int) and not isinstance(t, bool) for t in prompt):
            return prompt
        if isinstance(prompt, list) and len(prompt) > 1 and all(isinstance(p, (str, list)) for p in prompt):
            raise ValueError(f"only one prompt per request is supported, got {len(prompt)}")
        raise ValueError("prompt must be a non-empty string, a list of one string, "
                         "or a non-empty list of token ids (integers)")


class ChatMessage(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")

    role: Literal["system", "developer", "user", "assistant"]
    content: Any
    name: str | None = None

    @field_validator("content")
    @classmethod
    def _text_only(cls, content: Any) -> str:
        if isinstance(content, str):
            return content
        if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            return "".join(p["text"] for p in content)
        raise ValueError("content must be a string or a list of {'type': 'text', 'text': ...} parts "
                         "(only text is supported)")

    def template_dict(self) -> dict[str, str]:
        # Llama-family templates know "system", not OpenAI's newer "developer".
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)

    @field_validator("messages")
    @classmethod
    def _not_empty(cls, messages: list[ChatMessage]) -> list[ChatMessage]:
        if not messages:
            raise ValueError("messages must contain at least one message")
        return messages

    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens


# ---------------------------------------------------------------------- responses


def usage(num_prompt_tokens: int, num_completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": num_prompt_tokens, "completion_tokens": num_completion_tokens,
            "total_tokens": num_prompt_tokens + num_completion_tokens}


class CompletionShape:
    """The JSON objects of one /v1/completions response (whole or as stream chunks)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, request_id: str, model: str) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": None, "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return self.choice(text, finish_reason)

    def response(self, text: str, finish_reason: str | None, use: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.object, [self.choice(text, finish_reason)], usage=use)

    def chunk(self, text: str, finish_reason: str | None, with_usage_field: bool) -> dict[str, Any]:
        extra = {"usage": None} if with_usage_field else {}
        return self._envelope(self.chunk_object, [self.delta_choice(text, finish_reason)], **extra)

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [], usage=use)


class ChatShape(CompletionShape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def opening_chunks(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self._envelope(self.chunk_object, [choice])]

    def choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text}, "logprobs": None,
                "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text} if text else {}, "logprobs": None,
                "finish_reason": finish_reason}
