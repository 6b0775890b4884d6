"""The ``longctx`` command line: a thin shell that parses, validates, calls the API, prints.

Owns: flags (engine flags are derived from the config dataclasses' fields), reading prompt
files, streaming text to stdout and progress to stderr, turning user errors into one-line
messages with exit code 2. ``serve`` builds its ``ServerConfig`` from flags and hands over to
``longctx.entrypoints.server.launch`` (imported only then: it pulls in FastAPI and uvicorn); ``batch``
builds a ``BatchJob`` and hands over to ``longctx.entrypoints.batch``; ``summarize`` and ``ask`` call
``longctx.entrypoints.tasks`` and print the results.
Never: model or engine logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from pathlib import Path

from longctx.entrypoints.batch import (PROGRESS_MODES, TASK_MAX_TOKENS, BatchConfig, BatchError, BatchJob,
                           progress_bar, progress_enabled)
from longctx.config import CONFIG_CLASSES, FLAG_TYPES, ConfigError, ModelLoadConfig
from longctx.sampling_params import SamplingParams
from longctx.entrypoints.server.config import ServerConfig

TASK_MAX_TOKENS_HELP = "the task's: " + ", ".join(f"{k} {v}" for k, v in TASK_MAX_TOKENS.items())


SHORT_FLAGS = {"sequence_parallel_size": ("--sp",)}


def _add_config_flags(parser: argparse.ArgumentParser, classes: tuple = CONFIG_CLASSES,
                      title: str = "engine") -> None:
    group = parser.add_argument_group(title)
    for cls in classes:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            aliases = SHORT_FLAGS.get(f.name, ())
            help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
            if isinstance(f.default, bool):  # --flag / --no-flag
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                   dest=f.name, help=help_text)
            else:
                kind = FLAG_TYPES.get(f.name, float) if f.default is None else type(f.default)  # None: auto
                group.add_argument(flag, *aliases, type=kind, default=f.default, dest=f.name,
                                   help=help_text)


def config_kwargs(args: argparse.Namespace, classes: tuple = CONFIG_CLASSES) -> dict:
    """The options of ``classes`` a parsed command line gives (default: the engine's, as in
    ``LLM(**config_kwargs(args))``)."""
    return {f.name: getattr(args, f.name) for cls in classes for f in dataclasses.fields(cls)}


def _add_sampling_flags(parser: argparse.ArgumentParser, max_tokens_default: int | None = 256) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=max_tokens_default,
                       help=f"new tokens at most (default: {max_tokens_default or TASK_MAX_TOKENS_HELP})")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    group.add_argument("--repetition-penalty", type=float, default=1.0,
                       help="> 1 discourages tokens of the prompt and output, HF's rule (default: 1, off)")
    group.add_argument("--presence-penalty", type=float, default=0.0,
                       help="in [-2, 2]: subtracted once from tokens already in the output, OpenAI's "
                            "rule (default: 0)")
    group.add_argument("--frequency-penalty", type=float, default=None,
                       help="in [-2, 2]: subtracted per earlier occurrence in the output, OpenAI's "
                            "rule (default: 0; for summarize and ask 0.3, which stops loops)")
    group.add_argument("--min-p", type=float, default=0.0,
                       help="drop tokens less likely than this times the most likely one (default: 0, off)")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="longctx", description="Long-context LLM inference engine.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    gen = sub.add_parser("generate", help="generate text for one prompt, streamed to stdout",
                         description="Generate text for one prompt (text or file), streamed to stdout.")
    gen.add_argument("prompt", nargs="?", help="the prompt text (or use --prompt-file)")
    gen.add_argument("--prompt-file", type=Path, help="read the prompt (a document) from this file")
    gen.add_argument("--instruction", default=None,
                     help="text placed after the document (e.g. 'Summarize the text above.')")
    gen.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    gen.add_argument("--max-prompt-tokens", type=int, default=0,
                     help="keep only the first N tokens of the document (0: all)")
    _add_progress_flags(gen)
    _add_sampling_flags(gen)
    _add_config_flags(gen)
    serve = sub.add_parser("serve", help="serve an OpenAI-compatible HTTP API (see docs/serve.md)",
                           description="Serve the model over an OpenAI-compatible HTTP API: "
                                       "/v1/completions, /v1/chat/completions, /v1/models, "
                                       "/health, /metrics.")
    serve.add_argument("model_tag", nargs="?", metavar="MODEL", default=None,
                       help="the model (same as --model)")
    _add_config_flags(serve, (ServerConfig,), "server")
    _add_config_flags(serve)
    _add_task_parsers(sub)
    return parser


def _add_task_parsers(sub) -> None:
    batch = sub.add_parser(
        "batch", help="run a JSONL file of generate/summarize/ask records (resumable)",
        description="Run one JSON record per line of INPUT (task: generate | summarize | ask) and "
                    "append one result line per record to OUTPUT as each finishes. Re-running "
                    "the same command resumes: ids already in OUTPUT are skipped. Sampling "
                    "flags are defaults for records that leave the field out. See docs/guide.md.")
    batch.add_argument("input", type=Path, metavar="INPUT", help="JSONL file of records")
    batch.add_argument("--output", "-o", type=Path, required=True, help="JSONL file of results")
    _add_config_flags(batch, (BatchConfig,), "batch")
    _add_progress_flags(batch, with_mode=False)  # --progress is BatchConfig's
    ray = batch.add_argument_group("ray", "run the job on a Ray cluster (pip install 'longctx[ray]')")
    ray.add_argument("--ray", nargs="?", const="", default=None, metavar="ADDRESS",
                     help="run on Ray actors, one engine each: without ADDRESS start or join a local "
                          "cluster (ray.init()); else the cluster's address, e.g. auto or "
                          "ray://host:10001 (put --ray after INPUT, or write --ray=ADDRESS)")
    ray.add_argument("--ray-actors", type=int, default=0, metavar="N",
                     help="Ray actors (engines) to start (default: one per document group, as many "
                          "as the cluster's CPUs / --num-threads allow; its GPUs with --device cuda)")
    _add_sampling_flags(batch, max_tokens_default=None)
    _add_config_flags(batch)
    summ = sub.add_parser("summarize", help="summarize a document of any length",
                          description="Summarize a document (one pass if it fits the window, "
                                      "else its pieces and then their summaries).")
    summ.add_argument("document", type=Path, metavar="DOCUMENT", help="the document (a text file)")
    summ.add_argument("--instructions", default=None, help="what the summary should be")
    summ.add_argument("--json", action="store_true", help="print the whole result as JSON")
    _add_progress_flags(summ)
    ask = sub.add_parser("ask", help="answer questions about a document",
                         description="Answer questions about one document, as one batch sharing "
                                     "the document's prefix (BM25 excerpts when it is longer "
                                     "than the window).")
    ask.add_argument("document", type=Path, metavar="DOCUMENT", help="the document (a text file)")
    ask.add_argument("questions", nargs="+", metavar="QUESTION")
    ask.add_argument("--json", action="store_true", help="print the whole result as JSON")
    for parser in (summ, ask):
        _add_sampling_flags(parser, max_tokens_default=None)
        _add_config_flags(parser)


def _add_progress_flags(parser: argparse.ArgumentParser, with_mode: bool = True) -> None:
    if with_mode:
        parser.add_argument("--progress", choices=PROGRESS_MODES, default="auto",
                            help="progress bars on stderr: auto (when stderr is a terminal) | on | off "
                                 "(default: auto)")
    parser.add_argument("--no-progress", dest="progress", action="store_const", const="off",
                        help="no progress bars (same as --progress off)")


def _read_prompt(args: argparse.Namespace) -> str:
    if args.prompt_file is not None:
        if args.prompt is not None:
            raise ConfigError("give the prompt as text or with --prompt-file, not both")
        try:
            text = args.prompt_file.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as err:
            raise ConfigError(f"cannot read --prompt-file {args.prompt_file}: {err}") from err
    elif args.prompt is not None:
        text = args.prompt
    else:
        raise ConfigError("no prompt: give prompt text or --prompt-file FILE")
    if not text.strip():
        raise ConfigError("the prompt is empty")
    return text


def _advance(bar, done: int) -> None:
    """Move a tqdm bar to ``done`` (progress callbacks report totals so far)."""
    if done > bar.n:
        bar.update(done - bar.n)


def cmd_generate(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    params = SamplingParams(**{k: v for k, v in _sampling_defaults(args).items() if v is not None})
    from longctx.entrypoints.api import LLM

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    llm = LLM(**config_kwargs(args))
    tokenizer = llm.get_tokenizer()
    doc_ids = tokenizer.encode(text, add_special_tokens=False)
    if args.max_prompt_tokens:
        doc_ids = doc_ids[: args.max_prompt_tokens]
    body = tokenizer.decode(doc_ids)
    if args.instruction:
        body = f"{body}\n\n{args.instruction}"
    if args.chat:
        prompt_ids = llm.chat_prompt_ids([{"role": "user", "content": body}])
    else:
        prompt_ids = tokenizer.encode(body, add_special_tokens=False)
    prefill = progress_bar("prefill", len(prompt_ids), "tok", progress_enabled(args.progress))
    try:
        for delta in llm.stream({"prompt_token_ids": prompt_ids}, params,
                                on_prefill_progress=lambda d, t: _advance(prefill, d)):
            if not prefill.disable:  # the first token: the prefill is done
                _advance(prefill, len(prompt_ids))
                prefill.close()
            print(delta.text, end="", flush=True)
            if delta.finished and delta.output is not None:
                m = delta.output.metrics
                itl = m.inter_token_latencies
                n = len(delta.output.outputs[0].token_ids)
                print(file=sys.stdout)
                print(f"[{n} tokens, finish: {delta.finish_reason}, time to first token "
                      f"{m.time_to_first_token:.2f} s, "
                      f"{(1000 * sum(itl) / len(itl)) if itl else 0:.1f} ms/token after]", file=sys.stderr)
    finally:
        prefill.close()
    return 0


def _sampling_defaults(args: argparse.Namespace) -> dict:
    return {"max_tokens": args.max_tokens, "temperature": args.temperature, "top_p": args.top_p,
            "top_k": args.top_k, "seed": args.seed, "stop": tuple(args.stop),
            "ignore_eos": args.ignore_eos, "repetition_penalty": args.repetition_penalty,
            "presence_penalty": args.presence_penalty, "frequency_penalty": args.frequency_penalty,
            "min_p": args.min_p}


def cmd_batch(args: argparse.Namespace) -> int:
    from longctx.entrypoints.batch import run_batch, summary_line

    job = BatchJob(args.input, args.output, BatchConfig(**config_kwargs(args, (BatchConfig,))),
                   config_kwargs(args), _sampling_defaults(args))
    start = time.perf_counter()
    if args.ray is not None:
        if int(os.environ.get("WORLD_SIZE", 1)) > 1:
            raise ConfigError("--ray runs the job on Ray actors: start it once, not under torchrun")
        from longctx.entrypoints.ray_batch import run_ray_batch

        run_ray_batch(job, args.ray, args.ray_actors)
    elif args.ray_actors:
        raise ConfigError("--ray-actors needs --ray")
    else:
        run_batch(job)
    if os.environ.get("RANK", "0") == "0":  # under torchrun, rank 0 holds the merged output
        print(summary_line(args.output, time.perf_counter() - start), file=sys.stderr)
    return 0


def _task_llm(args: argparse.Namespace):
    from longctx.entrypoints.api import LLM

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    return LLM(**config_kwargs(args))


def _task_params(args: argparse.Namespace) -> SamplingParams:
    from longctx.entrypoints.tasks import TASK_FREQUENCY_PENALTY

    defaults = {k: v for k, v in _sampling_defaults(args).items() if v is not None}
    defaults.setdefault("frequency_penalty", TASK_FREQUENCY_PENALTY)
    return SamplingParams(**defaults)


class _StageBars:
    """A task's progress (``on_progress(stage, done, total)``): a tqdm bar per stage on stderr.
    A stage is finished when it reaches its total, when the next stage starts, or at
    ``close(finished=True)``; finished bars keep their line."""

    def __init__(self, enabled: bool) -> None:
        self.enabled = enabled
        self.bar = self.stage = None

    def __call__(self, stage: str, done: int, total: int) -> None:
        if self.bar is not None and self.stage != stage:
            self.close(finished=True)
        if self.bar is None:
            self.bar = progress_bar(stage, total, "tok" if stage == "prefill" else "call", self.enabled)
            self.stage = stage
        _advance(self.bar, done)
        if done >= total:
            self.close()

    def close(self, finished: bool = False) -> None:
        if self.bar is not None:
            if finished:
                _advance(self.bar, self.bar.total)
            self.bar.close()
            self.bar = None


def cmd_summarize(args: argparse.Namespace) -> int:
    from longctx.entrypoints import tasks

    text = tasks.read_document(args.document)
    llm = _task_llm(args)
    progress = _StageBars(progress_enabled(args.progress))
    try:
        result = tasks.summarize(llm, text, instructions=args.instructions,
                                 max_tokens=args.max_tokens or tasks.SUMMARY_TOKENS,
                                 sampling_params=_task_params(args), on_progress=progress)
        progress.close(finished=True)
    finally:
        progress.close()
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=1, ensure_ascii=False))
        return 0
    print(result.text)
    how = (f"{result.num_pieces} pieces, {result.num_levels} levels" if result.map_reduce
           else "one pass")
    print(f"[{result.document_tokens} document tokens, {how}, {result.completion_tokens} tokens "
          f"generated in {result.elapsed_s:.1f} s]", file=sys.stderr)
    return 0


def cmd_ask(args: argparse.Namespace) -> int:
    from longctx.entrypoints import tasks

    text = tasks.read_document(args.document)
    llm = _task_llm(args)
    result = tasks.ask(llm, text, args.questions, max_tokens=args.max_tokens or tasks.ANSWER_TOKENS,
                       sampling_params=_task_params(args))
    if args.json:
        print(json.dumps(dataclasses.asdict(result), indent=1, ensure_ascii=False))
        return 0
    for answer in result.answers:
        print(f"Q: {answer.question}\nA: {answer.text}\n")
    how = "BM25 excerpts (the document is longer than the window)" if result.retrieval else (
        f"{result.shared_prefix_tokens} shared prefix tokens")
    print(f"[{result.document_tokens} document tokens, {how}, {result.elapsed_s:.1f} s]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model not in (args.model_tag, ModelLoadConfig.model):
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    server_config = ServerConfig(**config_kwargs(args, (ServerConfig,)))
    from longctx.entrypoints.server.launch import run_server

    return run_server(server_config, config_kwargs(args))


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve, "batch": cmd_batch,
            "summarize": cmd_summarize, "ask": cmd_ask}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ValueError, FileNotFoundError, BatchError) as err:
        print(f"longctx: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlongctx: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
