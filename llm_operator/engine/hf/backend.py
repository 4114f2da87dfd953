"""The ``hf`` backend: any Hugging Face causal LM, BATON re-batching, shared prefixes.

Each iteration (``_HFSteps.step``):
  1. admit: waiting requests fill free row slots (as many as ``max_batch_size``
     and the KV budget allow); each is prefilled separately from a copy of its
     shared prefix's K/V, then its K/V are written into a free row of the batch;
  2. decode: one forward pass over the running rows (one column each; where a constrained
     row has jump-forward tokens to feed, as many columns as the most a row feeds);
  3. retire: rows that hit EOS, a stop string or their length free their slots.
A group's shared prefix (each segment of its chain) is prefilled once and kept
until its last member has been admitted.
"""

from __future__ import annotations

import inspect
from collections import deque
from dataclasses import dataclass, field

import torch
from transformers.cache_utils import DynamicCache

from llm_operator.config import EngineConfig
from llm_operator.engine.hf.batch_cache import GROWTH_COLUMNS, DenseBatchCache, KVLayers, layers_of
from llm_operator.engine.hf.prefix_store import PrefixStore
from llm_operator.engine.run import Request, Run
from llm_operator.planner import PlannedRequest


class HFBackend:
    """Runs a plan on a ``transformers`` causal LM with a dense batch KV cache."""

    name = "hf"

    def __init__(
        self, model, tokenizer, engine_config: EngineConfig, *, kv_cache_bytes: int | None = None
    ) -> None:
        """engine_config: its ``max_batch_size`` and ``prefill_batch_tokens`` apply here.
        kv_cache_bytes: the KV budget in bytes (``kv_cache_memory`` resolved for the
        device; None: unbounded)."""
        self.model = model
        self.tokenizer = tokenizer
        # batch sizes left to the engine: the CPU's, unless build_backend sized them for a GPU
        self.engine_config = engine_config.with_batch_defaults(None)
        self.kv_cache_bytes = kv_cache_bytes
        self.device = next(model.parameters()).device
        self.pad_token_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
        params = inspect.signature(model.forward).parameters
        self._cache_argument = "cache" if "cache" in params else "past_key_values"

    # -- one forward pass ------------------------------------------------
    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        cache: DynamicCache | KVLayers | None,
    ) -> tuple[torch.Tensor, DynamicCache]:
        """Logits of the last column [rows, vocab] and the cache holding the new K/V."""
        # input_ids, position_ids: [rows, new]; attention_mask: [rows, cached + new]
        if not isinstance(cache, DynamicCache):
            cache = DynamicCache(ddp_cache_data=cache)  # None: an empty cache
        out = self.model(
            input_ids=input_ids.to(self.device),
            attention_mask=attention_mask.to(self.device),
            position_ids=position_ids.to(self.device),
            use_cache=True,
            logits_to_keep=1,
            **{self._cache_argument: cache},
        )
        new_cache = getattr(out, "cache", None) or getattr(out, "past_key_values", None)
        return out.logits[:, -1, :], new_cache

    # -- a run -----------------------------------------------------------
    def start(self, run: Run) -> _HFSteps:
        return _HFSteps(self, run)


@dataclass(slots=True)
class _Row:
    """A request in the batch and the tokens to feed next (the sampled token, then any
    jump-forward tokens)."""

    request: Request
    pending: list[int] = field(default_factory=list)


class _HFSteps:
    """One run on the hf backend: the waiting queue, the batch, the prefix store."""

    def __init__(self, backend: HFBackend, run: Run) -> None:
        self.backend = backend
        self.run = run
        self.waiting: deque[PlannedRequest] = deque(run.plan.requests)
        self.slots: list[_Row | None] = []
        self.batch: DenseBatchCache | None = None
        self.prefixes = PrefixStore(backend.model, backend.forward, run.plan)

    def step(self) -> bool:
        if not (self.waiting or any(self.slots)):
            return False
        self.admit()
        if any(self.slots):
            self.decode()
        return True

    def close(self) -> None:
        self.run.prefill_tokens += self.prefixes.tokens_computed
        self.slots, self.batch = [], None

    # -- admission -------------------------------------------------------
    def admit(self) -> None:
        free = [i for i, row in enumerate(self.slots) if row is None]
        capacity = self.backend.engine_config.max_batch_size - len(self.slots) + len(free)
        chosen: list[PlannedRequest] = []
        while self.waiting and len(chosen) < capacity:
            request = self.waiting[0]
            if not self._fits(chosen, request):
                if chosen or any(self.slots):
                    break  # wait for rows to finish
                self.waiting.popleft()
                message = "the request needs more KV cache memory than kv_cache_memory allows"
                self.run.fail(request.request_id, message)
                self.prefixes.release(request)
                continue
            chosen.append(self.waiting.popleft())
        if not chosen:
            self._compact()
            return
        for part in self._prefill_parts(chosen):
            self._prefill_and_insert(part, free)

    def _fits(self, chosen: list[PlannedRequest], request: PlannedRequest) -> bool:
        """Projected dense cache size (rows x longest possible time axis) within the KV budget."""
        budget = self.backend.kv_cache_bytes
        if budget is None:
            return True
        active = [row.request.decoder for row in self.slots if row is not None]
        entering = [*chosen, request]
        # an entering row spans (longest prefix + longest suffix) columns of its prefill pass
        entering_time = max(r.prefix_length for r in entering) + max(
            len(r.suffix) for r in entering
        )
        time = max(self.batch.time if self.batch else 0, entering_time)
        remaining = max(
            [d.max_tokens - len(d.token_ids) for d in active]
            + [self.run.requests[r.request_id].params.max_tokens for r in entering]
        )
        columns = time + remaining + GROWTH_COLUMNS  # the buffer grows in steps of GROWTH_COLUMNS
        projected = (len(active) + len(entering)) * columns * self.prefixes.bytes_per_token
        return projected + self.prefixes.held_bytes() <= budget

    def _prefill_parts(self, chosen: list[PlannedRequest]) -> list[list[PlannedRequest]]:
        """Split admitted requests into prefill passes of at most prefill_batch_tokens padded suffix tokens."""
        budget = self.backend.engine_config.prefill_batch_tokens
        parts: list[list[PlannedRequest]] = [[]]
        widest = 0
        for request in chosen:
            width = max(widest, len(request.suffix), 1)
            if parts[-1] and width * (len(parts[-1]) + 1) > budget:
                parts.append([])
                width = max(len(request.suffix), 1)
            parts[-1].append(request)
            widest = width
        return parts

    def _prefill_and_insert(self, requests: list[PlannedRequest], free: list[int]) -> None:
        """Prefill the requests' suffixes from their prefix K/V, sample their first token, add them to the batch."""
        # (layers [1, h, P, d], last logits) per request
        prefixes = [self.prefixes.acquire(r) for r in requests]
        prefix_time = max(r.prefix_length for r in requests)
        suffix_time = max(len(r.suffix) for r in requests)
        rows = len(requests)
        mask = torch.zeros(rows, prefix_time + suffix_time, dtype=torch.bool)
        input_ids = torch.full((rows, suffix_time), self.backend.pad_token_id, dtype=torch.long)
        position_ids = torch.zeros(rows, suffix_time, dtype=torch.long)
        for i, r in enumerate(requests):  # prefixes and suffixes right-aligned
            start = suffix_time - len(r.suffix)
            mask[i, prefix_time - r.prefix_length : prefix_time] = True
            mask[i, prefix_time + start :] = True
            input_ids[i, start:] = torch.as_tensor(list(r.suffix), dtype=torch.long)
            position_ids[i, start:] = torch.arange(r.prefix_length, len(r.token_ids))
        layers = _stack_prefixes([p[0] for p in prefixes], prefix_time)
        if suffix_time > 0:
            logits, cache = self.backend.forward(input_ids, mask, position_ids, layers)
            layers = layers_of(cache)
            self.run.prefill_tokens += sum(len(r.suffix) for r in requests)
        first_logits = torch.stack(
            [logits[i] if r.suffix else p[1] for i, (r, p) in enumerate(zip(requests, prefixes))]
        )
        for request in requests:
            self.prefixes.release(request)
        tokens = self.run.sample(first_logits, [r.request_id for r in requests])
        positions = torch.tensor([len(r.token_ids) for r in requests], dtype=torch.long)
        reused = free[:rows]  # BATON: freed rows of the running batch first
        del free[:rows]
        slots = reused + list(range(len(self.slots), len(self.slots) + rows - len(reused)))
        self.slots.extend([None] * (rows - len(reused)))
        if self.batch is None:
            assert slots == list(range(rows)), "an empty batch fills from slot 0"
            self.batch = DenseBatchCache(layers, mask, positions)
        else:
            self.batch.write_rows(slots, layers, mask, positions)
        for slot, request in zip(slots, requests):
            self.slots[slot] = _Row(self.run.requests[request.request_id])
        self._append(slots, tokens)

    # -- decoding --------------------------------------------------------
    def decode(self) -> None:
        """One forward pass over the running rows: one column each, or as many as the
        longest pending (a row's sampled token and its jump-forward tokens, right-aligned,
        with masked holes left of a shorter row's tokens)."""
        pad = self.backend.pad_token_id
        pending = [row.pending if row is not None else [pad] for row in self.slots]
        counts = [len(p) for p in pending]
        width = max(counts)
        tokens = torch.full((len(pending), width), pad, dtype=torch.long)
        for i, p in enumerate(pending):
            tokens[i, width - len(p) :] = torch.as_tensor(p, dtype=torch.long)
        cache, mask, positions = self.batch.prepare_decode(counts if width > 1 else None)
        logits, _ = self.backend.forward(tokens, mask, positions, cache)
        self.batch.finish_decode()
        live = [i for i, row in enumerate(self.slots) if row is not None]
        index = torch.tensor(live, dtype=torch.long)
        sampled = self.run.sample(
            logits[index.to(logits.device)], [self.slots[i].request.request_id for i in live]
        )
        self._append(live, sampled)

    def _append(self, slots: list[int], tokens: list[int]) -> None:
        """Record each row's token (the run applies the stop rules) and what it feeds next;
        free the slots of rows that finished (their outputs are in the run already)."""
        finished = []
        for slot, token in zip(slots, tokens):
            row = self.slots[slot]
            if self.run.append(row.request.request_id, token):
                finished.append(slot)
            row.pending = [token, *self.run.jumped(row.request.request_id)]
        for slot in finished:
            self.slots[slot] = None
        if finished:
            self.batch.park_rows(finished)

    def _compact(self) -> None:
        """With nothing to admit, drop parked rows once they are a quarter of the batch."""
        live = [i for i, row in enumerate(self.slots) if row is not None]
        parked = len(self.slots) - len(live)
        if parked == 0 or (live and parked * 4 < len(self.slots)):
            return
        if not live:
            self.slots, self.batch = [], None
            return
        self.batch.keep_rows(live)
        self.slots = [self.slots[i] for i in live]


def _stack_prefixes(prefixes: list[KVLayers | None], prefix_time: int) -> KVLayers | None:
    """Left-pad each request's prefix K/V to prefix_time and stack them on the row axis
    (zeros for a request without one)."""
    if prefix_time == 0:
        return None
    template = next(p for p in prefixes if p is not None)

    def stacked(layer: int, kv: int) -> torch.Tensor:  # kv: 0 keys, 1 values
        first = template[layer][kv]
        out = first.new_zeros(len(prefixes), first.shape[1], prefix_time, first.shape[3])
        for i, prefix in enumerate(prefixes):
            if prefix is not None:
                out[i, :, prefix_time - prefix[layer][kv].shape[2] :] = prefix[layer][kv][0]
        return out

    return [(stacked(layer, 0), stacked(layer, 1)) for layer in range(len(template))]
