"""Ask several questions about one document with the Python API.

The questions run as one batch. Every prompt starts with the whole document, so with the
prefix cache on (the default) the document is prefilled once and its KV pages are shared by
all questions. A document longer than the window falls back to BM25: each question gets the
pieces of the document that match it best (``result.retrieval == "bm25"``).

    python examples/ask.py
"""

import os
from pathlib import Path

from longctx import LLM

MODEL = os.environ.get("LONGCTX_MODEL", "smollm2-135m")  # the tests point this at a tiny model
DOCUMENT = Path(__file__).parent / "data" / "memo.txt"
QUESTIONS = [
    "How many member-owners does the cooperative have?",
    "What was the revenue for the quarter?",
    "What went wrong in April?",
    "What did the members decide about Sundays?",
    "Who answers questions about the memo?",
]


def main() -> None:
    llm = LLM(MODEL)
    before = llm.cache_stats()
    result = llm.ask(DOCUMENT, QUESTIONS, max_tokens=48)
    after = llm.cache_stats()

    for answer in result.answers:
        print(f"Q: {answer.question}\nA: {answer.text}\n")
    print(f"document: {result.document_tokens} tokens, shared by all prompts: "
          f"{result.shared_prefix_tokens} tokens; retrieval: {result.retrieval}")
    print(f"prompt tokens: {result.prompt_tokens}, prefilled: "
          f"{after.computed_prompt_tokens - before.computed_prompt_tokens} "
          f"(the rest came from the prefix cache); {result.elapsed_s:.1f} s")


if __name__ == "__main__":
    main()
