"""A byte-level tokenizer that needs no download: one token per UTF-8 byte plus BOS/EOS.

Built with the `tokenizers` library and wrapped as a `transformers` fast tokenizer, so it saves
and loads like any Hugging Face tokenizer (``save_pretrained`` / ``AutoTokenizer``).
"""
from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

BOS, EOS = "<s>", "</s>"
NUM_BYTES = 256


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    """Ids 0..255 are the bytes (GPT-2 byte-to-unicode alphabet), 256 is BOS, 257 is EOS."""
    alphabet = pre_tokenizers.ByteLevel.alphabet()
    byte_chars = sorted(alphabet, key=lambda ch: _byte_of(ch))
    vocab = {ch: i for i, ch in enumerate(byte_chars)}
    vocab[BOS], vocab[EOS] = NUM_BYTES, NUM_BYTES + 1
    core = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    core.decoder = decoders.ByteLevel()
    # EOS doubles as the pad token, as usual for causal LMs, so padded batches tokenize.
    return PreTrainedTokenizerFast(tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=EOS)


def _byte_of(ch: str) -> int:
    """Inverse of GPT-2's bytes_to_unicode for one character."""
    code = ord(ch)
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
    if code in printable:
        return code
    others = [b for b in range(256) if b not in printable]
    return others[code - 256]
