"""The next iteration scheduled while the device runs this one (vLLM's async scheduling,
SGLang's overlap scheduler).

A plain step waits for its sampled tokens before it schedules the next: the device idles
while the host schedules, builds the inputs and hands the tokens over. Here iteration N+1
is scheduled, built and launched before N's tokens come back to the host:

    step N+1:  schedule, build  |  launch N+1 (its decode rows' input ids copied on the
               (host)           |  device from N's sampled tokens)  |  wait for N's
                                |  tokens, hand them over (while N+1 runs)  |  guess N+2

Every row sampled in N is guessed to decode on in N+1: a stand-in token (-1) is appended
to it, replaced on the device by its real token when N+1 launches, and on the host when
N's tokens arrive. A row whose ``max_tokens`` ends it at N is known on the host and
finishes at once. A row that ends at N by EOS is only known once N+1 runs: its N+1 output
is dropped and it finishes then (one row-step of wasted work; its K/V slot written by N+1
lies in blocks it still holds).

It applies to runs whose rows are all greedy and plain (no constraints, logprobs, stop
strings or jump-forward: ``Run.all_greedy``), whose sampling needs nothing but the
logits; the ``overlap`` option says where (auto: on for CUDA, where the host and the
device run side by side; on the CPU the device is the host, so nothing overlaps, but
``on`` runs the same logic: how the tests check it).
"""

from __future__ import annotations

import time
from typing import Any, NamedTuple

import numpy as np
import torch

from llm_operator.engine.native.sequence import RUNNING, WAITING, KVSequence, ScheduledChunk

STAND_IN = -1  # a guessed row's next token until the device (and then the host) has it


def patch_input_ids(input_ids: torch.Tensor, patch) -> None:
    """Copy, on the device, the guessed rows' real tokens into a step's input ids:
    ``patch`` is (token rows, indices, tokens) from ``OverlappedSteps._patch``:
    ``input_ids[rows] = tokens[indices]`` (in input_ids' dtype), no host sync."""
    rows, indices, tokens = patch
    device = input_ids.device
    source = tokens[torch.from_numpy(indices).to(device, non_blocking=True)]
    input_ids[torch.from_numpy(rows).to(device, non_blocking=True)] = source.to(input_ids.dtype)


class _Launched(NamedTuple):
    """An iteration launched on the device whose tokens the host has not handed over."""

    sampled: list[ScheduledChunk]
    tokens: torch.Tensor  # [sampled] int64 on the device, not yet copied to the host
    dropped: frozenset[int]  # indices into sampled whose rows ended before this step


class OverlappedSteps:
    """Steps of one run with the next iteration overlapping the device's work (see the
    module docstring). Same contract as the steps it wraps (``step``, ``close``): the
    native backend's, whose ``scheduler``, ``builder``, ``profile``, ``run``, ``logits``,
    ``finish`` and ``report_rejections`` it drives."""

    def __init__(self, steps: Any) -> None:
        self.steps = steps
        self.launched: _Launched | None = None
        # guessed rows: seq -> (position of its stand-in token, index into launched.tokens)
        self.guessed: dict[KVSequence, tuple[int, int]] = {}
        self.ended: set[KVSequence] = set()  # rows found ended (EOS) while still scheduled

    @torch.inference_mode()
    def step(self) -> bool:
        steps = self.steps
        scheduler, profile = steps.scheduler, steps.profile
        if scheduler.done:
            if self.launched is None:
                return False
            started = time.perf_counter()
            self._land(self.launched)
            self.launched = None
            profile.host.append(time.perf_counter() - started)
            return True
        started = step_started = time.perf_counter()
        chunks = scheduler.schedule()
        plan = steps.builder.plan(chunks, scheduler.copies)
        patch = self._patch(plan) if self.guessed else None
        host = time.perf_counter() - started
        profile.schedule += host
        started = time.perf_counter()
        logits = steps.logits(plan, patch)
        sampled = plan.sampled
        tokens = torch.argmax(logits, dim=-1) if sampled else None  # on the device
        host += steps.upload_seconds
        profile.schedule += steps.upload_seconds
        profile.forward += time.perf_counter() - started - steps.upload_seconds
        started = time.perf_counter()
        scheduler.complete(chunks)
        wait = 0.0
        if self.launched is not None:  # the device runs this step meanwhile
            wait = self._land(self.launched)
        # rows the landed tokens ended that this step computed again: dropped
        dropped = frozenset(k for k, chunk in enumerate(sampled) if chunk.seq in self.ended)
        self.launched = _Launched(sampled, tokens, dropped) if sampled else None
        self._guess(sampled, dropped)
        steps.report_rejections()
        handed_over = time.perf_counter() - started - wait
        profile.forward += wait
        profile.sample += handed_over
        profile.host.append(host + handed_over)
        profile.iterations += 1
        profile.steps.append((plan.num_tokens, len(sampled), time.perf_counter() - step_started))
        return True

    def close(self) -> None:
        self.steps.close()

    # -- the guesses ---------------------------------------------------------------------
    def _patch(self, plan) -> tuple[np.ndarray, np.ndarray, torch.Tensor] | None:
        """(token rows of this step, their indices into the launched step's tokens, those
        tokens): where this step reads a stand-in token."""
        rows, sources = [], []
        query_start = plan.query_start
        guessed = self.guessed
        for c, (seq, start, length, _sample) in enumerate(plan.chunks):
            entry = guessed.get(seq)
            if entry is not None and start <= entry[0] < start + length:
                rows.append(int(query_start[c]) + entry[0] - start)
                sources.append(entry[1])
        if not rows:
            return None
        return (
            np.array(rows, dtype=np.int64),
            np.array(sources, dtype=np.int64),
            self.launched.tokens,
        )

    def _land(self, launched: _Launched) -> float:
        """Hand a launched step's tokens over (waiting for them); returns seconds waited."""
        steps, run = self.steps, self.steps.run
        started = time.perf_counter()
        tokens = launched.tokens.tolist()  # the one host sync of the step
        wait = time.perf_counter() - started
        seqs, ids, kept = [], [], []
        for k, chunk in enumerate(launched.sampled):
            if k not in launched.dropped:
                seqs.append(chunk.seq)
                ids.append(chunk.seq.ref)
                kept.append(tokens[k])
        guessed, ended = self.guessed, self.ended
        for seq, token, finished in zip(seqs, kept, run.append_plain(ids, kept)):
            if not finished:
                seq.tokens[guessed[seq][0]] = token
            elif seq.status is RUNNING:  # guessed on: scheduled again, ends after that step
                ended.add(seq)
            elif seq.status is WAITING:  # guessed on, then preempted: never runs again
                steps.finish(seq)
        return wait

    def _guess(self, sampled: list[ScheduledChunk], dropped: frozenset[int]) -> None:
        """After this step: every sampled row decodes on with a stand-in token, but rows
        whose ``max_tokens`` this step's token reaches, and rows found ended, finish now."""
        steps = self.steps
        requests = steps.run.requests
        self.guessed = guessed = {}
        for k, chunk in enumerate(sampled):
            seq = chunk.seq
            if k in dropped:
                self.ended.discard(seq)
                steps.finish(seq)
                continue
            decoder = requests[seq.ref].decoder
            # the tokens handed over so far, this step's, and the one guessed
            if len(decoder.token_ids) + 1 >= decoder.max_tokens:
                steps.finish(seq)
                continue
            seq.tokens.append(STAND_IN)
            guessed[seq] = (len(seq.tokens) - 1, k)
