"""Continuous batching: one thread owns a `Runner` of `max_batch` rows (slots) of the static KV cache.

    submit(job) --> bounded waiting queue (full: QueueFull at once)
    loop:  free slots take waiting requests (oldest first)
           one prefill chunk of the oldest prefilling slot (`Runner.prefill_row`: the other rows keep their cache);
             its prompt complete -> its first token is sampled and the slot decodes from the next step on
           one batched decode step of every decoding slot (`Runner.decode_rows`: on the CPU the rows up to the
             last decoding one; on the GPU a replay of the dense graph of the first 1, 2, 4, ... rows that covers
             them, or of the whole batch with a sparse policy or `batch_invariant`; each captured once); each row
             sampled under its own settings and generator
           a row that stops (EOS, stop token or string, max_tokens) or whose client left frees its slot

Rows that are idle or still prefilling ride along in the decode step: they write one dead K/V slot at their length,
which is rolled back right after (their next chunk or prompt overwrites it), and their sampled tokens are ignored.
Each row attends only to its own positions, so a request's tokens do not depend on what shares the batch.
Text is produced per row by `RowOutput` (incremental detokenisation, stop strings held back), as in `generate`.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from ..attention.policy import Policy
from ..errors import SparseSpecError
from ..generate import Engine, GenerationConfig, RowOutput
from ..runner import Runner
from ..sampling import SamplingConfig, make_generator, sample, sample_rows
from ..spec.decode import speculative_step, tree_verify
from ..spec.drafters import Drafter
from .metrics import Metrics

log = logging.getLogger("sparsespec.serve")

_GREEDY = SamplingConfig()


class QueueFull(SparseSpecError):
    pass


class NotRunning(SparseSpecError):
    pass


@dataclass(frozen=True)
class SchedulerConfig:
    max_batch: int = 8  # slots decoded together
    max_queue: int = 256  # requests waiting for a slot; more are refused
    max_context: int = 4096  # positions per slot: prompt + max_tokens of a request must fit
    prefill_chunk: int = 1024  # prompt tokens prefilled per scheduler iteration (one slot at a time)
    cuda_graph: bool = True  # on CUDA, replay the decode step as a graph captured once
    block_size: int = 8  # with a drafter: the verify block (the pending token + up to block_size - 1 proposals)
    # on CUDA, replay the whole batch's graph for every decode step (not the graph of the busy rows' prefix): a
    # request's arithmetic, and so its tokens, then do not depend on how many other requests are running
    batch_invariant: bool = False

    def __post_init__(self):
        for name in ("max_batch", "max_context", "prefill_chunk"):
            if getattr(self, name) < 1:
                raise SparseSpecError(f"{name.replace('_', '-')} must be >= 1, got {getattr(self, name)}")
        if self.block_size < 2:
            raise SparseSpecError(f"block-size must be >= 2 (one pending token + proposals), got {self.block_size}")
        if self.max_queue < 0:
            raise SparseSpecError(f"max-queue must be >= 0, got {self.max_queue}")


@dataclass(frozen=True)
class Event:
    """What a request's consumer receives: text pieces in order (together exactly the final text); the last event
    has `finish_reason` ("stop", "length", "cancelled" or "error", with `error` then)."""

    text: str
    completion_tokens: int
    finish_reason: str | None = None
    error: str | None = None


class Job:
    """One request's generation: prompt ids, settings, and `deliver(Event)`, called from the scheduler thread."""

    _ids = itertools.count()

    def __init__(self, prompt: list[int], gen: GenerationConfig, deliver: Callable[[Event], None]):
        self.id = next(self._ids)
        self.prompt, self.gen, self.deliver = prompt, gen, deliver
        self.arrival = time.perf_counter()
        self._cancelled = threading.Event()
        self._wake: Callable[[], None] = lambda: None

    def cancel(self) -> None:
        """The consumer is gone: drop the request from the queue or free its slot (no more events)."""
        self._cancelled.set()
        self._wake()

    @property
    def cancelled(self) -> bool:
        return self._cancelled.is_set()


class _Slot:
    def __init__(self, job: Job, engine: Engine, device: torch.device):
        self.job = job
        self.output = RowOutput(engine, job.gen)
        self.generator = make_generator(job.gen.sampling, device)
        self.prefilled = 0  # prompt tokens in the cache
        self.features: list[torch.Tensor] = []  # with a drafter's taps: the prompt chunks' target features
        self.next_token: int | None = None  # decoding: the token the next step feeds
        self.history = list(job.prompt)  # the prompt and every generated token (grown in place: a speculative step
        #                                  must not copy a long context per row)

    @property
    def decoding(self) -> bool:
        return self.next_token is not None


class Scheduler:
    def __init__(self, engine: Engine, config: SchedulerConfig, policy: Policy | None = None,
                 drafter: Drafter | None = None):
        """`policy`: sparse decode attention for every row (graphable policies: their index is built per row as
        its prompt completes); None: dense. `drafter`: lossless speculative decoding of every row (each step
        drafts up to block_size - 1 tokens a row and verifies them in one dense forward of the batch)."""
        if config.max_context > engine.config.max_position:
            raise SparseSpecError(f"max-context {config.max_context} exceeds the model's context of "
                                  f"{engine.config.max_position} tokens")
        if policy is not None and not (policy.graphable and policy.row_index):
            raise SparseSpecError(f"serve runs graphable attention policies (per-row index); {policy.name} is not")
        if policy is not None and policy.options.select_every > 1:
            raise SparseSpecError("serve selects keys at every step (rows join and leave the batch): select_every is "
                                  "for generate and --draft self:POLICY")
        if policy is not None and drafter is not None:
            raise SparseSpecError("a drafter with a sparse attention policy is not supported: use one of them "
                                  "(or draft with self:POLICY)")
        if drafter is not None and engine.config.sliding_window is not None:
            raise SparseSpecError("speculative decoding does not support sliding-window models yet")
        self.engine, self.config, self.drafter = engine, config, drafter
        self.metrics = Metrics(self.queue_length, self.running_rows, config.max_batch)
        # with a drafter, room for a verify block (or tree: `spec.tree`) past every row's last position
        self.tree = None if drafter is None else tree_verify(drafter, config.block_size, engine.device)
        widest = 0 if drafter is None else max(config.block_size, drafter.tree_nodes + 1)
        capacity = min(config.max_context + widest, engine.config.max_position)
        self.runner = Runner(engine.model, config.max_batch, capacity, drafter.policy if drafter else policy,
                             config.cuda_graph, taps=drafter.taps if drafter else (),
                             row_graphs=not config.batch_invariant)
        self.slots: list[_Slot | None] = [None] * config.max_batch
        self._waiting: deque[Job] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._failure: str | None = None
        self._thread = threading.Thread(target=self._run, name="sparsespec-scheduler", daemon=True)

    # -- the consumer side (any thread) -------------------------------------------------------------------------

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def queue_length(self) -> int:
        return len(self._waiting)

    def running_rows(self) -> int:
        return sum(s is not None for s in self.slots)

    def submit(self, job: Job) -> None:
        """Queue `job`; QueueFull when `max_queue` requests already wait for a slot (besides those about to take
        a free one), NotRunning when stopped. The caller has checked that it fits (prompt + max_new_tokens <=
        max_context)."""
        if len(job.prompt) + job.gen.max_new_tokens > self.config.max_context:
            raise ValueError("the job does not fit a slot")  # the HTTP layer answers this case itself
        with self._cond:
            if not self.alive:
                raise NotRunning(self._failure or "the server is shutting down")
            free = sum(s is None for s in self.slots)  # the first `free` waiting requests are about to start
            if len(self._waiting) >= self.config.max_queue + free:
                self.metrics.rejected.inc()
                raise QueueFull(f"the queue is full ({self.config.max_queue} requests wait for a slot)")
            job._wake = lambda: self._cancelled(job)
            self._waiting.append(job)
            self._cond.notify()

    def stop(self, timeout: float = 30.0) -> None:
        """Stop the loop after its current step; every request not finished ends with finish_reason "cancelled"
        (by the loop as it leaves, or here when it never ran; a step still running after `timeout` keeps its rows
        until it ends, so no two threads touch the slots at once)."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        if self._thread.is_alive():
            self._thread.join(timeout)
        if not self._thread.is_alive():
            self._end_all("cancelled", None)

    def _cancelled(self, job: Job) -> None:
        """A waiting job leaves the queue now; a running one frees its slot at the next iteration."""
        with self._cond:
            if job in self._waiting:
                self._waiting.remove(job)
                self.metrics.requests.labels("cancelled").inc()
            self._cond.notify()

    # -- the scheduler thread -----------------------------------------------------------------------------------

    def _run(self) -> None:
        torch.set_grad_enabled(False)
        try:
            self.runner.build()  # a policy's index of the empty batch (rows get theirs as their prompts complete)
            if self.drafter is not None:  # the drafter's empty batch (rows start as their prompts complete)
                self.drafter.bind(self.runner)
                self.drafter.start([[] for _ in self.slots], None, self.runner.cache.capacity)
            if self.drafter is None:
                # CUDA: the decode graphs of the whole batch and (dense) of its first 1, 2, 4, ... rows, once
                self.runner.capture(rows=True)  # (the runner skips the row graphs when batch-invariant)
            elif self.drafter.policy is not None:  # a drafter through the runner's sparse steps (self, cascade):
                self.drafter.capture()  # its graphs now (other drafters step by verify alone)
            while True:
                with self._cond:
                    self._cond.wait_for(lambda: self._stopping or self._has_work())
                    if self._stopping:
                        break
                    self._admit()
                self._step()
        except Exception as e:  # a failed step: no request can continue; the server reports unhealthy
            log.exception("scheduler step failed")
            self._failure = f"generation failed: {type(e).__name__}: {e}"
            with self._cond:
                self._stopping = True
            self._end_all("error", self._failure)
            return
        self._end_all("cancelled", None)

    def _has_work(self) -> bool:
        return bool(self._waiting) or any(s is not None for s in self.slots)

    def _admit(self) -> None:
        """(lock held) Free the slots of cancelled requests; give free slots to the oldest waiting requests."""
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.job.cancelled:
                self._free(i, "cancelled")
        for i, slot in enumerate(self.slots):
            while self.slots[i] is None and self._waiting:
                job = self._waiting.popleft()
                try:
                    self.slots[i] = _Slot(job, self.engine, self.runner.device)
                except Exception as e:  # this request's own set-up failed: it alone ends, the batch serves on
                    log.exception("request set-up failed")
                    self.metrics.requests.labels("error").inc()
                    job.deliver(Event("", 0, "error", f"generation failed: {type(e).__name__}: {e}"))

    def _step(self) -> None:
        prefilling = [i for i, s in enumerate(self.slots) if s is not None and not s.decoding]
        if prefilling:
            self._prefill_chunk(min(prefilling, key=lambda i: self.slots[i].job.arrival))
        if any(s is not None and s.decoding for s in self.slots):
            self._decode() if self.drafter is None else self._speculate()

    def _prefill_chunk(self, i: int) -> None:
        slot = self.slots[i]
        prompt, start = slot.job.prompt, slot.prefilled
        chunk = prompt[start:start + self.config.prefill_chunk]
        hidden, features = self.runner.prefill_row_tapped(i, chunk, start)
        if features is not None:
            slot.features.append(features)
        slot.prefilled += len(chunk)
        self.metrics.prompt_tokens.inc(len(chunk))
        if slot.prefilled == len(prompt):
            self.runner.index_row(i)
            if self.drafter is not None:
                self.drafter.start_row(i, prompt, torch.cat(slot.features) if slot.features else None)
                slot.features = []
            logits = self.engine.model.logits(hidden[None])
            token = int(sample(logits, slot.job.gen.sampling, slot.generator)[0])
            self.metrics.ttft.observe(time.perf_counter() - slot.job.arrival)
            self.metrics.tokens(1)
            self._take(i, token)

    def _decode(self) -> None:
        start = time.perf_counter()
        decoding = [s is not None and s.decoding for s in self.slots]
        rows = max(i for i, d in enumerate(decoding) if d) + 1  # slots are taken lowest first: a short prefix
        tokens = torch.tensor([s.next_token if d else 0 for s, d in zip(self.slots[:rows], decoding)],
                              device=self.runner.device)
        logits = self.runner.decode_rows(tokens)
        # rows not decoding wrote one dead slot at their length: back to their prompt progress (idle rows: 0)
        lengths = self.runner.cache.lengths
        self.runner.truncate([lengths[i] if d else (s.prefilled if s is not None else 0)
                              for i, (s, d) in enumerate(zip(self.slots, decoding))])
        configs = [s.job.gen.sampling if d else _GREEDY for s, d in zip(self.slots[:rows], decoding)]
        generators = [s.generator if d else None for s, d in zip(self.slots[:rows], decoding)]
        new = sample_rows(logits, configs, generators).tolist()
        self.metrics.step.observe(time.perf_counter() - start)
        self.metrics.tokens(sum(decoding))
        for i, d in enumerate(decoding[:rows]):
            if d:
                self._take(i, new[i])

    def _speculate(self) -> None:
        """One speculative step of every decoding row (`spec.decode.speculative_step`, row by row with its own
        settings and generator): rows not decoding ride along and go back to their prompt progress (idle: 0)."""
        start = time.perf_counter()
        block, cap = self.config.block_size, self.runner.cache.capacity
        decoding = [s is not None and s.decoding for s in self.slots]
        histories = [s.history if d else None for s, d in zip(self.slots, decoding)]
        ks = [min(block - 1, min(len(s.job.prompt) + s.job.gen.max_new_tokens + block, cap) - n - 1) if d else 0
              for s, d, n in zip(self.slots, decoding, self.runner.cache.lengths)]
        commits = speculative_step(
            self.runner, self.drafter, histories, ks,
            [s.job.gen.sampling if d else _GREEDY for s, d in zip(self.slots, decoding)],
            [s.generator if d else None for s, d in zip(self.slots, decoding)], block,
            [s.prefilled if s is not None else 0 for s in self.slots],
            self.tree)
        self.metrics.step.observe(time.perf_counter() - start)
        self.metrics.tokens(sum(len(c) for c in commits if c is not None))
        for i, new in enumerate(commits):
            job = None if new is None else self.slots[i].job
            for token in new or ():
                if self.slots[i] is None or self.slots[i].job is not job:
                    break  # the row finished (or its client left) within this step's tokens
                self._take(i, token)

    def _take(self, i: int, token: int) -> None:
        """Slot `i` generated `token`: hand its text on; free the slot once the row is done."""
        slot = self.slots[i]
        if slot.job.cancelled:
            self._free(i, "cancelled")
            return
        text = slot.output.add(token)
        slot.history.append(token)
        if slot.output.done:
            text += slot.output.finish()
            slot.job.deliver(Event(text, len(slot.output.ids), slot.output.finish_reason))
            self._free(i, slot.output.finish_reason)
        else:
            if text:
                slot.job.deliver(Event(text, len(slot.output.ids)))
            slot.next_token = token

    def _free(self, i: int, reason: str) -> None:
        self.slots[i] = None
        self.metrics.requests.labels(reason).inc()

    def _end_all(self, reason: str, error: str | None) -> None:
        """End every queued and running request with `reason` (the loop has stopped)."""
        with self._cond:
            pending = [(j, 0) for j in self._waiting] + [(s.job, len(s.output.ids)) for s in self.slots
                                                         if s is not None]
            self._waiting.clear()
            self.slots = [None] * self.config.max_batch
        for job, tokens in pending:
            self.metrics.requests.labels(reason).inc()
            if not job.cancelled:
                job.deliver(Event("", tokens, reason, error))
