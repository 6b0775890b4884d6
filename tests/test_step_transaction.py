"""One step, one transaction: ``schedule() -> runner.execute(output) -> update(output, result)``.

Checked on a tiny random Llama: the engine calls nothing of the runner but ``execute``, once a
step, with every feature of a step on (lookahead drafts, prefix hits, logprobs, prompt
logprobs, stop strings, aborts); the ``SchedulerOutput`` is plain data (it pickles, and holds
no tensor); a request ended by a stop string right after an accepted, compacted draft leaves
its cached pages right for the next request; new requests reach the runner once and finished
ones are forgotten.
"""

from __future__ import annotations

import pickle

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.lookahead.tree import DraftTree
from longctx.engine.outputs import SchedulerOutput
from tiny_models import make_engine_checkpoint

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-step")
    make_engine_checkpoint(path)
    return str(path)


def _prompt(n: int, seed: int = 0) -> list[int]:
    return torch.randint(3, 150, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class _Recorder:
    """Stands in for the runner: every attribute the engine reads is recorded, then served by
    the real runner; ``execute`` also keeps the outputs it was given."""

    def __init__(self, runner) -> None:
        object.__setattr__(self, "inner", runner)
        object.__setattr__(self, "names", [])
        object.__setattr__(self, "outputs", [])

    def __getattr__(self, name):
        self.names.append(name)
        found = getattr(self.inner, name)
        if name != "execute":
            return found

        def execute(output):
            self.outputs.append(output)
            return found(output)
        return execute


def _decoy_tree(engine, reference: dict[str, list[int]]):
    """A propose() whose first branch is wrong and whose second holds the next 3 true tokens,
    so accepted nodes (2, 3, 4) are not first in memory and their KV must be compacted."""
    def propose(request_id, max_tokens):
        done = len(engine.output(request_id).outputs[0].token_ids)
        truth = reference.get(request_id, [])[done:done + 3]
        if max_tokens < 5 or len(truth) < 3:
            return DraftTree.empty()
        return DraftTree([(truth[0] + 1) % 150, truth[1], *truth], [-1, 0, -1, 2, 3])
    return propose


def test_a_step_calls_only_execute_once(folder):
    llm = LLM(folder, block_size=4, max_num_batched_tokens=32)
    engine = llm.engine
    prompt = _prompt(40)
    reference = llm.generate({"prompt_token_ids": prompt}, GREEDY)[0].outputs[0].token_ids
    engine.lookahead.propose = _decoy_tree(engine, {"a": reference, "b": reference, "c": reference})
    recorder = _Recorder(engine.runner)
    engine.runner = recorder
    engine.add_request(prompt, GREEDY, request_id="a")  # a prefix hit, drafts accepted
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=24, logprobs=2, prompt_logprobs=1,
                                              stop=["\n\n\n\n"]), request_id="b")
    engine.add_request(_prompt(9, seed=1), GREEDY, request_id="c")
    steps = 0
    while engine.has_unfinished():
        engine.step()
        steps += 1
        if steps == 3:
            engine.abort("c")
    assert recorder.names == ["execute"] * steps
    assert len(recorder.outputs) == steps
    assert engine.output("a").outputs[0].token_ids == reference
    assert engine.output("b").outputs[0].token_ids == reference
    assert sum(len(o.draft_moves) for o in recorder.outputs) > 0  # compactions rode in outputs
    news = [n.request_id for o in recorder.outputs for n in o.new_requests]
    assert sorted(news) == ["a", "b", "c"]  # each sent once
    finished = [r for o in recorder.outputs for r in o.finished_ids]
    assert "c" in finished
    assert "c" not in engine.runner.inner.requests  # the runner forgot the aborted one


def test_scheduler_output_is_plain_data(folder, tmp_path):
    llm = LLM(folder, block_size=4, max_num_batched_tokens=32, disk_cache_dir=str(tmp_path))
    engine = llm.engine
    prompt = _prompt(40)
    llm.generate({"prompt_token_ids": prompt}, GREEDY)
    recorder = _Recorder(engine.runner)
    engine.runner = recorder
    llm.generate([{"prompt_token_ids": prompt}, {"prompt_token_ids": _prompt(30, seed=2)}], GREEDY)

    def tensors(value) -> int:
        if isinstance(value, torch.Tensor):
            return 1
        if isinstance(value, (list, tuple)):
            return sum(tensors(v) for v in value)
        if isinstance(value, dict):
            return sum(tensors(v) for v in value.values())
        if hasattr(value, "__dataclass_fields__"):
            return sum(tensors(getattr(value, f)) for f in value.__dataclass_fields__)
        return 0

    assert recorder.outputs and all(isinstance(o, SchedulerOutput) for o in recorder.outputs)
    for output in recorder.outputs:
        assert tensors(output) == 0
        again = pickle.loads(pickle.dumps(output))
        assert again.seqs == output.seqs and again.new_requests == output.new_requests


def _run(engine, prompt, params, request_id):
    """Step ``engine`` until ``request_id`` ends: its output and its steps' new tokens."""
    engine.add_request(prompt, params, request_id=request_id)
    groups = []
    while engine.has_unfinished():
        groups += [u.new_token_ids for u in engine.step() if u.request_id == request_id and u.new_token_ids]
    return engine.release(request_id), groups


def test_stop_string_after_an_accepted_draft_leaves_cached_pages_right(folder):
    """A request ends on a stop string inside a step that accepted draft tokens past it: the
    scheduler had already counted the draft and ordered it compacted (the output processor,
    which finds stop strings, runs after ``update``), so its pages enter the prefix store with
    that compaction still to run in the next step. A second request hitting those pages must
    see the KV of a cold run: its log-probabilities are compared with an engine without a
    prefix store."""
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    prompt = _prompt(41, seed=3)
    first = LLM(folder, block_size=4, max_num_batched_tokens=64).engine
    reference = LLM(folder, block_size=4, lookahead=False).generate(
        {"prompt_token_ids": prompt}, params)[0].outputs[0].token_ids
    first.lookahead.propose = _decoy_tree(first, {"probe": reference})
    _, groups = _run(first, prompt, params, "probe")
    k = next(sum(map(len, groups[:i])) for i, g in enumerate(groups) if len(g) >= 2)
    stop = first.tokenizer.decode(reference[:k + 1], skip_special_tokens=True)  # ends at token k

    engine = LLM(folder, block_size=4, max_num_batched_tokens=64).engine  # nothing cached yet
    engine.lookahead.propose = _decoy_tree(engine, {"a": reference})
    recorder = _Recorder(engine.runner)
    engine.runner = recorder
    a, _ = _run(engine, prompt, SamplingParams(temperature=0.0, max_tokens=24, stop=[stop], ignore_eos=True), "a")
    assert a.outputs[0].finish_reason == "stop" and a.outputs[0].token_ids == reference[:k + 1]
    num_before = len(recorder.outputs)
    follow = prompt + reference[:16]
    probe = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=3)
    b, _ = _run(engine, follow, probe, "b")
    assert recorder.outputs[num_before].draft_moves  # the compaction ran in b's first step
    assert sum(engine.cache_stats().hit_tokens.values()) > len(prompt)  # b hit a's output pages
    cold = LLM(folder, block_size=4, enable_prefix_caching=False, lookahead=False)
    c = cold.generate({"prompt_token_ids": follow}, probe)[0].outputs[0]
    assert b.outputs[0].token_ids == c.token_ids
    for got, want in zip(b.outputs[0].logprobs, c.logprobs, strict=True):
        assert set(got) == set(want)
        assert max(abs(got[t] - want[t]) for t in want) < 1e-4


def test_no_function_of_the_engine_core_runs_over_60_lines():
    """The core (``longctx/engine/``: engine, scheduler, runner, output processor and their
    helpers) stays in small functions."""
    import ast
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent / "longctx" / "engine"
    names = sorted(p.name for p in root.glob("*.py"))
    assert {"llm_engine.py", "scheduler.py", "runner.py", "output_processor.py"} <= set(names)
    long = []
    for name in names:
        for node in ast.walk(ast.parse((root / name).read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and node.end_lineno - node.lineno >= 60:
                long.append(f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines)")
    assert long == []
