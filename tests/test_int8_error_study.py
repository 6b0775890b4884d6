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
    ("x:0:2", "sink must be 0, 1 or c"),
    ("x:0:0:q", "kind must be one of"),
    ("x:0:0:-:z", "seed must be a whole number"),
])
def test_a_bad_variant_says_what_is_wrong(study, spec, says):
    with pytest.raises(SystemExit, match=says):
        study.Variant(spec)
