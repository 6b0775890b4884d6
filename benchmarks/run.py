"""One harness for the benchmarks: a result is data with a machine, a revision and a schema.

Usage:  python benchmarks/run.py NAME [--allow-dirty] [--results DIR] [-- SCRIPT ARGS ...]
        python benchmarks/run.py --list

Runs ``benchmarks/<script of NAME>`` with ``--out FILE`` and its own arguments and writes
``benchmarks/results/<NAME>/<machine>/<git rev>.json`` (``--results DIR``: ``DIR/<NAME>/...``;
a later run of the same revision adds ``-2``, ``-3``, ... and never overwrites one):

    {"schema_version": 1, "bench": NAME, "machine": {cpu, cores, threads, torch, python, ...},
     "git": {"rev": ..., "dirty": bool}, "command": [...], "started": ISO time,
     "result": <what the script wrote>}

``<machine>`` is the CPU model and core count as a folder name (``lscpu``'s model name), so
results of Intel and AMD machines sit side by side; a result whose own ``machine`` names a GPU
(``bench_gpu``, ``bench_kernels`` on CUDA) goes under the GPU's name instead. A working tree with
changes is refused (the result could not be reproduced from its revision) unless
``--allow-dirty``, which the record then says (``git.dirty``). The script's own output (its
table) streams through.

Every benchmark script is here (``BENCHES``), and every one follows one rule: it writes its JSON
result to ``--out FILE`` only and, run by itself without ``--out``, prints its table and writes
nothing. Recording a result is this harness's job.
"""

from __future__ import annotations

import argparse
import datetime
import json
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from machine import cpu_id, cpu_model, machine_info

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results"
SCHEMA_VERSION = 1
BENCHES = {  # name -> script taking --out FILE (the results folder's name too)
    "e2e": "bench_e2e.py",
    "long": "bench_long.py",
    "batch": "bench_batch.py",
    "serve": "bench_serve.py",
    "kernels": "bench_kernels.py",
    "cpu-isa": "bench_cpu_isa.py",
    "detok": "bench_detok.py",
    "parallel": "bench_parallel.py",
    "gpu": "bench_gpu.py",
    "linear": "bench_linear.py",
    "load": "bench_load.py",
    "lookahead": "bench_lookahead.py",
    "prefill-paths": "bench_prefill_paths.py",
    "prefix": "bench_prefix.py",
    "tasks-32k": "bench_32k_tasks.py",
    "step": "bench_step.py",
    "int8-error": "int8_error_study.py",
    "window-kv": "bench_window_kv.py",
    "quant": "bench_quant.py",
    "blocks": "bench_blocks.py",
    "tiles": "bench_tiles.py",
}


def git(*cmd: str, cwd: Path = HERE) -> str:
    return subprocess.run(["git", *cmd], cwd=cwd, capture_output=True, text=True).stdout.strip()


def tree_is_dirty(cwd: Path = HERE) -> bool:
    """Changes to the code (new result records not yet committed do not count: a run must not
    make the next run of the same revision refuse)."""
    return bool(git("status", "--porcelain", "--", ":/", ":(top,exclude)benchmarks/results", cwd=cwd))


def machine_slug(cpu: str, cores: int | None, isa: list[str] | None = None) -> str:
    """``Intel(R) Xeon(R) Processor``, 2 -> ``intel-xeon-processor-2c``. An x86 CPU with AVX2
    and no AVX-512 gets ``-avx2`` before the cores: a VM's model name can be just ``AMD EPYC``
    for a Zen 3 (AVX2) and a Zen 4 (AVX-512) alike, and the kernels differ between the two."""
    words = re.sub(r"\((r|tm)\)", " ", cpu.lower())
    level = "-avx2" if isa and "avx2" in isa and "avx512f" not in isa else ""
    return "-".join(re.findall(r"[a-z0-9]+", words)) + f"{level}-{cores or 0}c"


def gpu_slug(gpu: str) -> str:
    """``NVIDIA H100 80GB HBM3`` -> ``nvidia-h100-80gb-hbm3``."""
    return "-".join(re.findall(r"[a-z0-9]+", gpu.lower()))


def result_gpu(result: object) -> str | None:
    """The GPU a result says it ran on (its own ``machine.gpu``), or None."""
    machine = result.get("machine") if isinstance(result, dict) else None
    gpu = machine.get("gpu") if isinstance(machine, dict) else None
    return gpu if isinstance(gpu, str) and gpu else None


def machine_folder(info: dict, result: object) -> str:
    """The folder of a result: the GPU it ran on where it names one, else this machine's CPU
    and cores."""
    gpu = result_gpu(result)
    return gpu_slug(gpu) if gpu else machine_slug(cpu_model(), info.get("cores"), cpu_id().get("isa"))


def result_path(name: str, machine: str, rev: str, root: Path = RESULTS) -> Path:
    """``root/name/machine/rev.json``; a later run of the same revision never overwrites an
    earlier one: ``rev-2.json``, ``rev-3.json``, ... (alternating runs of two revisions are how
    docs/benchmarks.md compares them)."""
    path, n = root / name / machine / f"{rev}.json", 1
    while path.exists():
        n += 1
        path = root / name / machine / f"{rev}-{n}.json"
    return path


def run(name: str, script_args: list[str], allow_dirty: bool = False, script: Path | None = None,
        root: Path = RESULTS) -> tuple[int, Path | None]:
    """Run benchmark ``name``; returns (the script's exit code, the record written or None)."""
    own = script_args[:script_args.index("--")] if "--" in script_args else script_args
    if any(a == "--out" or a.startswith("--out=") for a in own):
        print("run.py: --out is the harness's (the record goes under --results); "
              "run the script by itself to write a file of your own", file=sys.stderr)
        return 2, None
    dirty = tree_is_dirty()
    if dirty and not allow_dirty:
        print(f"run.py: the working tree has changes: commit them, or pass --allow-dirty "
              f"(the record will say so)", file=sys.stderr)
        return 2, None
    script = script or HERE / BENCHES[name]
    rev = git("rev-parse", "--short", "HEAD") or "unknown"
    info = machine_info()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "result.json"
        # --out first: what follows a script's own "--" (bench_serve's server flags) is not its
        command = [sys.executable, str(script), "--out", str(out), *script_args]
        rc = subprocess.run(command).returncode
        if rc != 0 or not out.exists():
            print(f"run.py: {script.name} exited with {rc}; nothing recorded", file=sys.stderr)
            return rc or 1, None
        result = json.loads(out.read_text())
    if result_gpu(result):
        info["gpu"] = result_gpu(result)
    record = {"schema_version": SCHEMA_VERSION, "bench": name, "machine": info,
              "git": {"rev": rev, "dirty": dirty}, "command": [script.name, *script_args],
              "started": started, "result": result}
    path = result_path(name, machine_folder(info, result), rev + ("-dirty" if dirty else ""), root)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(record, indent=1) + "\n")
    print(f"run.py: wrote {path.relative_to(HERE.parent) if HERE.parent in path.parents else path}")
    return 0, path


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    script_args = argv[argv.index("--") + 1:] if "--" in argv else []
    own = argv[:argv.index("--")] if "--" in argv else argv
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("name", nargs="?", choices=sorted(BENCHES))
    ap.add_argument("--allow-dirty", action="store_true", help="run from a tree with changes (recorded)")
    ap.add_argument("--results", type=Path, default=RESULTS, metavar="DIR",
                    help="root of the records (default: benchmarks/results)")
    ap.add_argument("--list", action="store_true", help="list the benchmarks and their scripts")
    args = ap.parse_args(own)
    if args.list or args.name is None:
        for name, script in sorted(BENCHES.items()):
            print(f"{name:14} benchmarks/{script}")
        return 0 if args.list else 2
    return run(args.name, script_args, args.allow_dirty, root=args.results.resolve())[0]


if __name__ == "__main__":
    sys.exit(main())
