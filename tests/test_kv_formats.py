"""KV formats behind one interface (``longctx.kv.formats``): each format's page bytes, layout,
row moves and prefix key; the two toggles of quantized pages as ``CacheConfig`` fields; and
the engine held to it: no engine module outside the formats names the int8 format, and no
backend probes a kernels module for what it takes."""

from __future__ import annotations

import ast
import json
import os
import re
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from longctx import LLM, SamplingParams
from longctx.config import CacheConfig
from longctx.kernels import kv_quant
from longctx.kv.device_pool import DeviceKVPool
from longctx.kv.formats import FloatPages, Int8Pages, kv_format
from tiny_models import VM_FLAGS_SOURCE, make_engine_checkpoint

ROOT = Path(__file__).resolve().parent.parent
CFG = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=16)
# the KV formats themselves, the exact tail (int8's), and the option's spelled values in config
FORMAT_MODULES = {"longctx/kv/formats.py", "longctx/kv/exact_tail.py", "longctx/config.py"}
# the weights' quantization (``quantization="int8"|"int4"``: matrices in Q8_0 / Q4_1 blocks) and
# its load path (the safetensors reader: a checkpoint's int8 dtype): their int8 is the weights', so
# only a KV mention counts there
WEIGHT_MODULES = {"longctx/model/quantize.py", "longctx/model/loader.py", "longctx/model/prepare.py",
                  "longctx/model/safetensors_file.py"}


def _names_and_strings(path: Path) -> list[tuple[int, str]]:
    """Identifiers and string constants of ``path``'s code (docstrings and comments left out)."""
    tree = ast.parse(path.read_text())
    docstrings = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list) and body and isinstance(body[0], ast.Expr) \
                and isinstance(body[0].value, ast.Constant) and isinstance(body[0].value.value, str):
            docstrings.add(id(body[0].value))
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Name):
            found.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute):
            found.append((node.lineno, node.attr))
        elif isinstance(node, (ast.FunctionDef, ast.ClassDef, ast.arg, ast.keyword)) and \
                getattr(node, "name", getattr(node, "arg", None)):
            found.append((node.lineno, getattr(node, "name", None) or node.arg))
        elif isinstance(node, ast.alias):
            found.append((getattr(node, "lineno", 0), node.asname or node.name))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings:
            found.append((node.lineno, node.value))
    return found


MENTION = re.compile(r"(^|[^a-z])int8|kv_quant|quantized")  # (uint8, a byte, is no mention)


KV_MENTION = re.compile(r"kv_quant|int8_?pages|kv.*int8|int8.*kv|kv.*quantized|quantized.*kv")


def _int8_mentions(path: Path, pattern: re.Pattern = MENTION) -> list[tuple[int, str]]:
    return [(line, text) for line, text in _names_and_strings(path) if pattern.search(text.lower())]


def test_no_engine_module_outside_the_formats_names_int8():
    offenders = {}
    for path in sorted((ROOT / "longctx").rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        pattern = KV_MENTION if rel in WEIGHT_MODULES else MENTION
        if rel not in FORMAT_MODULES and (found := _int8_mentions(path, pattern)):
            offenders[rel] = found
    assert offenders == {}


def test_the_check_can_fail(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text('"""int8 in a docstring is fine."""\nimport torch\n\n\ndef f(x):\n'
                   '    # int8 in a comment too\n    return x.dtype == torch.int8 or x.quantized\n')
    bad.write_text(bad.read_text() + "\n\nBYTES = torch.uint8\n")
    assert sorted(t for _, t in _int8_mentions(bad)) == ["int8", "quantized"]
    # in a weights module, the weights' int8 is no mention; the KV's still is
    weights = tmp_path / "weights.py"
    weights.write_text('SCHEME = "int8"\n\n\ndef load_quantized_model():\n    return SCHEME\n')
    assert _int8_mentions(weights, KV_MENTION) == []
    weights.write_text(weights.read_text() + "\n\nfrom longctx.kernels import kv_quant\nPAGES = 'Int8Pages'\n")
    assert sorted(t for _, t in _int8_mentions(weights, KV_MENTION)) == ["Int8Pages", "kv_quant"]


def test_no_backend_probes_its_kernels():
    for folder in ("longctx", "parallel", "kernels"):
        for path in (ROOT / folder).rglob("*.py"):
            assert "TAKES_" not in path.read_text(), path


@pytest.mark.parametrize("fmt", [FloatPages(CFG, torch.float32), Int8Pages(CFG, torch.float32)])
def test_a_page_reads_back_as_written_and_matches_its_bytes(fmt):
    pool = DeviceKVPool(fmt, 6, 4, "cpu")
    gen = torch.Generator().manual_seed(0)
    slots = torch.arange(24)
    for layer in pool.caches:
        for kv in range(2):
            rows = torch.randn(24, 2, 16, generator=gen)
            fmt.write_rows(layer, kv, rows, slots, slots.tolist())
            got = fmt.read_rows(layer, kv, slots)
            tol = 0.0 if fmt.name == "auto" else rows.abs().max().item() / 127  # one int8 step
            assert (got - rows).abs().max().item() <= tol
    pages = pool.read_pages([4, 1])
    assert pages.shape == (2, *pool.page_shape) and pages.dtype == pool.page_dtype
    assert pages[0].numel() * pages.element_size() == fmt.page_bytes(4)
    other = DeviceKVPool(fmt, 6, 4, "cpu")
    other.write_pages([0, 2], pages)
    for mine, theirs in zip(pool.caches, other.caches):
        for a, b in zip(mine, theirs):
            assert torch.equal(a[[4, 1]], b[[0, 2]])


def test_int8_move_slots_dequantises_and_writes_again():
    """As ``kv_quant`` defines it: the moved rows read dequantised, written under the
    destination pages' scales (a run starting at each page change)."""
    fmt = Int8Pages(CFG, torch.float32)
    pool = DeviceKVPool(fmt, 4, 4, "cpu")
    gen = torch.Generator().manual_seed(1)
    for layer in pool.caches:
        for kv in range(2):
            fmt.write_rows(layer, kv, torch.randn(16, 2, 16, generator=gen), torch.arange(16), list(range(16)))
    want = [tuple(t.clone() for t in layer) for layer in pool.caches]
    src, dst = [9, 11], [5, 6]
    for k, v, ks, vs in want:
        for cache, scale in ((k, ks), (v, vs)):
            rows = kv_quant.dequantize_rows(cache, scale, torch.tensor(src))
            kv_quant.write_int8(cache, scale, rows, torch.tensor(dst), kv_quant.run_starts(torch.tensor(dst), 4))
    pool.move_slots(src, dst)
    for got, expected in zip(pool.caches, want):
        for a, b in zip(got, expected):
            assert torch.equal(a, b)


def test_formats_name_themselves_in_the_prefix_key_and_size_their_tail():
    assert FloatPages(CFG, torch.float32).cache_key == "torch.float32"
    assert Int8Pages(CFG, torch.float32).cache_key == "torch.int8+rotated"
    assert Int8Pages(CFG, torch.float32, rotate=False).cache_key == "torch.int8"
    assert FloatPages(CFG, torch.float32).tail_bytes(4, 16) == 0
    assert Int8Pages(CFG, torch.float32).tail_bytes(4, 16) > 0
    assert Int8Pages(CFG, torch.float32).rotation("cpu") is not None
    assert Int8Pages(CFG, torch.float32, rotate=False).rotation("cpu") is None
    assert DeviceKVPool(Int8Pages(CFG, torch.float32, exact_tail=False), 2, 4, "cpu").tail is None


def test_kv_format_follows_the_cache_config():
    fmt = kv_format(CacheConfig(kv_cache_dtype="int8", kv_quant_rotation=False, kv_quant_exact_tail=False),
                    CFG, torch.float32)
    assert isinstance(fmt, Int8Pages) and not fmt.rotate and not fmt.exact_tail
    assert type(kv_format(CacheConfig(), CFG, torch.bfloat16)) is FloatPages
    with pytest.raises(ValueError, match="kv_quant_rotation and kv_quant_exact_tail must be True or False"):
        CacheConfig(kv_quant_rotation="yes")


def test_the_engine_takes_the_toggles_from_its_arguments(tmp_path):
    make_engine_checkpoint(tmp_path)
    llm = LLM(str(tmp_path), kv_cache_dtype="int8", kv_quant_rotation=False, kv_quant_exact_tail=False,
              block_size=16)
    assert llm.engine.kv.tail is None and llm.engine.kv_format.rotation("cpu") is None
    assert llm.engine.prefix_cache.extra_key[-1] == "torch.int8"
    out = llm.generate({"prompt_token_ids": list(range(3, 40))}, SamplingParams(max_tokens=4))
    assert len(out[0].outputs[0].token_ids) == 4


_PAGE_FLAGS = """
import json, sys
from types import SimpleNamespace
import longctx, torch
from longctx.kv.device_pool import DeviceKVPool
from longctx.kv.formats import FloatPages, Int8Pages

def flags(t):  # the VmFlags of a point inside the block, whatever its alignment
    return vm_flags(t.data_ptr() + t.numel() * t.element_size() // 2)

cfg = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=2, head_dim=64)
plain = torch.empty(8 << 20, dtype=torch.uint8)  # a block as large, not a pool's
seen = {"plain": ["hg" in flags(plain), "nh" in flags(plain)]}
for fmt in (FloatPages(cfg, torch.float32), Int8Pages(cfg, torch.float32)):
    pool = DeviceKVPool(fmt, 256, 64, "cpu")  # 8 MiB (int8: 2 MiB) per cache
    seen[fmt.name] = [["hg" in flags(t), "nh" in flags(t)] for layer in pool.caches for t in layer[:2]]
print(json.dumps(seen))
"""


@pytest.mark.skipif(not os.path.exists("/sys/kernel/mm/transparent_hugepage/enabled"),
                    reason="no transparent huge pages here (Linux's, where the kernel has them)")
def test_the_cpu_pool_asks_for_small_pages_where_torch_asks_for_huge_ones():
    """The CPU pool's caches are advised onto 4 KiB pages (the ``nh`` of their mapping's
    VmFlags; ``cpu_build.small_pages``), float and int8 alike, while a plain tensor as large,
    made after ``import longctx``, is advised onto huge pages (``hg``: what the pool's would be
    without the call). In a child process: torch reads its huge-page setting once."""
    clean = {k: v for k, v in os.environ.items() if k not in ("LONGCTX_HUGE_PAGES", "THP_MEM_ALLOC_ENABLE")}
    proc = subprocess.run([sys.executable, "-c", VM_FLAGS_SOURCE + _PAGE_FLAGS], env=clean, capture_output=True,
                          text=True, timeout=600, cwd=ROOT.parent)
    assert proc.returncode == 0, proc.stderr[-2000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["plain"] == [True, False]
    for name in ("auto", "int8"):
        assert seen[name] and all(pair == [False, True] for pair in seen[name]), (name, seen[name])
