import pytest

from engine.processing.detokenizer import IncrementalDetokenizer
from tests.tiny_tokenizer import save_tiny_tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(save_tiny_tokenizer(tmp_path_factory.mktemp("tok"))))


TEXT = " Ünïcödé text, emoji 🙂 and Paris is the capital of France."


def test_incremental_equals_full_decode(tokenizer):
    prompt = tokenizer.encode("The quick brown fox")
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    pieces = []
    for token in ids:
        before = detok.output_text
        detok.update([token])
        pieces.append(detok.output_text[len(before):])
        assert "\ufffd" not in detok.output_text
    assert detok.output_text == tokenizer.decode(ids) == "".join(pieces)


@pytest.mark.parametrize("include", [False, True])
def test_stop_string_truncates(tokenizer, include):
    ids = tokenizer.encode(TEXT)
    detok = IncrementalDetokenizer(tokenizer, [], stop=["capital"],
                                   include_stop_str_in_output=include)
    hit = None
    for token in ids:
        hit = detok.update([token])
        if hit:
            break
    assert hit == "capital"
    expected = TEXT[: TEXT.index("capital") + (len("capital") if include else 0)]
    assert detok.output_text == expected


def test_flush_emits_incomplete_tail(tokenizer):
    ids = tokenizer.encode("🙂")
    assert len(ids) > 1, "the emoji should span several byte-level tokens"
    detok = IncrementalDetokenizer(tokenizer, [])
    detok.update(ids[:-1])
    assert detok.output_text == ""  # held back: an incomplete character
    detok.flush()
    assert detok.output_text == tokenizer.decode(ids[:-1])
