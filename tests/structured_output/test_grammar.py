"""Structured outputs without an engine: what a request may ask for, the grammar that checks it
(malformed ones refused with xgrammar's reason, no C++ location), the bitmask's bits as the
workers unpack them (against xgrammar's own kernel), and a request's grammar state."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import xgrammar as xgr

from engine.structured_output.bitmask import allowed_ids, first_allowed_from, words_for
from engine.structured_output.grammar import choice_ebnf, grammar_of
from engine.structured_output.params import StructuredOutputsParams
from workers.sample.logits_processors import allowed_tokens


def test_a_request_asks_for_exactly_one_constraint():
    assert StructuredOutputsParams(regex="a+").kind == "regex"
    assert StructuredOutputsParams(json_object=True).kind == "json_object"
    for bad in ({}, {"regex": "a", "grammar": "root ::= \"a\""}, {"json": {}, "json_object": True}):
        with pytest.raises(ValueError, match="exactly one of"):
            StructuredOutputsParams(**bad)
    for choice in ([], ["a", ""]):
        with pytest.raises(ValueError, match="non-empty"):
            StructuredOutputsParams(choice=choice)


@pytest.mark.parametrize("params, reason", [
    (StructuredOutputsParams(json="not json"), "the JSON schema is not valid: Failed to parse"),
    (StructuredOutputsParams(json={"type": "integer", "minimum": 5, "maximum": 3}),
     "minimum greater than maximum"),
    (StructuredOutputsParams(json={"type": "nonsense"}), 'Unsupported type "nonsense"'),
    (StructuredOutputsParams(json={"enum": []}), "enum array must not be empty"),
    (StructuredOutputsParams(regex="[a-z"), "the regex is not valid: .*Unclosed '\\['"),
    (StructuredOutputsParams(grammar="root ::= foo"), 'Rule "foo" is not defined'),
])
def test_a_malformed_or_unsatisfiable_constraint_names_what_is_wrong(params, reason):
    with pytest.raises(ValueError, match=reason) as caught:
        grammar_of(params)
    message = str(caught.value)
    assert message.startswith("structured outputs: ")
    assert ".cc:" not in message and "\n" not in message  # xgrammar's location is not shown


def test_well_formed_constraints_build_and_choices_are_escaped():
    for params in (StructuredOutputsParams(json={"type": "object"}),
                   StructuredOutputsParams(json='{"type": "array"}'),
                   StructuredOutputsParams(regex=r"\d{3}-\d{4}"),
                   StructuredOutputsParams(grammar='root ::= "yes" | "no"'),
                   StructuredOutputsParams(json_object=True)):
        assert grammar_of(params) is not None
    assert choice_ebnf(['say "hi"', "a\\b"]) == r'root ::= "say \"hi\"" | "a\\b"'
    assert grammar_of(StructuredOutputsParams(choice=['say "hi"', "a\\b"])) is not None


def test_the_workers_unpack_the_bits_as_xgrammars_own_kernel_masks():
    vocab = 1000
    rng = np.random.default_rng(0)
    words = rng.integers(-2**31, 2**31, size=(1, words_for(vocab)), dtype=np.int64).astype(np.int32)
    mask = words.tobytes()
    ours = allowed_tokens([mask], vocab, torch.device("cpu"))[0]
    logits = torch.zeros(1, vocab)
    xgr.apply_token_bitmask_inplace(logits, torch.from_numpy(words))
    theirs = logits[0] == 0  # xgrammar sets the disallowed ones to -inf
    assert torch.equal(ours, theirs)
    assert 0 < int(ours.sum()) < vocab  # probe: a mix of allowed and refused tokens
    assert allowed_ids(mask)[allowed_ids(mask) < vocab].tolist() == ours.nonzero()[:, 0].tolist()
    # A vocabulary wider than the mask (padded embeddings): the tail is not allowed.
    wide = allowed_tokens([mask], 32 * words.shape[1] + 7, torch.device("cpu"))[0]
    assert not wide[-7:].any() and torch.equal(wide[:vocab], ours)


def test_first_allowed_wraps_around_the_vocabulary():
    bits = np.zeros(words_for(100), dtype=np.int32)
    for token in (5, 70):
        bits[token // 32] |= 1 << (token % 32)
    mask = bits.tobytes()
    assert [first_allowed_from(mask, t, 100) for t in (0, 5, 6, 71, 99)] == [5, 5, 70, 5, 5]
    assert first_allowed_from(np.zeros(4, dtype=np.int32).tobytes(), 3, 100) is None


def test_a_request_grammar_moves_only_on_accepted_tokens(tmp_path):
    from transformers import AutoTokenizer

    from engine.structured_output.compiler import GrammarCompiler
    from engine.structured_output.matcher import RequestGrammar
    from tests.utils.tiny_tokenizer import save_tiny_tokenizer

    save_tiny_tokenizer(tmp_path)
    tokenizer = AutoTokenizer.from_pretrained(str(tmp_path))
    compiler = GrammarCompiler(str(tmp_path), vocab_size=len(tokenizer))
    try:
        compiled = compiler.submit(StructuredOutputsParams(choice=["yes", "no"])).result(60)
    finally:
        compiler.shutdown()
    grammar = RequestGrammar(compiled, [tokenizer.eos_token_id], len(tokenizer))
    first = grammar.next_token_bitmask()
    assert grammar.next_token_bitmask() == first  # filling twice changes nothing
    allowed = {tokenizer.decode([t]) for t in allowed_ids(first)}
    assert allowed and all("yes".startswith(a) or "no".startswith(a) for a in allowed)
    refused = tokenizer.encode("x", add_special_tokens=False)[0]
    assert not grammar.accept(refused) and grammar.next_token_bitmask() == first
    for token in tokenizer.encode("yes", add_special_tokens=False):
        assert grammar.accept(token)
    assert not grammar.is_terminated
    assert allowed_ids(grammar.next_token_bitmask()).tolist() == [tokenizer.eos_token_id]
    assert grammar.accept(tokenizer.eos_token_id) and grammar.is_terminated


def test_json_schema_keeps_the_order_of_its_properties():
    from engine.structured_output.grammar import schema_text

    schema = {"type": "object", "properties": {"zeta": {"type": "string"},
                                               "alpha": {"type": "integer"}}}
    text = schema_text(StructuredOutputsParams(json=schema))
    assert list(json.loads(text)["properties"]) == ["zeta", "alpha"]
