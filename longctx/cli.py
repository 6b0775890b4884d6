"""The ``longctx`` command line: a thin shell that parses, validates, calls the API, prints.

Owns: flags (engine flags are derived from the config dataclasses' fields), reading prompt
files, streaming text to stdout and progress to stderr, turning user errors into one-line
messages with exit code 2. ``serve`` builds its ``ServerConfig`` from flags and hands over to
``longctx.server.launch`` (imported only then: it pulls in FastAPI and uvicorn).
Never: model or engine logic.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import sys
import time
from pathlib import Path

from longctx.config import CONFIG_CLASSES, ConfigError, ModelLoadConfig
from longctx.sampling_params import SamplingParams
from longctx.server.config import ServerConfig


def _add_config_flags(parser: argparse.ArgumentParser, classes: tuple = CONFIG_CLASSES,
                      title: str = "engine") -> None:
    group = parser.add_argument_group(title)
    for cls in classes:
        for f in dataclasses.fields(cls):
            flag = "--" + f.name.replace("_", "-")
            help_text = f"{f.metadata.get('help', '')} (default: {f.default})"
            if isinstance(f.default, bool):  # --flag / --no-flag
                group.add_argument(flag, action=argparse.BooleanOptionalAction, default=f.default,
                                   dest=f.name, help=help_text)
            else:
                group.add_argument(flag, type=type(f.default), default=f.default, dest=f.name,
                                   help=help_text)


def _config_kwargs(args: argparse.Namespace, classes: tuple = CONFIG_CLASSES) -> dict:
    return {f.name: getattr(args, f.name) for cls in classes for f in dataclasses.fields(cls)}


def _add_sampling_flags(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=256, help="new tokens at most (default: 256)")
    group.add_argument("--temperature", type=float, default=0.0, help="0 is greedy (default: 0)")
    group.add_argument("--top-p", type=float, default=1.0)
    group.add_argument("--top-k", type=int, default=0)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=[], help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")


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
    return parser


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


def _progress(done: int, total: int, start: list[float]) -> None:
    elapsed = time.perf_counter() - start[0]
    rate = done / elapsed if elapsed > 0 else 0.0
    print(f"\rprefill {done}/{total} tokens ({rate:.0f} tok/s)", end="", file=sys.stderr, flush=True)


def cmd_generate(args: argparse.Namespace) -> int:
    text = _read_prompt(args)
    params = SamplingParams(temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
                            seed=args.seed, max_tokens=args.max_tokens, stop=tuple(args.stop),
                            ignore_eos=args.ignore_eos)
    from longctx.api import LLM

    print(f"loading {args.model} ...", file=sys.stderr, flush=True)
    llm = LLM(**_config_kwargs(args))
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
    start = [time.perf_counter()]
    first = True
    for delta in llm.stream({"prompt_token_ids": prompt_ids}, params,
                            on_prefill_progress=lambda d, t: _progress(d, t, start)):
        if first:
            print(f"\rprefill {len(prompt_ids)} tokens done in {time.perf_counter() - start[0]:.1f} s",
                  file=sys.stderr, flush=True)
            first = False
        print(delta.text, end="", flush=True)
        if delta.finished and delta.output is not None:
            m = delta.output.metrics
            itl = m.inter_token_latencies
            n = len(delta.output.outputs[0].token_ids)
            print(file=sys.stdout)
            print(f"[{n} tokens, finish: {delta.finish_reason}, time to first token "
                  f"{m.time_to_first_token:.2f} s, "
                  f"{(1000 * sum(itl) / len(itl)) if itl else 0:.1f} ms/token after]", file=sys.stderr)
    return 0


def cmd_serve(args: argparse.Namespace) -> int:
    if args.model_tag is not None:
        if args.model not in (args.model_tag, ModelLoadConfig.model):
            raise ConfigError(f"two models given: {args.model_tag!r} and --model {args.model!r}")
        args.model = args.model_tag
    server_config = ServerConfig(**_config_kwargs(args, (ServerConfig,)))
    from longctx.server.launch import run_server

    return run_server(server_config, _config_kwargs(args))


COMMANDS = {"generate": cmd_generate, "serve": cmd_serve}


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return COMMANDS[args.command](args)
    except (ConfigError, ValueError, FileNotFoundError) as err:
        print(f"longctx: error: {err}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\nlongctx: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
