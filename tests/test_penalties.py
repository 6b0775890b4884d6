"""Penalties and min-p: ``apply_penalties`` / ``warp`` against hand-computed values and HF's
logits processor; the per-row statistics (``penalty_rows``, ``PenaltyState``, draft paths);
and on the tiny model through ``LLM``: greedy output with penalties equal to HF's
``generate(repetition_penalty=...)`` and to a hand-rolled reference, the same with lookahead on
and off (a draft row's penalties count the draft tokens on its path), with a test that fails
when they do not. The real model against HF is in test_real_model.py."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.lookahead.tree import DraftTree
from longctx.sampling import (PenaltyRows, PenaltyState, Sampler, SamplingRows, SeqSampling,
                              apply_penalties, filtered_probs, penalty_rows, sample, sampling_rows,
                              warp)
from tiny_models import make_engine_checkpoint

# ---------------------------------------------------------------------------- apply_penalties


def rows_of(prompt_ids: list[list[int]], output_ids: list[list[int]], vocab: int) -> PenaltyRows:
    return penalty_rows(prompt_ids, output_ids, vocab, "cpu")


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, 0.0]])
    rows = rows_of([[0, 1]], [[4]], 5)  # seen: 0, 1 (prompt) and 4 (output)
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], rows)
    assert out.tolist() == [[1.0, -2.0, 0.5, 3.0, 0.0]]
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=0.5)], rows)  # < 1 encourages
    assert out.tolist() == [[4.0, -0.5, 0.5, 3.0, 0.0]]


def test_repetition_penalty_counts_a_token_once():
    logits = torch.tensor([[2.0, 2.0]])
    rows = rows_of([[0, 0, 0]], [[0, 0]], 2)
    out = apply_penalties(logits, [SamplingParams(repetition_penalty=2.0)], rows)
    assert out.tolist() == [[1.0, 2.0]]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = torch.tensor([[1.0, 1.0, 1.0, 1.0]])
    rows = rows_of([[3, 3, 3]], [[1, 2, 2, 2]], 4)  # token 3 only in the prompt
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    out = apply_penalties(logits, [params], rows)
    # token 1: 1 - 0.25 * 1 - 0.5; token 2: 1 - 0.25 * 3 - 0.5; tokens 0 and 3 untouched
    assert out.tolist() == [[1.0, 0.25, -0.25, 1.0]]
    negative = SamplingParams(presence_penalty=-1.0, frequency_penalty=-0.5)  # encourage
    assert apply_penalties(logits, [negative], rows).tolist() == [[1.0, 2.5, 3.5, 1.0]]


def test_repetition_then_presence_and_frequency():
    logits = torch.tensor([[4.0, -2.0, 1.0]])
    rows = rows_of([[1]], [[0, 0]], 3)
    params = SamplingParams(repetition_penalty=2.0, presence_penalty=1.0, frequency_penalty=0.5)
    # token 0: 4 / 2 - 0.5 * 2 - 1 = 0; token 1 (prompt): -2 * 2 = -4; token 2 untouched
    assert apply_penalties(logits, [params], rows).tolist() == [[0.0, -4.0, 1.0]]


def test_each_row_gets_its_own_penalties():
    logits = torch.tensor([[2.0, 2.0, 2.0]] * 4)
    rows = rows_of([[0]] * 4, [[1]] * 4, 3)
    params = [SamplingParams(), SamplingParams(repetition_penalty=2.0),
              SamplingParams(presence_penalty=1.5), SamplingParams(frequency_penalty=-1.0)]
    assert apply_penalties(logits, params, rows).tolist() == [
        [2.0, 2.0, 2.0], [1.0, 1.0, 2.0], [2.0, 0.5, 2.0], [2.0, 3.0, 2.0]]


@pytest.mark.parametrize("penalty", [0.7, 1.3, 2.0])
def test_repetition_penalty_equals_hfs_logits_processor(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    gen = torch.Generator().manual_seed(0)
    logits = torch.randn(3, 50, generator=gen) * 3
    ids = [torch.randint(0, 50, (n,), generator=gen).tolist() for n in (1, 7, 30)]
    ours = apply_penalties(logits, [SamplingParams(repetition_penalty=penalty)] * 3,
                           rows_of(ids, [[], [], []], 50))
    processor = RepetitionPenaltyLogitsProcessor(penalty)
    for r, row_ids in enumerate(ids):
        theirs = processor(torch.tensor([row_ids]), logits[r:r + 1].clone())
        torch.testing.assert_close(ours[r], theirs[0], rtol=0, atol=0)


# ---------------------------------------------------------------------------- warp and min-p


def test_min_p_keeps_tokens_at_least_min_p_times_the_top_probability():
    probs = [0.5, 0.25, 0.15, 0.1]
    logits = torch.tensor(probs).log()
    # min_p=0.3: floor 0.15, so 0.1 goes; the rest renormalised over 0.9
    assert warp(logits[None], [SamplingParams(min_p=0.3)])[0].tolist() == pytest.approx(
        [0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0], abs=1e-6)
    # min_p=1: only the most likely token
    assert warp(logits[None], [SamplingParams(min_p=1.0)])[0].tolist() == [1.0, 0.0, 0.0, 0.0]
    # min_p=0: off
    assert warp(logits[None], [SamplingParams(min_p=0.0)])[0].tolist() == pytest.approx(probs, abs=1e-6)


def test_min_p_applies_after_temperature():
    # T=0.5 squares the probabilities: 0.25, 0.0625, 0.0225, 0.01 (/0.345); min_p=0.2 then
    # floors at 0.05 of the 0.25: only 0.0225 and 0.01 go. At T=1 min_p=0.2 (floor 0.1) keeps 3.
    logits = torch.tensor([0.5, 0.25, 0.15, 0.1]).log()
    out = warp(logits[None], [SamplingParams(temperature=0.5, min_p=0.2)])[0]
    assert out.tolist() == pytest.approx([0.25 / 0.3125, 0.0625 / 0.3125, 0.0, 0.0], abs=1e-6)
    out = warp(logits[None], [SamplingParams(min_p=0.2)])[0]
    assert out.tolist() == pytest.approx([0.5 / 0.9, 0.25 / 0.9, 0.15 / 0.9, 0.0], abs=1e-6)


def test_min_p_and_top_k_together():
    logits = torch.tensor([0.4, 0.3, 0.2, 0.1]).log()
    out = warp(logits[None], [SamplingParams(top_k=3, min_p=0.6)])[0]
    # top_k=3 -> 0.4, 0.3, 0.2 (/0.9); min_p=0.6 floors at 0.6 * 0.4/0.9: 0.2/0.9 goes
    assert out.tolist() == pytest.approx([4 / 7, 3 / 7, 0.0, 0.0], abs=1e-6)


def test_a_batch_of_rows_warps_each_with_its_own_parameters():
    gen = torch.Generator().manual_seed(1)
    logits = torch.randn(6, 30, generator=gen) * 2
    params = [SamplingParams(), SamplingParams(temperature=0.5, top_k=5),
              SamplingParams(top_p=0.6), SamplingParams(min_p=0.2, temperature=1.5),
              SamplingParams(top_k=10, top_p=0.9, min_p=0.05), SamplingParams(temperature=0.0)]
    batched = warp(logits, params)
    for r, p in enumerate(params[:-1]):
        torch.testing.assert_close(batched[r], filtered_probs(logits[r], p), rtol=0, atol=1e-6)
    assert float(batched[-1].sum()) == pytest.approx(1.0)  # a greedy row: temperature 1


def test_greedy_with_a_penalty_takes_the_argmax_of_the_penalised_logits():
    logits = torch.tensor([[3.0, 2.0, 1.0], [3.0, 2.0, 1.0]])
    params = [SamplingParams(temperature=0.0, repetition_penalty=2.0), SamplingParams(temperature=0.0)]
    rows = SamplingRows.of(params, [0, 0], rows_of([[0], [0]], [[], []], 3))
    assert Sampler().sample(logits, rows).tokens.tolist() == [1, 0]


def test_sampled_rows_follow_the_penalised_distribution():
    # Logits all 1; the penalty takes token 0 to 1 - 2 = -1: p(0) = e^-1 / (e^-1 + 3 e)
    params = SamplingParams(seed=3, frequency_penalty=1.0)
    n = 6000
    rows = SamplingRows.of([params] * n, list(range(n)), rows_of([[]] * n, [[0, 0]] * n, 4))
    tokens = Sampler().sample(torch.ones(n, 4), rows).tokens
    p0 = math.exp(-1) / (math.exp(-1) + 3 * math.e)
    count = int((tokens == 0).sum())
    assert abs(count - n * p0) < 4 * math.sqrt(n * p0 * (1 - p0)), count
    # the same rows without the penalty: token 0 as likely as the others
    plain = sample(torch.ones(n, 4), [dataclasses.replace(params, frequency_penalty=0.0)] * n)
    assert abs(plain.count(0) - n / 4) < 4 * math.sqrt(n * 0.25 * 0.75)


# ---------------------------------------------------------------------------- per-row statistics


def test_penalty_rows_counts_output_and_marks_prompt_and_output_seen():
    rows = rows_of([[1, 1, 2], []], [[3, 3, 1], [0]], 5)
    assert rows.counts.tolist() == [[0, 1, 0, 2, 0], [1, 0, 0, 0, 0]]
    assert rows.seen.tolist() == [[False, True, True, True, False], [True, False, False, False, False]]


def seq(request_id: str, prompt, output, draft_ids=(), draft_parents=(), **kwargs) -> SeqSampling:
    params = SamplingParams(repetition_penalty=1.5, **kwargs)
    return SeqSampling(request_id, params, len(output), tuple(draft_ids), tuple(draft_parents),
                       list(prompt), list(output))


def test_draft_rows_count_the_draft_tokens_on_their_path():
    #   root ── 4 ── 5          rows: root, node 0 (4), node 1 (5), node 2 (6)
    #        └─ 6
    s = seq("a", [1], [2, 2], draft_ids=(4, 5, 6), draft_parents=(-1, 0, -1))
    assert s.row_paths() == [[], [4], [4, 5], [6]]
    assert s.depths() == [0, 1, 2, 1]
    rows = PenaltyState(8, "cpu").rows([s])
    expected = rows_of([[1]] * 4, [[2, 2], [2, 2, 4], [2, 2, 4, 5], [2, 2, 6]], 8)
    assert torch.equal(rows.counts, expected.counts) and torch.equal(rows.seen, expected.seen)


def test_penalty_state_keeps_statistics_between_steps():
    state = PenaltyState(10, "cpu")
    prompt, output = [1, 2, 3], []
    for step, token in enumerate([4, 4, 9, 1, 4]):
        other = seq("b", [7], [8] * step)  # a second request beside it
        rows = state.rows([seq("a", prompt, output), other])
        expected = rows_of([prompt, [7]], [output, [8] * step], 10)
        assert torch.equal(rows.counts, expected.counts) and torch.equal(rows.seen, expected.seen)
        output = output + [token]
    state.forget("a")
    rows = state.rows([seq("a", [5], [])])  # a new request with the same id starts afresh
    assert rows.seen[0].nonzero().flatten().tolist() == [5] and int(rows.counts.sum()) == 0
    restarted = state.rows([seq("b", [7], [3])])  # fewer outputs than last time: rebuilt
    assert torch.equal(restarted.counts, rows_of([[7]], [[3]], 10).counts)


def test_sampling_rows_give_positions_per_depth_and_penalties_only_when_asked():
    s = seq("a", [1], [2, 2, 2], draft_ids=(4, 5, 6), draft_parents=(-1, 0, -1))
    plain = SeqSampling("b", SamplingParams(), 7)
    rows = sampling_rows([s, plain], PenaltyState(8, "cpu"))
    assert rows.positions == [3, 4, 5, 4, 7]
    assert rows.params == [s.params] * 4 + [plain.params]
    assert rows.penalties is not None and rows.penalties.counts.shape == (5, 8)
    assert sampling_rows([plain], PenaltyState(8, "cpu")).penalties is None


# ---------------------------------------------------------------------------- the tiny model


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny-penalties")
    hf = make_engine_checkpoint(path)
    return str(path), hf


@pytest.fixture(scope="module")
def plain_llm(tiny):
    return LLM(tiny[0], block_size=16, lookahead=False)


def _prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    base = torch.randint(3, 160, (30,), generator=gen).tolist()
    return [base * 3, torch.randint(3, 160, (40,), generator=gen).tolist()]


def _tokens(llm: LLM, prompts, params) -> list[list[int]]:
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs]


def reference(hf, prompt: list[int], params: SamplingParams, num_tokens: int) -> list[int]:
    """Greedy by hand: a full forward per token, HF's repetition penalty over prompt and
    output, OpenAI's presence and frequency penalties over the output."""
    ids = list(prompt)
    with torch.no_grad():
        for _ in range(num_tokens):
            logits = hf(torch.tensor([ids])).logits[0, -1].clone()
            seen = torch.tensor(sorted(set(ids)))
            picked = logits[seen]
            logits[seen] = torch.where(picked > 0, picked / params.repetition_penalty,
                                       picked * params.repetition_penalty)
            counts = torch.bincount(torch.tensor(ids[len(prompt):], dtype=torch.long),
                                    minlength=logits.shape[0]).float()
            logits -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).float()
            ids.append(int(logits.argmax()))
    return ids[len(prompt):]


PENALISED = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=0.8,
                   frequency_penalty=0.6),
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.2,
                   frequency_penalty=-0.4),
]


def test_greedy_repetition_penalty_equals_hf_generate(tiny, plain_llm):
    _, hf = tiny
    for penalty in (1.3, 1.1, 0.9):
        params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True,
                                repetition_penalty=penalty)
        for prompt in _prompts():
            with torch.no_grad():
                out = hf.generate(torch.tensor([prompt]), max_new_tokens=40, min_new_tokens=40,
                                  do_sample=False, repetition_penalty=penalty,
                                  attention_mask=torch.ones(1, len(prompt), dtype=torch.long))
            expected = out[0, len(prompt):].tolist()
            assert _tokens(plain_llm, [prompt], params)[0] == expected


@pytest.mark.parametrize("params", PENALISED, ids=["rep1.3", "pres+freq", "rep+negfreq"])
def test_greedy_with_penalties_equals_the_reference(tiny, plain_llm, params):
    _, hf = tiny
    unpenalised = dataclasses.replace(params, repetition_penalty=1.0, presence_penalty=0.0,
                                      frequency_penalty=0.0)
    prompts = _prompts()
    got = _tokens(plain_llm, prompts, params)  # both prompts in one batch
    assert got == [reference(hf, p, params, 40) for p in prompts]
    assert got != _tokens(plain_llm, prompts, unpenalised)  # the penalties did something


def _forced_drafts(llm: LLM, references: dict[tuple, list[int]]):
    """A propose() that drafts, every step, a decoy branch and then the true next 3 tokens
    (from ``references``, keyed by prompt), so verify rows hold penalised draft paths."""
    engine = llm.engine

    def propose(request_id, max_tokens):
        out = engine.output(request_id)
        truth = references[tuple(out.prompt_token_ids)][len(out.outputs[0].token_ids):][:3]
        if max_tokens < 5 or len(truth) < 3:
            return DraftTree.empty()
        decoy = (truth[0] + 1) % 160
        return DraftTree([decoy, truth[1], truth[0], truth[1], truth[2]], [-1, 0, -1, 2, 3])
    return propose


def _with_forced_drafts(folder: str, prompts, params, references) -> tuple[list[list[int]], int]:
    llm = LLM(folder, block_size=16)
    llm.engine.lookahead.propose = _forced_drafts(llm, references)
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params)
    return [o.outputs[0].token_ids for o in outs], sum(o.metrics.num_accepted_tokens for o in outs)


SEEDED = [
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, repetition_penalty=1.3),
    SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, presence_penalty=1.5,
                   frequency_penalty=1.0),
    SamplingParams(temperature=0.9, max_tokens=40, ignore_eos=True, seed=11, presence_penalty=1.0,
                   frequency_penalty=0.5, repetition_penalty=1.2, top_k=20),
]


@pytest.mark.parametrize("params", SEEDED, ids=["greedy-rep", "greedy-pres+freq", "seeded-all"])
def test_lookahead_with_penalties_equals_plain_decoding(tiny, plain_llm, params):
    prompts = _prompts()
    expected = _tokens(plain_llm, prompts, params)
    references = {tuple(p): e for p, e in zip(prompts, expected)}
    got, accepted = _with_forced_drafts(tiny[0], prompts, params, references)
    assert got == expected
    assert accepted >= 2 * 3 * 8  # most verify steps accepted their 3 true tokens
    # also with the engine's own drafter
    assert _tokens(LLM(tiny[0], block_size=16), prompts, params) == expected


def test_the_lookahead_check_fails_if_draft_rows_ignore_their_paths(tiny, plain_llm, monkeypatch):
    # Penalising draft rows by the committed output only (not the draft tokens before them)
    # changes the tokens of the verify steps: the equality above would catch it.
    params = SEEDED[1]
    prompts = _prompts()
    expected = _tokens(plain_llm, prompts, params)
    references = {tuple(p): e for p, e in zip(prompts, expected)}
    monkeypatch.setattr(SeqSampling, "row_paths", lambda self: [[] for _ in range(self.num_rows)])
    got, _ = _with_forced_drafts(tiny[0], prompts, params, references)
    assert got != expected


# ---------------------------------------------------------------------------- the command line


@pytest.mark.parametrize("command", [["generate", "hi"], ["batch", "in.jsonl", "-o", "out.jsonl"],
                                     ["summarize", "doc.txt"], ["ask", "doc.txt", "Who?"]])
def test_cli_sampling_flags_reach_sampling_params(command):
    from longctx.entrypoints import cli

    args = cli.build_parser().parse_args(command + [
        "--repetition-penalty", "1.3", "--presence-penalty", "0.5", "--frequency-penalty", "-0.25",
        "--min-p", "0.1"])
    params = SamplingParams(**{k: v for k, v in cli._sampling_defaults(args).items() if v is not None})
    assert (params.repetition_penalty, params.presence_penalty, params.frequency_penalty,
            params.min_p) == (1.3, 0.5, -0.25, 0.1)
    defaults = cli.build_parser().parse_args(command)
    assert SamplingParams(**{k: v for k, v in cli._sampling_defaults(defaults).items()
                             if v is not None}).has_penalties is False


def test_cli_bad_penalty_is_one_line_exit_2(capsys):
    from longctx.entrypoints import cli

    assert cli.main(["generate", "hi", "--presence-penalty", "3"]) == 2
    assert capsys.readouterr().err.strip() == "longctx: error: presence_penalty must be in [-2, 2], got 3.0"


def test_summarize_and_ask_default_to_a_mild_frequency_penalty(tmp_path):
    from longctx.entrypoints import cli, tasks
    from longctx.entrypoints.batch import parse_record

    assert tasks.task_params(None, 50).frequency_penalty == tasks.TASK_FREQUENCY_PENALTY == 0.3
    given = SamplingParams(temperature=0.0, frequency_penalty=0.0)
    assert tasks.task_params(given, 50).frequency_penalty == 0.0  # explicit params win
    parser = cli.build_parser()
    assert cli._task_params(parser.parse_args(["summarize", "doc.txt"])).frequency_penalty == 0.3
    assert cli._task_params(parser.parse_args(["summarize", "doc.txt", "--frequency-penalty", "0"])).frequency_penalty == 0.0
    doc = tmp_path / "doc.txt"
    doc.write_text("text")
    summary = parse_record({"id": "a", "task": "summarize", "document_path": str(doc)}, 1, tmp_path, {})
    generate = parse_record({"id": "b", "task": "generate", "prompt": "hi"}, 2, tmp_path, {})
    assert summary.params.frequency_penalty == 0.3 and generate.params.frequency_penalty == 0.0
