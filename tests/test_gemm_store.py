"""The CPU GEMM choices stored per machine kind (``models/gemm_store.py``): processes of one
kind use the first choice recorded for a shape, whatever their own timings say."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from llm_operator.models import gemm_store
from llm_operator.models.gemm import GemmChoice
from llm_operator.models.gemm_store import GemmStore, key_text

SHAPE = (torch.float32, 6, 512, 512, False, False)  # 32 rows of a 512 x 512 weight


def timed_as(name: str):
    """A _measure_one whose timings always make ``name`` the fastest."""

    def measure(self, x, weight, bias, packed, kernel):
        return name

    return measure


def test_a_second_process_takes_the_first_ones_choice(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(tmp_path))
    x, weight = torch.randn(32, 512), torch.randn(512, 512)
    monkeypatch.setattr(GemmChoice, "_measure_one", timed_as("aten"))
    first = GemmChoice(onednn=True)
    out_first = first(x, weight)
    assert first.choices[SHAPE] == "aten"
    monkeypatch.setattr(GemmChoice, "_measure_one", timed_as("onednn"))  # opposite timings
    second = GemmChoice(onednn=True)  # a fresh process's choice object
    out_second = second(x, weight)
    assert second.choices[SHAPE] == "aten"  # read, not re-timed
    assert torch.equal(out_first, out_second)  # the same kernel: the same bits
    stored = json.loads(next((tmp_path / "gemm").glob("*.json")).read_text())
    assert stored["choices"] == {key_text(SHAPE): "aten"}
    assert stored["machine"]["threads"] == torch.get_num_threads()


def test_another_machine_kind_is_never_read(tmp_path):
    machine = gemm_store.machine_record(onednn=True)
    here = GemmStore(tmp_path, machine)
    here.record(SHAPE, "onednn")
    other = dict(machine, cpu="x86_64 Some Other CPU avx2")
    assert GemmStore(tmp_path, other).get(SHAPE) is None  # another digest
    # the same file name with another machine record inside (e.g. copied): ignored
    forged = GemmStore(tmp_path, machine)
    forged.path.write_text(json.dumps({"machine": other, "choices": {key_text(SHAPE): "aten"}}))
    assert GemmStore(tmp_path, machine).get(SHAPE) is None
    assert GemmStore(tmp_path, machine).record(SHAPE, "packed") == "packed"


def test_turned_off_nothing_is_written(tmp_path, monkeypatch):
    monkeypatch.setenv("LLM_OPERATOR_CACHE", str(tmp_path))
    monkeypatch.setenv(gemm_store.STORE_ENV, "off")
    monkeypatch.setattr(GemmChoice, "_measure_one", timed_as("aten"))
    GemmChoice(onednn=True)(torch.randn(32, 512), torch.randn(512, 512))
    assert not (tmp_path / "gemm").exists()
    monkeypatch.setenv(gemm_store.STORE_ENV, "maybe")
    with pytest.raises(ValueError, match="LLM_OPERATOR_GEMM_STORE must be on or off"):
        gemm_store.store_enabled()


WRITER = textwrap.dedent(
    """
    import sys, time
    import torch
    from llm_operator.models.gemm_store import GemmStore, machine_record
    store = GemmStore(__import__("pathlib").Path(sys.argv[1]), machine_record(onednn=True))
    while time.time() < float(sys.argv[3]):
        pass
    print(store.record((torch.float32, 6, 512, 512, False, False), sys.argv[2]))
    """
)


def test_concurrent_writers_agree_and_leave_one_valid_file(tmp_path):
    """Four processes record different choices for one shape at the same moment: every
    one returns the same choice and the file holds it."""
    import time

    start = time.time() + 4  # all of them importing torch first, then racing
    names = ["aten", "onednn", "packed", "aten"]
    children = [
        subprocess.Popen(
            [sys.executable, "-c", WRITER, str(tmp_path), name, str(start)],
            stdout=subprocess.PIPE,
            text=True,
            env=dict(os.environ),
        )
        for name in names
    ]
    answers = [child.communicate(timeout=120)[0].strip() for child in children]
    assert all(child.returncode == 0 for child in children)
    assert len(set(answers)) == 1 and answers[0] in names
    (path,) = tmp_path.glob("*.json")
    assert json.loads(path.read_text())["choices"] == {key_text(SHAPE): answers[0]}
    assert not list(tmp_path.glob("*.tmp"))


ENGINE_RUN = textwrap.dedent(
    """
    import json, sys
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator.models import gemm
    from llm_operator.models.gemm import GemmChoice

    timed = []
    def measure(self, *args):
        timed.append(args)
        return sys.argv[2]          # this process's timings: always this kernel fastest
    def measure_group(self, *args):
        timed.append(args)
        return sys.argv[2]
    GemmChoice._measure_one, GemmChoice._measure = measure, measure_group
    # deterministic=False: the fastest kernel per shape (the batch-invariant mode times nothing)
    op = LLMOperator(sys.argv[1], backend="native", dtype="bfloat16", deterministic=False)
    rows = [f"Review {i}: the battery lasts {i} days and the screen is bright" for i in range(6)]
    out = op.generate(rows, SamplingParams(max_tokens=6, ignore_eos=True))
    print(json.dumps({"tokens": [list(r.token_ids) for r in out], "timed": len(timed),
                      "choices": sorted(f"{k}={v}" for k, v in gemm.DEFAULT_GEMM.choices.items())}))
    """
)


def test_two_processes_with_opposite_timings_give_the_same_tokens(tmp_path, tiny_tokenizer_dir):
    """A bf16 model large enough for its GEMMs to be timed: the first process finds aten
    fastest everywhere, the second oneDNN; the second reads the first's choices and
    produces the same tokens."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_tokenizer_dir)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=512, intermediate_size=1024,
        num_hidden_layers=2, num_attention_heads=8, num_key_value_heads=4,
        max_position_embeddings=256, initializer_range=0.2, eos_token_id=0, pad_token_id=0,
        bos_token_id=None, tie_word_embeddings=True,
    )  # fmt: skip
    torch.manual_seed(0)
    model_dir = tmp_path / "model"
    LlamaForCausalLM(config).save_pretrained(model_dir)
    tokenizer.save_pretrained(model_dir)
    # (the elementwise packages are not what this checks: eager, nothing to build)
    env = dict(os.environ, LLM_OPERATOR_CACHE=str(tmp_path / "cache"), LLM_OPERATOR_COMPILE="off")
    runs = []
    for fastest in ("aten", "onednn"):
        done = subprocess.run(
            [sys.executable, "-c", ENGINE_RUN, str(model_dir), fastest],
            env=env, capture_output=True, text=True, timeout=600,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr[-3000:]
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    first, second = runs
    assert first["timed"] > 0 and all(c.endswith("=aten") for c in first["choices"] if "|" not in c)
    assert second["timed"] == 0  # every shape read from the store
    assert second["choices"] == first["choices"]
    assert second["tokens"] == first["tokens"]
