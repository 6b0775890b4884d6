"""The OpenAI wire format: request bodies (validated) and the JSON of responses and chunks.

Owns: which fields a request may carry and their checks (each error names its field), the
``SamplingParams`` a request asks for, and the exact shape of completion / chat responses,
stream chunks and usage. Never: tokenizing, the engine, or HTTP status codes.

Field names follow OpenAI's API; ``top_k``, ``min_p``, ``repetition_penalty`` and
``ignore_eos`` are vLLM's extensions. Types are strict (``"5"`` is not a number) and unknown
fields are ignored, as OpenAI and vLLM do, except the ones listed in ``UNSUPPORTED``: those
change the output, so setting them is an error.

Log-probabilities (``logprobs``; chat: ``logprobs: true`` and ``top_logprobs``) come back in
OpenAI's shapes, whole or per stream chunk: chat ``choices[].logprobs.content[]`` of
``{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}``, completions
``choices[].logprobs`` of ``{tokens, token_logprobs, top_logprobs, text_offset}``. They are the
model's raw distribution (before penalties, temperature and filters), as vLLM reports them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator

from longctx.sampling_params import MAX_LOGPROBS, SamplingParams

# Fields with a meaning this server does not implement, and the values that ask for nothing
# (their defaults): any other value is refused rather than silently ignored.
UNSUPPORTED: dict[str, tuple[Any, ...]] = {
    "prompt_logprobs": (None,), "echo": (None, False), "best_of": (None, 1), "suffix": (None, ""),
    "logit_bias": (None, {}), "tools": (None, []), "functions": (None, []),
    "response_format": (None, {"type": "text"}),
}

# A log-probability of -inf is not valid JSON; vLLM reports it as this.
MIN_LOGPROB = -9999.0


class StreamOptions(BaseModel):
    model_config = ConfigDict(strict=True, extra="ignore")
    include_usage: bool = False


def _text(value: str) -> str:
    """``value`` if it is valid Unicode text; a lone surrogate (JSON lets ``"\\ud800"`` through)
    cannot be encoded or tokenized, so it is the client's error."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as err:
        raise ValueError(f"contains a lone surrogate ({value[err.start]!r} at character {err.start}), "
                         "which is not valid Unicode text") from None
    return value


class GenerationRequest(BaseModel):
    """Fields shared by /v1/completions and /v1/chat/completions."""

    model_config = ConfigDict(strict=True, extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, allow_inf_nan=False)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 64)
    stop: Any = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    ignore_eos: bool = False
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0)
    min_p: float | None = Field(None, ge=0, le=1)

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
        return tuple(_text(s) for s in stop)

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

    def num_logprobs(self) -> int | None:
        """Top log-probabilities to return per token (0: only the chosen token's); None: none."""
        return None

    def sampling_params(self, max_tokens: int) -> SamplingParams:
        def given(value: float | None, default: float) -> float:
            return default if value is None else value

        return SamplingParams(
            temperature=given(self.temperature, 1.0), top_p=given(self.top_p, 1.0),
            top_k=self.top_k or 0, seed=self.seed, max_tokens=max_tokens, stop=self.stop,
            ignore_eos=self.ignore_eos, presence_penalty=given(self.presence_penalty, 0.0),
            frequency_penalty=given(self.frequency_penalty, 0.0),
            repetition_penalty=given(self.repetition_penalty, 1.0), min_p=given(self.min_p, 0.0),
            logprobs=self.num_logprobs())

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class CompletionRequest(GenerationRequest):
    prompt: Any  # str | [str] | [int] | [[int]], normalised to str or list[int]
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # top ones per token (OpenAI: <= 5)

    def num_logprobs(self) -> int | None:
        return self.logprobs

    @field_validator("prompt")
    @classmethod
    def _one_prompt(cls, prompt: Any) -> str | list[int]:
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # a batch of one
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            return _text(prompt)
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
            return _text(content)
        if isinstance(content, list) and all(
                isinstance(p, dict) and p.get("type") == "text" and isinstance(p.get("text"), str)
                for p in content):
            return _text("".join(p["text"] for p in content))
        raise ValueError("content must be a string or a list of {'type': 'text', 'text': ...} parts "
                         "(only text is supported)")

    def template_dict(self) -> dict[str, str]:
        # Llama-family templates know "system", not OpenAI's newer "developer".
        return {"role": "system" if self.role == "developer" else self.role, "content": self.content}


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage]
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool | None = None
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @field_validator("top_logprobs")
    @classmethod
    def _needs_logprobs(cls, top: int | None, info: ValidationInfo) -> int | None:
        if top and not info.data.get("logprobs"):
            raise ValueError("top_logprobs needs logprobs: true")
        return top

    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

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


@dataclass(frozen=True)
class TokenLogprob:
    """One generated token's log-probability, and the tokens the engine reported at its
    position (the top ones, plus the chosen one if it was not among them), most likely first."""

    token: str
    logprob: float
    top: tuple[tuple[str, float], ...]


def _finite(logprob: float) -> float:
    return max(float(logprob), MIN_LOGPROB)


class CompletionShape:
    """The JSON objects of one /v1/completions response (whole or as stream chunks).
    ``num_logprobs``: what the request asked for (None: no ``logprobs`` in the choices)."""

    object = "text_completion"
    chunk_object = "text_completion"
    id_prefix = "cmpl"

    def __init__(self, request_id: str, model: str, num_logprobs: int | None = None) -> None:
        self.request_id, self.model, self.created = request_id, model, int(time.time())
        self.num_logprobs = num_logprobs
        self.text_offset = 0  # characters of the tokens already given logprobs (completions)

    def _envelope(self, obj: str, choices: list[dict], **extra: Any) -> dict[str, Any]:
        return {"id": self.request_id, "object": obj, "created": self.created, "model": self.model,
                "choices": choices, **extra}

    def logprobs(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        """OpenAI's legacy shape: up to ``logprobs + 1`` entries per ``top_logprobs`` dict (the
        top ones and the chosen token), keyed by token text."""
        offsets = []
        for t in tokens:
            offsets.append(self.text_offset)
            self.text_offset += len(t.token)
        top = []
        for t in tokens:
            entry: dict[str, float] = {}
            for text, lp in t.top:
                entry.setdefault(text, _finite(lp))
            top.append(entry)
        return {"tokens": [t.token for t in tokens], "token_logprobs": [_finite(t.logprob) for t in tokens],
                "top_logprobs": top, "text_offset": offsets}

    def _logprobs(self, tokens: list[TokenLogprob] | None) -> dict[str, Any] | None:
        return None if self.num_logprobs is None or tokens is None else self.logprobs(tokens)

    def opening_chunks(self) -> list[dict[str, Any]]:
        return []

    def choice(self, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"index": 0, "text": text, "logprobs": self._logprobs(logprobs),
                "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None,
                     logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return self.choice(text, finish_reason, logprobs)

    def response(self, text: str, finish_reason: str | None, use: dict[str, int],
                 logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return self._envelope(self.object, [self.choice(text, finish_reason, logprobs)], usage=use)

    def chunk(self, text: str, finish_reason: str | None, with_usage_field: bool,
              logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        extra = {"usage": None} if with_usage_field else {}
        return self._envelope(self.chunk_object, [self.delta_choice(text, finish_reason, logprobs)],
                              **extra)

    def usage_chunk(self, use: dict[str, int]) -> dict[str, Any]:
        return self._envelope(self.chunk_object, [], usage=use)


class ChatShape(CompletionShape):
    object = "chat.completion"
    chunk_object = "chat.completion.chunk"
    id_prefix = "chatcmpl"

    def logprobs(self, tokens: list[TokenLogprob]) -> dict[str, Any]:
        """OpenAI's chat shape: ``top_logprobs`` holds exactly the top ``top_logprobs`` tokens."""
        def entry(text: str, lp: float) -> dict[str, Any]:
            return {"token": text, "logprob": _finite(lp), "bytes": list(text.encode("utf-8"))}

        return {"content": [{**entry(t.token, t.logprob),
                             "top_logprobs": [entry(*top) for top in t.top[:self.num_logprobs]]}
                            for t in tokens]}

    def opening_chunks(self) -> list[dict[str, Any]]:
        choice = {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                  "finish_reason": None}
        return [self._envelope(self.chunk_object, [choice])]

    def choice(self, text: str, finish_reason: str | None,
               logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"index": 0, "message": {"role": "assistant", "content": text},
                "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}

    def delta_choice(self, text: str, finish_reason: str | None,
                     logprobs: list[TokenLogprob] | None = None) -> dict[str, Any]:
        return {"index": 0, "delta": {"content": text} if text else {},
                "logprobs": self._logprobs(logprobs), "finish_reason": finish_reason}
