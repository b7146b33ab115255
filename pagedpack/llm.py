"""``LLM``: the offline generation API, in the style of vLLM's ``LLM``."""
from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass, field

import torch
from tqdm.auto import tqdm

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
        block_size: tokens per KV block.
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

    def __init__(self, model=None, *, tokenizer=None, block_size: int = 16, num_blocks: int | None = None,
                 kv_cache_memory: int | None = None, max_num_batched_tokens: int = 2048,
                 max_num_seqs: int = 256, max_model_len: int | None = None,
                 dtype: torch.dtype | None = None, device: str | torch.device = "cpu"):
        _check_positive(block_size=block_size, max_num_batched_tokens=max_num_batched_tokens,
                        max_num_seqs=max_num_seqs)
        if num_blocks is not None and kv_cache_memory is not None:
            raise ValueError("num_blocks, kv_cache_memory: expected at most one of them, got both")
        if isinstance(model, torch.nn.Module):
            module = model.to(device=device, dtype=dtype).eval() if dtype else model.to(device).eval()
        else:
            module, loaded_tokenizer = load(model, dtype=dtype, device=device)
            tokenizer = tokenizer or loaded_tokenizer
        self.model, self.tokenizer = module, tokenizer
        limit, note = model_max_len(module.config)
        if max_model_len is not None and not 1 <= max_model_len <= limit:
            raise ValueError(f"max_model_len: expected 1 .. {limit} (the model's limit), got {max_model_len}")
        self.max_model_len = max_model_len or limit

        self.num_captures = 0
        self.rewritten: RewrittenModel = self._capture_and_rewrite(module)
        if note:
            self.rewritten.report.notes.append(note)
        self.rewritten.raise_if_refused()

        self.block_size = block_size
        self.num_blocks = self._num_blocks(num_blocks, kv_cache_memory, max_num_seqs)
        runner = ModelRunner(self.rewritten, num_blocks=self.num_blocks, block_size=block_size, device=device)
        scheduler = Scheduler(KVCacheManager(self.num_blocks, block_size),
                              max_num_batched_tokens=max_num_batched_tokens,
                              max_num_seqs=max_num_seqs, max_model_len=self.max_model_len)
        self.llm_engine = LLMEngine(runner, scheduler)
        self._eos = eos_token_ids(module, tokenizer)
        self._ids = itertools.count()

    @property
    def report(self):
        """The pass report (what ``pagedpack inspect`` prints)."""
        return self.rewritten.report

    def _capture_and_rewrite(self, module) -> RewrittenModel:
        self.num_captures += 1
        return rewrite(capture(module, max_num_tokens=self.max_model_len))

    def _num_blocks(self, num_blocks, kv_cache_memory, max_num_seqs) -> int:
        bytes_per_block = self.rewritten.bytes_per_token * self.block_size
        if num_blocks is not None:
            _check_positive(num_blocks=num_blocks)
            return num_blocks
        if kv_cache_memory is not None:
            if kv_cache_memory < bytes_per_block:
                raise ValueError(f"kv_cache_memory: expected at least one block ({bytes_per_block} bytes), "
                                 f"got {kv_cache_memory}")
            return kv_cache_memory // bytes_per_block
        full = max_num_seqs * -(-self.max_model_len // self.block_size)
        return max(1, min(full, _DEFAULT_KV_CACHE_MEMORY // bytes_per_block))

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 *, use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate for ``prompts`` (a string, a list of strings, or a list of token-id lists),
        all submitted together; returns one :class:`RequestOutput` per prompt, in order.

        A request that can never run (prompt longer than ``max_model_len``, more tokens than the
        whole KV pool) gets ``error`` set; the others finish normally.
        """
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"sampling_params: expected one per prompt ({len(prompts)}), got {len(params)}")
        outputs, live = [], {}
        for prompt, p in zip(prompts, params):
            request = self._make_request(prompt, p or SamplingParams())
            out = RequestOutput(request.request_id, prompt if isinstance(prompt, str) else None,
                                request.prompt_token_ids)
            outputs.append(out)
            try:
                self.llm_engine.add_request(request)
                live[request.request_id] = (request, out)
            except ValueError as err:
                out.error = str(err)
                out.outputs.append(CompletionOutput(0, "", [], "error"))
        with tqdm(total=len(live), desc="generate", unit="req", disable=not use_tqdm) as bar:
            while self.llm_engine.has_unfinished():
                for request in self.llm_engine.step():
                    _, out = live[request.request_id]
                    out.outputs.append(CompletionOutput(0, self._decode(request.output_token_ids),
                                                        list(request.output_token_ids), request.finish_reason))
                    out.error = request.error
                    bar.update(1)
        return outputs

    def _make_request(self, prompt, params: SamplingParams) -> Request:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise ValueError("prompts: got a string but the model has no tokenizer; pass token ids")
            ids = self.tokenizer(prompt).input_ids
        else:
            ids = [int(t) for t in prompt]
        eos = self._eos[0] if self._eos else None
        if len(self._eos) > 1 and not params.ignore_eos:
            params = dataclasses.replace(params, stop_token_ids=[*params.stop_token_ids, *self._eos[1:]])
        return Request(str(next(self._ids)), ids, params, eos_token_id=eos)

    def _decode(self, token_ids: list[int]) -> str:
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise ValueError(f"{name}: expected a positive int, got {value!r}")
