"""The Python API: ``LLM`` and ``SamplingParams``, shaped like vLLM's so one import swaps.

Owns: accepting user input (strings, token-id dicts, chat messages), validating it with
messages that say what was wrong, and driving the engine to completion or as a stream.
Never: model math or scheduling.

    from longctx import LLM, SamplingParams
    llm = LLM()                                   # the default model
    outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=32))
    outs[0].outputs[0].text
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Union

from longctx.entrypoints import tasks
from longctx.config import split_engine_kwargs
from longctx.engine.llm_engine import LLMEngine
from longctx.engine.output_processor import RequestOutput
from longctx.sampling_params import SamplingParams

PromptType = Union[str, dict[str, Any]]
ProgressFn = Callable[[int, int], None]


@dataclass
class StreamDelta:
    """One piece of a streamed generation."""

    text: str
    token_ids: list[int]
    finished: bool
    finish_reason: str | None
    output: RequestOutput | None = None  # set on the last delta


class LLM:
    def __init__(self, model: str = "smollm2-135m", **engine_kwargs: Any) -> None:
        """Engine options as keywords (``longctx.config``). ``sequence_parallel_size=N`` > 1
        starts N-1 worker processes once, for this LLM's lifetime: every step is shared by
        the N ranks, KV pages spread over them (docs/parallel.md); everything else works the
        same. ``close()`` (or the end of the interpreter) stops them."""
        self.configs = split_engine_kwargs({"model": model, **engine_kwargs})
        self.engine = LLMEngine(*self.configs)
        self.sequence_parallel_size = self.configs[-1].sequence_parallel_size
        self._closed = False
        # Runs when this LLM is garbage-collected or, at the latest, at interpreter exit.
        self._atexit = weakref.finalize(self, self.engine.close)

    def get_tokenizer(self):
        return self.engine.tokenizer

    # ------------------------------------------------------------------ prefix cache

    def cache_stats(self):
        """``PrefixCacheStats``: prompt tokens seen, prefilled, and served per cache tier."""
        return self.engine.cache_stats(wait_for_disk=True)

    def clear_prefix_cache(self) -> None:
        """Forget the cached pages on the device and host tiers (the disk tier stays)."""
        self.engine.clear_prefix_cache()

    def close(self) -> None:
        """Persist the prefix cache to the disk tier (when ``disk_cache_dir`` is set) and stop
        the sequence-parallel ranks. Also runs at interpreter exit; calling it twice is
        harmless."""
        if not self._closed:
            self._closed = True
            self._atexit.detach()
            self.engine.close()

    def __enter__(self) -> "LLM":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ input

    def _to_ids(self, prompt: PromptType) -> tuple[list[int], str | None]:
        if isinstance(prompt, str):
            if not prompt:
                raise ValueError("prompt is an empty string")
            return self.engine.tokenizer.encode(prompt, add_special_tokens=False), prompt
        if isinstance(prompt, dict):
            unknown = set(prompt) - {"prompt", "prompt_token_ids", "cache_salt"}
            if unknown:
                raise ValueError(f"unknown prompt dict key(s): {', '.join(sorted(unknown))}")
            if "prompt_token_ids" in prompt:
                ids = prompt["prompt_token_ids"]
                if not isinstance(ids, (list, tuple)) or not ids:
                    raise ValueError("prompt_token_ids must be a non-empty list of integers")
                return list(ids), prompt.get("prompt")
            if "prompt" in prompt:
                return self._to_ids(prompt["prompt"])
            raise ValueError("a prompt dict needs 'prompt_token_ids' or 'prompt'")
        raise TypeError(f"a prompt must be a string or a dict, got {type(prompt).__name__}")

    @staticmethod
    def _params_list(params: SamplingParams | Sequence[SamplingParams] | None, n: int) -> list[SamplingParams]:
        if params is None:
            return [SamplingParams()] * n
        if isinstance(params, SamplingParams):
            return [params] * n
        params = [params] if isinstance(params, (dict, str)) or not isinstance(params, Iterable) else list(params)
        wrong = next((p for p in params if not isinstance(p, SamplingParams)), None)
        if wrong is not None:
            hint = " (pass SamplingParams(**that_dict))" if isinstance(wrong, dict) else ""
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, got "
                            f"{type(wrong).__name__}{hint}")
        if len(params) != n:
            raise ValueError(f"got {len(params)} sampling params for {n} prompts")
        return params

    def chat_prompt_ids(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> list[int]:
        if not messages or not all(isinstance(m, dict) and "role" in m and "content" in m for m in messages):
            raise ValueError("messages must be a non-empty list of {'role': ..., 'content': ...} dicts")
        ids = self.engine.tokenizer.apply_chat_template(
            messages, add_generation_prompt=add_generation_prompt, tokenize=True)
        return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys") else ids)

    # ------------------------------------------------------------------ generation

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 *, on_prefill_progress: ProgressFn | None = None) -> list[RequestOutput]:
        """Run every prompt to completion (batched); outputs in the order of ``prompts``."""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        prompts = list(prompts)
        if not prompts:
            raise ValueError("no prompts given")
        params = self._params_list(sampling_params, len(prompts))
        encoded = [self._to_ids(p) for p in prompts]  # validate all before adding any
        salts = [_salt(p) for p in prompts]
        for ids, p in zip(encoded, params):
            self.engine.check_request(len(ids[0]), p.max_tokens)
        request_ids = []
        try:
            for salt, (ids, text), p in zip(salts, encoded, params):
                request_ids.append(self.engine.add_request(ids, p, prompt=text, cache_salt=salt))
            self._run(set(request_ids), on_prefill_progress)
        except BaseException:
            for rid in request_ids:
                self.engine.abort(rid)
            raise
        return [self.engine.release(rid) for rid in request_ids]

    def chat(self, messages: list[dict[str, str]] | list[list[dict[str, str]]],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             **kwargs: Any) -> list[RequestOutput]:
        """Generate replies to one conversation or a list of them (chat template applied)."""
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        prompts = [{"prompt_token_ids": self.chat_prompt_ids(c)} for c in conversations]
        return self.generate(prompts, sampling_params, **kwargs)

    def stream(self, prompt: PromptType, sampling_params: SamplingParams | None = None,
               *, on_prefill_progress: ProgressFn | None = None) -> Iterator[StreamDelta]:
        """Yield text as it is produced for one prompt."""
        ids, text = self._to_ids(prompt)
        rid = self.engine.add_request(ids, sampling_params or SamplingParams(), prompt=text,
                                      cache_salt=_salt(prompt))
        finished = False
        try:
            while not finished:
                for update in self.engine.step():
                    if update.request_id != rid:
                        continue
                    if not update.new_token_ids:
                        if on_prefill_progress:
                            on_prefill_progress(update.num_computed_tokens, update.num_prompt_tokens)
                        continue
                    finished = update.finished
                    yield StreamDelta(update.new_text, update.new_token_ids, update.finished,
                                      update.finish_reason,
                                      self.engine.release(rid) if finished else None)
        finally:
            if not finished:
                self.engine.abort(rid)

    # ------------------------------------------------------------------ document tasks

    def summarize(self, document: Any, *, instructions: str | None = None,
                  max_tokens: int = tasks.SUMMARY_TOKENS, sampling_params: SamplingParams | None = None,
                  on_progress: Callable[[str, int, int], None] | None = None) -> tasks.SummaryResult:
        """Summarize a document (text or path): one pass if it fits the window, else map-reduce
        over window-sized pieces. See ``longctx.entrypoints.tasks``."""
        return tasks.summarize(self, document, instructions=instructions, max_tokens=max_tokens,
                               sampling_params=sampling_params, on_progress=on_progress)

    def ask(self, document: Any, questions: Sequence[str], *, max_tokens: int = tasks.ANSWER_TOKENS,
            sampling_params: SamplingParams | None = None) -> tasks.AskResult:
        """Answer questions about one document, batched over one shared prefill (BM25-retrieved
        pieces when the document is longer than the window). See ``longctx.entrypoints.tasks``."""
        return tasks.ask(self, document, questions, max_tokens=max_tokens, sampling_params=sampling_params)

    def _run(self, pending: set[str], on_progress: ProgressFn | None) -> None:
        while pending:
            for update in self.engine.step():
                if update.finished:
                    pending.discard(update.request_id)
                elif on_progress and not update.new_token_ids:
                    on_progress(update.num_computed_tokens, update.num_prompt_tokens)


def _salt(prompt: PromptType) -> str | None:
    salt = prompt.get("cache_salt") if isinstance(prompt, dict) else None
    if salt is not None and (not isinstance(salt, str) or not salt):
        raise ValueError("cache_salt must be a non-empty string")
    return salt

