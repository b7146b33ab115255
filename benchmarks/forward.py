"""Padded forward: eager ``transformers`` vs ``torch.compile(backend="pagedpack")`` (packed).

One batch of random token ids of the lengths below (or ``--lengths``), right-padded to the longest, through the
same model both ways, side by side in one run: by default a 4-layer Llama shape with random
weights, with ``--model`` an alias (``smollm2-135m``: real weights, fetched on first use) or a
Hugging Face directory, in float32. Prints one JSON object: tokens computed and wall time (median
of ``--repeat`` runs after a warm-up) for each, the sites the backend rewrote, the largest
difference at real positions and the 1-minute load at the start (start only below 0.8). Run:
``python benchmarks/forward.py [--model smollm2-135m] [--inductor] [--repeat N] [--lengths 5,9]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

import pagedpack.compiler.backend as backend
from pagedpack.models.loading import load
from pagedpack.models.tiny import tiny_model

from common import load_1min

LENGTHS = (128, 200, 512, 1024, 2048, 256, 64, 1024)


def timed(fn, repeat: int) -> tuple[float, object]:
    fn()  # warm-up (and, for the compiled model, the compile)
    times, out = [], None
    for _ in range(repeat):
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times), out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--lengths", type=lambda text: tuple(int(n) for n in text.split(",")), default=LENGTHS,
                        help="comma-separated sequence lengths (default: %(default)s)")
    parser.add_argument("--inductor", action="store_true", help="hand the packed graph to Inductor")
    parser.add_argument("--model", default=None,
                        help="an alias (smollm2-135m, gemma3-270m) or a Hugging Face directory; "
                             "default: a 4-layer Llama shape with random weights")
    args = parser.parse_args()
    load_start = load_1min()

    if args.model is None:
        model = tiny_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                           num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    else:
        model = load(args.model, dtype=torch.float32)[0]
    g = torch.Generator().manual_seed(0)
    width = max(args.lengths)
    input_ids = torch.randint(0, min(256, model.config.vocab_size), (len(args.lengths), width), generator=g)
    attention_mask = (torch.arange(width)[None] < torch.tensor(args.lengths)[:, None]).long()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True,
                             options={"inductor": args.inductor})
    with torch.inference_mode():
        eager_s, eager = timed(lambda: model(input_ids=input_ids, attention_mask=attention_mask,
                                             use_cache=False).logits, args.repeat)
    with torch.no_grad():
        packed_s, packed = timed(lambda: compiled(input_ids=input_ids, attention_mask=attention_mask,
                                                  use_cache=False).logits, args.repeat)
    real, report = attention_mask.bool(), backend.LAST_REPORTS[-1]
    print(json.dumps({
        "model": args.model or "4-layer Llama shape, random weights",
        "lengths": list(args.lengths),
        "eager_padded": {"tokens_computed": input_ids.numel(), "seconds": round(eager_s, 3)},
        "pagedpack_packed": {"tokens_computed": int(real.sum()), "seconds": round(packed_s, 3),
                             "inductor": args.inductor,
                             "sites_rewritten": f"{report.num_rewritten} of {report.num_found}"},
        "speedup": round(eager_s / packed_s, 2),
        "max_abs_diff_at_real_positions": float((packed[real] - eager[real]).abs().max()),
        "load_1min": load_start,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
