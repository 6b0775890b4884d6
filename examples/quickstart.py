"""The basic Python API: generate, chat and stream.

    python examples/quickstart.py
"""

import os

from longctx import LLM, SamplingParams

MODEL = os.environ.get("LONGCTX_MODEL", "smollm2-135m")  # the tests point this at a tiny model


def main() -> None:
    llm = LLM(MODEL)
    greedy = SamplingParams(temperature=0.0, max_tokens=32)

    # plain completion, several prompts batched together
    for out in llm.generate(["The capital of France is", "A haiku about the sea:"], greedy):
        print(repr(out.outputs[0].text), out.outputs[0].finish_reason)

    # one conversation through the model's chat template
    reply = llm.chat([{"role": "user", "content": "Name three primary colors."}], greedy)[0]
    print(reply.outputs[0].text)
    print(f"time to first token: {reply.metrics.time_to_first_token:.2f} s")

    # text as it is generated
    for delta in llm.stream("Once upon a time", SamplingParams(temperature=0.8, seed=1, max_tokens=32)):
        print(delta.text, end="", flush=True)
    print()


if __name__ == "__main__":
    main()
