"""Device and dtype choice, and loading a tokenizer and a causal LM from a local directory.

Loading never touches the network (`local_files_only=True`) and never reads pickle
checkpoints (`use_safetensors=True`). torch is imported on first use, so
`llm_operator.models` (e.g. the registry's driver-side model check) imports without it.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llm_operator.models.registry import validate_model_directory

if TYPE_CHECKING:
    import torch
    from transformers import PreTrainedModel, PreTrainedTokenizerBase

SUPPORTED_DTYPE_NAMES = ("float32", "bfloat16", "float16")
# dtype spelling -> torch dtype name
DTYPE_SPELLINGS: dict[str, str] = {name: name for name in SUPPORTED_DTYPE_NAMES}
DTYPE_SPELLINGS.update(fp32="float32", bf16="bfloat16", fp16="float16", half="float16")
DEVICE_TYPES = ("cpu", "cuda", "mps")


def resolve_device(device: str | torch.device) -> torch.device:
    """A validated, available device of "auto" (cuda if available, else cpu), "cpu", "cuda"
    (the current one), "cuda:N", "mps" or a torch.device. Raises TypeError for other types
    and ValueError for unknown or unavailable devices."""
    import torch

    if isinstance(device, str):
        text = device.strip().lower()
        if text == "auto":
            text = "cuda" if torch.cuda.is_available() else "cpu"
        try:
            parsed = torch.device(text)
        except (RuntimeError, ValueError) as error:
            raise ValueError(
                f"device={device!r} is not a device; use 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
            ) from error
    elif isinstance(device, torch.device):
        parsed = device
    else:
        raise TypeError(
            f"device must be a str or torch.device, got {type(device).__name__}: {device!r}"
        )

    if parsed.type not in DEVICE_TYPES:
        raise ValueError(
            f"device={device!r}: device type {parsed.type!r} is not supported; use one of {DEVICE_TYPES}"
        )
    if parsed.type == "cpu":
        return torch.device("cpu")
    if parsed.type == "mps":
        if not torch.backends.mps.is_available():
            raise ValueError(f"device={device!r} but MPS is not available on this machine")
        return torch.device("mps")
    if not torch.cuda.is_available():
        raise ValueError(f"device={device!r} but CUDA is not available on this machine")
    index = torch.cuda.current_device() if parsed.index is None else parsed.index
    if not 0 <= index < torch.cuda.device_count():
        raise ValueError(
            f"device={device!r} but this machine has {torch.cuda.device_count()} CUDA device(s)"
        )
    return torch.device("cuda", index)


def resolve_dtype(dtype: str | torch.dtype, device: torch.device) -> torch.dtype:
    """ "auto" -> float32 on cpu/mps, bfloat16 on cuda when supported else float16; also
    the spellings of DTYPE_SPELLINGS and those torch dtypes. Raises TypeError for other
    types, ValueError for other values."""
    import torch

    supported = tuple(getattr(torch, name) for name in SUPPORTED_DTYPE_NAMES)
    if isinstance(dtype, torch.dtype):
        if dtype not in supported:
            raise ValueError(f"dtype={dtype!r} is not supported; use one of {supported}")
        return dtype
    if not isinstance(dtype, str):
        raise TypeError(
            f"dtype must be a str or torch.dtype, got {type(dtype).__name__}: {dtype!r}"
        )
    text = dtype.strip().lower().removeprefix("torch.")
    if text == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.float32
    if text not in DTYPE_SPELLINGS:
        raise ValueError(
            f"dtype={dtype!r} is not supported; use 'auto' or one of {sorted(DTYPE_SPELLINGS)}"
        )
    return getattr(torch, DTYPE_SPELLINGS[text])


def _require_directory(model_dir: Path, parameter: str = "model_dir") -> Path:
    if not isinstance(model_dir, (str, Path)):
        raise TypeError(
            f"{parameter} must be a Path, got {type(model_dir).__name__}: {model_dir!r}"
        )
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FileNotFoundError(f"{parameter}={str(model_dir)!r} is not a directory")
    return model_dir


def load_tokenizer(model_dir: Path, *, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The fast tokenizer of `model_dir`, with a pad token (eos if none) and left padding;
    ValueError if only a slow tokenizer is available or it has neither a pad nor an eos."""
    from transformers import AutoTokenizer

    model_dir = _require_directory(model_dir)
    tokenizer = AutoTokenizer.from_pretrained(
        model_dir, use_fast=True, local_files_only=True, trust_remote_code=trust_remote_code
    )
    if not tokenizer.is_fast:
        raise ValueError(
            f"model_dir={str(model_dir)!r}: only a slow tokenizer ({type(tokenizer).__name__}) is "
            f"available; a fast tokenizer (tokenizer.json) is required"
        )
    if tokenizer.pad_token is None:
        if tokenizer.eos_token is None:
            raise ValueError(
                f"model_dir={str(model_dir)!r}: the tokenizer has neither an eos nor a pad token"
            )
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"
    return tokenizer


def load_causal_lm(
    model_dir: Path, *, device: torch.device, dtype: torch.dtype, trust_remote_code: bool = False
) -> PreTrainedModel:
    """AutoModelForCausalLM from safetensors in `model_dir`, in eval mode, on `device` in `dtype`,
    after `validate_model_directory` (pickles and unrequested remote code: ValueError)."""
    import torch
    from transformers import AutoModelForCausalLM

    model_dir = _require_directory(model_dir)
    if not isinstance(device, torch.device):
        raise TypeError(f"device must be a torch.device (see resolve_device), got {device!r}")
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype (see resolve_dtype), got {dtype!r}")
    validate_model_directory(model_dir, trust_remote_code=trust_remote_code)
    model = AutoModelForCausalLM.from_pretrained(
        model_dir,
        dtype=dtype,
        use_safetensors=True,
        local_files_only=True,
        trust_remote_code=trust_remote_code,
    )
    return model.to(device).eval()
