"""The engine core: one step is ``scheduler.schedule() -> runner.execute(output) ->
scheduler.update(output, result)``, then the output processor (docs/architecture.md).

    llm_engine.py        LLMEngine: builds the parts, runs steps, the facade front-ends use
    scheduler.py         (no torch) queues, token budget, chunking, pages, preemption, prefixes
    runner.py            execute(SchedulerOutput) -> RunnerOutput: KV orders, forward, sampling
    outputs.py           (no torch) the plain data passed between them
    output_processor.py  text, stop strings, streamed deltas, logprobs, timings
    step_inputs.py, cuda_graphs.py, detokenizer.py, sp.py (sequence-parallel ranks)

Nothing here parses flags, speaks HTTP or reads files of jobs: that is ``longctx.entrypoints``.
"""

__all__ = ["LLMEngine"]


def __getattr__(name: str):
    if name == "LLMEngine":  # imported lazily: it pulls in torch
        from longctx.engine.llm_engine import LLMEngine

        return LLMEngine
    raise AttributeError(f"module 'longctx.engine' has no attribute {name!r}")
