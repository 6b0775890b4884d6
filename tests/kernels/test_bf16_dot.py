"""bfloat16 products by vdpbf16ps or widened to float32 (``cpu_tune.settle_bf16_dot``): what each
way computes (widened: exactly the float32 products on the widened values; vdpbf16ps: x, or q
and the softmax weights, rounded to bfloat16), the rule that chooses between them, the setting
and the cache. Each way is run here by setting it on the loaded library, whatever this machine
chose; the process's choice is put back after each test."""

from __future__ import annotations

import json
import logging

import pytest
import torch

from longctx.kernels import cpu_build, cpu_flash, cpu_linear, cpu_tune, reference


def _linear_lib():
    return cpu_linear._load() if cpu_linear.available() else None


def _flash_lib():
    return cpu_flash._load() if cpu_flash.available() else None


def _state(lib, kind: str) -> int:
    """The library's way now (1: vdpbf16ps, 0: widened or none in the build)."""
    return int(lib.longctx_linear_bf16_panels() if kind == "linear" else lib.longctx_flash_bf16_dot())


def _has_dot(lib, setter: str) -> bool:
    """Whether ``lib``'s build has the vdpbf16ps products (the setter says so; the way is put back)."""
    if lib is None:
        return False
    was = _state(lib, "linear" if "linear" in setter else "flash")
    has = bool(getattr(lib, setter)(1))
    getattr(lib, setter)(was)
    return has


LINEAR_DOT = _has_dot(_linear_lib(), "longctx_linear_set_bf16_dot") and cpu_linear.max_rows() > 64
FLASH_DOT = _has_dot(_flash_lib(), "longctx_flash_set_bf16_dot")
needs_linear_dot = pytest.mark.skipif(not LINEAR_DOT, reason="the row kernel's build has no vdpbf16ps panels here")
needs_flash_dot = pytest.mark.skipif(not FLASH_DOT, reason="the flash kernel's vector build has no vdpbf16ps here")


def _way(lib, kind: str):
    """The library's setter for the test (1: vdpbf16ps, 0: widened); its way put back after."""
    was = _state(lib, kind)
    set_dot = lib.longctx_linear_set_bf16_dot if kind == "linear" else lib.longctx_flash_set_bf16_dot
    yield set_dot
    set_dot(was)


@pytest.fixture
def linear_way():
    yield from _way(cpu_linear._load(), "linear")


@pytest.fixture
def flash_way():
    yield from _way(cpu_flash._load(), "flash")


def test_the_process_chose_once_its_libraries_loaded():
    if cpu_linear.available():
        assert cpu_tune.bf16_dot("linear") in (True, False)
        # rounds_bf16_rows follows the choice: the panel rows where vdpbf16ps runs, 0 where widened
        assert (cpu_linear.rounds_bf16_rows() > 0) == (bool(cpu_tune.bf16_dot("linear")) and LINEAR_DOT)
    if cpu_flash.available():
        assert cpu_tune.bf16_dot("flash") in (True, False)
    with pytest.raises(ValueError, match="kind must be one of"):
        cpu_tune.bf16_dot("decode")


@needs_linear_dot
@pytest.mark.parametrize("rows", [17, 45, 200])
def test_linear_widened_is_float32s_product_and_dot_rounds_x(rows, linear_way):
    gen = torch.Generator().manual_seed(rows)
    k, n = 200, 70  # K not a multiple of 32 (pairs past K), N not of 16
    x = torch.randn(rows, k, generator=gen)
    w = (torch.randn(n, k, generator=gen) * 0.1).bfloat16()
    bias = torch.randn(n, generator=gen)
    linear_way(0)
    assert cpu_linear.rounds_bf16_rows() == 0
    widened = cpu_linear.linear(x, w, bias)
    # the same panels on the widened matrix: the same bits
    assert torch.equal(widened, cpu_linear.linear(x, w.float(), bias))
    linear_way(1)
    assert cpu_linear.rounds_bf16_rows() == cpu_linear.BF16_PANEL_ROWS
    dot = cpu_linear.linear(x, w, bias)
    assert not torch.equal(dot, widened)  # x was rounded
    ref = x.bfloat16().double() @ w.double().t() + bias.double()  # x rounded, exact products
    assert torch.allclose(dot.double(), ref, rtol=1e-5, atol=1e-4)
    assert (dot.double() - ref).abs().max() < (widened.double() - ref).abs().max()


def _pages(seed: int, ctx: int, kv: int, d: int, bs: int = 16):
    gen = torch.Generator().manual_seed(seed)
    blocks = -(-ctx // bs) + 2
    k = torch.randn(blocks, bs, kv, d, generator=gen).bfloat16()
    v = torch.randn(blocks, bs, kv, d, generator=gen).bfloat16()
    perm = torch.randperm(blocks, generator=gen)[: -(-ctx // bs)].tolist()  # pages out of order
    return k, v, perm


@needs_flash_dot
@pytest.mark.parametrize("new,ctx,heads,kv,d", [(37, 37, 4, 2, 64), (130, 300, 6, 2, 128), (9, 500, 3, 1, 80)])
def test_flash_widened_pages_are_float32_pages_and_dot_rounds(new, ctx, heads, kv, d, flash_way):
    k, v, blocks = _pages(new + ctx, ctx, kv, d)
    q = torch.randn(new, heads, d, generator=torch.Generator().manual_seed(d))
    scale = d ** -0.5
    if cpu_flash._library_for(k) is not cpu_flash._load():
        pytest.skip("bfloat16 pages of this head dim run on the AMX build here")
    flash_way(0)
    assert not cpu_flash.rounds_bf16(k)
    widened, lse_w = cpu_flash.attend(q, k, v, blocks, ctx, scale)
    # the vector build's float32 products on the same values in float32 pages: the same bits
    as_f32, lse_f = cpu_flash.attend(q, k.float(), v.float(), blocks, ctx, scale)
    assert torch.equal(widened, as_f32) and torch.equal(lse_w, lse_f)
    flash_way(1)
    assert cpu_flash.rounds_bf16(k)
    dot, _ = cpu_flash.attend(q, k, v, blocks, ctx, scale)
    assert not torch.equal(dot, widened)  # q and p rounded to bfloat16
    # against the float64 reference on the pages' values: widened to float32 error, dot to
    # bfloat16 rounding of q and p (and never closer than widened)
    ref, _ = reference.paged_attention(q.double(), k.double(), v.double(), torch.tensor([blocks], dtype=torch.int32),
                                       torch.tensor([ctx], dtype=torch.int32),
                                       torch.tensor([0, new], dtype=torch.int32), scale=scale)
    err_w, err_d = (widened.double() - ref).abs().max(), (dot.double() - ref).abs().max()
    assert err_w < 1e-5 and err_d < 2e-2 and err_d > err_w, (err_w, err_d)


def test_the_rule_keeps_the_dot_products_unless_widening_wins_by_the_margin():
    state = {"on": None, "calls": []}

    def set_dot(on):
        state["on"] = on
        return 1

    def fake(dot_ms, widen_ms):
        clock_t = [0.0]

        def run():
            clock_t[0] += (dot_ms if state["on"] else widen_ms) / 1e3
            state["calls"].append(state["on"])

        return run, (lambda: clock_t[0])

    for dot_ms, widen_ms, expected in [(10.0, 7.0, False), (10.0, 9.8, True), (10.0, 12.0, True)]:
        run, clock = fake(dot_ms, widen_ms)
        state["calls"].clear()
        got = cpu_tune.measure_bf16_dot(run, set_dot, clock=clock)
        assert got["dot"] is expected
        assert got["dot_ms"] == pytest.approx(dot_ms) and got["widen_ms"] == pytest.approx(widen_ms)
        assert state["on"] == int(expected)  # left at the choice
        assert state["calls"].count(1) == state["calls"].count(0) == cpu_tune.REPEATS + 1  # alternating, warmed


class FakeLib:
    """A library's setter that records what it was set to; ``has``: whether the build has vdpbf16ps."""

    def __init__(self, has: bool = True):
        self.has, self.on, self._name = has, None, "/x/linear_rows-fake.so"
        outer = self

        class Setter:
            restype = argtypes = None

            def __call__(self, on):
                outer.on = on
                return int(outer.has)

        self.longctx_linear_set_bf16_dot = Setter()
        self.longctx_flash_set_bf16_dot = Setter()


@pytest.fixture
def tune_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("LONGCTX_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("LONGCTX_BF16_DOT", raising=False)
    monkeypatch.setenv("LONGCTX_CPU_TUNE", "auto")
    monkeypatch.setattr(cpu_tune, "_BF16_DOT", {})
    monkeypatch.setattr(cpu_tune.os, "getloadavg", lambda: (0.1, 0.1, 0.1))
    return tmp_path


def _measured(calls, dot):
    def measure(run, set_dot, clock=None):
        calls.append(run)
        set_dot(int(dot))
        return {"dot_ms": 10.0, "widen_ms": 5.0 if not dot else 11.0, "dot": dot}
    return measure


@pytest.mark.parametrize("kind", ["linear", "flash"])
def test_settle_measures_once_and_caches(kind, tune_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_tune, "measure_bf16_dot", _measured(calls, False))
    monkeypatch.setattr(cpu_tune, "_linear_ways", lambda lib, threads: (None, None))
    monkeypatch.setattr(cpu_tune, "_flash_ways", lambda lib, threads: (None, None))
    lib = FakeLib()
    assert cpu_tune.settle_bf16_dot(kind, lib, threads=2) is False
    assert lib.on == 0 and cpu_tune.bf16_dot(kind) is False and len(calls) == 1
    data = json.loads(cpu_tune.cache_file().read_text())
    (key, record), = [(k, v) for k, v in data.items() if k.startswith("bf16dot")]
    assert f"|{kind}|" in key and "threads=2" in key and record["dot"] is False
    # a second process (the memo is the cache): no measurement
    monkeypatch.setattr(cpu_tune, "measure_bf16_dot", lambda *a, **k: pytest.fail("measured again"))
    lib2 = FakeLib()
    assert cpu_tune.settle_bf16_dot(kind, lib2, threads=2) is False and lib2.on == 0
    # the float32 tune's writes keep these entries
    monkeypatch.setattr(cpu_tune, "measure", lambda shapes, threads, way="blas": {
        "rows": {}, "blas_from_rows": None})
    if cpu_linear.available() and cpu_linear.max_rows() >= cpu_tune.NEVER:
        monkeypatch.setattr(cpu_tune, "_MEMO", {})
        cpu_tune.blas_from_rows([(64, 256), (128, 64)], threads=2)
        assert key in json.loads(cpu_tune.cache_file().read_text())


def test_settle_on_a_busy_machine_does_not_cache(tune_cache, monkeypatch):
    calls = []
    monkeypatch.setattr(cpu_tune, "measure_bf16_dot", _measured(calls, False))
    monkeypatch.setattr(cpu_tune, "_linear_ways", lambda lib, threads: (None, None))
    monkeypatch.setattr(cpu_tune.os, "getloadavg", lambda: (99.0, 99.0, 99.0))
    lib = FakeLib()
    assert cpu_tune.settle_bf16_dot("linear", lib, threads=2) is False and lib.on == 0
    assert not cpu_tune.cache_file().exists() or not any(
        k.startswith("bf16dot") for k in json.loads(cpu_tune.cache_file().read_text()))


@pytest.mark.parametrize("env,tune,expected", [("on", "auto", True), ("off", "auto", False), ("1", "auto", True),
                                               ("0", "auto", False), ("", "off", True), ("off", "off", False)])
def test_forced_settings_measure_nothing(env, tune, expected, tune_cache, monkeypatch):
    monkeypatch.setenv("LONGCTX_BF16_DOT", env)
    monkeypatch.setenv("LONGCTX_CPU_TUNE", tune)
    monkeypatch.setattr(cpu_tune, "measure_bf16_dot", lambda *a, **k: pytest.fail("measured"))
    lib = FakeLib()
    assert cpu_tune.settle_bf16_dot("flash", lib) is expected and lib.on == int(expected)
    assert cpu_tune.bf16_dot("flash") is expected


def test_a_build_without_vdpbf16ps_widens(tune_cache, monkeypatch):
    monkeypatch.setattr(cpu_tune, "measure_bf16_dot", lambda *a, **k: pytest.fail("measured"))
    monkeypatch.setenv("LONGCTX_BF16_DOT", "on")
    assert cpu_tune.settle_bf16_dot("linear", FakeLib(has=False)) is False
    assert cpu_tune.bf16_dot("linear") is False


@pytest.mark.parametrize("raw", ["fast", "yes", "2"])
def test_a_bad_setting_is_refused_by_name(raw, tune_cache, monkeypatch):
    monkeypatch.setenv("LONGCTX_BF16_DOT", raw)
    with pytest.raises(ValueError, match="LONGCTX_BF16_DOT must be 'auto', 'on' or 'off'"):
        cpu_tune.settle_bf16_dot("linear", FakeLib())
    with pytest.raises(ValueError, match="kind must be one of"):
        cpu_tune.settle_bf16_dot("amx", FakeLib())


def test_a_failed_measurement_keeps_the_dot_products(tune_cache, monkeypatch, caplog):
    def broken(run, set_dot, clock=None):
        set_dot(0)
        raise RuntimeError("linear_rows returned -2")

    monkeypatch.setattr(cpu_tune, "measure_bf16_dot", broken)
    monkeypatch.setattr(cpu_tune, "_linear_ways", lambda lib, threads: (None, None))
    lib = FakeLib()
    with caplog.at_level(logging.WARNING, logger="longctx.kernels.cpu_tune"):
        assert cpu_tune.settle_bf16_dot("linear", lib) is True
    assert lib.on == 1 and "vdpbf16ps kept" in caplog.text


def test_the_library_hook_raises_a_bad_setting_and_loads_after(tmp_path, monkeypatch):
    """A bad LONGCTX_BF16_DOT reaches the first caller as a ValueError; the library loads once it is fixed."""
    seen = []

    def settle(lib):
        seen.append(lib)
        cpu_tune.bf16_dot_setting()

    lib = cpu_build.KernelLibrary(cpu_linear.SOURCE, cpu_linear._declare,
                                  extra_flags=cpu_build.vendor_flags(cpu_linear.VENDOR_FLAGS), settle=settle)
    if not cpu_linear.available():
        pytest.skip(f"row kernel {cpu_linear.status()}")
    monkeypatch.setenv("LONGCTX_BF16_DOT", "sometimes")
    with pytest.raises(ValueError, match="LONGCTX_BF16_DOT"):
        lib.load()
    monkeypatch.setenv("LONGCTX_BF16_DOT", "auto")
    assert lib.load() is not None and lib.status() == "ok" and len(seen) == 2


def test_real_measurement_runs_both_ways_and_agrees_with_the_kernels(tune_cache):
    """The two measured calls run on the real libraries (widened and dot), each leaving the setter
    at its choice."""
    for kind, lib in (("linear", _linear_lib()), ("flash", _flash_lib())):
        if lib is None or not (LINEAR_DOT if kind == "linear" else FLASH_DOT):
            continue
        was = _state(lib, kind)
        run, set_dot = (cpu_tune._linear_ways if kind == "linear" else cpu_tune._flash_ways)(lib, 2)
        try:
            got = cpu_tune.measure_bf16_dot(run, set_dot)
            assert got["dot_ms"] > 0 and got["widen_ms"] > 0 and isinstance(got["dot"], bool)
            assert _state(lib, kind) == int(got["dot"])  # left at its choice
        finally:
            set_dot(was)
