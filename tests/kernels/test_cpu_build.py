"""The C kernels' instruction-set dispatch (kernels/cpu_build.py): the level follows the CPU's
features, LONGCTX_CPU_ISA forces one, a level the CPU cannot run or an unknown name is refused
with the reason (the kernels then report it and the torch paths run), and each level builds a
library of its own."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from longctx.kernels import cpu_build

V3 = "cx16 lahf_lm popcnt sse4_1 sse4_2 ssse3 avx avx2 bmi1 bmi2 f16c fma abm movbe xsave"
AVX512 = V3 + " avx512f avx512bw avx512vl avx512dq avx512cd"


@pytest.fixture
def cpu(monkeypatch):
    """Pretend the CPU (x86) has the given /proc/cpuinfo flags."""
    def set_flags(flags: str):
        monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: " fpu sse sse2 " + flags)
        monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
        cpu_build._choose_isa.cache_clear()
    yield set_flags
    cpu_build._choose_isa.cache_clear()


@pytest.mark.parametrize("flags,level", [(AVX512 + " avx512_bf16 avx512_vnni", "avx512bf16"), (AVX512, "avx512"),
                                         (AVX512 + " avx512_bf16", "avx512"),  # the level's VNNI products missing
                                         (V3, "avx2"), (V3.replace("movbe", ""), "portable"),
                                         ("avx avx2 fma", "portable"), ("", "portable")])
def test_the_best_level_the_cpu_has(cpu, monkeypatch, flags, level):
    monkeypatch.delenv("LONGCTX_CPU_ISA", raising=False)
    cpu(flags)
    assert cpu_build.isa() == level
    assert cpu_build.isa_flags() == cpu_build.X86_LEVELS[level][0]


@pytest.mark.parametrize("text,vendor,model,flags", [
    ("processor\t: 0\nvendor_id\t: GenuineIntel\nmodel name\t: Intel(R) Xeon(R)\nflags\t\t: fpu avx2\n"
     "processor\t: 1\nvendor_id\t: AuthenticAMD\n", "GenuineIntel", "Intel(R) Xeon(R)", " fpu avx2"),
    ("processor\t: 0\nFeatures\t: fp asimd\n", "", None, " fp asimd"),
    (None, "", None, "")])
def test_cpuinfo_fields(monkeypatch, tmp_path, text, vendor, model, flags):
    """The first line of each field, its value after the colon; "" or None where the field or the
    file is missing (the kernels' build flags and the tuner's key read them)."""
    cpuinfo = tmp_path / "cpuinfo"
    if text is not None:
        cpuinfo.write_text(text)
    monkeypatch.setattr(cpu_build, "CPUINFO", cpuinfo)
    assert cpu_build.cpu_vendor() == vendor
    assert cpu_build._cpu_flags() == flags
    got = cpu_build.cpuinfo_field("model name")
    assert (got.strip() if got is not None else None) == model


def test_unknown_features_leave_it_to_the_compiler(monkeypatch):
    """No /proc/cpuinfo flags on x86: -march=native, not the slowest level."""
    monkeypatch.delenv("LONGCTX_CPU_ISA", raising=False)
    monkeypatch.setattr(cpu_build, "_cpu_flags", lambda: "")
    monkeypatch.setattr(cpu_build.platform, "machine", lambda: "x86_64")
    cpu_build._choose_isa.cache_clear()
    try:
        assert cpu_build.isa() == "native" and cpu_build.isa_flags() == ["-march=native"]
    finally:
        cpu_build._choose_isa.cache_clear()


@pytest.mark.parametrize("forced,fast", [("avx2", True), ("avx512", True), ("portable", False), ("sse9", False)])
def test_the_kernels_count_as_fast_only_with_their_vector_paths(cpu, monkeypatch, forced, fast):
    """The engine takes the compiled kernels only where they have intrinsic paths (the plain C
    loops measured slower than torch's); a refused level is not fast either."""
    cpu(AVX512)
    cpu_build._vectorized.cache_clear()
    monkeypatch.setenv("LONGCTX_CPU_ISA", forced)
    try:
        assert cpu_build.vectorized() is fast
    finally:
        cpu_build._vectorized.cache_clear()


def test_a_forced_level(cpu, monkeypatch):
    cpu(AVX512 + " avx512_bf16")
    monkeypatch.setenv("LONGCTX_CPU_ISA", "avx2")
    assert cpu_build.isa() == "avx2" and "-march=x86-64-v3" in cpu_build.isa_flags()
    monkeypatch.setenv("LONGCTX_CPU_ISA", "portable")
    assert cpu_build.isa_flags()[0] == "-march=x86-64"


def test_a_level_the_cpu_cannot_run_or_an_unknown_one_is_refused(cpu, monkeypatch):
    cpu(V3)
    monkeypatch.setenv("LONGCTX_CPU_ISA", "avx512bf16")
    with pytest.raises(RuntimeError, match="needs CPU features this machine lacks: avx512_bf16, avx512_vnni, "
                                           "avx512bw, avx512cd, avx512dq, avx512f, avx512vl"):
        cpu_build.isa()
    monkeypatch.setenv("LONGCTX_CPU_ISA", "sse9")
    with pytest.raises(RuntimeError, match="'sse9' is not one of avx512bf16, avx512, avx2, portable, native"):
        cpu_build.isa()


REFUSED = textwrap.dedent("""
    import logging
    logging.basicConfig(level=logging.INFO)
    import torch
    from longctx.kernels import cpu_linear
    from longctx.model.llama import choose_cpu_matmul
    assert not cpu_linear.available()
    print(cpu_linear.status())
    assert choose_cpu_matmul("auto", torch.float32) in ("onednn", "blas")
""")


def test_a_refused_level_leaves_the_torch_paths_and_says_why(tmp_path):
    env = {**os.environ, "LONGCTX_CACHE_DIR": str(tmp_path), "LONGCTX_CPU_ISA": "sse9"}
    proc = subprocess.run([sys.executable, "-c", REFUSED], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.strip() == ("unavailable: LONGCTX_CPU_ISA='sse9' is not one of "
                                   + ", ".join(cpu_build._levels()))
    assert "C kernel linear_rows.c not used" in proc.stderr  # logged once, at load


def test_each_level_builds_its_own_library(tmp_path, monkeypatch):
    if not cpu_build.enabled() or cpu_build.isa() == "portable":
        pytest.skip("needs the C kernels and a level above portable")
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path))
    source = cpu_build.CSRC / "linear_rows.c"
    try:
        cpu_build.build(source)
    except cpu_build.BUILD_ERRORS as exc:
        pytest.skip(f"no build here: {exc}")
    monkeypatch.setenv("LONGCTX_CPU_ISA", "portable")
    cpu_build.build(source)
    assert len(list((tmp_path / "cpu_kernels").glob("linear_rows-*.so"))) == 2


SIMD_SUM = r"""
#include <stdio.h>
#include <string.h>
static float sum(const float *x, int n) {
    float s = 0.0f;
#pragma omp simd reduction(+ : s)
    for (int i = 0; i < n; i++) s += x[i] * x[i];
    return s;
}
int main(void) {
    static float x[4099];
    unsigned state = 12345u;
    for (int i = 0; i < 4099; i++) { state = state * 1664525u + 1013904223u; x[i] = (float)(state >> 8) / 16777216.0f - 0.5f; }
    volatile int n = 4099;
    float s = sum(x, n);
    unsigned bits; memcpy(&bits, &s, 4);
    printf("%08x\n", bits);
    return 0;
}
"""


@pytest.mark.parametrize("level", ["avx512bf16", "avx512", "avx2"])
def test_a_level_sums_alike_under_every_tuning(tmp_path, level):
    """The C files' `omp simd reduction` sums (the RMSNorm's, some dot products) take as many lanes
    as the vectorizer picks, and -mtune=native picks differently per CPU (rocketlake prefers 256
    bits, znver3 512): the level's flags fix the width, so one level sums alike on Intel and AMD.
    Built with each tuning in place of native and run here, the sums must be the same bits."""
    if cpu_build._levels() is not cpu_build.X86_LEVELS:
        pytest.skip("not an x86 CPU")
    try:
        cpu_build._choose_isa(level)
    except RuntimeError as e:
        pytest.skip(str(e))
    compiler = cpu_build.c_compiler()
    src = tmp_path / "sum.c"
    src.write_text(SIMD_SUM)
    sums = {}
    for tune in ("rocketlake", "znver3", "generic"):
        flags = [f if f != "-mtune=native" else f"-mtune={tune}" for f in cpu_build.X86_LEVELS[level][0]]
        exe = tmp_path / f"sum-{tune}"
        subprocess.run([compiler, "-O3", "-fopenmp", "-std=c11", *flags, str(src), "-o", str(exe)],
                       check=True, capture_output=True, text=True)
        sums[tune] = subprocess.run([str(exe)], check=True, capture_output=True, text=True).stdout.strip()
    assert len(set(sums.values())) == 1, sums


HEAP_PROBE = """
import json, torch
from longctx.kernels import cpu_build

def from_heap(t):  # whether the block lies in glibc's heap, not in a mapping of its own
    at = t.data_ptr()
    for line in open("/proc/self/maps"):
        lo, hi = (int(v, 16) for v in line.split()[0].split("-"))
        if lo <= at < hi:
            return line.rstrip().endswith("[heap]")
    raise AssertionError("the block is in no mapping")

before = from_heap(torch.empty(64 << 20, dtype=torch.uint8))
took = cpu_build.keep_large_blocks()
block = torch.empty(64 << 20, dtype=torch.uint8)
after = from_heap(block)
print(json.dumps([before, took, after]))
"""


@pytest.mark.parametrize("switch,expected", [(None, [False, True, True]), ("0", [False, False, False])])
def test_keep_large_blocks_has_glibc_serve_them_from_its_heap(switch, expected):
    """A 64 MiB block is a mapping of its own (faulted in afresh at each use) until the engine's
    ``keep_large_blocks`` call; after it, it comes from the heap. ``LONGCTX_MALLOC_TUNE=0``
    leaves glibc's default. In a child process: the setting is the whole process's."""
    if sys.platform != "linux" or cpu_build.platform.libc_ver()[0] != "glibc":
        pytest.skip("glibc only")
    env = {k: v for k, v in os.environ.items() if k != "LONGCTX_MALLOC_TUNE"}
    if switch is not None:
        env["LONGCTX_MALLOC_TUNE"] = switch
    out = subprocess.run([sys.executable, "-c", HEAP_PROBE], env=env, capture_output=True, text=True,
                         check=True)
    assert json.loads(out.stdout.strip().splitlines()[-1]) == expected
