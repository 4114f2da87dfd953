"""Check and time the Triton attention kernels on a CUDA GPU (one prepared run, ~6 minutes).

    python -m llm_operator_bench.gpu.attention_kernels --out DIR [--model PATH] [--budget SECONDS]

Sections (each fails soft: an error is recorded and the next section runs):

  correctness  every Triton kernel (store_kv, prefix_attention, own_attention,
               merge_attention_states) against the torch reference on CUDA, in bf16, fp16
               and fp32, head_dim 64/128, GQA 1/4/8, prefixes of 1k-8k tokens (not a
               multiple of the block size) shared by 64-512 rows, two segments per batch,
               decode rows and prefill chunks; max abs errors of out and lse.
  timing       prefix_attention (Triton, paged, the segment's K/V read once per row tile)
               against scaled_dot_product_attention over the prefix replicated per request
               (the dense baseline: each request reads its own copy) and SDPA over one
               contiguous copy with every row in one query block (flash, no paging);
               medians of CUDA-event timings.
  bandwidth    prefix_attention's bytes (prefix K/V once + q + out + lse) per second
               against a measured device copy bandwidth (a large tensor's .copy_).
  engine       with --model: the native engine's tokens/s (LLMOperator(backend="native",
               device="cuda", dtype="bfloat16"), Triton kernels) on a shared-prefix
               workload from bench.core.workloads, then vLLM on the same prompts when a python
               with vLLM is found (bench.baselines.vllm_systems), else "skipped".

Writes DIR/bench_kernels.json and DIR/bench_kernels.md and prints the Markdown. Only
``--help`` and the import work without CUDA.
"""

from __future__ import annotations

import argparse
import functools
import gc
import json
import math
import os
import platform
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
# Pass limits on max |triton - reference| (on GPU fp16/bf16 products take the input
# dtype, the softmax weights rounded to it; fp32 products are exact).
OUT_LIMIT = {"bf16": 3e-2, "fp16": 5e-3, "fp32": 1e-4}
LSE_LIMIT = 1e-3
GIB = 1 << 30
DEVICE = "cuda"  # the only device this script is meant for (a dry run may change it)

# (dtype, head_dim, num_kv_heads, group, prefix tokens, rows sharing it, block size)
CORRECTNESS_CASES = [
    ("bf16", 128, 8, 4, 4099, 512, 16),
    ("bf16", 128, 8, 1, 1031, 64, 16),
    ("bf16", 128, 4, 8, 8191, 256, 32),
    ("bf16", 64, 4, 1, 2047, 128, 16),
    ("bf16", 64, 4, 4, 1500, 512, 32),
    ("bf16", 64, 2, 8, 8000, 64, 16),
    ("bf16", 64, 3, 3, 3001, 96, 16),  # SmolLM2-135M's 9 heads on 3 KV heads
    ("fp16", 128, 8, 4, 8191, 512, 16),
    ("fp16", 64, 4, 8, 1031, 64, 32),
    ("fp32", 128, 8, 4, 2049, 128, 16),
    ("fp32", 64, 4, 1, 1031, 64, 16),
]

# (head_dim, num_kv_heads, group, prefix tokens, rows); bf16, one decode row per request
# unless rows > 1024 (then: prefill chunks of 512 rows per request).
TIMING_CASES = [
    (128, 8, 4, 1024, 64),
    (128, 8, 4, 1024, 512),
    (128, 8, 4, 4096, 64),
    (128, 8, 4, 4096, 256),
    (128, 8, 4, 4096, 512),
    (128, 8, 4, 8192, 64),
    (128, 8, 4, 8192, 256),
    (128, 8, 4, 8192, 512),
    (64, 4, 8, 4096, 64),
    (64, 4, 8, 4096, 512),
    (128, 8, 1, 4096, 256),
    (128, 8, 4, 4096, 4096),  # prefill: 8 chunks of 512 rows on one prefix
]
DENSE_LIMIT_BYTES = 24 * GIB  # replicated K+V above this: the dense baseline is skipped


# ---------------------------------------------------------------- helpers


def log(message: str) -> None:
    print(f"[bench_kernels {time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


class Budget:
    """Wall-clock budget for the whole run; sections skip work past their share."""

    def __init__(self, seconds: float) -> None:
        self.start = time.perf_counter()
        self.seconds = seconds

    def left(self) -> float:
        return self.seconds - (time.perf_counter() - self.start)


def cuda_time_ms(fn: Callable[[], Any], *, reps: int = 7, inner: int = 3, warmup: int = 2) -> float:
    """Median over `reps` samples of the mean time of `inner` back-to-back calls, by CUDA
    events (back to back, so host launch overhead overlaps earlier work after the first)."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(inner):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / inner)
    return statistics.median(samples)


def max_abs(a: torch.Tensor, b: torch.Tensor) -> float:
    """max |a - b| over entries where both are finite or equal (-inf == -inf counts 0);
    inf where only one side is finite."""
    a, b = a.double(), b.double()
    same = (a == b) | (a.isnan() & b.isnan())
    both = torch.isfinite(a) & torch.isfinite(b)
    if bool((~same & ~both).any()):
        return math.inf
    diff = torch.where(both, (a - b).abs(), torch.zeros_like(a))
    return float(diff.max()) if diff.numel() else 0.0


def kernels_modules():
    from llm_operator.kernels import layout, torch_attention, triton_attention

    return layout, torch_attention, triton_attention


# ---------------------------------------------------------------- case building


def build_batch(
    *,
    dtype: torch.dtype,
    head_dim: int,
    num_kv_heads: int,
    group: int,
    prefix_len: int,
    rows: int,
    block_size: int,
    seed: int,
    device: str | None = None,
    own_lengths: list[tuple[int, int]] | None = None,
    store=None,
) -> dict:
    """A NaN-filled paged cache holding two shared segments (prefix_len tokens read by the
    first 3/4 of the rows, prefix_len // 3 by the rest) and each request's own tokens; the
    own requests are decode rows plus, by default, two prefill chunks.

    store: the store_kv used to fill the cache (torch_attention's by default)."""
    layout, torch_attention, _ = kernels_modules()
    store = store or torch_attention.store_kv
    device = device or DEVICE
    generator = torch.Generator(device=device).manual_seed(seed)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    if own_lengths is None:
        chunk = min(128, max(1, rows // 8))
        decode = rows - 2 * chunk
        own_lengths = [(1 + (7 * b) % 64, 1) for b in range(decode)] + [
            (300, chunk),
            (chunk, chunk),
        ]
    num_rows = sum(n for _, n in own_lengths)
    split = (3 * num_rows) // 4
    segments = [
        (prefix_len, list(range(split))),
        (max(1, prefix_len // 3), list(range(split, num_rows))),
    ]
    lengths = [length for length, _ in segments] + [c for c, _ in own_lengths]
    blocks_per = [-(-length // block_size) for length in lengths]
    num_blocks = sum(blocks_per) + 4
    order = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))
    owned = list(torch.split(order[: sum(blocks_per)], blocks_per))
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    v_cache = torch.full(shape, math.nan, dtype=dtype, device=device)
    slots = torch.cat(
        [
            blocks.long()[torch.arange(length) // block_size] * block_size
            + torch.arange(length) % block_size
            for blocks, length in zip(owned, lengths)
        ]
    ).to(device)
    k = randn(slots.shape[0], num_kv_heads, head_dim)
    v = randn(slots.shape[0], num_kv_heads, head_dim)
    store(k_cache, v_cache, k, v, slots)
    cache = {"block_size": block_size, "num_blocks": num_blocks, "device": device}
    prefix = layout.prefix_batch(
        [rows_ for _, rows_ in segments],
        [b.tolist() for b in owned[:2]],
        [length for length, _ in segments],
        num_rows=num_rows,
        **cache,
    )
    starts = [0]
    for _, n in own_lengths:
        starts.append(starts[-1] + n)
    own = layout.own_batch(
        starts, [b.tolist() for b in owned[2:]], [c for c, _ in own_lengths], **cache
    )
    q = randn(num_rows, num_kv_heads * group, head_dim)
    return {
        "q": q,
        "k_cache": k_cache,
        "v_cache": v_cache,
        "k": k,
        "v": v,
        "slots": slots,
        "prefix": prefix,
        "own": own,
        "scale": head_dim**-0.5,
    }


# ---------------------------------------------------------------- sections


def section_correctness(budget: Budget, share: float) -> dict:
    _, torch_attention, tri = kernels_modules()
    deadline = budget.left() - share
    rows_out = []
    for index, (name, head_dim, num_kv, group, prefix_len, rows, block_size) in enumerate(
        CORRECTNESS_CASES
    ):
        if budget.left() < deadline:
            rows_out.append({"case": index, "skipped": "over the section's time share"})
            continue
        dtype = DTYPES[name]
        record: dict[str, Any] = {
            "dtype": name,
            "head_dim": head_dim,
            "num_kv_heads": num_kv,
            "group": group,
            "prefix_len": prefix_len,
            "rows": rows,
            "block_size": block_size,
        }
        started = time.perf_counter()
        try:
            case = build_batch(
                dtype=dtype,
                head_dim=head_dim,
                num_kv_heads=num_kv,
                group=group,
                prefix_len=prefix_len,
                rows=rows,
                block_size=block_size,
                seed=index,
                store=tri.store_kv,
            )
            # store_kv: the Triton-filled cache equals a reference-filled one, bit for bit.
            k_ref = torch.full_like(case["k_cache"], math.nan)
            v_ref = torch.full_like(case["v_cache"], math.nan)
            torch_attention.store_kv(k_ref, v_ref, case["k"], case["v"], case["slots"])
            same = torch.equal(
                k_ref.nan_to_num(7.0), case["k_cache"].nan_to_num(7.0)
            ) and torch.equal(v_ref.nan_to_num(7.0), case["v_cache"].nan_to_num(7.0))
            record["store_kv_exact"] = bool(same)
            args = (case["q"], case["k_cache"], case["v_cache"])
            tp = tri.prefix_attention(*args, case["prefix"], case["scale"])
            rp = torch_attention.prefix_attention(*args, case["prefix"], case["scale"])
            to = tri.own_attention(*args, case["own"], case["scale"])
            ro = torch_attention.own_attention(*args, case["own"], case["scale"])
            tm = tri.merge_attention_states([tp, to])
            rm = torch_attention.merge_attention_states([rp, ro])
            torch.cuda.synchronize()
            plan = [v for k, v in case["prefix"].derived.items() if k[0] == "triton"]
            record["prefix_splits"] = plan[0].num_splits if plan else None
            for label, got, want in (("prefix", tp, rp), ("own", to, ro), ("merged", tm, rm)):
                record[f"{label}_out_err"] = max_abs(got.out, want.out)
                record[f"{label}_lse_err"] = max_abs(got.lse, want.lse)
            errors_out = [record[f"{x}_out_err"] for x in ("prefix", "own", "merged")]
            errors_lse = [record[f"{x}_lse_err"] for x in ("prefix", "own", "merged")]
            record["ok"] = bool(
                same and max(errors_out) <= OUT_LIMIT[name] and max(errors_lse) <= LSE_LIMIT
            )
            del case, tp, rp, to, ro, tm, rm, k_ref, v_ref
        except Exception as error:  # noqa: BLE001 - report and go on
            record["error"] = f"{type(error).__name__}: {error}"
            record["traceback"] = traceback.format_exc()
            record["ok"] = False
        record["seconds"] = round(time.perf_counter() - started, 2)
        log(f"correctness {record}")
        rows_out.append(record)
        torch.cuda.empty_cache()
    return {
        "cases": rows_out,
        "all_ok": all(r.get("ok", False) for r in rows_out if "skipped" not in r),
    }


def copy_bandwidth() -> float:
    """Device copy bandwidth in GB/s (bytes read + written per second, 2 GiB buffer)."""
    src = torch.empty(GIB // 2, dtype=torch.float32, device=DEVICE).normal_()
    dst = torch.empty_like(src)
    ms = cuda_time_ms(functools.partial(dst.copy_, src), reps=9, inner=2)
    return 2 * src.numel() * src.element_size() / (ms * 1e-3) / 1e9


def time_case(
    index: int,
    head_dim: int,
    num_kv: int,
    group: int,
    prefix_len: int,
    rows: int,
    copy_gbs: float | None,
) -> dict:
    """One timing case; its tensors are freed on return."""
    import torch.nn.functional as F

    layout, _, tri = kernels_modules()
    sdpa = F.scaled_dot_product_attention
    record: dict[str, Any] = {
        "dtype": "bf16",
        "head_dim": head_dim,
        "num_kv_heads": num_kv,
        "group": group,
        "prefix_len": prefix_len,
        "rows": rows,
    }
    dtype, device = torch.bfloat16, DEVICE
    num_heads = num_kv * group
    block_size = 16
    chunk = 512 if rows > 1024 else 1  # rows per request: decode rows, or prefill chunks
    requests = rows // chunk
    generator = torch.Generator(device=device).manual_seed(index)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator, device=device).to(dtype)

    prefix_k, prefix_v = randn(prefix_len, num_kv, head_dim), randn(prefix_len, num_kv, head_dim)
    q = randn(rows, num_heads, head_dim)
    num_blocks = -(-prefix_len // block_size) + 1
    k_cache = torch.zeros(num_blocks, block_size, num_kv, head_dim, dtype=dtype, device=device)
    v_cache = torch.zeros_like(k_cache)
    blocks = torch.randperm(num_blocks - 1, generator=torch.Generator().manual_seed(index)) + 1
    position = torch.arange(prefix_len)
    slots = (blocks[position // block_size] * block_size + position % block_size).to(device)
    tri.store_kv(k_cache, v_cache, prefix_k, prefix_v, slots)
    batch = layout.prefix_batch(
        [list(range(rows))],
        [blocks.tolist()],
        [prefix_len],
        num_rows=rows,
        block_size=block_size,
        num_blocks=num_blocks,
        device=device,
    )
    scale = head_dim**-0.5
    triton_call = functools.partial(tri.prefix_attention, q, k_cache, v_cache, batch, scale)
    triton_ms = cuda_time_ms(triton_call)
    record["triton_ms"] = triton_ms
    record["splits"] = next(v for k, v in batch.derived.items() if k[0] == "triton").num_splits

    # SDPA over one contiguous copy, all rows of a KV head in one query block.
    k_shared = prefix_k.permute(1, 0, 2).unsqueeze(0).contiguous()  # [1, kv, L, D]
    v_shared = prefix_v.permute(1, 0, 2).unsqueeze(0).contiguous()
    q_packed = q.view(rows, num_kv, group, head_dim).permute(1, 0, 2, 3)
    q_packed = q_packed.reshape(1, num_kv, rows * group, head_dim).contiguous()
    shared_call = functools.partial(sdpa, q_packed, k_shared, v_shared, scale=scale)
    record["sdpa_shared_ms"] = cuda_time_ms(shared_call)
    record["speedup_vs_shared_sdpa"] = record["sdpa_shared_ms"] / triton_ms

    # Dense baseline: the prefix replicated per request; q [requests, kv, chunk * group, D]
    # (GQA as extra query rows, so no K/V expansion), non-causal.
    dense_bytes = 2 * requests * prefix_len * num_kv * head_dim * 2
    record["dense_bytes"] = dense_bytes
    if dense_bytes <= DENSE_LIMIT_BYTES:
        k_dense = k_shared.expand(requests, -1, -1, -1).contiguous()
        v_dense = v_shared.expand(requests, -1, -1, -1).contiguous()
        q_dense = q.view(requests, chunk, num_kv, group, head_dim).permute(0, 2, 1, 3, 4)
        q_dense = q_dense.reshape(requests, num_kv, chunk * group, head_dim).contiguous()
        dense_call = functools.partial(sdpa, q_dense, k_dense, v_dense, scale=scale)
        record["sdpa_dense_ms"] = cuda_time_ms(dense_call)
        record["speedup_vs_dense"] = record["sdpa_dense_ms"] / triton_ms
        # The baseline computes the same thing (a check on the baseline itself).
        dense_out = dense_call().view(requests, num_kv, chunk, group, head_dim)
        dense_out = dense_out.permute(0, 2, 1, 3, 4).reshape(rows, num_heads, head_dim)
        record["dense_vs_triton_err"] = max_abs(dense_out, triton_call().out)
    else:
        record["sdpa_dense_ms"] = None
        record["dense_skipped"] = f"replicated K/V {dense_bytes / GIB:.1f} GiB > limit"

    # Bandwidth: the prefix K/V once + q + out + lse.
    element = torch.finfo(dtype).bits // 8
    moved = 2 * prefix_len * num_kv * head_dim * element
    moved += 2 * rows * num_heads * head_dim * element + rows * num_heads * 4
    record["bytes"] = moved
    record["achieved_gbs"] = moved / (triton_ms * 1e-3) / 1e9
    if copy_gbs:
        record["fraction_of_copy_bw"] = record["achieved_gbs"] / copy_gbs
    record["tflops"] = 4 * rows * num_heads * prefix_len * head_dim / (triton_ms * 1e-3) / 1e12
    return record


def section_timing(budget: Budget, share: float, copy_gbs: float | None) -> dict:
    deadline = budget.left() - share
    results = []
    for index, case in enumerate(TIMING_CASES):
        if budget.left() < deadline:
            results.append({"case": index, "skipped": "over the section's time share"})
            continue
        try:
            record = time_case(index, *case, copy_gbs)
        except Exception as error:  # noqa: BLE001 - report and go on
            record = {
                "case": index,
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
        log(f"timing {record}")
        results.append(record)
        gc.collect()
        torch.cuda.empty_cache()
    return {"cases": results}


def section_engine(args: argparse.Namespace, budget: Budget) -> dict:
    from llm_operator import LLMOperator, SamplingParams
    from llm_operator_bench.core.workloads import make_workload

    result: dict[str, Any] = {"model": args.model, "workload": args.workload}
    started = time.perf_counter()
    engine_options = {
        "model": args.model,
        "backend": "native",
        "device": DEVICE,
        "dtype": "bfloat16",
        "kv_cache_memory": args.kv_cache_memory,
        "max_batch_size": args.max_batch_size,
    }
    operator = LLMOperator(kernels="triton", **engine_options)
    overrides = json.loads(args.workload_overrides) if args.workload_overrides else {}
    workload = make_workload(args.workload, operator.tokenizer, size=args.size, seed=0, **overrides)
    token_ids = operator.tokenize(workload.prompts)
    keep = [i for i, ids in enumerate(token_ids) if ids is not None]
    prompts = [workload.prompts[i] for i in keep]
    max_tokens = [workload.max_tokens[i] for i in keep]
    token_ids = [token_ids[i] for i in keep]
    params = [SamplingParams(max_tokens=m) for m in max_tokens]
    result["rows"] = len(prompts)
    result["prompt_tokens"] = sum(len(ids) for ids in token_ids)
    result["workload_params"] = workload.params

    def run_native(label: str, engine: Any) -> dict:
        torch.cuda.synchronize()
        began = time.perf_counter()
        outputs = engine.generate(prompts, params)
        torch.cuda.synchronize()
        seconds = time.perf_counter() - began
        stats = engine.last_stats
        output_tokens = sum(r.completion_tokens for r in outputs)
        errors = sum(1 for r in outputs if r.finish_reason == "error")
        entry = {
            "run": label,
            "seconds": seconds,
            "output_tokens": output_tokens,
            "output_tokens_per_s": output_tokens / seconds,
            "total_tokens_per_s": (output_tokens + result["prompt_tokens"]) / seconds,
            "prefill_tokens_computed": stats.prefill_tokens_computed,
            "error_rows": errors,
        }
        log(f"engine {entry}")
        return entry

    runs = [run_native("native-triton cold (load + compile)", operator)]
    if budget.left() > 2.5 * runs[0]["seconds"] + 30:
        runs.append(run_native("native-triton", operator))
    result["load_and_first_run_seconds"] = time.perf_counter() - started
    # The reference kernels in the engine (an ablation), only with time to spare for vLLM.
    if args.torch_kernels and budget.left() > 4 * runs[-1]["seconds"] + 150:
        reference = LLMOperator(kernels="torch", **engine_options)
        runs.append(run_native("native-torch-reference-kernels", reference))
        del reference
    result["native"] = runs
    model_path = str(getattr(operator.model, "path", args.model))
    del operator
    gc.collect()
    torch.cuda.empty_cache()
    try:
        result["vllm"] = run_vllm(args, budget, model_path, token_ids, max_tokens)
    except Exception as error:  # noqa: BLE001 - a vLLM failure keeps the native numbers
        result["vllm"] = {"error": f"{type(error).__name__}: {error}"[:2000]}
    return result


def run_vllm(args, budget: Budget, model_path: str, token_ids, max_tokens) -> dict:
    if args.skip_vllm:
        return {"skipped": "--skip-vllm"}
    try:
        from llm_operator_bench.baselines.vllm_systems import find_vllm_python, run_vllm_job

        python = find_vllm_python()
    except Exception as error:  # noqa: BLE001 - VLLMUnavailable and import problems
        return {"skipped": f"no vLLM: {type(error).__name__}: {error}"}
    timeout = budget.left() - 10
    if timeout < 60:
        return {"skipped": f"only {budget.left():.0f} s of the budget left"}
    job = {
        "model": model_path,
        "dtype": "bfloat16",
        "prefix_caching": True,
        "prompts": token_ids,
        "max_tokens": max_tokens,
        "runs": [{"name": "vllm", "order": list(range(len(token_ids)))}],
        "repeat": 1,
        "warmup": True,
        "kv_cache_gib": args.vllm_kv_cache_gib,
        "enforce_eager": args.vllm_eager,
    }
    began = time.perf_counter()
    answer = run_vllm_job(job, python=python, timeout=timeout)
    run = answer["runs"][0]
    seconds = run["seconds"][0]
    prompt_tokens = sum(len(ids) for ids in token_ids)
    return {
        "python": python,
        "version": answer.get("vllm_version"),
        "enforce_eager": args.vllm_eager,
        "load_seconds": answer.get("load_seconds"),
        "seconds": seconds,
        "output_tokens": run.get("output_tokens"),
        "output_tokens_per_s": run.get("output_tokens", 0) / seconds,
        "total_tokens_per_s": (run.get("output_tokens", 0) + prompt_tokens) / seconds,
        "cached_tokens": run.get("cached_tokens"),
        "wall_seconds": time.perf_counter() - began,
    }


# ---------------------------------------------------------------- report


def fmt(value: Any, digits: int = 3) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        if math.isinf(value) or math.isnan(value):
            return str(value)
        return f"{value:.{digits}g}" if abs(value) < 1e4 else f"{value:.0f}"
    return str(value)


def _case_rows(cases: list[dict], label: str, keys: tuple[str, ...]) -> list[str]:
    """One Markdown table row per case; a skipped or failed case shows its reason."""
    rows = []
    for r in cases:
        if "skipped" in r or "error" in r:
            rows.append(f"| {r.get(label, r.get('case'))} | {r.get('skipped') or r.get('error')} |")
        else:
            rows.append("| " + " | ".join(fmt(r.get(k)) for k in keys) + " |")
    return rows


def markdown(report: dict) -> str:
    lines = [f"# Triton attention kernels on {report.get('device', '?')}", ""]
    correctness = report["sections"].get("correctness", {})
    if "cases" in correctness:
        lines += [
            "## Correctness (max |Triton - reference|)",
            "",
            f"All cases within limits (out: {OUT_LIMIT}, lse: {LSE_LIMIT}): "
            f"{'yes' if correctness.get('all_ok') else 'NO'}",
            "",
            "| dtype | D | kv | group | prefix | rows | block | splits | store exact | prefix out | prefix lse | own out | own lse | merged out | ok |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += _case_rows(
            correctness["cases"],
            "dtype",
            (
                "dtype",
                "head_dim",
                "num_kv_heads",
                "group",
                "prefix_len",
                "rows",
                "block_size",
                "prefix_splits",
                "store_kv_exact",
                "prefix_out_err",
                "prefix_lse_err",
                "own_out_err",
                "own_lse_err",
                "merged_out_err",
                "ok",
            ),
        )
        lines.append("")
    timing = report["sections"].get("timing", {})
    if "cases" in timing:
        copy = report["sections"].get("copy_bandwidth_gbs")
        lines += [
            f"## prefix_attention timing, bf16 (device copy bandwidth {fmt(copy)} GB/s)",
            "",
            "| D | kv | group | prefix | rows | splits | Triton ms | SDPA dense (replicated) ms | SDPA shared ms | vs dense | vs shared | GB/s | of copy BW | TFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
        ]
        lines += _case_rows(
            timing["cases"],
            "head_dim",
            (
                "head_dim",
                "num_kv_heads",
                "group",
                "prefix_len",
                "rows",
                "splits",
                "triton_ms",
                "sdpa_dense_ms",
                "sdpa_shared_ms",
                "speedup_vs_dense",
                "speedup_vs_shared_sdpa",
                "achieved_gbs",
                "fraction_of_copy_bw",
                "tflops",
            ),
        )
        lines.append("")
    engine = report["sections"].get("engine")
    if isinstance(engine, dict) and "native" in engine:
        lines += [
            f"## Engine: {engine.get('model')} on {engine.get('workload')} "
            f"({engine.get('rows')} rows, {engine.get('prompt_tokens')} prompt tokens)",
            "",
            "| system | seconds | output tokens | output tok/s | total tok/s |",
            "|---|---|---|---|---|",
        ]
        for run in engine["native"]:
            lines.append(
                f"| {run['run']} | {fmt(run['seconds'])} | {run['output_tokens']} | "
                f"{fmt(run['output_tokens_per_s'])} | {fmt(run['total_tokens_per_s'])} |"
            )
        vllm = engine.get("vllm", {})
        if "seconds" in vllm:
            eager = " (eager)" if vllm.get("enforce_eager") else ""
            lines.append(
                f"| vLLM {vllm.get('version')}{eager} | {fmt(vllm['seconds'])} | "
                f"{vllm['output_tokens']} | {fmt(vllm['output_tokens_per_s'])} | "
                f"{fmt(vllm['total_tokens_per_s'])} |"
            )
        else:
            lines.append(f"| vLLM | {vllm.get('skipped') or vllm.get('error', '-')} | | | |")
        lines.append("")
    elif isinstance(engine, dict) and "skipped" in engine:
        lines += ["## Engine", "", f"Skipped: {engine['skipped']}.", ""]
    errors = {
        k: v["error"] for k, v in report["sections"].items() if isinstance(v, dict) and "error" in v
    }
    if errors:
        lines += ["## Section errors", ""] + [f"- {k}: {v}" for k, v in errors.items()] + [""]
    lines.append(f"Total {fmt(report.get('seconds'))} s.")
    return "\n".join(lines)


# ---------------------------------------------------------------- main


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description="Check the Triton attention kernels against the torch reference on CUDA, "
        "time prefix_attention against dense SDPA, and (with --model) the native engine "
        "against vLLM. Writes DIR/bench_kernels.json and .md.",
    )
    parser.add_argument("--out", required=True, type=Path, help="output directory")
    parser.add_argument("--model", help="model directory or alias for the engine section")
    parser.add_argument("--budget", type=float, default=330.0, help="seconds for the whole run")
    parser.add_argument("--workload", default="etl-fewshot", help="bench.core.workloads name")
    parser.add_argument("--size", default="default", help="workload size preset")
    parser.add_argument(
        "--workload-overrides",
        default='{"groups": 4, "rows_per_group": 64}',
        help="JSON of make_workload size overrides ('' for none)",
    )
    parser.add_argument("--kv-cache-memory", default="16GiB", help="native engine KV cache")
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument(
        "--torch-kernels",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="also run the engine with kernels='torch' when time allows",
    )
    parser.add_argument("--skip-vllm", action="store_true")
    parser.add_argument("--vllm-kv-cache-gib", type=float, default=16.0)
    parser.add_argument(
        "--vllm-eager",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="vLLM without torch.compile / CUDA graphs (a much faster start)",
    )
    parser.add_argument(
        "--sections",
        default="correctness,timing,engine",
        help="comma-separated subset of correctness,timing,engine",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    budget = Budget(args.budget)
    sections = {s.strip() for s in args.sections.split(",") if s.strip()}
    report: dict[str, Any] = {
        "argv": sys.argv[1:],
        "python": platform.python_version(),
        "torch": torch.__version__,
        "sections": {},
    }
    try:
        import triton

        report["triton"] = triton.__version__
    except ImportError as error:
        report["triton"] = f"missing: {error}"
    if not torch.cuda.is_available():
        report["error"] = "CUDA is not available; this script needs a GPU"
        print(report["error"], file=sys.stderr)
        (args.out / "bench_kernels.json").write_text(json.dumps(report, indent=2))
        return 2
    report["device"] = torch.cuda.get_device_name()
    if os.environ.get("TRITON_INTERPRET") == "1":
        log("warning: TRITON_INTERPRET=1 is set; kernels would run in the interpreter")

    def run(name: str, fn: Callable[[], Any]) -> None:
        log(f"section {name} ({budget.left():.0f} s left)")
        began = time.perf_counter()
        try:
            report["sections"][name] = fn()
        except Exception as error:  # noqa: BLE001 - fail soft
            report["sections"][name] = {
                "error": f"{type(error).__name__}: {error}",
                "traceback": traceback.format_exc(),
            }
            log(f"section {name} failed: {error}")
        seconds = time.perf_counter() - began
        if isinstance(report["sections"][name], dict):
            report["sections"][name]["section_seconds"] = seconds
        gc.collect()
        torch.cuda.empty_cache()
        (args.out / "bench_kernels.json").write_text(json.dumps(report, indent=2, default=str))

    engine_share = 180.0 if args.model and "engine" in sections else 0.0
    if "correctness" in sections:
        run(
            "correctness",
            lambda: section_correctness(budget, (budget.left() - engine_share) * 0.55),
        )
    if "timing" in sections:
        copy_gbs = None
        try:
            copy_gbs = copy_bandwidth()
            report["sections"]["copy_bandwidth_gbs"] = copy_gbs
        except Exception as error:  # noqa: BLE001
            report["sections"]["copy_bandwidth_error"] = f"{type(error).__name__}: {error}"
        run("timing", lambda: section_timing(budget, budget.left() - engine_share - 5, copy_gbs))
    if "engine" in sections:
        if args.model:
            run("engine", lambda: section_engine(args, budget))
        else:
            report["sections"]["engine"] = {"skipped": "no --model"}
    report["seconds"] = time.perf_counter() - budget.start
    text = markdown(report)
    (args.out / "bench_kernels.json").write_text(json.dumps(report, indent=2, default=str))
    (args.out / "bench_kernels.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
