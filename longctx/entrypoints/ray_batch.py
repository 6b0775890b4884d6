"""Batch jobs on a Ray cluster: ``longctx batch INPUT --output OUT --ray [ADDRESS]``, and
``LongctxPredictor`` for Ray Data's ``map_batches``.

Owns: starting or joining the cluster, one engine per Ray actor (``LongctxPredictor``, built
once in the actor), dealing whole document groups to the actors (heaviest first, each to the
next actor that is free), streaming each result line back to the driver, which is the only
writer of OUTPUT; the batch-dict conversion for ``map_batches``.
Never: records, grouping, resume keys, result and error lines, or running records: all of that
is ``longctx.entrypoints.batch``'s, so a Ray job reads the same input and writes the same lines as a local
one. Ray is imported only here, and only when used (``pip install 'longctx[ray]'``).

    longctx batch jobs.jsonl --output results.jsonl --ray                 # local cluster
    longctx batch jobs.jsonl --output results.jsonl --ray auto --ray-actors 4

    ds = ray.data.read_text("jobs.jsonl")                                  # one JSON line per row
    out = ds.map_batches(LongctxPredictor, fn_constructor_kwargs={"engine_kwargs": {"model": m}},
                         compute=ray.data.ActorPoolStrategy(size=2),      # 2 actors, 2 engines
                         batch_size=16)                                    # rows: {"key", "result"}

Documents named by ``document_path`` are read by the driver and sent with their group, so the
workers need no access to the input's folder (only to the model).
"""

from __future__ import annotations

import collections
import json
import math
import os
import queue
import threading
from dataclasses import dataclass, field, replace
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from longctx.entrypoints import batch
from longctx.entrypoints.batch import (BatchError, BatchJob, ProgressBar, Record, ResultLog, check_paths,
                           delete_outputs, error_line, group_records, group_weight, merge_parts,
                           parse_lines, progress_enabled, result_key, run_records, todo_records)
from longctx.config import ConfigError

INSTALL_HINT = "Ray is not installed: install longctx[ray] (pip install 'longctx[ray]')"


def require_ray() -> Any:
    """The ``ray`` module, or a ``ConfigError`` saying how to install it."""
    try:
        import ray
    except ImportError as err:
        raise ConfigError(INSTALL_HINT) from err
    return ray


# ---------------------------------------------------------------- the engine of one actor

class LongctxPredictor:
    """One ``LLM`` per Ray actor, built once when the actor starts.

    As a Ray Data callable class, ``__call__`` takes a batch (a dict of columns as
    ``map_batches`` gives it, a pandas DataFrame or a pyarrow Table) whose rows are records:
    either a ``text`` column holding one JSON line each (``ray.data.read_text``), or one column
    per record field (``read_json``, ``from_items``; missing fields may be null). An optional
    ``line`` column numbers the rows for error lines. Records sharing a document run one after
    another; it returns ``{"key": [...], "result": [...]}``: each record's resume key
    (``"id:<id>"``, or ``"line:<n>"`` for a row without a usable id) and its result line as JSON
    text, the same line ``longctx batch`` writes (an error line for a bad record).
    ``defaults`` are sampling values for records that leave them out (greedy unless they say
    otherwise, as in ``longctx batch``); a relative ``document_path`` is relative to
    ``base_dir`` (default: the actor's working directory).

    ``longctx batch --ray`` runs it as a Ray actor and calls ``run`` with whole groups.
    """

    def __init__(self, engine_kwargs: dict | None = None, *, defaults: dict | None = None,
                 max_in_flight: int = 16, base_dir: str | os.PathLike | None = None) -> None:
        from longctx.entrypoints.api import LLM

        self.llm = LLM(**(engine_kwargs or {}))
        self.defaults = {"temperature": 0.0, **(defaults or {})}  # greedy, as longctx batch
        self.max_in_flight = max_in_flight
        self.base_dir = Path(base_dir) if base_dir is not None else Path.cwd()

    def run(self, records: list[Record]) -> Iterator[dict]:
        """Result lines of ``records`` (in group order), each as soon as it finishes."""
        yield from run_records(self.llm, records, self.max_in_flight)

    def info(self) -> dict:
        """Where this actor runs (for logs and tests)."""
        import socket

        return {"pid": os.getpid(), "host": socket.gethostname()}

    def __call__(self, batch_data: Any) -> dict[str, list]:
        lines = list(_batch_rows(batch_data))
        records, bad = parse_lines(lines, self.base_dir, self.defaults)
        results = [error_line(b, b.error) for b in bad]
        records = [r for g in group_records(records) for r in g]
        results += list(self.run(records))
        return {"key": [result_key(r) for r in results],
                "result": [json.dumps(r, ensure_ascii=False) for r in results]}

    def close(self) -> None:
        self.llm.close()


def _batch_rows(data: Any) -> Iterator[tuple[int | None, str | dict]]:
    """(line number or None, JSON text or record dict) for each row of a Ray Data batch."""
    if hasattr(data, "to_pydict"):  # pyarrow.Table
        data = data.to_pydict()
    elif hasattr(data, "to_dict") and hasattr(data, "columns"):  # pandas.DataFrame
        data = data.to_dict("list")
    columns = {k: list(v) for k, v in dict(data).items()}
    n = len(next(iter(columns.values()))) if columns else 0
    lines = columns.pop("line", [None] * n)
    for i in range(n):
        line = _plain(lines[i])
        if set(columns) == {"text"}:
            yield line, _plain(columns["text"][i])
            continue
        row = {}
        for name, values in columns.items():
            value = _plain(values[i])
            if value is not None:
                row[name] = value
        yield line, row


def _plain(value: Any) -> Any:
    """A numpy/pandas value as plain Python; None for nulls (NaN, None, pandas NA); whole
    floats as ints."""
    if hasattr(value, "tolist"):  # numpy arrays and scalars
        value = value.tolist()
    if isinstance(value, list):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, float):  # an integer column with nulls comes as floats
        return None if math.isnan(value) else int(value) if value.is_integer() else value
    if value is None:
        return None
    if type(value).__name__ in ("NAType", "NaTType"):
        return None
    return value


# ---------------------------------------------------------------- the driver of a job

@dataclass
class RayBatchReport:
    """What a Ray run did: actors started, where each ran, which actor ran each record."""
    actors: int = 0
    actor_info: list[dict] = field(default_factory=list)
    actor_of: dict[str, int] = field(default_factory=dict)  # result key -> actor index
    written: int = 0


def run_ray_batch(job: BatchJob, address: str | None = None, num_actors: int = 0) -> RayBatchReport:
    """Run a job on Ray: ``address`` None or "" starts or joins a local cluster (``ray.init()``),
    else names one ("auto", "ray://host:10001"); an already initialized Ray is used as it is.
    ``num_actors`` 0: one per document group, at most one per CPU (GPU with ``device`` cuda)
    of the cluster. Resumes like ``run_batch``: records with a line in OUTPUT are skipped."""
    check_paths(job)
    if num_actors < 0:
        raise ConfigError(f"--ray-actors must be >= 0, got {num_actors}")
    if job.config.num_workers > 1:
        raise ConfigError("--ray runs the job on Ray actors: leave --num-workers at 1")
    ray = require_ray()
    if job.config.overwrite:
        delete_outputs(job.output)
    merge_parts(job.output)  # parts a killed --num-workers run left behind
    todo, bad = todo_records(job, 0, 1)
    report = RayBatchReport()
    log = ResultLog(job.output)
    try:
        for b in bad:
            log.write(error_line(b, b.error))
            report.written += 1
        if todo:
            _run_groups(ray, job, group_records(todo), address, num_actors, log, report)
    finally:
        log.close()
    return report


def _run_groups(ray: Any, job: BatchJob, groups: list[list[Record]], address: str | None,
                num_actors: int, log: ResultLog, report: RayBatchReport) -> None:
    started = not ray.is_initialized()
    if started:
        try:
            ray.init(address=address or None)
        except (ConnectionError, RuntimeError) as err:
            where = f"the Ray cluster at {address!r}" if address else "a local Ray cluster"
            raise ConfigError(f"cannot start or join {where}: {err}") from err
    progress = ProgressBar(sum(map(len, groups)), progress_enabled(job.config.progress))
    actors: list = []
    try:
        n, options, kwargs = _placement(ray, job.engine_kwargs, len(groups), num_actors)
        actor_class = ray.remote(LongctxPredictor).options(**options)
        actors = [actor_class.remote(kwargs, max_in_flight=job.config.max_in_flight) for _ in range(n)]
        report.actors = n
        report.actor_info = [{} for _ in range(n)]
        weights = [group_weight(g) for g in groups]
        pending = collections.deque(groups[i] for i in sorted(range(len(groups)),
                                                              key=lambda i: (-weights[i], i)))
        events: queue.Queue = queue.Queue()
        lock = threading.Lock()
        for i, actor in enumerate(actors):
            threading.Thread(target=_feed, args=(ray, i, actor, pending, lock, events, report),
                             name=f"longctx-ray-{i}", daemon=True).start()
        failures = _collect(events, n, log, progress, report)
        if failures or pending:
            raise BatchError(f"{'; '.join(failures)}; finished records are kept in {job.output}: "
                             "run the same command again to resume")
    finally:
        progress.close()
        for actor in actors:
            _kill(ray, actor)
        if started:
            ray.shutdown()


def _placement(ray: Any, engine_kwargs: dict, num_groups: int, num_actors: int) -> tuple[int, dict, dict]:
    """How many actors, their Ray resources, and their engine options (``num_threads`` set)."""
    kwargs = dict(engine_kwargs)
    threads = int(kwargs.get("num_threads") or 0)
    resources = ray.cluster_resources()
    if str(kwargs.get("device", "cpu")).startswith("cuda"):
        kwargs["device"] = "cuda"  # Ray gives each actor its GPU as device 0
        n = num_actors or max(1, min(num_groups, int(resources.get("GPU", 0)) or 1))
        return min(n, num_groups), {"num_gpus": 1, "num_cpus": max(threads, 1)}, kwargs
    cpus = max(1, int(resources.get("CPU", 1)))
    n = min(num_actors or max(1, cpus // max(threads, 1)), num_groups)
    if not threads:
        node_cpus = max((int(node.get("Resources", {}).get("CPU", 0)) for node in ray.nodes()
                         if node.get("Alive")), default=cpus)
        threads = max(1, min(cpus // n, node_cpus))
        kwargs["num_threads"] = threads
    return n, {"num_cpus": threads}, kwargs


def _feed(ray: Any, index: int, actor: Any, pending: collections.deque, lock: threading.Lock,
          events: queue.Queue, report: RayBatchReport) -> None:
    """One actor's loop (a driver thread): take the next group, stream its results back; when
    nothing is left, free the actor's resources."""
    try:
        report.actor_info[index] = ray.get(actor.info.remote())
        while True:
            with lock:
                if not pending:
                    break
                group = pending.popleft()
            ready, errors = _with_documents(group)
            for result in errors:
                events.put(("result", index, result))
            if ready:
                for ref in actor.run.remote(ready):
                    events.put(("result", index, ray.get(ref)))
    except Exception as err:  # noqa: BLE001 - the actor or its engine failed: the job reports it
        events.put(("failed", index, _reason(err)))
    finally:
        _kill(ray, actor)
        events.put(("done", index, None))


def _with_documents(group: list[Record]) -> tuple[list[Record], list[dict]]:
    """The group's records with their documents' text in place of their paths (read here, once
    per document), and error lines for those whose document cannot be read."""
    ready, errors = [], []
    for r in group:
        if r.document_path is None:
            ready.append(r)
            continue
        try:
            text = batch._document(r)
        except Exception as err:  # noqa: BLE001 - as run_records would report it
            errors.append(error_line(r, err))
            continue
        ready.append(replace(r, document_path=None, fields={**r.fields, "document": text}))
    return ready, errors


def _collect(events: queue.Queue, live: int, log: ResultLog, progress: ProgressBar,
             report: RayBatchReport) -> list[str]:
    """Write results as they arrive until every actor's loop has ended; the failures, one per
    reason."""
    failures: dict[str, list[int]] = {}
    while live:
        try:
            kind, index, payload = events.get(timeout=0.5)
        except queue.Empty:
            continue
        if kind == "result":
            log.write(payload)
            report.actor_of[result_key(payload)] = index
            report.written += 1
            progress.update(tokens=payload.get("completion_tokens", 0))
        elif kind == "failed":
            failures.setdefault(payload, []).append(index)
        else:
            live -= 1
    return [f"Ray actor{'s' if len(ids) > 1 else ''} {', '.join(map(str, sorted(ids)))} failed: {reason}"
            for reason, ids in failures.items()]


def _reason(err: BaseException) -> str:
    """The last line of a Ray error (the original exception), else its type and text."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, BaseException):
        return f"{type(cause).__name__}: {cause}"
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    return lines[-1] if lines else type(err).__name__


def _kill(ray: Any, actor: Any) -> None:
    try:
        ray.kill(actor)
    except Exception:  # noqa: BLE001 - already gone, or Ray is shutting down
        pass
