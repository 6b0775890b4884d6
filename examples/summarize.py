"""Summarize a document with the Python API.

A document that fits the model's window is summarized in one pass. A longer one is cut at
paragraph and sentence boundaries into pieces that fit, each piece is summarized, and the
summaries are combined. Here the window is set to 4,096 tokens, so the bundled GPL (about 7,700
tokens) takes that map-reduce path.

    python examples/summarize.py                 # the bundled GPL text
    python examples/summarize.py report.txt      # any text file
"""

import os
import sys
from pathlib import Path

from longctx import LLM

MODEL = os.environ.get("LONGCTX_MODEL", "smollm2-135m")  # the tests point this at a tiny model
DOCUMENT = Path(__file__).parent / "data" / "gpl-3.txt"


def show_progress(stage: str, done: int, total: int) -> None:
    print(f"  {stage}: {done}/{total}", file=sys.stderr)


def main() -> None:
    document = Path(sys.argv[1]) if len(sys.argv) > 1 else DOCUMENT
    llm = LLM(MODEL, max_model_len=4096)
    result = llm.summarize(document, max_tokens=128, on_progress=show_progress)

    print(result.text)
    print(f"\n{result.document_tokens} document tokens; map-reduce: {result.map_reduce}; "
          f"{result.num_pieces} pieces, {result.num_levels} levels; {result.elapsed_s:.1f} s")
    for step in result.steps:
        kind = "piece" if step.level == 0 else f"combine (level {step.level})"
        print(f"  {kind} {step.index}: {step.prompt_tokens} prompt tokens -> "
              f"{step.completion_tokens} tokens")


if __name__ == "__main__":
    main()
