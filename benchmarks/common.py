"""What the benchmark scripts share: prompt text and load readings."""
from __future__ import annotations

import importlib.util
import platform
import pydoc
from pathlib import Path

PROMPT_LENS = (32, 50, 128, 256, 512, 64, 16, 256)  # W1's (../shared/bench/workload.py)


def english_text() -> str:
    """About 20k tokens of English prose: the documentation of a few standard modules."""
    import argparse
    import collections
    import json
    import logging
    import pathlib
    import subprocess
    import threading
    import unittest
    return "\n\n".join(pydoc.getdoc(m) + "\n" + "\n".join(pydoc.getdoc(getattr(m, n)) for n in dir(m)
                                                          if not n.startswith("_") and callable(getattr(m, n)))
                       for m in (unittest, logging, argparse, threading, collections, subprocess, pathlib, json))


def model_folder(model: str) -> str:
    """The Hugging Face folder of ``model`` (a folder, or an alias fetched on first use)."""
    if Path(model).is_dir():
        return model
    from pagedpack.models import aliases

    return str(aliases.fetch(model))


def load_1min() -> float:
    """The 1-minute load average (start a measurement only below 0.8)."""
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def w1_workload(args) -> tuple[str, list[list[int]]]:
    """The model (alias or directory) and the prompts' token ids of ``args.workload`` (``w1``: W1's
    model, written to ``args.w1_dir`` on first use, and prompts; with ``args.model``, W1's lengths cut
    from :func:`english_text`; ``random``: ``args.model`` on random ids, ``args.repeat`` times W1's lengths)."""
    import torch

    from pagedpack import LLM

    if args.workload == "random":
        model = args.model or "tiny"
        vocab = LLM(model).model.config.vocab_size if model != "tiny" else 256
        g = torch.Generator().manual_seed(0)
        return model, [torch.randint(0, min(vocab, 256), (n,), generator=g).tolist()
                       for n in list(PROMPT_LENS) * args.repeat]
    source = args.bench_dir / "workload.py"
    if not source.is_file():  # ../shared/bench lives beside the repository, not in it
        raise SystemExit(f"--bench-dir: expected a folder holding workload.py (the shared benchmark folder), "
                         f"got {str(args.bench_dir)!r}; give --bench-dir, or use --workload random")
    spec = importlib.util.spec_from_file_location("workload", source)
    workload = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(workload)
    if args.workload == "w1-hybrid":
        from pagedpack.models.aliases import cache_dir

        return w1_hybrid_model(workload, Path(args.w1_dir or cache_dir() / "w1-hybrid")), workload.prompts_w1()
    if args.model is None:
        from pagedpack.models.aliases import cache_dir

        folder = Path(args.w1_dir or cache_dir() / "w1")
        # save_model imports transformers' Llama even when the folder exists: not in this process then
        return str(folder) if (folder / "config.json").is_file() else workload.save_model(str(folder)), \
            workload.prompts_w1()
    from pagedpack.models.aliases import resolve
    from pagedpack.models.loading import load_tokenizer

    model_dir = resolve(args.model)
    ids = load_tokenizer(model_dir)(english_text())["input_ids"]
    prompts, start = [], 0
    for n in workload.LENGTHS_W1:  # consecutive windows of the text, W1's lengths
        prompts.append(ids[start:start + n])
        start = (start + n) % (len(ids) - 512)
    return model_dir, prompts


def w1_hybrid_model(workload, folder: Path) -> str:
    """W1's model as a hybrid (written to ``folder`` on first use): Qwen3-Next's architecture at W1's
    sizes (hidden 512, 8 layers, 8 query / 2 KV heads of 64, W1's vocabulary), every fourth layer
    attention and the others gated DeltaNets (4 key / 8 value heads of 64: Qwen3-Next's ratio and
    grouping), each layer's MLP 8 experts of 704 (2 a token) and a shared one of 704, seed-0 random
    weights, fp32. (vLLM's Qwen3-Next needs its experts; Qwen3.5's text class has the same layers, and
    vLLM CPU does not load it without torchvision, which its CPU recipe removes.)"""
    if not (folder / "config.json").is_file():
        import torch
        import transformers as T

        w1 = workload.model_config()
        layers = w1.num_hidden_layers
        config = T.Qwen3NextConfig(
            vocab_size=w1.vocab_size, hidden_size=w1.hidden_size,
            num_hidden_layers=layers, num_attention_heads=w1.num_attention_heads,
            num_key_value_heads=w1.num_key_value_heads, head_dim=64, max_position_embeddings=4096,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4), num_experts=8,
            num_experts_per_tok=2, moe_intermediate_size=704, shared_expert_intermediate_size=704,
            linear_num_key_heads=4, linear_num_value_heads=8, linear_key_head_dim=64,
            linear_value_head_dim=64, tie_word_embeddings=False, bos_token_id=w1.bos_token_id,
            eos_token_id=w1.eos_token_id, pad_token_id=w1.pad_token_id)
        torch.manual_seed(0)
        T.AutoModelForCausalLM.from_config(config).eval().save_pretrained(folder)
    return str(folder)


def reset_peak_rss(pid: int | str = "self") -> None:
    """Restart process ``pid``'s peak-RSS count (Linux: ``5`` to ``/proc/<pid>/clear_refs``), so that
    :func:`peak_rss_mb` measures what runs after, as vllm_cpu.py samples its RSS during its runs."""
    with open(f"/proc/{pid}/clear_refs", "w") as f:
        f.write("5")


def peak_rss_mb(pid: int | str = "self") -> int:
    """Process ``pid``'s peak RSS since :func:`reset_peak_rss` (``VmHWM``), in MiB."""
    with open(f"/proc/{pid}/status") as f:
        return round(next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) / 1024)


def cpu_model() -> str:
    """The host's CPU model name (``/proc/cpuinfo``), to name beside every figure."""
    try:
        with open("/proc/cpuinfo") as f:
            return next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor()
