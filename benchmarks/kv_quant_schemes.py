"""Which scales for a quantized KV cache: perplexity of the unmodified model with its keys and values
quantized and read back in its attention, per scheme (the measurement behind ``kv_cache_dtype``'s
choice, docs/design.md "Quantized KV").

Schemes, for int8 and fp8_e4m3 (qmax 127 / 448; a scale is max |x| / qmax over its group):
``token``: one scale per (token, KV head), keys and values alike (what pagedpack stores);
``channel-keys``: keys one static scale per (KV head, channel) from a calibration text (KIVI,
vllm-ascend's C8), values per token; ``tensor``: one static scale per layer for K and one for V from
the calibration text (vLLM's fp8 ``calculate_kv_scales``); ``tensor-1``: scale 1.0 (vLLM's default
without calibration). The text: ``--tokens`` of :func:`common.english_text`, the calibration text the
next ``--calibration-tokens``. Prints JSON. Run: ``python benchmarks/kv_quant_schemes.py``.
"""
from __future__ import annotations

import argparse
import json
import math

import torch
from transformers import AttentionInterface, AutoModelForCausalLM, AutoTokenizer
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from pagedpack.models.aliases import resolve

from common import english_text, load_1min

QMAX = {"int8": 127.0, "fp8_e4m3": 448.0}


def quantize(x: torch.Tensor, scale: torch.Tensor, kind: str) -> torch.Tensor:
    scale = torch.where(scale > 0, scale, 1.0)  # a group that was all zeros
    q = x / scale
    q = q.round().clamp(-127, 127) if kind == "int8" else q.clamp(-448, 448).to(torch.float8_e4m3fn).float()
    return q * scale


def per_row(x: torch.Tensor, kind: str) -> torch.Tensor:  # x [B, Hkv, T, D]: one scale per (token, head)
    return quantize(x, x.abs().amax(-1, keepdim=True) / QMAX[kind], kind)


class Scheme:
    """The attention function of one scheme; in calibration mode it records each layer's maxima."""

    def __init__(self, name: str, kind: str):
        self.name, self.kind, self.calibrating, self.amax = name, kind, False, {}

    def __call__(self, module, query, key, value, attention_mask, **kwargs):
        layer = module.layer_idx
        if self.calibrating:
            k_ch, v_ch = key.abs().amax(dim=(0, 2)), value.abs().amax(dim=(0, 2))  # [Hkv, D]
            old = self.amax.get(layer)
            self.amax[layer] = (k_ch, v_ch) if old is None else (old[0].maximum(k_ch), old[1].maximum(v_ch))
        elif self.name == "token":
            key, value = per_row(key, self.kind), per_row(value, self.kind)
        elif self.name == "channel-keys":
            key = quantize(key, (self.amax[layer][0] / QMAX[self.kind])[None, :, None, :], self.kind)
            value = per_row(value, self.kind)
        elif self.name == "tensor":
            k_scale, v_scale = (a.max() / QMAX[self.kind] for a in self.amax[layer])
            key, value = quantize(key, k_scale, self.kind), quantize(value, v_scale, self.kind)
        elif self.name == "tensor-1":
            key, value = quantize(key, torch.tensor(1.0), self.kind), quantize(value, torch.tensor(1.0), self.kind)
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)


def perplexity(model, ids: list[int]) -> float:
    with torch.no_grad():
        logits = model(torch.tensor([ids]), use_cache=False).logits[0, :-1].float()
    nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:]))
    return math.exp(nll.item())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--tokens", type=int, default=4096)
    parser.add_argument("--calibration-tokens", type=int, default=512)
    args = parser.parse_args()
    path = str(resolve(args.model))
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = AutoTokenizer.from_pretrained(path)(english_text())["input_ids"]
    text, calibration = ids[:args.tokens], ids[args.tokens:args.tokens + args.calibration_tokens]
    result = {"model": args.model, "tokens": len(text), "load_1min_at_start": load_1min(),
              "fp32": perplexity(model, text), "schemes": {}}
    for kind in QMAX:
        for name in ("token", "channel-keys", "tensor", "tensor-1"):
            scheme = Scheme(name, kind)
            AttentionInterface.register(f"kv_{kind}_{name}", scheme)
            AttentionMaskInterface.register(f"kv_{kind}_{name}", sdpa_mask)  # causal and sliding-window masks
            model.config._attn_implementation = f"kv_{kind}_{name}"
            scheme.calibrating = True
            with torch.no_grad():
                model(torch.tensor([calibration]), use_cache=False)
            scheme.calibrating = False
            ppl = perplexity(model, text)
            result["schemes"][f"{kind} {name}"] = {"perplexity": ppl, "vs_fp32": ppl / result["fp32"] - 1}
            print(kind, name, json.dumps(result["schemes"][f"{kind} {name}"]), flush=True)
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
