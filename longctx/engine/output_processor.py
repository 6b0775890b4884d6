"""The output processor: what each step's committed tokens mean to the caller.

Owns: per request its text (detokenized token by token), stop strings, what was streamed so
far, log-probabilities, timings and the final ``RequestOutput``. It runs after
``scheduler.update`` (outside the schedule -> execute -> update core) and ends a request whose
text hits a stop string through the ``stop`` callback (the scheduler's ``finish_request``).
Never: tensors, pages or the scheduler's queues; stop tokens, ``max_tokens`` and the window
are the scheduler's (``Scheduler.update``).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from longctx.engine.stop_matcher import StopMatcher
from longctx.engine.detokenizer import Detokenizer, make_detokenizer
from longctx.engine.outputs import RequestUpdate, RunnerOutput, SchedulerOutput
from longctx.sampling_params import SamplingParams


@dataclass
class RequestMetrics:
    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    finished_time: float | None = None
    token_times: list[float] = field(default_factory=list)  # one per token (a step's tokens share one)
    num_verify_steps: int = 0  # lookahead: steps that verified a draft
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0

    @property
    def time_to_first_token(self) -> float | None:
        return None if self.first_token_time is None else self.first_token_time - self.arrival_time

    @property
    def inter_token_latencies(self) -> list[float]:
        return [b - a for a, b in zip(self.token_times, self.token_times[1:])]


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    logprobs: list[dict[int, float]] | None = None  # per token: its own and the top ones


@dataclass
class RequestOutput:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool
    metrics: RequestMetrics
    # with SamplingParams.prompt_logprobs: None for the first prompt token, then per token
    # {token id: logprob} with the token's own and the top ones
    prompt_logprobs: list[dict[int, float] | None] | None = None


@dataclass
class StepUpdate:
    """What one step did for one request: new tokens and text, or prefill progress."""

    request_id: str
    new_token_ids: list[int]
    new_text: str
    num_computed_tokens: int
    num_prompt_tokens: int
    finished: bool
    finish_reason: str | None
    new_logprobs: list[dict[int, float]] | None = None  # per new token, when the request asked


@dataclass
class Tracked:
    """One request's output so far."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    token_ids: list[int] = field(default_factory=list)  # the output's tokens (cut at a stop string)
    text: str = ""
    num_sent: int = 0  # characters of ``text`` already handed out as ``new_text``
    detok: Detokenizer | None = None  # the output's text, token by token (made on the first)
    finish_reason: str | None = None
    logprobs: list[dict[int, float]] | None = None  # per output token, when asked
    prompt_logprobs: list[dict[int, float] | None] | None = None
    stops: StopMatcher | None = None  # the request's stop strings, fed as the text grows


def partial_stop_len(text: str, stops: tuple[str, ...]) -> int:
    """Length of the longest end of ``text`` that is a proper start of some stop string: text a
    later token may turn into a stop (and cut), so it is not handed out yet. (The plain form of
    what ``StopMatcher.pending`` keeps as the text grows; tests compare the two.)"""
    best = 0
    for stop in stops:
        for k in range(min(len(stop) - 1, len(text)), best, -1):
            if text.endswith(stop[:k]):
                best = k
                break
    return best


class OutputProcessor:
    def __init__(self, tokenizer, stop: Callable[[str, str], None]) -> None:
        """``stop(request_id, reason)`` ends a request the scheduler still runs."""
        self.tokenizer = tokenizer
        self.stop = stop
        self.tracked: dict[str, Tracked] = {}

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, arrival_time: float) -> None:
        self.tracked[request_id] = Tracked(
            request_id, prompt, list(prompt_token_ids), params, RequestMetrics(arrival_time),
            logprobs=[] if params.logprobs is not None else None,
            prompt_logprobs=[None] if params.prompt_logprobs is not None else None,
            stops=StopMatcher(params.stop) if params.stop else None)

    def abort(self, request_id: str) -> bool:
        """Forget the request; True if it was still unfinished."""
        t = self.tracked.pop(request_id, None)
        return t is not None and t.finish_reason is None

    def output(self, request_id: str) -> RequestOutput:
        t = self.tracked[request_id]
        completion = CompletionOutput(0, t.text, list(t.token_ids), t.finish_reason,
                                      None if t.logprobs is None else list(t.logprobs))
        return RequestOutput(request_id, t.prompt, t.prompt_token_ids, [completion], t.finish_reason is not None,
                             t.metrics, None if t.prompt_logprobs is None else list(t.prompt_logprobs))

    def release(self, request_id: str) -> RequestOutput:
        """The final output of a finished request; the processor forgets it."""
        out = self.output(request_id)
        del self.tracked[request_id]
        return out

    def process(self, output: SchedulerOutput, result: RunnerOutput, updates: list[RequestUpdate],
                scheduled_at: float, now: float) -> list[StepUpdate]:
        """The step's updates as the caller sees them: ``scheduled_at``, when the step began;
        ``now``, the time its tokens count as produced."""
        for seq in output.seqs:
            m = self.tracked[seq.request_id].metrics
            m.first_scheduled_time = m.first_scheduled_time or scheduled_at
        for request_id, (first, entries) in result.prompt_logprobs.items():
            kept = self.tracked[request_id].prompt_logprobs
            if len(kept) >= first:  # (a preempted request recomputes what it has: kept once)
                kept.extend(entries[len(kept) - first:])
        return [self._commit(self.tracked[u.request_id], u, now) for u in updates]

    def _commit(self, t: Tracked, update: RequestUpdate, now: float) -> StepUpdate:
        """Append ``update``'s tokens in order until one ends the request."""
        m = t.metrics
        if update.num_drafted:
            m.num_verify_steps += 1
            m.num_draft_tokens += update.num_drafted
            m.num_accepted_tokens += update.num_accepted
        pieces, reason, last = [], None, len(update.new_token_ids) - 1
        for i, token in enumerate(update.new_token_ids):
            piece, reason = self._append(t, token, now, update.finish_reason if i == last else None)
            pieces.append(piece)
            if reason is not None:
                break
        new_tokens = update.new_token_ids[:len(pieces)]
        new_logprobs = None
        if t.logprobs is not None and update.logprobs is not None:
            new_logprobs = update.logprobs[:len(pieces)]
            t.logprobs.extend(new_logprobs)
        if reason is not None and update.finish_reason is None:  # a stop string
            self.stop(t.request_id, reason)
        return StepUpdate(t.request_id, new_tokens, "".join(pieces), update.num_computed_tokens,
                          update.num_prompt_tokens, reason is not None, reason, new_logprobs)

    def _append(self, t: Tracked, token: int, now: float, reason: str | None) -> tuple[str, str | None]:
        """Add one token; ``reason``: why the scheduler ended the request at it (a stop token,
        the length), else None. Returns the text to hand out now and the finish reason."""
        params = t.params
        t.token_ids.append(token)
        m = t.metrics
        m.first_token_time = m.first_token_time or now
        m.token_times.append(now)
        old_text = t.text
        if t.detok is None or len(t.detok.token_ids) != len(t.token_ids) - 1:
            t.detok = make_detokenizer(self.tokenizer, t.token_ids[:-1])
        # == tokenizer.decode(t.token_ids, skip_special_tokens=True), at a cost per token that
        # does not grow with the output
        text = t.detok.add(token)
        matcher, saved = t.stops, t.stops.state if t.stops is not None else 0
        if matcher is not None:
            if not text.startswith(old_text):  # (the text before changed: read it all again)
                matcher.reset()
                old_text_len = 0
            else:
                old_text_len = len(old_text)
            hit = matcher.feed(text[old_text_len:])
            if hit is not None:
                stop = params.stop[hit[0]]
                at = old_text_len + hit[1] - len(stop)
                text = text[: at + len(stop)] if params.include_stop_str_in_output else text[:at]
                reason = "stop"
        if reason is None and text.endswith("\ufffd"):
            text = old_text  # an incomplete UTF-8 sequence: wait for the next token
            if matcher is not None:
                matcher.state = saved  # (the matcher is where old_text left it)
        t.text = text
        if reason is not None:
            t.finish_reason = reason
            m.finished_time = now
            end = len(text)
        else:
            end = max(t.num_sent, len(text) - (matcher.pending if matcher is not None else 0))
        new_text, t.num_sent = text[t.num_sent:end], end
        return new_text, reason
