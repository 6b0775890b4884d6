"""The runner's step contract, ``run(batch, seqs) -> tokens``, on a tiny random Llama: a step's
integer inputs go to the device in one upload and its sampled tokens come back in one
download; nothing else in the step reads a tensor back to the host, apart from the CPU-only
attention and matmul kernels (which never run on a GPU). A ``TorchFunctionMode`` sees every
torch call the step makes from Python, so a stray ``.tolist()``, ``.item()``, ``int(t)`` or
``if t:`` in the model, the sampler or the runner fails these tests."""

from __future__ import annotations

import collections
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from longctx import LLM, SamplingParams
from tiny_models import random_tokens

READS_BACK = {"tolist", "item", "__int__", "__float__", "__bool__", "__index__", "cpu", "numpy"}
CPU_ONLY = {"torch_paged.py", "cpu_decode.py", "cpu_flash.py", "cpu_linear.py", "cpu_build.py"}


class StepProbe(TorchFunctionMode):
    """Records where tensors are read back to the host, outside the CPU-only kernels."""

    def __init__(self) -> None:
        super().__init__()
        self.reads: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in READS_BACK:
            frames = traceback.extract_stack()[:-1]
            files = {Path(f.filename).name for f in frames[-4:]}
            if not files & CPU_ONLY:
                caller = frames[-1]
                self.reads[f"{name} at {Path(caller.filename).name}:{caller.name}"] += 1
        return func(*args, **(kwargs or {}))


@pytest.fixture(scope="module")
def folder(tiny_engine_folder):
    return tiny_engine_folder


def probe_step(engine):
    packer = engine.runner.packer
    up, down = packer.uploads, packer.downloads
    with StepProbe() as probe:
        updates = engine.step()
    return updates, packer.uploads - up, packer.downloads - down, probe.reads


tokens = random_tokens


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def test_a_decode_step_is_one_upload_and_one_download(folder):
    engine = LLM(folder, block_size=16, lookahead=False).engine
    for seed in range(3):
        engine.add_request(tokens(30 + seed, seed), GREEDY)
    engine.step()  # the prefills
    updates, uploads, downloads, reads = probe_step(engine)
    assert [len(u.new_token_ids) for u in updates] == [1, 1, 1]
    assert (uploads, downloads) == (1, 1)
    assert dict(reads) == {"tolist at step_inputs.py:download": 1}


def test_a_mixed_prefill_and_decode_step_too(folder):
    engine = LLM(folder, block_size=16, lookahead=False, max_num_batched_tokens=64).engine
    engine.add_request(tokens(20, 1), GREEDY)
    engine.step()
    engine.add_request(tokens(150, 2), GREEDY)  # a prefill chunk beside the decode
    _, uploads, downloads, reads = probe_step(engine)
    assert (uploads, downloads) == (1, 1)
    assert dict(reads) == {"tolist at step_inputs.py:download": 1}


def test_a_lookahead_verify_step_too(folder):
    engine = LLM(folder, block_size=16).engine  # lookahead on
    prompt = tokens(12, 3) * 4  # repeats: the drafter finds n-grams to propose
    engine.add_request(prompt, SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True))
    seen_verify = False
    for _ in range(10):
        updates, uploads, downloads, reads = probe_step(engine)
        assert (uploads, downloads) == (1, 1)
        assert dict(reads) == {"tolist at step_inputs.py:download": 1}
        if any(len(u.new_token_ids) > 1 for u in updates):
            seen_verify = True
        if not engine.has_unfinished():
            break
    assert seen_verify, "no step verified a draft: the test did not test a verify step"


def test_a_sampled_step_adds_one_upload_of_the_sampling_parameters(folder):
    engine = LLM(folder, block_size=16, lookahead=False).engine
    engine.add_request(tokens(25, 4), SamplingParams(temperature=0.8, top_p=0.9, seed=1, max_tokens=8))
    engine.add_request(tokens(25, 5), GREEDY)
    engine.step()
    _, uploads, downloads, reads = probe_step(engine)
    assert (uploads, downloads) == (2, 1)
    assert dict(reads) == {"tolist at step_inputs.py:download": 1}


def test_the_probe_sees_a_read_back():
    # the check has teeth: a model-side .item() would show up
    with StepProbe() as probe:
        torch.ones(3).sum().item()
    assert sum(probe.reads.values()) == 1
