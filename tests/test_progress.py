"""The progress bar: rows of the user's only, and a token rate that is not stale."""

from __future__ import annotations

import re

from llm_operator import LLMOperator, SamplingParams
from llm_operator import progress as progress_module


def test_choices_with_logprobs_count_rows_not_scoring_requests(tiny_llama_dir, capsys):
    prompts = ["Is the box crushed?", "Is it great value?", "Does it work fine?"]
    params = SamplingParams(max_tokens=4, choices=["yes", "no", "maybe"], logprobs=True)
    results = LLMOperator(tiny_llama_dir, progress=True).generate(prompts, params)
    assert all(r.choice_logprobs is not None for r in results)  # 9 scoring requests ran
    err = capsys.readouterr().err
    counts = set(re.findall(r"(\d+)/(\d+) \[", err))
    assert ("3", "3") in counts
    assert all(total == "3" for _, total in counts), counts  # never "9/3" or "/12"


def test_the_rate_shown_at_the_end_is_the_whole_run(monkeypatch, capsys):
    clock = [100.0]
    monkeypatch.setattr(progress_module.time, "perf_counter", lambda: clock[0])
    with progress_module.ProgressBar(2, enabled=True) as bar:
        clock[0] = 101.0
        bar.update(0, 1)  # an early, slow start: 1 token in 1 s
        clock[0] = 101.2  # within 0.5 s: no new rate yet
        bar.update(1, 99)
        clock[0] = 110.0
        bar.update(1, 0)
    err = capsys.readouterr().err
    assert "2/2" in err
    assert err.rstrip().endswith("10.0 tok/s]"), err[-200:]  # 100 tokens in 10 s
