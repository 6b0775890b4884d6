"""``longctx batch``: a JSONL file of records in, one result line per record out, resumable.

Owns: reading and checking records; grouping records that share a document so they run one
after another (the prefix cache then holds the document's pages); dealing groups to workers
(``RANK``/``WORLD_SIZE`` under torchrun, or ``--num-workers`` spawned processes); resuming
(ids that already have a line in the output or in a worker's part are skipped); appending each
result as it finishes (flushed and fsync'd); error lines; progress bars (tqdm on stderr);
merging parts. ``longctx.entrypoints.ray_batch`` runs the same records on Ray actors with these pieces.
Never: prompts or model calls of its own (``longctx.entrypoints.tasks`` and ``LLM.generate`` make those).

Input, one JSON object per line (``document_path`` is relative to the input file's folder):

    {"id": "s1", "task": "summarize", "document_path": "report.txt", "max_tokens": 200}
    {"id": "q1", "task": "ask", "document_path": "report.txt", "questions": ["Who?", "When?"]}
    {"id": "g1", "task": "generate", "prompt": "Write a haiku.", "temperature": 0.7, "seed": 1}

Output, one line per input record, in the order records finish:

    {"id": "q1", "task": "ask", "answers": [...], "retrieval": null, ...}
    {"id": "x", "line": 7, "task": "ask", "error": "'questions' must be a non-empty list ..."}

A killed job loses at most the records in flight; the same command resumes it. A line of the
input that is not a record (bad JSON, no id, a repeated id) gets an error line with ``"id":
null`` and its line number.
"""

from __future__ import annotations

import functools
import glob
import hashlib
import json
import multiprocessing
import os
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import asdict, dataclass, field, replace
from datetime import timedelta
from pathlib import Path
from typing import Any, TextIO

from longctx.entrypoints import tasks
from longctx.config import ConfigError
from longctx.sampling_params import SamplingParams

TASKS = ("generate", "summarize", "ask")
SAMPLING_FIELDS = ("max_tokens", "temperature", "top_p", "top_k", "seed", "stop",
                   "stop_token_ids", "ignore_eos", "min_p", "repetition_penalty", "presence_penalty",
                   "frequency_penalty")
COMMON_FIELDS = ("id", "task", "document", "document_path", *SAMPLING_FIELDS)
TASK_FIELDS = {"generate": ("prompt", "chat"), "summarize": ("instructions",), "ask": ("questions",)}
TASK_MAX_TOKENS = {"generate": 256, "summarize": tasks.SUMMARY_TOKENS, "ask": tasks.ANSWER_TOKENS}
PROGRESS_MODES = ("auto", "on", "off")
DISTRIBUTED_TIMEOUT = timedelta(days=7)  # ranks wait for the slowest at the end of a long job


@dataclass(frozen=True)
class BatchConfig:
    num_workers: int = field(default=1, metadata={
        "help": "engine processes on this machine; each writes OUTPUT.partN, merged at the end"})
    max_in_flight: int = field(default=16, metadata={
        "help": "generate records run together as one batch (a killed job redoes at most these)"})
    overwrite: bool = field(default=False, metadata={
        "help": "start over: delete OUTPUT and its parts first instead of resuming"})
    progress: str = field(default="auto", metadata={"help": "auto | on | off (auto: when stderr is a terminal)"})

    def __post_init__(self) -> None:
        if self.num_workers < 1:
            raise ConfigError(f"num_workers must be >= 1, got {self.num_workers}")
        if self.max_in_flight < 1:
            raise ConfigError(f"max_in_flight must be >= 1, got {self.max_in_flight}")
        if self.progress not in PROGRESS_MODES:
            raise ConfigError(f"progress must be one of {', '.join(PROGRESS_MODES)}, got {self.progress!r}")


@dataclass(frozen=True)
class BatchJob:
    input: Path
    output: Path
    config: BatchConfig = BatchConfig()
    engine_kwargs: dict = field(default_factory=dict)  # LLM(**engine_kwargs)
    defaults: dict = field(default_factory=dict)  # sampling fields for records that leave them out


# ---------------------------------------------------------------- records

class RecordError(ValueError):
    """What is wrong with one input record."""


class BatchError(Exception):
    """A job could not finish (a worker failed); what is done is kept for a re-run."""


@dataclass(frozen=True)
class Record:
    line: int
    id: str | int
    task: str
    fields: dict
    params: SamplingParams
    document_path: Path | None
    document_key: str  # records with equal keys share a document; "" for none

    @property
    def key(self) -> str:
        return f"id:{self.id}"


@dataclass(frozen=True)
class BadLine:
    line: int
    id: str | int | None
    task: str | None
    error: str

    @property
    def key(self) -> str:
        return f"id:{self.id}" if self.id is not None else f"line:{self.line}"


def result_key(result: dict) -> str:
    """The resume key of an output line: its id, or its input line for id-less error lines."""
    return f"id:{result['id']}" if result.get("id") is not None else f"line:{result.get('line')}"


def read_records(path: Path, defaults: dict | None = None) -> tuple[list[Record], list[BadLine]]:
    """The records of a JSONL file, and the lines that are not valid records (with reasons)."""
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise ConfigError(f"cannot read the input {path}: {err}") from err
    return parse_lines(enumerate(lines, 1), path.parent, defaults)


def parse_lines(lines: Iterable[tuple[int, str | dict]], base_dir: Path,
                defaults: dict | None = None) -> tuple[list[Record], list[BadLine]]:
    """Records and bad lines of numbered input lines: JSON text (blank lines are skipped), or
    objects already decoded. ``document_path`` is relative to ``base_dir``."""
    records: list[Record] = []
    bad: list[BadLine] = []
    first_line: dict[str, int] = {}
    for n, raw in lines:
        if isinstance(raw, str):
            if not raw.strip():
                continue
            try:
                obj = json.loads(raw)
            except json.JSONDecodeError as err:
                bad.append(BadLine(n, None, None, f"not valid JSON: {err}"))
                continue
        else:
            obj = raw
        if not isinstance(obj, dict):
            bad.append(BadLine(n, None, None, f"a record must be a JSON object, got {type(obj).__name__}"))
            continue
        task = obj.get("task") if isinstance(obj.get("task"), str) else None
        rid = obj.get("id")
        if not _valid_id(rid):
            bad.append(BadLine(n, None, task, f"'id' must be a non-empty string or an integer, got {rid!r}"))
            continue
        key = f"id:{rid}"
        if key in first_line:
            bad.append(BadLine(n, None, task, f"duplicate id {rid!r} (first on line {first_line[key]}); "
                                              "record skipped"))
            continue
        first_line[key] = n
        try:
            records.append(parse_record(obj, n, base_dir, defaults or {}))
        except RecordError as err:
            bad.append(BadLine(n, rid, task, str(err)))
    return records, bad


def _valid_id(rid: object) -> bool:
    return (isinstance(rid, str) and bool(rid)) or (isinstance(rid, int) and not isinstance(rid, bool))


def parse_record(obj: dict, line: int, base_dir: Path, defaults: dict) -> Record:
    """Check one record's task, fields and sampling values; raise ``RecordError`` naming the
    problem."""
    task = obj.get("task")
    if task not in TASKS:
        raise RecordError(f"'task' must be one of {', '.join(TASKS)}, got {task!r}")
    known = (*COMMON_FIELDS, *TASK_FIELDS[task])
    unknown = sorted(set(obj) - set(known))
    if unknown:
        raise RecordError(f"unknown field(s) {', '.join(map(repr, unknown))} for task {task!r}; "
                          f"known: {', '.join(known)}")
    _check_task_fields(obj, task)
    path = _document_path(obj, base_dir)
    return Record(line, obj["id"], task, obj, _sampling_params(obj, task, defaults), path,
                  _document_key(obj, path))


def _check_task_fields(obj: dict, task: str) -> None:
    def non_empty_str(name: str) -> bool:
        return isinstance(obj.get(name), str) and bool(obj[name].strip())

    if task == "generate" and not non_empty_str("prompt"):
        raise RecordError("a generate record needs 'prompt': a non-empty string")
    if task == "ask":
        qs = obj.get("questions")
        if not isinstance(qs, list) or not qs or not all(isinstance(q, str) and q.strip() for q in qs):
            raise RecordError("'questions' must be a non-empty list of non-empty strings")
    if "instructions" in obj and not non_empty_str("instructions"):
        raise RecordError("'instructions' must be a non-empty string")
    if "chat" in obj and not isinstance(obj["chat"], bool):
        raise RecordError(f"'chat' must be true or false, got {obj['chat']!r}")
    given = [k for k in ("document", "document_path") if k in obj]
    if len(given) > 1:
        raise RecordError("give 'document' or 'document_path', not both")
    if task != "generate" and not given:
        raise RecordError(f"a {task} record needs 'document' (the text) or 'document_path'")
    if given and not non_empty_str(given[0]):
        raise RecordError(f"'{given[0]}' must be a non-empty string")


def _document_path(obj: dict, base_dir: Path) -> Path | None:
    if "document_path" not in obj:
        return None
    path = Path(obj["document_path"]).expanduser()
    return path if path.is_absolute() else base_dir / path


def _document_key(obj: dict, path: Path | None) -> str:
    if path is not None:
        return f"path:{path.resolve()}"
    if "document" in obj:
        return "text:" + hashlib.sha256(obj["document"].encode("utf-8")).hexdigest()
    return ""


def _sampling_params(obj: dict, task: str, defaults: dict) -> SamplingParams:
    values = {k: v for k, v in defaults.items() if v is not None}
    values.setdefault("max_tokens", TASK_MAX_TOKENS[task])
    if task in ("summarize", "ask"):
        values.setdefault("frequency_penalty", tasks.TASK_FREQUENCY_PENALTY)
    values.update({k: obj[k] for k in SAMPLING_FIELDS if k in obj})
    try:
        return SamplingParams(**values)
    except (ValueError, TypeError) as err:
        raise RecordError(str(err)) from err


# ---------------------------------------------------------------- grouping and sharding

def group_records(records: list[Record]) -> list[list[Record]]:
    """Records sharing a document, groups in order of first appearance, records in input order."""
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.document_key or f"none:{r.key}", []).append(r)
    return list(groups.values())


def group_weight(group: list[Record]) -> int:
    """Rough cost of a group: the document's characters once plus ~4 characters per token that
    may be generated."""
    first = group[0]
    if first.document_path is not None:
        doc = first.document_path.stat().st_size if first.document_path.is_file() else 0
    else:
        doc = len(first.fields.get("document", ""))
    outputs = sum(len(r.fields.get("questions", [None])) * r.params.max_tokens for r in group)
    return doc + 4 * outputs + sum(len(r.fields.get("prompt", "")) for r in group)


def shard(groups: list[list[Record]], rank: int, world: int) -> list[list[Record]]:
    """The groups worker ``rank`` of ``world`` runs: heaviest first to the least loaded worker
    (ties: lowest rank), so every worker computes the same split; kept in input order."""
    loads = [0] * world
    mine = []
    weights = [group_weight(g) for g in groups]
    for i in sorted(range(len(groups)), key=lambda i: (-weights[i], i)):
        worker = min(range(world), key=lambda w: (loads[w], w))
        loads[worker] += weights[i]
        if worker == rank:
            mine.append(i)
    return [groups[i] for i in sorted(mine)]


# ---------------------------------------------------------------- result files

def part_path(output: Path, rank: int) -> Path:
    return output.with_name(f"{output.name}.part{rank}")


def part_paths(output: Path) -> list[Path]:
    return sorted(Path(p) for p in glob.glob(glob.escape(str(output)) + ".part*"))


def read_results(path: Path) -> list[dict]:
    """The complete lines of a result file (a last line without its newline is ignored)."""
    if not path.exists():
        return []
    data = path.read_bytes()
    results = []
    for n, line in enumerate(data[: data.rfind(b"\n") + 1].decode("utf-8").splitlines(), 1):
        try:
            obj = json.loads(line)
        except json.JSONDecodeError:
            obj = None
        if not isinstance(obj, dict):
            raise ConfigError(f"{path} line {n} is not a result line; remove it or choose another --output")
        results.append(obj)
    return results


def done_keys(output: Path) -> set[str]:
    """Resume keys of every record with a line in ``output`` or in one of its parts."""
    return {result_key(r) for path in [output, *part_paths(output)] for r in read_results(path)}


class ResultLog:
    """An append-only JSONL file. Each line is flushed and fsync'd before the next record
    starts. An unfinished last line (a killed writer) is cut off when the file is opened."""

    def __init__(self, path: Path) -> None:
        if path.exists():
            data = path.read_bytes()
            keep = data.rfind(b"\n") + 1
            if keep < len(data):
                os.truncate(path, keep)
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a", encoding="utf-8")

    def write(self, result: dict) -> None:
        self.file.write(json.dumps(result, ensure_ascii=False) + "\n")
        self.file.flush()
        os.fsync(self.file.fileno())

    def close(self) -> None:
        self.file.close()


def merge_parts(output: Path) -> int:
    """Append the parts' lines whose keys ``output`` lacks, then delete the parts. Safe to
    repeat after a kill: lines already merged are not written twice."""
    parts = part_paths(output)
    if not parts:
        return 0
    log = ResultLog(output)
    done = {result_key(r) for r in read_results(output)}
    written = 0
    try:
        for part in parts:
            for result in read_results(part):
                if result_key(result) not in done:
                    log.write(result)
                    done.add(result_key(result))
                    written += 1
    finally:
        log.close()
    for part in parts:
        part.unlink()
    return written


def error_line(item: Record | BadLine, error: BaseException | str) -> dict:
    if isinstance(error, BaseException):
        error = str(error) if isinstance(error, ValueError) else f"{type(error).__name__}: {error}"
    return {"id": item.id, "line": item.line, "task": item.task, "error": error}


# ---------------------------------------------------------------- running records

@functools.lru_cache(maxsize=4)  # the records of a group read their document once
def _read_file(path: Path) -> str:
    return tasks.read_document(path)


def _document(record: Record) -> str | None:
    if record.document_path is not None:
        return _read_file(record.document_path)
    text = record.fields.get("document")
    return None if text is None else tasks.Text(text)  # text, even if it names a file


def _generate_content(record: Record) -> str:
    document = _document(record)
    prompt = record.fields["prompt"]
    return tasks.document_prompt(document, prompt) if document else prompt


def run_generates(llm: Any, records: list[Record]) -> Iterator[dict]:
    """Generate records as one batch (each document's common prefix prefilled once)."""
    ready = []
    for r in records:
        try:
            ids = tasks.prompt_ids(llm, _generate_content(r), chat=r.fields.get("chat", True))
            llm.engine.check_request(len(ids), r.params.max_tokens)
            ready.append((r, ids))
        except Exception as err:  # noqa: BLE001 - any failure of one record is its error line
            yield error_line(r, err)
    if not ready:
        return
    try:
        outputs, _ = tasks.generate_sharing_prefixes(
            llm, [ids for _, ids in ready], [r.params for r, _ in ready],
            keys=[r.document_key or None for r, _ in ready])
    except Exception as err:  # noqa: BLE001 - the batch failed: each record gets the reason
        for r, _ in ready:
            yield error_line(r, err)
        return
    for (r, _), out in zip(ready, outputs):
        yield {"id": r.id, "task": r.task, **tasks.usage(out)}


def run_document_task(llm: Any, record: Record) -> dict:
    """One summarize or ask record; a failure becomes its error line."""
    params, f = record.params, record.fields
    try:
        document = _document(record)
        if record.task == "summarize":
            result = tasks.summarize(llm, document, instructions=f.get("instructions"),
                                     max_tokens=params.max_tokens, sampling_params=params)
        else:
            result = tasks.ask(llm, document, f["questions"], max_tokens=params.max_tokens,
                               sampling_params=params)
    except Exception as err:  # noqa: BLE001 - any failure of one record is its error line
        return error_line(record, err)
    return {"id": record.id, "task": record.task, **asdict(result)}


def _runs(records: list[Record], max_in_flight: int) -> Iterator[list[Record]]:
    """Consecutive generate records up to ``max_in_flight`` together; other tasks one by one."""
    run: list[Record] = []
    for r in records:
        if r.task == "generate":
            run.append(r)
            if len(run) < max_in_flight:
                continue
        if run:
            yield run
            run = []
        if r.task != "generate":
            yield [r]
    if run:
        yield run


def run_records(llm: Any, records: list[Record], max_in_flight: int) -> Iterator[dict]:
    """A result line per record, each as soon as it (or its generate batch) finishes."""
    for run in _runs(records, max_in_flight):
        if run[0].task == "generate":
            yield from run_generates(llm, run)
        else:
            yield run_document_task(llm, run[0])


# ---------------------------------------------------------------- progress

def progress_enabled(mode: str, stream: TextIO | None = None) -> bool:
    """Whether to draw progress bars: ``on``; ``off``; ``auto`` when ``stream`` (stderr) is a
    terminal."""
    stream = stream if stream is not None else sys.stderr
    return mode == "on" or (mode == "auto" and _isatty(stream))


def _isatty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


def progress_bar(desc: str, total: int | None, unit: str, enabled: bool,
                 stream: TextIO | None = None, **kwargs: Any) -> Any:
    """A tqdm bar on ``stream`` (stderr by default) that draws nothing when not ``enabled``."""
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, unit=unit, file=stream if stream is not None else sys.stderr,
                disable=not enabled, dynamic_ncols=True, mininterval=0.2, **kwargs)


class ProgressBar:
    """Records done of total, output tokens per second and the time left: a tqdm bar on stderr;
    silent when disabled."""

    FORMAT = "{desc}: {percentage:3.0f}%|{bar}| {n_fmt}/{total_fmt} records [{elapsed}<{remaining}{postfix}]"

    def __init__(self, total: int, enabled: bool, stream: TextIO | None = None, desc: str = "batch") -> None:
        self.total, self.enabled = total, enabled and total > 0
        self.done = self.tokens = 0
        self.start = time.perf_counter()
        self.bar = progress_bar(desc, total, "records", self.enabled, stream, bar_format=self.FORMAT,
                                postfix="0.0 tok/s")

    def update(self, records: int = 1, tokens: int = 0) -> None:
        self.done += records
        self.tokens += tokens
        if self.enabled:
            elapsed = time.perf_counter() - self.start
            self.bar.set_postfix_str(f"{self.tokens / elapsed if elapsed else 0:.1f} tok/s", refresh=False)
            self.bar.update(records)

    def close(self) -> None:
        self.bar.close()


# ---------------------------------------------------------------- one worker

def todo_records(job: BatchJob, rank: int, world: int) -> tuple[list[Record], list[BadLine]]:
    """Records (and, on rank 0, bad lines) of this worker that have no result line yet."""
    records, bad = read_records(job.input, job.defaults)
    mine = [r for g in shard(group_records(records), rank, world) for r in g]
    done = done_keys(job.output)
    return ([r for r in mine if r.key not in done],
            [b for b in bad if b.key not in done] if rank == 0 else [])


def run_shard(job: BatchJob, rank: int, world: int, show_progress: bool) -> None:
    """Run this worker's share, appending to OUTPUT (one worker) or OUTPUT.partRANK."""
    log = ResultLog(job.output if world == 1 else part_path(job.output, rank))
    try:
        todo, bad = todo_records(job, rank, world)
        for b in bad:
            log.write(error_line(b, b.error))
        if todo:
            _run_todo(job, todo, log, show_progress)
    finally:
        log.close()


def _run_todo(job: BatchJob, todo: list[Record], log: ResultLog, show_progress: bool) -> None:
    from longctx.entrypoints.api import LLM

    llm = LLM(**job.engine_kwargs)
    progress = ProgressBar(len(todo), show_progress)
    try:
        for result in run_records(llm, todo, job.config.max_in_flight):
            log.write(result)
            progress.update(tokens=result.get("completion_tokens", 0))
    finally:
        progress.close()
        llm.close()


def _shard_process(job: BatchJob, rank: int, world: int) -> None:
    run_shard(job, rank, world, show_progress=False)


# ---------------------------------------------------------------- jobs

def delete_outputs(output: Path) -> None:
    for path in [output, *part_paths(output)]:
        path.unlink(missing_ok=True)


def check_paths(job: BatchJob) -> None:
    """The input is a file and the output is not the input."""
    if not job.input.is_file():
        raise ConfigError(f"cannot read the input {job.input}: no such file")
    if job.input.resolve() == job.output.resolve():
        raise ConfigError("--output must not be the input file")


def run_batch(job: BatchJob) -> None:
    """Run a job to the end: alone, as ``--num-workers`` processes, or as one rank of torchrun
    (``RANK``/``WORLD_SIZE`` set; rank 0 merges the parts once all ranks are done)."""
    check_paths(job)
    rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
    if world > 1:
        if job.config.num_workers > 1:
            raise ConfigError("under torchrun every rank is one worker: leave --num-workers at 1")
        _run_distributed(job, rank, world)
        return
    if job.config.overwrite:
        delete_outputs(job.output)
    if job.config.num_workers > 1:
        _run_spawned(job)
    else:
        run_shard(job, 0, 1, progress_enabled(job.config.progress))
    merge_parts(job.output)


def _run_spawned(job: BatchJob) -> None:
    n = job.config.num_workers
    kwargs = dict(job.engine_kwargs)
    if not kwargs.get("num_threads"):
        kwargs["num_threads"] = max(1, (os.cpu_count() or 1) // n)
    child = replace(job, engine_kwargs=kwargs)
    total = sum(len(todo) + len(bad) for todo, bad in (todo_records(job, rank, n) for rank in range(n)))
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_shard_process, args=(child, rank, n), name=f"longctx-batch-{rank}")
             for rank in range(n)]
    for p in procs:
        p.start()
    _follow_parts(job.output, procs, ProgressBar(total, progress_enabled(job.config.progress)))
    failed = [f"worker {rank} (exit code {p.exitcode})" for rank, p in enumerate(procs) if p.exitcode]
    if failed:
        raise BatchError(f"{', '.join(failed)} failed; finished records are kept in "
                           f"{job.output}.part*: run the same command again to resume")


def _follow_parts(output: Path, procs: list, progress: ProgressBar) -> None:
    """Wait for the workers, counting new lines in their parts for the progress bar."""
    offsets: dict[Path, int] = {p: p.stat().st_size for p in part_paths(output)}
    try:
        while any(p.is_alive() for p in procs):
            time.sleep(0.5)
            for path in part_paths(output):
                for result in _new_lines(path, offsets):
                    progress.update(tokens=result.get("completion_tokens", 0))
        for p in procs:
            p.join()
    finally:
        progress.close()


def _new_lines(path: Path, offsets: dict[Path, int]) -> list[dict]:
    with open(path, "rb") as f:
        f.seek(offsets.get(path, 0))
        data = f.read()
    complete = data[: data.rfind(b"\n") + 1]
    offsets[path] = offsets.get(path, 0) + len(complete)
    return [json.loads(line) for line in complete.splitlines()]


def _run_distributed(job: BatchJob, rank: int, world: int) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", timeout=DISTRIBUTED_TIMEOUT)
    try:
        if job.config.overwrite and rank == 0:
            delete_outputs(job.output)
        dist.barrier()
        run_shard(job, rank, world, rank == 0 and progress_enabled(job.config.progress))
        dist.barrier()
        if rank == 0:
            merge_parts(job.output)
    finally:
        dist.destroy_process_group()


def summary_line(output: Path, seconds: float) -> str:
    """One line for the end of a job: result lines in the output, of which errors."""
    results = read_results(output)
    errors = sum("error" in r for r in results)
    return f"{output}: {len(results)} records done ({errors} errors); this run took {seconds:.1f} s"
