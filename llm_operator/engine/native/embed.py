"""Embeddings on the native engine: the plan's shared segments prefilled once, each row's
own tokens computed once, and the last hidden states pooled instead of sampled.

An embedding run is a generation run that stops where sampling would start: the scheduler,
the step builder, the KV pool and the forward are the generation's (``backend``), with
one output token budgeted per row and none sampled. Each step's final-normed hidden
states [tokens, hidden] are read by chunk (``HostStep.query_start``):

- ``"last"``: a row's vector is the hidden state of its last prompt token, the row that
  generation would sample from;
- ``"mean"``: every sequence (a segment or a row's own tokens) keeps its computed
  tokens' hidden states; a row's vector is the mean of its chain's segments' states and
  its own, put end to end: one sum over the whole prompt in position order, so a row
  gets the same bits whatever it shares with (the default batch-invariant mode holds). A
  segment's tokens are computed once, whatever number of rows reads it. (With tail
  copies, the tokens a sequence copies are its parent's, kept there.) A sequence
  computed again (an evicted segment) starts again;
- ``"cls"``: the hidden state at position 0 (the chain's first segment, or the row's own).

The attention is causal, so a token's hidden state depends only on the tokens before it:
a segment's hidden states are the same for every row that starts with it, and the
vectors equal those of each row run alone.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from llm_operator import kernels
from llm_operator.engine.native.op_profile import TimedOps
from llm_operator.engine.native.sequence import REQUEST, SEGMENT, KVSequence

if TYPE_CHECKING:
    from llm_operator.engine.native.backend import NativeBackend, _NativeSteps
    from llm_operator.planner import Plan


class EmbedRun:
    """What the native steps need of a run when nothing is sampled: the plan, rejected
    rows (their messages) and the prefill count."""

    def __init__(self, plan: Plan, progress=None) -> None:
        self.plan = plan
        self.failed: dict[int, str] = {}
        self.prefill_tokens = 0
        self.progress = progress

    def fail(self, request_id: int, message: str) -> None:
        self.failed[request_id] = message


def embed_steps(backend: NativeBackend, run: EmbedRun, pooling: str) -> _NativeSteps:
    from llm_operator.engine.native.backend import _NativeSteps

    class EmbedSteps(_NativeSteps):
        """``_NativeSteps`` whose step pools where generation samples."""

        def __init__(self) -> None:
            super().__init__(backend, run)
            self.pooling = pooling
            self.states: dict[tuple, list] = {}  # (kind, ref) -> its chunks' hidden states
            self.first: dict[tuple, torch.Tensor] = {}  # (kind, ref) -> position 0's state
            self.vectors: dict[int, torch.Tensor] = {}  # request_id -> pooled float32

        @torch.inference_mode()
        def step(self) -> bool:
            scheduler, profile, ops = self.scheduler, self.profile, self.backend.op_profile
            if scheduler.done:
                return False
            regions = None
            if ops is not None:  # profile_ops: this step's seconds by kind of work
                ops.begin()
                regions = TimedOps(self.backend.ops, ops)
            step_started = time.perf_counter()
            chunks = scheduler.schedule()
            plan = self.builder.plan(chunks, scheduler.copies)
            if plan.copies is not None:  # tail copies: before any layer reads them
                copies = kernels.device_tensor(plan.copies, self.backend.device)
                kernels.copy_blocks(self.implementation, [*self.k_cache, *self.v_cache], copies)
            batch = self.builder.to_device(plan)
            forward_started = time.perf_counter()
            profile.schedule += forward_started - step_started
            hidden = self._forward(batch, regions).float()
            pool_started = time.perf_counter()
            profile.forward += pool_started - forward_started
            self._keep(plan.chunks, plan.query_start, hidden)
            scheduler.complete(chunks)
            last = hidden[batch.last_rows] if plan.sampled else None
            for index, chunk in enumerate(plan.sampled):
                self.vectors[chunk.seq.ref] = self._pooled(chunk.seq, last[index])
                self.finish(chunk.seq)
            if plan.sampled and run.progress is not None:
                run.progress([chunk.seq.ref for chunk in plan.sampled])
            self.report_rejections()
            ended = time.perf_counter()
            profile.sample += ended - pool_started  # pooling, where generation samples
            profile.host.append(forward_started - step_started + ended - pool_started)
            profile.iterations += 1
            profile.steps.append((plan.num_tokens, len(plan.sampled), ended - step_started))
            if ops is not None:
                profile.ops = [*(profile.ops or []), ops.end(ended - step_started)]
            return True

        def _keep(self, chunks, query_start, hidden: torch.Tensor) -> None:
            """What pooling needs of this step's hidden states, by sequence."""
            if self.pooling == "last":
                return
            for index, chunk in enumerate(chunks):
                seq = chunk.seq
                key = (seq.kind, seq.ref)
                rows = hidden[int(query_start[index]) : int(query_start[index + 1])]
                if self.pooling == "cls":
                    if seq.prefix_length + chunk.start == 0:
                        self.first[key] = rows[0].clone()
                    continue
                if chunk.start == seq.head or key not in self.states:  # (again) from its start
                    self.states[key] = []
                self.states[key].append(rows.clone())  # not a view of the whole step

        def _pooled(self, seq: KVSequence, last: torch.Tensor) -> torch.Tensor:
            if self.pooling == "last":
                return last
            if self.pooling == "cls":
                key = (SEGMENT, seq.chain[0]) if seq.chain else (REQUEST, seq.ref)
                return self.first[key]
            keys = [(SEGMENT, segment_id) for segment_id in seq.chain] + [(REQUEST, seq.ref)]
            states = torch.cat([rows for key in keys for rows in self.states[key]])
            del self.states[(REQUEST, seq.ref)]
            length = len(run.plan.requests[seq.ref].token_ids)
            assert len(states) == length, f"mean pooling saw {len(states)} of {length} tokens"
            return states.sum(0) / length

    return EmbedSteps()


class NativeEmbedder:
    """The native backend's embedder: the same model, KV pool and kernels as ``generate``."""

    name = "native"

    def __init__(self, backend: NativeBackend) -> None:
        self.backend = backend
        self.paths = backend.paths

    def embed(
        self, plan: Plan, pooling: str, progress=None
    ) -> tuple[dict[int, torch.Tensor], dict[int, str], int]:
        """Run ``plan`` (each request budgeted one output token), pooling: (vector by
        request id, error message by request id, prefill tokens computed). ``progress``
        is called with the request ids of each step's finished rows."""
        run = EmbedRun(plan, progress)
        steps = embed_steps(self.backend, run, pooling)
        try:
            while steps.step():
                pass
        finally:
            steps.close()
        return steps.vectors, run.failed, run.prefill_tokens
