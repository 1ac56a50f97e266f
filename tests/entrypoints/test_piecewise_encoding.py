"""Encoding a long text in pieces (engine.processing.piecewise_encoding): the same token ids as
encoding it whole, for byte-level BPE (the default model's tokenizer and one trained here, with
and without special tokens) and for a SentencePiece-style tokenizer whose seams all fail their
check; and the pauses between the pieces really happen."""

from __future__ import annotations

import functools

from hypothesis import given
from hypothesis import strategies as st
from tokenizers import Tokenizer, models, normalizers, pre_tokenizers, processors, trainers

from engine.benchmarks.attainment.traces import PromptSource
from engine.entrypoints.default_model import default_model_path
from engine.processing.input_processor import InputProcessor
from engine.processing.piecewise_encoding import encode_in_pieces, seams

CORPUS = ["the quick brown fox jumps over the lazy dog 12 times, doesn't it?",
          "Überall 3.14159 tokens; naïve café — sentence pieces\n\nnew  paragraph\tx",
          "def f(x_1):\n    return x_1 ** 2  # squared"] * 20


def _trained(model_normalizer=None, pre_tokenizer=None) -> Tokenizer:
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    if model_normalizer is not None:
        tok.normalizer = model_normalizer
    if pre_tokenizer is not None:
        tok.pre_tokenizer = pre_tokenizer
    alphabet = pre_tokenizers.ByteLevel.alphabet() if pre_tokenizer is not None else []
    tok.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<bos>"], initial_alphabet=alphabet,
        show_progress=False))
    return tok


@functools.cache
def byte_level() -> Tokenizer:
    """GPT-2 style: its regex splits words, each space going with the word after it; a BOS
    added by the post-processor."""
    tok = _trained(pre_tokenizer=pre_tokenizers.ByteLevel(add_prefix_space=False))
    tok.post_processor = processors.TemplateProcessing(single="<bos> $A",
                                                       special_tokens=[("<bos>", 1)])
    return tok


@functools.cache
def prepending() -> Tokenizer:
    """Llama 2 style: "▁" prepended to every input, spaces replaced by "▁", no pre-tokenizer."""
    return _trained(normalizers.Sequence([normalizers.Prepend("▁"),
                                          normalizers.Replace(" ", "▁")]))


@functools.cache
def default_model() -> Tokenizer:
    return InputProcessor(str(default_model_path())).tokenizer._tokenizer


def _pieces(tok: Tokenizer, text: str, add_special_tokens: bool, piece_chars: int
            ) -> tuple[list[int], int]:
    pauses = []
    ids = encode_in_pieces(tok, text, add_special_tokens, lambda: pauses.append(1),
                           piece_chars=piece_chars)
    return ids, len(pauses)


def test_a_document_in_pieces_is_the_document_whole_and_pauses_between_them():
    from transformers import AutoTokenizer

    tok = default_model()
    hf = AutoTokenizer.from_pretrained(str(default_model_path()))
    source = PromptSource(hf)
    for offset in (0, 5_000, 40_000):
        text = hf.decode([int(t) for t in source.window(offset, 8_000)])
        for special in (True, False):
            ids, pauses = _pieces(tok, text, special, piece_chars=4_096)
            assert ids == tok.encode(text, add_special_tokens=special).ids
            assert pauses >= len(text) // 4_096 - 2  # probe: it was encoded in pieces


_TEXT = st.lists(st.sampled_from(list("ab xyz9 .,'\n\tÜé—") + ["  ", "do ", "n't ", "<bos>"]),
                 max_size=120).map("".join)


@given(_TEXT)
def test_any_text_in_pieces_equals_it_whole_byte_level_bpe(text):
    tok = byte_level()
    for special in (True, False):
        assert _pieces(tok, text, special, piece_chars=8)[0] == tok.encode(
            text, add_special_tokens=special).ids


@given(_TEXT)
def test_any_text_in_pieces_equals_it_whole_default_model(text):
    tok = default_model()
    assert _pieces(tok, text, True, piece_chars=8)[0] == tok.encode(text).ids


def test_the_special_tokens_are_added_once_around_the_whole():
    tok = byte_level()
    text = "the quick brown fox jumps over the lazy dog " * 10
    ids, pauses = _pieces(tok, text, True, piece_chars=32)
    assert pauses > 3  # probe: in pieces
    assert ids == tok.encode(text).ids and ids.count(1) == 1 and ids[0] == 1


def test_a_tokenizer_that_marks_each_inputs_start_is_encoded_whole():
    """Encoded apart, each piece would start with its own "▁": every seam fails its check,
    and the text is encoded in one piece."""
    tok = prepending()
    text = "the quick brown fox jumps over the lazy dog " * 10
    assert tok.encode("fox").tokens[0].startswith("▁")  # probe: it does mark the start
    assert seams(tok, text, piece_chars=32) == []
    ids, pauses = _pieces(tok, text, False, piece_chars=32)
    assert ids == tok.encode(text, add_special_tokens=False).ids and pauses == 0


def test_a_text_without_seams_is_encoded_whole():
    tok = byte_level()
    for text in ("9" * 500, "x" * 500, "word\n" * 100):
        ids, pauses = _pieces(tok, text, True, piece_chars=32)
        assert ids == tok.encode(text).ids and pauses == 0


def test_the_input_processor_encodes_in_pieces_only_when_asked(tiny_model):
    inputs = InputProcessor(tiny_model(), chat_template="{% for m in messages %}<eos>"
                            "{{ m['role'] }}: {{ m['content'] }}{% endfor %}")
    text = "the quick brown fox jumps over the lazy dog " * 600  # 26k characters
    pauses = []
    pieced = inputs.between_pieces(lambda: pauses.append(1))
    assert pieced.encode(text) == inputs.encode(text)
    assert len(pauses) >= 2  # probe: in pieces
    messages = [{"role": "user", "content": text}]
    assert pieced.apply_chat_template(messages) == inputs.apply_chat_template(messages)
    before = len(pauses)
    inputs.encode(text)
    assert len(pauses) == before  # the processor itself encodes whole
