"""The driver's decode chains: decode chunks run back to back on the worker thread, and their
tokens handed to the running requests.

A chain is the engine's steady state: while nothing needs the event loop (no slot finished, no
request, release, cancel or idle work arrived, the batch is not underfull), chunk after chunk runs
without a round trip through the loop. On accelerators and a one-device CPU mesh a chain keeps
one chunk in flight ahead of the one whose tokens it fetches (`_decode_chain_overlapped`), so
the host's share of a chunk runs while the device computes. `DecodeChainMixin` is a part of
`engine.driver.Engine` (it uses the driver's state: `steps`, `state`, `params`, `_running`,
`_logs`, `_kicks`, `stats`, and the paging mixin's `_reserve_chunk`, `_sync_pages`).
"""
from __future__ import annotations

import time

import jax
import numpy as np

from sfrrl_jax.engine.admission import host_fields
from sfrrl_jax.engine.jobs import Job, SlotHandle
from sfrrl_jax.generation_types import Completion


class DecodeChainMixin:
    """Decode chains and token delivery of `engine.driver.Engine`."""

    def _decode_chain(self, undelivered: dict[int, int] | None = None) -> list[dict]:
        """Decode chunks back to back on the worker thread for as long as the loop has nothing to
        act on: no slot finished (its trajectory's tool call should start), no `_kick` (a request,
        release, cancel or idle work arrived) and the batch is not underfull (idle work's turn).
        Each round trip through the event loop costs host time in which the device idles, ms per
        chunk while tool coroutines run. The tokens are the same: sampling is keyed per slot.
        Returns each chunk's results, in order.
        A paged cache reserves each chunk's pages before it starts; the chain ends at one it
        cannot reserve (possibly the first: then the loop makes room, see `engine.page_policy`).
        undelivered: slot -> tokens generated but not yet pushed to its job (an admission's first
        tokens, pushed after the chain it starts; see `_may_decode`).
        """
        kicks = self._kicks
        if self._pt is None and self._overlap_chunks:
            return self._decode_chain_overlapped(kicks, undelivered or {})
        chunks = []
        while (not chunks or (not chunks[-1]["done"].any() and self._kicks == kicks
                              and len(self._running) > self.underfull_slots)):
            if not self._reserve_chunk():
                break
            chunks.append(self._fetch_decode(self._dispatch_decode(ahead=len(chunks))))
        return chunks

    @property
    def _overlap_chunks(self) -> bool:
        """Whether a decode chain dispatches a chunk before fetching the previous one's tokens: on
        accelerators and on a one-device CPU mesh (measured 1.04-1.15x the sequential chain at
        batch 1-32 there, timed alternately: `experiments/bench/decode.py`). Not on a
        multi-device CPU mesh: XLA:CPU aborts with two multi-device programs in flight (see
        `_admit_on_device`)."""
        devices = self.steps.mesh.devices
        return devices.size == 1 or devices.flat[0].platform != "cpu"

    def _decode_chain_overlapped(self, kicks: int, undelivered: dict[int, int]) -> list[dict]:
        """`_decode_chain` with chunk i+1 dispatched before chunk i's tokens are fetched: the
        host's share of a chunk (the fetch, the next dispatch, the bookkeeping) runs while the
        device computes, instead of between chunks. Whether to go on is decided from the chunks
        fetched so far, so a chunk in which a slot finishes is followed by one more (the other
        slots' tokens are the same: sampling is keyed per slot; the finished slot's tool call
        starts one chunk later; a dense cache only: a paged chunk needs its pages reserved
        from the device's lengths first)."""
        chunks = []
        in_flight = self._dispatch_decode(ahead=0)
        while in_flight is not None:
            go_on = ((not chunks or not chunks[-1]["done"].any()) and self._kicks == kicks
                     and len(self._running) > self.underfull_slots
                     and self._may_decode(len(chunks) + 1, undelivered))
            following = self._dispatch_decode(ahead=len(chunks) + 1) if go_on else None
            chunks.append(self._fetch_decode(in_flight))
            in_flight = following
        return chunks

    def _decode_k_len(self, ahead: int) -> int:
        """The decode bucket of the next chunk: every running slot's cache length at its end.
        `ahead` chunks of this chain ran after the token logs were last updated; a log holds
        the cached tokens and, once its first token is in, the pending one (one more than
        cached: a safe bound)."""
        logs = [self._logs.get(s) for s in list(self._running)]
        longest = max((len(log.context) for log in logs if log is not None), default=0)
        return self.steps.decode_k_len(longest + (ahead + 1) * self.decode_steps)

    def _may_decode(self, ahead: int, undelivered: dict[int, int]) -> bool:
        """Whether some running slot can still decode after `ahead` more chunks of this chain: its
        max_new_tokens not reached by then (a stop token may end it earlier; a chunk in which
        every slot has already ended would only compute masked steps). undelivered: slot ->
        tokens its job has not received yet (see `_decode_chain`)."""
        reach = ahead * self.decode_steps
        return any(len(job.tokens) + undelivered.get(slot, 0) + reach < job.request.max_new_tokens
                   for slot, job in list(self._running.items()))

    def _dispatch_decode(self, ahead: int = 0):
        """Starts a decode chunk (asynchronously): the handle `_fetch_decode` takes."""
        t0 = time.perf_counter()
        self._sync_pages()
        k_len = self._decode_k_len(ahead)
        self.state, results = self.steps.generate(self.params, self.state, self.decode_steps, k_len)
        return results, t0

    def _fetch_decode(self, handle) -> dict:
        """The chunk's results on the host (waits for it); counts its steps."""
        results, t0 = handle
        results = jax.device_get(host_fields(results))
        # overlapped chunks: device time counted once, from the later of dispatch and last fetch
        self._account("decode", max(t0, self._last_fetch))
        self._last_fetch = time.perf_counter()
        # counted here, not when the tokens reach their requests: a chain delivers those at its end
        self.stats.decode_steps += self.decode_steps
        self.stats.slot_steps_total += self.decode_steps * self.steps.max_slots
        self.stats.slot_steps_active += int(np.sum(results["valid"]))
        return results

    def _decode_on_device(self, ahead: int = 0):
        return self._fetch_decode(self._dispatch_decode(ahead))

    def _distribute(self, chunks: list[dict]):
        for results in chunks:
            self._distribute_chunk(results)

    def _distribute_chunk(self, results):
        # Python lists once per chunk, and each slot's tokens handed over in one call: per-token
        # bookkeeping on numpy elements was a few % of a short generation's wall at batch 32
        # (values unchanged: float32 -> float is exact).
        valid = np.asarray(results["valid"])[:self.decode_steps]   # [steps, slots]
        tokens, logprobs, raw = (np.asarray(results[k])[:self.decode_steps].T.tolist()
                                 for k in ("tokens", "logprobs", "raw_logprobs"))
        done = np.asarray(results["done"])[:self.decode_steps]
        routes = results["routes"]
        # A slot's valid steps are a prefix of the chunk (it decodes until done or the chunk's
        # end); slots that ended at an earlier step go first, so requests complete in step order.
        counts = valid.sum(axis=0)
        for slot in np.argsort(counts, kind="stable").tolist():
            n, job = int(counts[slot]), self._running.get(slot)
            if n == 0 or job is None:
                continue
            if routes is not None:  # the routes of the tokens these steps fed
                job.routes.append(np.asarray(routes[:n, slot]))
            self._push(job, tokens[slot][:n], logprobs[slot][:n], raw[slot][:n], bool(done[n - 1, slot]))

    def _push(self, job: Job, tokens: list, logprobs: list, raw: list, done: bool):
        """Hands a running job its next tokens (their log-probs under the sampling distribution
        and the policy); `done`: the last of them ended the call."""
        job.tokens.extend(int(t) for t in tokens)
        job.logprobs.extend(float(x) for x in logprobs)
        job.raw_logprobs.extend(float(x) for x in raw)
        log = self._logs[job.slot]
        log.context.extend(job.tokens[-len(tokens):])
        log.draws += len(tokens)
        self.stats.generated_tokens += len(tokens)
        if not done:
            return
        token = job.tokens[-1]
        del self._running[job.slot]
        serial = self._serials[job.slot]
        self._parked[job.slot] = serial
        stop = int(token) in job.request.stop_token_ids
        if not job.future.done():
            job.future.set_result(Completion(
                tokens=job.tokens, logprobs=job.logprobs, finish_reason="stop" if stop else "length",
                slot_handle=SlotHandle(job.slot, serial, self._engine_id), raw_logprobs=job.raw_logprobs,
                routes=job.routes_array() if self.record_routes else None))
