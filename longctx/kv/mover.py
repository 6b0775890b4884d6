"""KV tier moves, planned by the prefix store as plain data and carried out here, off the
scheduler: the runner executes a step's orders before its forward, and disk reads and writes
run on a background thread.

Owns: the orders (``HostSave``, ``HostLoad``, ``DiskSave``, ``DiskLoad``), executing them on
the device, host and disk pools, and the one background thread of the disk tier.
Never: deciding what moves (``longctx.kv.prefix_cache`` and the radix tree plan), or which
request waits for what (the scheduler holds a request whose pages are being read in its
``loading`` state; the engine hands finished reads back to it); never waiting on the disk
longer than the disk tier's deadline.

Order and overlap. ``schedule()`` may free a device block by writing its page back to the host
and hand the block to another request in the same step, so a step's orders run in the order
they were planned, all before the step's forward writes any KV. On CUDA the host copies run
on a side stream, page by page and layer by layer between pinned host pages and device pages,
and the forward's stream waits on an event for them (the host thread never waits); on the CPU
they are plain copies. A disk page is written from a copy of its bytes taken when the order
runs, so the source page may be reused right after; the file (hash, HMAC, rename) is written
by the background thread. A disk read is a request's alone: its blocks are reserved but not yet
in the radix tree, the thread reads and checks the files, and the engine writes the good pages
into the blocks at the start of a later step, so steps that do not need those pages go on
meanwhile.

Deadlines. Every file operation of the disk tier is bounded by ``disk_timeout_s``
(``longctx.kv.disk_io``), so each disk job ends; ``flush`` and ``close`` still wait only while
the thread makes progress, and give up after one deadline without any.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch

log = logging.getLogger(__name__)

READ_THREADS = 2  # page files read and authenticated at once (HMAC releases the GIL)


@dataclass(frozen=True)
class HostSave:
    """Write device pages back to host pages (eviction from the device)."""

    device_ids: tuple[int, ...]
    host_ids: tuple[int, ...]


@dataclass(frozen=True)
class HostLoad:
    """Copy host pages into device pages (a prefix hit on the host tier)."""

    host_ids: tuple[int, ...]
    device_ids: tuple[int, ...]


@dataclass(frozen=True)
class DiskSave:
    """Write pages to the disk tier under ``keys``, from the device (``tier="device"``) or
    from the host tier."""

    keys: tuple[str, ...]
    page_ids: tuple[int, ...]
    tier: str


@dataclass
class DiskLoad:
    """A request's pages to read from disk into its reserved device blocks. The background
    thread fills ``buffer`` ([P, L, 2, BS, Hkv, D] on the CPU) and ``num_read``: the pages
    read, up to the first missing or bad one."""

    request_id: str
    keys: tuple[str, ...]
    device_ids: tuple[int, ...]
    buffer: torch.Tensor | None = None
    num_read: int = 0


KVOrder = HostSave | HostLoad | DiskSave


class KVMover:
    def __init__(self, device_kv, host_kv=None, disk=None) -> None:
        """``device_kv``: a ``DeviceKVPool`` (or anything with its ``read_pages``,
        ``write_pages`` and ``device``, as the sequence-parallel pool); ``host_kv``: a
        ``HostKVPool`` or None; ``disk``: a ``DiskKVStore`` or None."""
        self.device_kv, self.host_kv, self.disk = device_kv, host_kv, disk
        self.device = torch.device(device_kv.device)
        self.cuda = self.device.type == "cuda" and not device_kv.spans_ranks
        self.stream = torch.cuda.Stream(self.device) if self.cuda else None
        self._event = None  # the side stream's last copy, for the forward to wait on
        self._jobs: queue.Queue = queue.Queue()
        self._done: queue.Queue = queue.Queue()
        self._thread: threading.Thread | None = None
        self._progress = threading.Condition()  # jobs submitted and finished, for ``flush``
        self._num_submitted = self._num_finished = 0
        self.num_orders = 0

    # ------------------------------------------------------------------ orders (main thread)

    def execute(self, orders: list[KVOrder]) -> None:
        """Carry out ``orders`` in order (before the step's forward)."""
        for order in orders:
            self.num_orders += 1
            if isinstance(order, HostSave):
                self._host_copy(list(order.device_ids), list(order.host_ids), to_host=True)
            elif isinstance(order, HostLoad):
                self._host_copy(list(order.host_ids), list(order.device_ids), to_host=False)
            elif isinstance(order, DiskSave):
                self._disk_save(order)
            else:
                raise TypeError(f"not a KV order: {order!r}")
        if self._event is not None:  # the forward's stream waits for the side stream's copies
            torch.cuda.current_stream(self.device).wait_event(self._event)
            self._event = None

    def _host_copy(self, src_ids: list[int], dst_ids: list[int], to_host: bool) -> None:
        """Pages between the device and the host pool: plain copies on the CPU, the side
        stream between device and pinned host pages on CUDA."""
        if not self.cuda:
            (self.host_kv.write_back if to_host else self.host_kv.load)(src_ids, dst_ids)
            return
        src, dst = ((self.device_kv, self.host_kv) if to_host else (self.host_kv, self.device_kv))
        self._on_side_stream(lambda: self._copy_pages(src.layers, src_ids, dst.layers, dst_ids))

    def _on_side_stream(self, copy) -> None:
        compute = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(compute)  # the pages' last writes (earlier forwards) are done
        with torch.cuda.stream(self.stream):
            copy()
        self._event = self.stream.record_event()

    @staticmethod
    def _copy_pages(src_layers, src_ids: list[int], dst_layers, dst_ids: list[int]) -> None:
        """Page by page, layer by layer (pinned host pages: asynchronous copies)."""
        for (sk, sv), (dk, dv) in zip(src_layers, dst_layers):
            for s, d in zip(src_ids, dst_ids):
                dk[d].copy_(sk[s], non_blocking=True)
                dv[d].copy_(sv[s], non_blocking=True)

    def _disk_save(self, order: DiskSave) -> None:
        if order.tier == "device":
            if self._event is not None:  # a host load into these blocks earlier in this step
                torch.cuda.current_stream(self.device).wait_event(self._event)
            pages = self.device_kv.read_pages(list(order.page_ids))  # a copy on the CPU
        else:
            if self.stream is not None:  # host pages a side-stream copy may still be writing
                self.stream.synchronize()
            pages = self.host_kv.pages(list(order.page_ids))
        for key, page in zip(order.keys, pages):
            self.disk.put(key, page)
        self._submit(("write",))

    def write_pages(self, device_ids: list[int], pages: torch.Tensor) -> None:
        """Pages read from disk ([P, L, 2, BS, Hkv, D]) into their device blocks (main
        thread, a later step)."""
        if device_ids:
            self.device_kv.write_pages(device_ids, pages)

    # ------------------------------------------------------------------ the disk thread

    def submit_read(self, load: DiskLoad) -> None:
        self._submit(("read", load))

    def completed_reads(self, wait: float = 0.0) -> list[DiskLoad]:
        """Reads the thread has finished; with ``wait``, block up to that long for one."""
        done = []
        try:
            done.append(self._done.get(timeout=wait) if wait else self._done.get_nowait())
            while True:
                done.append(self._done.get_nowait())
        except queue.Empty:
            pass
        return done

    def _submit(self, job: tuple) -> None:
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._work, name="longctx-kv-disk", daemon=True)
            self._thread.start()
        with self._progress:
            self._num_submitted += 1
        self._jobs.put(job)

    def _work(self) -> None:
        while True:
            job = self._jobs.get()
            if job[0] == "stop":
                return
            try:
                if job[0] == "write":
                    self.disk.flush()
                else:
                    self._read(job[1])
            except Exception:  # noqa: BLE001 - a failed disk job is a miss, never a crash
                log.exception("disk KV job %s failed", job[0])
                if job[0] == "read":
                    self._done.put(job[1])
            finally:
                with self._progress:
                    self._num_finished += 1
                    self._progress.notify_all()

    def _read(self, load: DiskLoad) -> None:
        """Fetch (read and authenticate) the pages, ``READ_THREADS`` at once, then accept them
        in order up to the first miss: the pages after a bad one are neither used nor counted,
        as a page-by-page read would have it, but quarantined (this run rewrites them)."""
        load.buffer = torch.empty((len(load.keys), *self.disk.page_shape), dtype=self.disk.dtype,
                                  pin_memory=self.cuda)
        fetches = self._fetch_in_order(load.keys)
        try:
            for i, fetched in enumerate(fetches):
                if self.disk.accept(load.keys[i], fetched, out=load.buffer[i]) is None:
                    self.disk.quarantine_after(fetched[1], load.keys[i + 1:])
                    break
                load.num_read = i + 1
        finally:
            fetches.close()
        self._done.put(load)

    def _fetch_in_order(self, keys: Sequence[str]) -> Iterator[tuple]:
        """``disk.fetch`` of each key, in order, run ``READ_THREADS`` at a time on daemon
        threads (each fetch ends within the disk deadline); the threads stop taking keys once
        the caller stops reading."""
        results: list = [None] * len(keys)
        ready = [threading.Event() for _ in keys]
        indices = iter(range(len(keys)))  # (``next`` on it is atomic: the threads share it)
        stop = threading.Event()

        def reader() -> None:
            for i in indices:
                if stop.is_set():
                    return
                try:
                    results[i] = self.disk.fetch(keys[i])
                except Exception as err:  # noqa: BLE001 - a bug, not the file's fault: a plain miss
                    log.exception("disk KV read of page %s failed", keys[i][:16])
                    results[i] = (None, f"error ({type(err).__name__})")
                finally:
                    ready[i].set()

        for _ in range(min(READ_THREADS, len(keys))):
            threading.Thread(target=reader, name="longctx-kv-read", daemon=True).start()
        try:
            for i in range(len(keys)):
                ready[i].wait()
                yield results[i]
        finally:
            stop.set()

    def flush(self) -> None:
        """Wait until every disk job submitted so far is done (while the thread makes
        progress), write what is still queued, and wait for the side stream."""
        if self._thread is not None and self._thread.is_alive():
            self._wait_for_jobs()
        if self.disk is not None:
            self.disk.flush()
        if self.stream is not None:
            self.stream.synchronize()

    def _wait_for_jobs(self) -> None:
        """Block until the disk thread has finished every job submitted, giving up after one
        disk deadline in which neither a job nor a file operation finished."""
        patience = self.disk.io.timeout_s
        with self._progress:
            while self._num_finished < self._num_submitted:
                seen = (self._num_finished, self.disk.io.num_finished)
                if not self._progress.wait(patience) and seen == (self._num_finished, self.disk.io.num_finished):
                    log.warning("the disk thread made no progress in %g s; not waiting for it", patience)
                    return

    def close(self) -> None:
        self.flush()
        if self._thread is not None and self._thread.is_alive():
            self._jobs.put(("stop",))
            self._thread.join(timeout=self.disk.io.timeout_s)
