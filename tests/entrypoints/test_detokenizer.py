import pytest

from engine.processing.detokenizer import IncrementalDetokenizer
from tests.utils.tiny_tokenizer import save_tiny_tokenizer


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


@pytest.mark.parametrize("skip", [False, True])
def test_fast_decode_equals_the_tokenizers_decode(tokenizer, skip, monkeypatch):
    import random

    from engine.processing.detokenizer import fast_decode

    rng = random.Random(0)
    vocab = len(tokenizer)
    sequences = [tokenizer.encode(TEXT)] + [[rng.randrange(vocab) for _ in range(rng.randrange(1, 12))]
                                            for _ in range(300)]
    sequences += [[tokenizer.all_special_ids[0], *tokenizer.encode(" a b")]]
    expected = [tokenizer.decode(ids, skip_special_tokens=skip) for ids in sequences]
    decode = fast_decode(tokenizer)
    # Probe: the fast path never calls the transformers wrapper.
    monkeypatch.setattr(tokenizer, "decode", lambda *a, **k: pytest.fail("wrapper called"))
    assert [decode(ids, skip) for ids in sequences] == expected


def test_fast_decode_keeps_the_wrapper_where_it_cleans_up_spaces(tokenizer, monkeypatch):
    from engine.processing.detokenizer import fast_decode

    calls = []
    monkeypatch.setattr(tokenizer, "clean_up_tokenization_spaces", True)
    monkeypatch.setattr(tokenizer, "decode",
                        lambda ids, skip_special_tokens: calls.append(ids) or "text")
    assert fast_decode(tokenizer)([5, 6], True) == "text" and calls == [[5, 6]]
