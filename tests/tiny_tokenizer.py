"""A small byte-level BPE tokenizer trained in the test, so tiny models can take text prompts."""

from __future__ import annotations

from pathlib import Path

CORPUS = [
    "The quick brown fox jumps over the lazy dog.",
    "Paris is the capital of France, and Berlin is the capital of Germany.",
    "A paged KV cache stores keys and values in fixed-size blocks.",
    "Deadlines matter: an interactive turn must start within half a second.",
    "Ünïcödé text, emoji 🙂 and numbers 12345 exercise multi-byte decoding.",
] * 20


def save_tiny_tokenizer(path: str | Path, vocab_size: int = 400) -> Path:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")
    fast.save_pretrained(str(path))
    return Path(path)
