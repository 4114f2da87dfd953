"""K/V of shared prefix segments: computed once, held until the last member is admitted.

Contract:
  acquire(request) -> (K/V of the request's whole shared prefix, each layer
      [1, kv_heads, prefix_length, head_dim], or None when it shares nothing;
      logits [vocab] of the prefix's last token, used when the suffix is empty)
  release(request) -> the request no longer needs its chain; a segment whose
      every member has been released is freed (it is never evicted earlier): the
      member counting is ``SegmentPins``, shared with the native backend.
A segment's K/V are computed from its parent's (one forward pass over the
segment's own tokens), so each shared token is prefilled exactly once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from llm_operator.engine.hf.batch_cache import KVLayers, layers_of
from llm_operator.engine.segment_pins import SegmentPins
from llm_operator.planner import Plan, PlannedRequest


def kv_bytes_per_token(model) -> int:
    """Bytes of K and V for one token over all layers (from the model config)."""
    config = (
        model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    )
    heads = getattr(config, "num_attention_heads", 1)
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    layers = getattr(config, "num_hidden_layers", 1)
    element = next(model.parameters()).element_size()
    return 2 * layers * kv_heads * head_dim * element


class PrefixStore(SegmentPins):
    def __init__(self, model, forward: Callable, plan: Plan) -> None:
        """model: the HF model (its config sizes the K/V); forward(input_ids, mask,
        positions, parent K/V) -> (logits, K/V): ``HFBackend.forward``."""
        super().__init__(len(plan.segments), (r.chain for r in plan.requests))
        self.forward = forward
        self.plan = plan
        self.entries: dict[int, tuple[KVLayers, torch.Tensor]] = {}
        self.tokens_computed = 0
        self.bytes_per_token = kv_bytes_per_token(model)

    def held_bytes(self) -> int:
        return sum(k.nbytes + v.nbytes for layers, _ in self.entries.values() for k, v in layers)

    def acquire(self, request: PlannedRequest):
        if not request.chain:
            return None, None
        return self._segment(request.chain[-1])

    def release(self, request: PlannedRequest) -> None:
        for segment_id in self.member_done(request.chain):
            self.entries.pop(segment_id, None)

    def _segment(self, segment_id: int):
        if segment_id in self.entries:
            return self.entries[segment_id]
        segment = self.plan.segments[segment_id]
        parent = None if segment.parent_id is None else self._segment(segment.parent_id)[0]
        input_ids = torch.tensor([list(segment.token_ids)], dtype=torch.long)
        positions = torch.arange(segment.start, segment.end).unsqueeze(0)
        mask = torch.ones(1, segment.end, dtype=torch.bool)
        logits, cache = self.forward(input_ids, mask, positions, parent)
        self.entries[segment_id] = (layers_of(cache), logits[0])
        self.tokens_computed += len(segment.token_ids)
        return self.entries[segment_id]
