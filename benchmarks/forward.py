"""Padded forward: eager ``transformers`` vs ``torch.compile(backend="pagedpack")`` (packed).

One batch of sequences of the lengths below, right-padded to the longest, through the same
model both ways, side by side in one run. Prints one JSON object: tokens computed and wall
time (median of ``--repeat`` runs after a warm-up) for each, and the largest difference at real
positions. Run: ``python benchmarks/forward.py [--inductor]``.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from pagedpack.models.tiny import tiny_model

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
    parser.add_argument("--inductor", action="store_true", help="hand the packed graph to Inductor")
    args = parser.parse_args()

    model = tiny_model("llama", hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                       num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=4096)
    g = torch.Generator().manual_seed(0)
    width = max(LENGTHS)
    input_ids = torch.randint(0, 256, (len(LENGTHS), width), generator=g)
    attention_mask = (torch.arange(width)[None] < torch.tensor(LENGTHS)[:, None]).long()
    compiled = torch.compile(model, backend="pagedpack", dynamic=True,
                             options={"inductor": args.inductor})
    with torch.inference_mode():
        eager_s, eager = timed(lambda: model(input_ids=input_ids, attention_mask=attention_mask,
                                             use_cache=False).logits, args.repeat)
    with torch.no_grad():
        packed_s, packed = timed(lambda: compiled(input_ids=input_ids, attention_mask=attention_mask,
                                                  use_cache=False).logits, args.repeat)
    real = attention_mask.bool()
    print(json.dumps({
        "lengths": list(LENGTHS),
        "eager_padded": {"tokens_computed": input_ids.numel(), "seconds": round(eager_s, 3)},
        "pagedpack_packed": {"tokens_computed": int(real.sum()), "seconds": round(packed_s, 3),
                             "inductor": args.inductor},
        "speedup": round(eager_s / packed_s, 2),
        "max_abs_diff_at_real_positions": float((packed[real] - eager[real]).abs().max()),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
    }, indent=2))


if __name__ == "__main__":
    main()
