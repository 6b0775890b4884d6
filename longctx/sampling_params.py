"""``SamplingParams``: how one request's tokens are chosen and when it stops (no torch).

Field names and meanings follow vLLM's ``SamplingParams`` so code moves over by changing one
import. Validated on construction; a bad value raises ``ValueError`` naming the field.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

# temperatures below this are greedy: logits / 1e-38 overflow float32 to inf and the draw
# becomes garbage (vLLM's floor is the same 1e-5)
TEMPERATURE_FLOOR = 1e-5


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or below TEMPERATURE_FLOOR): greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: off
    seed: int | None = None  # reproducible per request when set
    max_tokens: int = 16
    stop: tuple[str, ...] | None = ()  # stop strings; not included in the output text
    stop_token_ids: tuple[int, ...] | None = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    repetition_penalty: float = 1.0  # > 1 discourages tokens of the prompt and output (HF's rule)
    presence_penalty: float = 0.0  # OpenAI's: minus this once for a token already in the output
    frequency_penalty: float = 0.0  # OpenAI's: minus this per earlier occurrence in the output
    min_p: float = 0.0  # drop tokens with probability < min_p * the most likely token's
    logprobs: int | None = None  # return the chosen token's log-probability and this many top ones
    prompt_logprobs: int | None = None  # the same for every prompt token after the first
    extra: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else self.stop
        stop_ids = () if self.stop_token_ids is None else self.stop_token_ids
        if not isinstance(stop, (list, tuple)):
            raise ValueError(f"stop must be a string or a list of strings, got {self.stop!r}")
        if not isinstance(stop_ids, (list, tuple)) or not all(
                isinstance(t, int) and not isinstance(t, bool) and t >= 0 for t in stop_ids):
            raise ValueError(f"stop_token_ids must be a list of token ids (integers >= 0), "
                             f"got {self.stop_token_ids!r}")
        object.__setattr__(self, "stop", tuple(stop))
        object.__setattr__(self, "stop_token_ids", tuple(stop_ids))
        if self.top_k == -1:
            object.__setattr__(self, "top_k", 0)
        checks = [
            (_number(self.temperature) and math.isfinite(self.temperature) and self.temperature >= 0,
             f"temperature must be a finite number >= 0, got {self.temperature!r}"),
            (isinstance(self.top_p, (int, float)) and 0 < self.top_p <= 1,
             f"top_p must be in (0, 1], got {self.top_p!r}"),
            (isinstance(self.top_k, int) and self.top_k >= 0,
             f"top_k must be an integer >= 0 (or -1 for off), got {self.top_k!r}"),
            (isinstance(self.max_tokens, int) and self.max_tokens >= 1,
             f"max_tokens must be an integer >= 1, got {self.max_tokens!r}"),
            (self.seed is None or isinstance(self.seed, int),
             f"seed must be an integer, got {self.seed!r}"),
            (all(isinstance(s, str) and s for s in self.stop),
             f"stop must be non-empty strings, got {self.stop!r}"),
            (_number(self.repetition_penalty) and self.repetition_penalty > 0,
             f"repetition_penalty must be a number > 0 (1 is off), got {self.repetition_penalty!r}"),
            (_number(self.presence_penalty) and -2 <= self.presence_penalty <= 2,
             f"presence_penalty must be in [-2, 2], got {self.presence_penalty!r}"),
            (_number(self.frequency_penalty) and -2 <= self.frequency_penalty <= 2,
             f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty!r}"),
            (_number(self.min_p) and 0 <= self.min_p <= 1,
             f"min_p must be in [0, 1], got {self.min_p!r}"),
            (self.logprobs is None or _count(self.logprobs),
             f"logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, got {self.logprobs!r}"),
            (self.prompt_logprobs is None or _count(self.prompt_logprobs),
             f"prompt_logprobs must be an integer in [0, {MAX_LOGPROBS}] or None, "
             f"got {self.prompt_logprobs!r}"),
        ]
        for ok, message in checks:
            if not ok:
                raise ValueError(message)
        if self.temperature < TEMPERATURE_FLOOR:
            object.__setattr__(self, "temperature", 0.0)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0

    @property
    def has_penalties(self) -> bool:
        return (self.repetition_penalty != 1.0 or self.presence_penalty != 0.0
                or self.frequency_penalty != 0.0)


MAX_LOGPROBS = 20  # as OpenAI's top_logprobs


def _number(x: object) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and x == x


def _count(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_LOGPROBS
