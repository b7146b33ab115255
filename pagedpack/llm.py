"""``LLM``: the offline generation API, in the style of vLLM's ``LLM``."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

from pagedpack import ascend_backend
from pagedpack.lowering.ascend_limits import StepBounds
from pagedpack.inputs import (check_causal_lm, check_engine_args, check_int, check_token_ids, normalize_prompts,
                              normalize_sampling_params, resolve_dtype)
from pagedpack.models.capture import capture
from pagedpack.models.loading import eos_token_ids, load, max_model_len as model_max_len
from pagedpack.passes.pipeline import RewrittenModel, rewrite
from pagedpack.runtime.engine import LLMEngine
from pagedpack.runtime.kv_cache_manager import KVCacheManager
from pagedpack.runtime.model_runner import ModelRunner
from pagedpack.runtime.request import Request
from pagedpack.runtime.sampling import SamplingParams
from pagedpack.runtime.scheduler import Scheduler

_DEFAULT_KV_CACHE_MEMORY = 256 << 20  # bytes, when neither num_blocks nor kv_cache_memory is given
# Lowering targets and their default block size (Ascend's paged FIA takes multiples of 128).
DEFAULT_BLOCK_SIZE = {"reference": 16, "ascend": 128}


@dataclass
class CompletionOutput:
    """One completion: generated ``token_ids`` and their decoded ``text``."""

    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None  # "stop", "length" or "error"


@dataclass
class RequestOutput:
    """The result of one prompt. ``error`` is set (and ``outputs[0]`` empty) if it failed."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput] = field(default_factory=list)
    error: str | None = None

    @property
    def finished(self) -> bool:
        return True


class LLM:
    """Capture ``model``, rewrite it to packed + paged attention, and generate with it.

    Args:
        model: None for the built-in tiny Llama, a local Hugging Face directory, a hub id, or a
            ``transformers`` causal LM instance (then pass ``tokenizer`` too, or use token ids).
        tokenizer: overrides the tokenizer loaded with ``model``.
        target: ``"reference"`` (the project's ops, any device) or ``"ascend"`` (torch_npu ops
            through TorchAir on an ``npu`` device; elsewhere the lowered graph runs on their
            emulation, see :mod:`pagedpack.ascend_backend`).
        block_size: tokens per KV block (default: 16 for reference, 128 for ascend).
        num_blocks / kv_cache_memory: size of the KV pool, in blocks or in bytes (at most one;
            default: what fits 256 MiB, capped at ``max_num_seqs`` full-length sequences).
        max_num_batched_tokens: token budget per step (prompts longer than it are chunked).
        max_num_seqs: most sequences per step.
        max_model_len: most tokens per request (default: the model's limit, see
            :func:`pagedpack.models.loading.max_model_len`).
        dtype / device: where and in what precision the model runs.
    Raises:
        ValueError on bad arguments; :class:`pagedpack.passes.pipeline.UnsupportedModelError`
        if the pass cannot rewrite every attention site (its report says why).
    """

    def __init__(self, model=None, *, tokenizer=None, target: str = "reference", block_size: int | None = None,
                 num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
        if target not in DEFAULT_BLOCK_SIZE:
            raise ValueError(f"target: expected one of {sorted(DEFAULT_BLOCK_SIZE)}, got {target!r}")
        block_size = DEFAULT_BLOCK_SIZE[target] if block_size is None else block_size
        check_engine_args(block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                          max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, tokenizer=tokenizer)
        dtype = resolve_dtype(dtype)
        if target == "ascend":
            ascend_backend.prepare_device(device)
        if isinstance(model, torch.nn.Module):
            check_causal_lm(model)  # before moving it: the caller's module is converted in place
            module = model.to(device=device, dtype=dtype).eval() if dtype else model.to(device).eval()
        else:
            module, loaded_tokenizer = load(model, dtype=dtype, device=device, target=target)
            tokenizer = tokenizer or loaded_tokenizer
            check_causal_lm(module)
        self.model, self.tokenizer = module, tokenizer
        self.vocab_size = module.config.vocab_size
        limit, note = model_max_len(module.config)
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len: expected 1 .. {limit} (the model's limit), got {max_model_len}")
        self.max_model_len = max_model_len or limit

        self.num_captures = 0
        self.rewritten: RewrittenModel = self._capture_and_rewrite(module)
        if note:
            self.rewritten.report.notes.append(note)
        self.rewritten.raise_if_refused()

        self.target, self.block_size = target, block_size
        self.num_blocks = self._num_blocks(num_blocks, kv_cache_memory, max_num_seqs)
        step = None
        if target == "ascend":
            step, note = ascend_backend.ascend_step(
                self.rewritten, block_size=block_size, device=device,
                bounds=StepBounds(max_num_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs))
            self.rewritten.report.notes.append(note)
        runner = ModelRunner(self.rewritten, num_blocks=self.num_blocks, block_size=block_size, device=device,
                             step=step)
        self._start_engine(runner, max_num_batched_tokens, max_num_seqs)
        self._eos = eos_token_ids(module, tokenizer)

    def _start_engine(self, runner: ModelRunner, max_num_batched_tokens: int, max_num_seqs: int) -> None:
        scheduler = Scheduler(KVCacheManager(self.num_blocks, self.block_size),
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        self.llm_engine = LLMEngine(runner, scheduler)
        self._ids = itertools.count()

    @classmethod
    def from_exported(cls, path, *, tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                      kv_cache_memory: int | None = None, max_num_batched_tokens: int = 2048,
                      max_num_seqs: int = 256, max_model_len: int | None = None) -> "LLM":
        """An ``LLM`` whose runner calls the step program of a file written by ``pagedpack export``:
        a ``.pt2`` archive (:func:`pagedpack.export.export_pt2`) or an ONNX model run by an
        onnxruntime CPU session (:func:`pagedpack.onnx_export.export_onnx`); same scheduler and
        sampler, CPU only, no capture. ``block_size`` and the pool size are chosen here, not at
        export. ``tokenizer`` overrides the one stored in the file. ``report`` is None.
        Raises ``ValueError`` for bad arguments or a file that is not such an export."""
        from pagedpack.export import load_exported

        check_engine_args(block_size=block_size, num_blocks=num_blocks, kv_cache_memory=kv_cache_memory,
                          max_num_batched_tokens=max_num_batched_tokens, max_num_seqs=max_num_seqs,
                          max_model_len=max_model_len, tokenizer=tokenizer)
        step = load_exported(path)
        limit = step.max_model_len
        if max_model_len is not None and limit is not None and not max_model_len <= limit:
            raise ValueError(f"max_model_len: expected 1 .. {limit} (the model's limit), got {max_model_len}")
        if (max_model_len or limit) is None:
            raise ValueError("max_model_len: the exported file records none; pass max_model_len")
        self = cls.__new__(cls)
        self.model, self.tokenizer, self.vocab_size = None, tokenizer or step.tokenizer, step.vocab_size
        self.max_model_len, self.num_captures, self.rewritten = max_model_len or limit, 0, step
        self.target, self.block_size = "reference", block_size
        self.num_blocks = self._num_blocks(num_blocks, kv_cache_memory, max_num_seqs)
        self._start_engine(ModelRunner(step, num_blocks=self.num_blocks, block_size=block_size),
                           max_num_batched_tokens, max_num_seqs)
        self._eos = list(step.eos_token_ids)
        return self

    @property
    def report(self):
        """The pass report (what ``pagedpack inspect`` prints)."""
        return self.rewritten.report

    def _capture_and_rewrite(self, module) -> RewrittenModel:
        self.num_captures += 1
        return rewrite(capture(module))

    def _num_blocks(self, num_blocks, kv_cache_memory, max_num_seqs) -> int:
        bytes_per_block = self.rewritten.bytes_per_token * self.block_size
        if num_blocks is not None:
            return check_int("num_blocks", num_blocks)
        if kv_cache_memory is not None:
            if kv_cache_memory < bytes_per_block:
                raise ValueError(f"kv_cache_memory: expected at least one block ({bytes_per_block} bytes), "
                                 f"got {kv_cache_memory}")
            return int(kv_cache_memory // bytes_per_block)
        full = max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(full, _DEFAULT_KV_CACHE_MEMORY // bytes_per_block))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for ``prompts`` (a string, a list of token ids, or a list of those), all
        submitted together; returns one :class:`RequestOutput` per prompt, in order.

        A request that can never run (token ids outside the vocabulary, prompt longer than
        ``max_model_len``, more tokens than the whole KV pool) gets ``error`` set; the others
        finish normally. Malformed arguments raise ``ValueError`` before anything is queued.
        """
        prompts = normalize_prompts(prompts)
        params = normalize_sampling_params(sampling_params, len(prompts))
        if any(isinstance(p, str) for p in prompts) and self.tokenizer is None:
            raise ValueError("prompts: got a string but the model has no tokenizer; pass token ids")
        requests = [self._make_request(prompt, p) for prompt, p in zip(prompts, params)]  # tokenize first
        outputs, live = [], {}
        for prompt, request in zip(prompts, requests):
            out = RequestOutput(request.request_id, prompt if isinstance(prompt, str) else None,
                                request.prompt_token_ids)
            outputs.append(out)
            try:
                check_token_ids(request.prompt_token_ids, self.vocab_size)
                self.llm_engine.add_request(request)
                live[request.request_id] = (request, out)
            except ValueError as err:
                out.error = f"request {request.request_id!r}: {err}" if str(err).startswith("prompt:") else str(err)
                out.outputs.append(CompletionOutput(0, "", [], "error"))
        try:
            with tqdm(total=len(live), desc="generate", unit="req", disable=not use_tqdm) as bar:
                while self.llm_engine.has_unfinished():
                    for request in self.llm_engine.step():
                        _, out = live[request.request_id]
                        out.outputs.append(CompletionOutput(0, self._decode(request.output_token_ids),
                                                            list(request.output_token_ids), request.finish_reason))
                        out.error = request.error
                        bar.update(1)
        except BaseException:
            self.llm_engine.scheduler.abort_all()  # leave the engine usable for the next call
            raise
        return outputs

    def _make_request(self, prompt: str | list[int], params: SamplingParams) -> Request:
        ids = self.tokenizer(prompt).input_ids if isinstance(prompt, str) else prompt
        eos = self._eos[0] if self._eos else None
        if len(self._eos) > 1 and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *self._eos[1:]])
        return Request(str(next(self._ids)), ids, params, eos_token_id=eos)

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)
