"""The baseline a user writes in a pandas UDF: Hugging Face ``generate`` on
fixed-size batches in input order, each batch run to completion."""

from __future__ import annotations

import copy
import time
from collections.abc import Sequence
from typing import NamedTuple

import torch


class StaticRun(NamedTuple):
    token_ids: list[list[int]]  # generated tokens per prompt, cut after the first EOS
    prompt_tokens: int  # real prompt tokens prefilled
    padded_prompt_tokens: int  # prompt positions computed, padding included
    output_tokens: int
    seconds: float


@torch.inference_mode()
def run_hf_static(
    model,
    tokenizer,
    prompts: Sequence[Sequence[int]],
    *,
    max_tokens: int | Sequence[int],
    batch_size: int,
    stop: Sequence[str] = (),
    ignore_eos: bool = False,
) -> StaticRun:
    """Greedy ``model.generate`` over ``prompts`` (token ids), ``batch_size`` at a time, left-padded.

    max_tokens: one limit, or one per prompt; a batch runs to its largest limit (as one
    ``generate`` call must) and each row is cut to its own afterwards.
    ignore_eos: never stop at EOS (it is generated like any other token), so every row
    gets exactly its max_tokens, as ``SamplingParams(ignore_eos=True)`` does.
    """
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    if len(limits) != len(prompts):
        raise ValueError(f"max_tokens has {len(limits)} limits for {len(prompts)} prompts")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = model.generation_config.eos_token_id
    eos_ids = set() if ignore_eos else set([eos] if isinstance(eos, int) else (eos or []))
    generation_config = copy.deepcopy(model.generation_config)
    if ignore_eos:
        generation_config.eos_token_id = []  # None would be refilled from the model's config
    device = next(model.parameters()).device
    outputs: list[list[int]] = []
    padded = 0
    started = time.perf_counter()
    for begin in range(0, len(prompts), batch_size):
        batch = prompts[begin : begin + batch_size]
        width = max(len(p) for p in batch)
        padded += width * len(batch)
        input_ids = torch.full((len(batch), width), pad, dtype=torch.long)
        mask = torch.zeros((len(batch), width), dtype=torch.long)
        for i, p in enumerate(batch):
            input_ids[i, width - len(p) :] = torch.as_tensor(list(p))
            mask[i, width - len(p) :] = 1
        extra = {"stop_strings": list(stop), "tokenizer": tokenizer} if stop else {}
        generated = model.generate(
            input_ids=input_ids.to(device),
            attention_mask=mask.to(device),
            generation_config=generation_config,
            max_new_tokens=max(limits[begin : begin + batch_size]),
            do_sample=False,
            pad_token_id=pad,
            **extra,
        )
        for offset, row in enumerate(generated[:, width:].tolist()):
            row = row[: limits[begin + offset]]
            cut = next((i + 1 for i, t in enumerate(row) if t in eos_ids), len(row))
            row = row[:cut]
            while stop and row and row[-1] == pad and pad not in eos_ids:
                row.pop()  # generate pads rows that ended on a stop string
            outputs.append(row)
    seconds = time.perf_counter() - started
    return StaticRun(
        outputs,
        sum(len(p) for p in prompts),
        padded,
        sum(len(o) for o in outputs),
        seconds,
    )
