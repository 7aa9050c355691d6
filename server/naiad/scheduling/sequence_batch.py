"""Triton's sequence batcher: stateful models whose requests are grouped into sequences by correlation ID.

Routing. A request carrying SEQUENCE_START opens a sequence (keyed by its correlation ID, a uint64 or a
string; 7 and "7" are different sequences) and binds it to one *slot* of one model instance; every later
request of the sequence runs on that instance, in arrival order, never two at once. SEQUENCE_END closes the
sequence when that request is taken for execution, which frees the slot. A START for a sequence that is
still active restarts it in place (Triton: "previous sequence will be terminated early"): the requests
already queued run first, then the START request runs with fresh controls and fresh implicit state.

Slots. Each instance has `max(1, max_batch_size)` slots for `direct` and `max_candidate_sequences` (or
`max(1, max_batch_size)` when unset) for `oldest` -- per instance, as Triton's sequence batcher allocates
them. A START that finds every slot of every instance taken goes to a FIFO backlog with the requests that
follow it; the backlog's head takes the next slot that frees. New sequences take the lowest free slot index
over all instances, so they spread over instances before filling any one.

Batching. Each instance has one dispatcher task and runs one batch at a time. A batch holds at most one
request per sequence (the head of its queue) and at most `max(1, max_batch_size)` requests:
- `direct`: the ready sequences in slot order. `direct.max_queue_delay_microseconds` only delays a batch
  when `minimum_slot_utilization` > 0, until that fraction of slots is ready or the oldest head request
  has waited that long (Triton's rule; the default utilization 0 runs as soon as one slot is ready).
- `oldest`: the ready sequences, oldest head request first, like the dynamic batcher: wait up to
  `oldest.max_queue_delay_microseconds` for the largest `preferred_batch_size` (or max_batch_size), and
  trim an oversized batch to the largest preferred size that fits.
Requests whose non-ragged input shapes differ from the batch's first request wait for a later batch.

Control inputs (`control_input`, sequence_controls.py) are synthesised per request from its flags and
correlation ID; implicit state (`state`, sequence_state.py) carries a sequence's state output to its next
request.

Idle sequences: a sequence with nothing queued or running that gets no request for
`max_sequence_idle_microseconds` (default 1 s) is released: its slot frees and later non-START requests
for it fail as for an unknown sequence. (Triton measures idleness from the last request's arrival.)

Cancellation: a request whose client went away before it ran cancels its sequence, as in Triton: the
requests queued behind it fail with CANCELLED, the sequence becomes unknown and its slot frees.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from pathlib import Path

import numpy as np
from tritonclient.grpc import model_config_pb2 as mc

from ..errors import Cancelled, InvalidArgument, Unavailable, as_naiad_error
from ..inference import SEQUENCE_END, SEQUENCE_START, InferenceRequest, InferenceResponse, RequestedOutput
from ..tensors import numpy_dtype
from .pool import InstancePool
from .sequence_controls import CORRID, END, START, correlation_key, corrid_array, display_key, parse_controls
from .sequence_state import parse_states

log = logging.getLogger("naiad.sequence")

DEFAULT_IDLE_US = 1_000_000  # Triton's default max_sequence_idle_microseconds


class _Seq:
    """One sequence: its slot, its queue of not-yet-dispatched requests and its implicit state."""

    __slots__ = ("busy", "closed", "key", "queue", "slot", "states", "timer", "worker")

    def __init__(self, key) -> None:
        self.key = key
        self.worker: _Worker | None = None
        self.slot = -1
        self.queue: collections.deque[_Entry] = collections.deque()
        self.states: dict[str, np.ndarray] | None = None  # None: initial state
        self.busy = False  # a request of it is executing
        self.closed = False  # END taken, or released as idle: no longer routable
        self.timer: asyncio.TimerHandle | None = None


class _Entry:
    __slots__ = ("future", "request", "seq", "wanted")

    def __init__(self, request, future, seq) -> None:
        self.request = request
        self.future = future
        self.seq = seq
        self.wanted: list[RequestedOutput] | None = None  # the client's outputs, while patched


class _Worker:
    """One model instance: its sequence slots and its dispatcher task."""

    def __init__(self, inst, slots: int):
        self.inst = inst
        self.slots: list[_Seq | None] = [None] * slots
        self.wake = asyncio.Event()
        self.task: asyncio.Task | None = None


class SequenceBatchScheduler:
    """Sequence batcher in front of an InstancePool (a `scheduling.scheduler.Scheduler`); `model_dir` is where
    `initial_state` data files are found."""

    def __init__(self, pool: InstancePool, config: mc.ModelConfig, model_dir: Path | None):
        self.pool = pool
        self.stats = pool.stats
        self.config = config
        try:
            self._configure(config, model_dir)
        except BaseException:
            pool.close()  # the caller never gets a scheduler to close, so nothing else would
            raise
        self.active: dict = {}  # key -> routable sequence (in a slot or in the backlog)
        self.backlog: collections.deque[_Seq] = collections.deque()
        self.workers: list[_Worker] | None = None  # created on the loop, at the first request
        self.queued = 0  # requests not yet taken into a batch
        self.running = 0  # batches executing
        self._stopping = False
        self._closed = False

    # ---- configuration ----
    def _configure(self, config: mc.ModelConfig, model_dir: Path | None) -> None:
        sb = config.sequence_batching
        name = config.name
        if sb.iterative_sequence:
            raise InvalidArgument(f"model '{name}': sequence_batching.iterative_sequence is not supported")
        self.batched = config.max_batch_size > 0
        self.max_batch = max(1, config.max_batch_size)
        self.oldest = sb.WhichOneof("strategy_choice") == "oldest"
        if self.oldest:
            self.slot_count = sb.oldest.max_candidate_sequences or self.max_batch
            self.delay_ns = sb.oldest.max_queue_delay_microseconds * 1000
            self.preferred = sorted(p for p in sb.oldest.preferred_batch_size if p > 0)
            for p in self.preferred:
                if p > self.max_batch:
                    raise InvalidArgument(
                        f"model '{name}': sequence batching preferred batch size {p} must be <= "
                        f"max_batch_size {config.max_batch_size}"
                    )
            self.min_utilization = 0.0
        else:
            self.slot_count = self.max_batch
            self.delay_ns = sb.direct.max_queue_delay_microseconds * 1000
            self.min_utilization = sb.direct.minimum_slot_utilization
            self.preferred = []
        self.idle_s = (sb.max_sequence_idle_microseconds or DEFAULT_IDLE_US) / 1e6
        self.control_shape = (1, 1) if self.batched else (1,)
        self.controls = parse_controls(config)
        self.states = parse_states(config, model_dir)
        self.ragged = {i.name for i in config.input if i.allow_ragged_batch}
        self.config_outputs = [o.name for o in config.output]
        self.is_python = config.backend == "python"

    # ---- submission ----
    async def submit(self, request: InferenceRequest) -> InferenceResponse | None:
        name = self.config.name
        if self._closed:
            raise Unavailable(f"model '{name}' is unloading")
        if request.batch_size(self.batched) > 1:
            raise InvalidArgument(
                f"inference request to model '{name}' must specify batch-size 1 due to requirements of "
                "sequence batcher"
            )
        key = correlation_key(request.correlation_id)
        if key is None:
            raise InvalidArgument(
                f"inference request to model '{name}' must specify a non-zero or non-empty correlation ID"
            )
        start = bool(request.flags & SEQUENCE_START)
        end = bool(request.flags & SEQUENCE_END)
        if self._stopping and start:
            raise Unavailable(
                "Server is stopping, scheduler for model has stopped accepting new inference requests"
            )
        self._start_workers()
        seq = self.active.get(key)
        if seq is None:
            if not start:
                raise InvalidArgument(
                    f"inference request for sequence {display_key(key)} to model '{name}' must specify the "
                    "START flag on the first request of the sequence"
                )
            seq = _Seq(key)
            self.active[key] = seq
            self._place(seq)
        elif start:
            log.warning(
                "sequence %s for model '%s' has a conflict. The previous sequence did not end before "
                "this sequence start. Previous sequence will be terminated early.",
                display_key(key),
                name,
            )
        entry = _Entry(request, asyncio.get_running_loop().create_future(), seq)
        trace = getattr(request, "trace", None)
        if trace is not None:
            trace.append(("QUEUE_START", time.monotonic_ns()))
        seq.queue.append(entry)
        self.queued += 1
        self._disarm(seq)
        if end:
            seq.closed = True
            del self.active[key]
        if seq.worker is not None:
            seq.worker.wake.set()
        self.pool.stats.pending += 1
        try:
            return await entry.future
        finally:
            self.pool.stats.pending -= 1

    # ---- slots ----
    def _start_workers(self) -> None:
        if self.workers is not None:
            return
        loop = asyncio.get_running_loop()
        self.workers = [_Worker(inst, self.slot_count) for inst in self.pool.instances]
        for w in self.workers:
            w.task = loop.create_task(self._worker_loop(w))

    def _place(self, seq: _Seq) -> None:
        """Give a new sequence the lowest free slot over all instances, or put it in the backlog."""
        for slot in range(self.slot_count):
            for w in self.workers or ():
                if w.slots[slot] is None:
                    self._assign(seq, w, slot)
                    return
        self.backlog.append(seq)

    def _assign(self, seq: _Seq, w: _Worker, slot: int) -> None:
        w.slots[slot] = seq
        seq.worker, seq.slot = w, slot
        self._arm(seq)
        w.wake.set()

    def _release(self, seq: _Seq) -> None:
        """Free the sequence's slot and hand it to the oldest backlogged sequence still worth running."""
        w, slot = seq.worker, seq.slot
        if w is None:
            return
        seq.worker, seq.slot = None, -1
        w.slots[slot] = None
        while self.backlog:
            nxt = self.backlog.popleft()
            if nxt.closed and not nxt.queue:
                continue  # every request of it was cancelled
            self._assign(nxt, w, slot)
            return

    def _arm(self, seq: _Seq) -> None:
        """Start the idle clock of a sequence that has nothing queued or running (if not yet running)."""
        if seq.timer is not None or seq.closed or seq.busy or seq.queue or seq.worker is None:
            return
        seq.timer = asyncio.get_running_loop().call_later(self.idle_s, self._reap, seq)

    @staticmethod
    def _disarm(seq: _Seq) -> None:
        if seq.timer is not None:
            seq.timer.cancel()
            seq.timer = None

    def _reap(self, seq: _Seq) -> None:
        seq.timer = None
        if seq.closed or seq.busy or seq.queue:
            return
        seq.closed = True
        if self.active.get(seq.key) is seq:
            del self.active[seq.key]
        log.info(
            "sequence %s of model '%s' was idle for %.0f us: released",
            display_key(seq.key),
            self.config.name,
            self.idle_s * 1e6,
        )
        self._release(seq)

    # ---- dispatch ----
    def _ready(self, w: _Worker) -> list[_Seq]:
        """Sequences of the instance with a request waiting, in slot order (cancelled heads dropped)."""
        ready = []
        for seq in w.slots:
            if seq is None:
                continue
            if seq.queue and seq.queue[0].future.done():  # its client went away
                self._cancel(seq)
            if seq.queue:
                ready.append(seq)
            elif seq.closed:
                self._release(seq)
            else:
                self._arm(seq)
        return ready

    def _cancel(self, seq: _Seq) -> None:
        """A cancelled request cancels its sequence (Triton): the requests queued behind it fail, the
        sequence becomes unknown, its slot frees once nothing of it runs."""
        log.info(
            "sequence %s of model '%s': a request was cancelled, cancelling the sequence",
            display_key(seq.key),
            self.config.name,
        )
        seq.closed = True
        if self.active.get(seq.key) is seq:
            del self.active[seq.key]
        while seq.queue:
            entry = seq.queue.popleft()
            self.queued -= 1
            self._restore(entry)
            if not entry.future.done():
                entry.future.set_exception(
                    Cancelled(f"sequence {display_key(seq.key)} of model '{self.config.name}' was cancelled")
                )

    def _wait_s(self, ready: list[_Seq]) -> float:
        """How long to hold the batch back for more sequences (0: run now)."""
        if not self.delay_ns or self.max_batch == 1:
            return 0.0
        if self.oldest:
            target = self.preferred[-1] if self.preferred else self.max_batch
            if len(ready) >= target:
                return 0.0
        else:
            if self.min_utilization <= 0 or len(ready) / self.max_batch >= self.min_utilization:
                return 0.0
        oldest = min(s.queue[0].request.arrival_ns for s in ready)
        remaining = oldest + self.delay_ns - time.monotonic_ns()
        return max(0.0, remaining / 1e9)

    async def _worker_loop(self, w: _Worker) -> None:
        while not self._closed:
            try:
                w.wake.clear()  # before looking: a wake-up while we look is not lost
                ready = self._ready(w)
                if not ready:
                    await w.wake.wait()
                    continue
                wait = self._wait_s(ready)
                if wait > 0:
                    try:
                        await asyncio.wait_for(w.wake.wait(), wait)
                    except asyncio.TimeoutError:
                        pass
                    continue
                batch = self._collect(w, ready)
                if batch:
                    await self._execute(w, batch)
                # (these locals would outlive the iteration while the loop waits: the last batch's requests
                # and responses, whose tensors can be views of a large receive buffer, must not)
                del batch, ready
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("sequence batcher of model '%s' failed", self.config.name)
                await asyncio.sleep(0.01)

    def _collect(self, w: _Worker, ready: list[_Seq]) -> list[_Entry]:
        """Take the next batch: at most one request per sequence, same shapes, up to max_batch_size."""
        order = sorted(ready, key=lambda s: s.queue[0].request.arrival_ns) if self.oldest else ready
        batch: list[_Entry] = []
        shape_key = None
        for seq in order:
            if len(batch) >= self.max_batch:
                break
            entry = seq.queue[0]
            try:
                self._prepare(entry)
            except Exception as exc:
                seq.queue.popleft()
                self.queued -= 1
                self._restore(entry)
                if not entry.future.done():
                    entry.future.set_exception(as_naiad_error(exc))
                self._after_take(seq, entry)
                continue
            key = self._shape_key(entry.request)
            if batch and key != shape_key:
                continue
            if not batch:
                shape_key = key
            batch.append(entry)
        if self.preferred and len(batch) not in self.preferred and len(batch) > self.preferred[0]:
            batch = batch[: max(p for p in self.preferred if p <= len(batch))]
        for entry in batch:
            seq = entry.seq
            seq.queue.popleft()
            self.queued -= 1
            seq.busy = True
            if entry.request.flags & SEQUENCE_START:
                seq.states = None  # the (re)started sequence begins from the initial state
            self._after_take(seq, entry)
        return batch

    def _after_take(self, seq: _Seq, entry: _Entry) -> None:
        # The END request frees the slot as it is taken (Triton): a backlogged sequence moves in and runs
        # in this instance's next batch. Nothing can follow END in the queue: END makes it unroutable.
        if entry.request.flags & SEQUENCE_END:
            self._release(seq)

    def _shape_key(self, request: InferenceRequest):
        if not self.batched:
            return None
        return tuple(
            sorted((n, a.shape[1:] if n not in self.ragged else None) for n, a in request.inputs.items())
        )

    def _prepare(self, entry: _Entry) -> None:
        """Add control and state inputs; make sure the state outputs get computed and returned to us."""
        req = entry.request
        seq = entry.seq
        flags = req.flags
        for c in self.controls:
            if c.kind == CORRID:
                arr = corrid_array(seq.key, c.datatype, self.control_shape)
            else:
                on = (
                    bool(flags & SEQUENCE_START)
                    if c.kind == START
                    else bool(flags & SEQUENCE_END)
                    if c.kind == END
                    else True
                )
                arr = np.full(self.control_shape, c.true if on else c.false, dtype=numpy_dtype(c.datatype))
            req.inputs[c.name] = arr
            req.datatypes[c.name] = c.datatype
        if not self.states:
            return
        current = None if (flags & SEQUENCE_START) or seq.states is None else seq.states
        for st in self.states:
            value = current.get(st.input_name) if current is not None else None
            req.inputs[st.input_name] = value if value is not None else st.initial.copy()
            req.datatypes[st.input_name] = st.datatype
        if entry.wanted is None:
            entry.wanted = list(req.outputs)
            names = {o.name for o in req.outputs}
            if not req.outputs and not self.is_python:
                # Tensor backends compute only config outputs unless told otherwise.
                req.outputs = [RequestedOutput(n) for n in self.config_outputs]
                names = set(self.config_outputs)
            if req.outputs:
                req.outputs = list(req.outputs) + [
                    RequestedOutput(st.output_name) for st in self.states if st.output_name not in names
                ]

    @staticmethod
    def _restore(entry: _Entry) -> None:
        if entry.wanted is not None:
            entry.request.outputs = entry.wanted

    async def _execute(self, w: _Worker, batch: list[_Entry]) -> None:
        self.running += 1
        limiter = getattr(self.pool, "limiter", None)  # --rate-limit: the instance's resources, held per run
        try:
            if limiter is not None:
                await limiter.acquire(w.inst)
            try:
                results = await self.pool.run(w.inst, [e.request for e in batch], time.monotonic_ns())
            finally:
                if limiter is not None:
                    limiter.release(w.inst)
        except Exception as exc:
            for entry in batch:
                entry.seq.busy = False
                self._restore(entry)
                if not entry.future.done():
                    entry.future.set_exception(as_naiad_error(exc))
            raise
        finally:
            self.running -= 1
        for entry, res in zip(batch, results):
            seq = entry.seq
            seq.busy = False
            if self.states and isinstance(res, InferenceResponse):
                try:
                    self._take_states(entry, res)
                except Exception as exc:
                    res = as_naiad_error(exc)
            self._restore(entry)
            if not entry.future.done():
                if isinstance(res, BaseException):
                    entry.future.set_exception(res)
                else:
                    entry.future.set_result(res)
            if seq.worker is not None:
                self._arm(seq)

    def _take_states(self, entry: _Entry, res: InferenceResponse) -> None:
        """Keep the state outputs of a successful response as the sequence's next state inputs; hide them."""
        seq = entry.seq
        wanted = entry.wanted or []
        requested = {o.name for o in wanted}
        if res.error is None:
            new = dict(seq.states) if seq.states is not None else {}
            for st in self.states:
                out = res.output(st.output_name)
                if out is not None:
                    new[st.input_name] = out.data
            seq.states = new
        hidden = {
            st.output_name
            for st in self.states
            if st.output_name not in self.config_outputs or (requested and st.output_name not in requested)
        }
        if hidden:
            res.outputs = [o for o in res.outputs if o.name not in hidden]

    # ---- shutdown ----
    async def close(self, timeout: float | None = None) -> None:
        """Stop accepting new sequences; let queued and running work finish (up to `timeout`)."""
        self._stopping = True
        deadline = time.monotonic() + (timeout if timeout is not None else 1e9)
        while (self.queued or self.running) and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        self._closed = True
        error = Unavailable(f"model '{self.config.name}' was unloaded")
        seqs = list(self.backlog)
        for w in self.workers or []:
            seqs.extend(s for s in w.slots if s is not None)
        for seq in seqs:
            self._disarm(seq)
            while seq.queue:
                entry = seq.queue.popleft()
                self._restore(entry)
                if not entry.future.done():
                    entry.future.set_exception(error)
        self.queued = 0
        self.active.clear()
        self.backlog.clear()
        for w in self.workers or []:
            w.wake.set()  # the dispatcher exits; a batch still executing completes and answers its requests
