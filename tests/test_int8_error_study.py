"""benchmarks/int8_error_study.py: its int8 rounding is the stored pages' (so the study's
"int8 per page" rows measure what the engine stores), and a bad variant is a clear error."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
import torch

from longctx.kernels import kv_quant

pytestmark = pytest.mark.model  # importing the study imports the real-model test's prompts

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "int8_error_study.py"


@pytest.fixture(scope="module")
def study():
    spec = importlib.util.spec_from_file_location("int8_error_study", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_int8_rounding_equals_a_page_written_whole(study):
    """Pages written in one call by ``kv_quant.write_int8`` and read back equal the study's
    rounding of the same rows (one scale per page and KV head), to float32 rounding of the
    scale; per-row rounding is another thing (the check fails if the variant kinds are mixed up)."""
    gen = torch.Generator().manual_seed(0)
    pages, bs, heads, d = 3, 16, 2, 8
    rows = torch.randn(pages, bs, heads, d, generator=gen) * torch.tensor([1.0, 5.0])[None, None, :, None]
    rows[1, 3, 0, 2] = 40.0  # one large value sets its page's scale
    cache = torch.zeros(pages, bs, heads, d, dtype=torch.int8)
    scale = torch.zeros(pages, heads)
    kv_quant.write_int8(cache, scale, rows.flatten(0, 1), torch.arange(pages * bs))
    stored = kv_quant.dequantize(cache, scale)
    per_page = study.Variant("x:0:0").round(rows)
    step = scale[:, None, :, None]  # a page's scale is its quantisation step
    assert torch.all((per_page - stored).abs() <= 1e-5 * step)
    assert (study.Variant("x:0:0:1").round(rows) - stored).abs().max() > 0.1 * scale.min()


@pytest.mark.parametrize("spec, says", [
    ("x:0", "expected name:W:sink"),
    ("x:a:0", "W must be a whole number"),
    ("x:0:2", "sink must be 0, 1, c or e"),
    ("x:0:0:q", "kind must be one of"),
    ("x:0:0:-:z", "seed must be a whole number"),
])
def test_a_bad_variant_says_what_is_wrong(study, spec, says):
    with pytest.raises(SystemExit, match=says):
        study.Variant(spec)


def test_fp8_kinds_round_as_e4m3(study):
    """``e`` is float8 e4m3 with scale 1 (a plain cast, vLLM's uncalibrated fp8 KV); ``f`` scales
    each page and KV head so its largest value lands on 448, e4m3's largest. Both keep 3 mantissa
    bits: a normal value moves by at most 1/16 of itself. Scaling keeps small pages' values
    normal, so ``f`` is closer than ``e`` on a page of small values (the check fails if the
    two kinds are swapped or the scale is dropped)."""
    gen = torch.Generator().manual_seed(1)
    rows = torch.randn(2, 16, 2, 8, generator=gen)
    rows[1] *= 1e-3  # a page of values below e4m3's smallest normal (2^-6)
    cast = study.Variant("x:0:0:e:x").round(rows)
    assert torch.equal(cast, rows.to(torch.float8_e4m3fn).float())
    scaled = study.Variant("x:0:0:f:x").round(rows)
    assert torch.all((scaled - rows).abs() <= rows.abs() / 16 + 1e-12)
    assert (scaled - rows)[1].abs().max() < 0.25 * (cast - rows)[1].abs().max()


def test_seed_x_means_no_rotation(study):
    hook = study.Hook()
    assert study.Variant("x:0:0:e:x").seed is None
    assert torch.equal(hook.rotation(8, None), torch.eye(8))
    r = hook.rotation(8, 3)
    assert torch.allclose(r @ r.T, torch.eye(8), atol=1e-5) and not torch.allclose(r, torch.eye(8))
