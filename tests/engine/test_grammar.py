"""Structured-output constraints on token ids (`cleave.engine.grammar`): random walks through
each step's allowed tokens end in answers that `json` / `jsonschema` / `re` accept, think tags
leave the reasoning free, and bad specs are refused naming their field."""

from __future__ import annotations

import json
import random
import re

import jsonschema
import pytest
import torch

from cleave.engine.grammar import GrammarCompiler
from cleave.errors import InvalidArgument
from cleave.generation.reasoning import Phase
from cleave.generation.structured_output import MAX_SCHEMA_DEPTH, StructuredKind, StructuredOutput, json_depth
from cleave.model.tokenizer import Tokenizer
from cleave.testing.tiny_models import write_tiny_checkpoint


def nested_arrays(levels: int) -> str:
    """A schema of arrays of arrays `levels` deep around a string: levels + 1 JSON levels."""
    return '{"type":"array","items":' * levels + '{"type":"string"}' + "}" * levels


SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "pattern": "^[a-z ]{1,6}$"},
        "ok": {"type": "boolean"},
        "color": {"enum": ["red", "green", "blue"]},
        "tags": {"type": "array", "items": {"enum": ["a", "b"]}, "maxItems": 3},
    },
    "required": ["name", "ok", "color", "tags"],
    "additionalProperties": False,
}
VOCAB = 520  # the logits' width: wider than the tokenizer's 512 ids, as padded models are


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory) -> Tokenizer:
    return Tokenizer.from_pretrained(write_tiny_checkpoint(tmp_path_factory.mktemp("qwen3"), "qwen3"))


@pytest.fixture(scope="module")
def compiler(tokenizer) -> GrammarCompiler:
    return GrammarCompiler(tokenizer, VOCAB, sorted(tokenizer.eos_token_ids))


def allowed(bitmask: torch.Tensor, index: int = 0) -> list[int]:
    words = bitmask[index].tolist()
    return [v for v in range(VOCAB) if (words[v // 32] >> (v % 32)) & 1]


def walk(constraint, rng: random.Random, given: list[int] = (), max_tokens: int = 400,
         closers: frozenset[int] = frozenset()) -> list[int]:
    """Sample uniformly among the allowed tokens until a stop token or `max_tokens`; half the
    steps where one of `closers` is allowed take it (free-form JSON ends soon)."""
    tokens = list(given)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    while len(tokens) < max_tokens:
        bitmask.fill_(-1)
        if not constraint.fill_bitmask(tokens, bitmask, 0):  # it read a stop token: the answer is whole
            assert constraint.is_terminated and not constraint.failed
            break
        choices = allowed(bitmask)
        assert choices, "the grammar allowed nothing"
        closing = [t for t in choices if t in closers]
        tokens.append(rng.choice(closing if closing and rng.random() < 0.5 else choices))
    return tokens


def answer_text(tokenizer: Tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t not in tokenizer.eos_token_ids])


@pytest.mark.parametrize("seed", range(6))
def test_random_walks_through_a_schema_end_in_instances_of_it(tokenizer, compiler, seed):
    grammar = compiler.compile(StructuredOutput.json_schema(SCHEMA))
    constraint = compiler.constraint(grammar)
    tokens = walk(constraint, random.Random(seed))
    assert constraint.is_terminated and tokens[-1] in tokenizer.eos_token_ids
    jsonschema.validate(json.loads(answer_text(tokenizer, tokens)), SCHEMA)


def test_padding_ids_beyond_the_tokenizer_are_never_allowed(tokenizer, compiler):
    constraint = compiler.constraint(compiler.compile(StructuredOutput(StructuredKind.JSON_OBJECT)))
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    assert constraint.fill_bitmask([], bitmask, 0)
    assert all(v < tokenizer.vocab_size for v in allowed(bitmask))
    assert tokenizer.decode(allowed(bitmask)).strip().startswith("{")


@pytest.mark.parametrize("seed", range(3))
def test_json_object_regex_choice_and_grammar(tokenizer, compiler, seed):
    rng = random.Random(seed)
    closers = frozenset(tokenizer.encode('"}]', add_special_tokens=False)) | tokenizer.eos_token_ids
    text = answer_text(tokenizer, walk(compiler.constraint(compiler.compile(
        StructuredOutput(StructuredKind.JSON_OBJECT))), rng, closers=closers))
    assert isinstance(json.loads(text), dict)
    text = answer_text(tokenizer, walk(compiler.constraint(compiler.compile(
        StructuredOutput(StructuredKind.REGEX, r"[0-9]{3}-(yes|no)"))), rng))
    assert re.fullmatch(r"[0-9]{3}-(yes|no)", text)
    choices = ('say "hi"', "back\\slash", "日本", "a")
    text = answer_text(tokenizer, walk(compiler.constraint(compiler.compile(
        StructuredOutput(StructuredKind.CHOICE, choices=choices))), rng))
    assert text in choices
    text = answer_text(tokenizer, walk(compiler.constraint(compiler.compile(
        StructuredOutput(StructuredKind.GRAMMAR, 'root ::= "x" ("y" | "z")+ "."'))), rng))
    assert re.fullmatch(r"x[yz]+\.", text)


def test_thinking_is_free_and_the_answer_follows_the_end_tag(tokenizer, compiler):
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    grammar = compiler.compile(StructuredOutput.json_schema(SCHEMA))
    constraint = compiler.constraint(grammar, [start], [end], starts_in_reasoning=False)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    # before the block: the start tag or the answer's first tokens, nothing else
    assert constraint.fill_bitmask([], bitmask, 0)
    first = allowed(bitmask)
    assert start in first and end not in first
    assert all(t == start or tokenizer.decode([t]).strip().startswith("{") for t in first)
    # inside: free, whatever the tokens
    thinking = [start] + tokenizer.encode("not json at all", add_special_tokens=False)
    assert not constraint.fill_bitmask(thinking, bitmask, 0)
    assert constraint.phase is Phase.REASONING
    # after the end tag: the schema, to a stop token
    tokens = walk(constraint, random.Random(1), given=thinking + [end])
    assert constraint.phase is Phase.ANSWER
    jsonschema.validate(json.loads(answer_text(tokenizer, tokens[len(thinking) + 1:])), SCHEMA)


def test_answering_at_once_skips_the_thinking(tokenizer, compiler):
    start, end = tokenizer.token_to_id("<think>"), tokenizer.token_to_id("</think>")
    constraint = compiler.constraint(compiler.compile(StructuredOutput(StructuredKind.CHOICE, choices=("yes", "no"))),
                                     [start], [end], starts_in_reasoning=False)
    tokens = walk(constraint, random.Random(3), given=tokenizer.encode("no", add_special_tokens=False)[:1])
    assert constraint.phase is Phase.ANSWER
    assert answer_text(tokenizer, tokens) in ("yes", "no")


def test_a_prompt_that_opened_the_block_starts_free(tokenizer, compiler):
    end = tokenizer.token_to_id("</think>")
    constraint = compiler.constraint(compiler.compile(StructuredOutput(StructuredKind.JSON_OBJECT)),
                                     [tokenizer.token_to_id("<think>")], [end], starts_in_reasoning=True)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    assert not constraint.fill_bitmask([], bitmask, 0)
    assert torch.all(bitmask == -1)  # the row is left as it was
    assert constraint.fill_bitmask([5, 6, end], bitmask, 0)


def test_a_constraint_nothing_satisfies_ends_the_sample(tokenizer, compiler):
    constraint = compiler.constraint(compiler.compile(StructuredOutput.json_schema({"anyOf": []})))
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    assert constraint.fill_bitmask([], bitmask, 0)
    assert set(allowed(bitmask)) == set(tokenizer.eos_token_ids)


def test_a_constraint_no_token_can_start_is_refused_and_one_that_dead_ends_ends_the_sample():
    """The shipped reasoner writes digits, letters and a few signs, no "{": JSON can never
    start (refused, naming the field, instead of an empty answer that claims to have stopped);
    `a{` starts, then nothing continues it, so the sample ends there."""
    from cleave.config import SHIPPED_MODEL_DIR

    shipped = Tokenizer.from_pretrained(SHIPPED_MODEL_DIR)
    vocab_size = shipped.backend.get_vocab_size()
    compiler = GrammarCompiler(shipped, vocab_size, sorted(shipped.eos_token_ids))
    with pytest.raises(InvalidArgument) as raised:
        compiler.compile(StructuredOutput(StructuredKind.JSON_OBJECT), field="response_format")
    assert raised.value.field == "response_format" and "no token of its vocabulary" in raised.value.message
    constraint = compiler.constraint(compiler.compile(StructuredOutput(StructuredKind.REGEX, r"a\{")))
    bitmask = torch.full((1, (vocab_size + 31) // 32), -1, dtype=torch.int32)
    assert constraint.fill_bitmask([], bitmask, 0) and not constraint.failed
    words = bitmask[0].tolist()
    assert [v for v in range(vocab_size) if (words[v // 32] >> (v % 32)) & 1] == [shipped.token_to_id("a")]
    assert constraint.fill_bitmask([shipped.token_to_id("a")], bitmask, 0) and constraint.failed
    words = bitmask[0].tolist()
    assert {v for v in range(vocab_size) if (words[v // 32] >> (v % 32)) & 1} == set(shipped.eos_token_ids)


def test_a_given_token_the_grammar_refuses_frees_the_sample(tokenizer, compiler):
    constraint = compiler.constraint(compiler.compile(StructuredOutput(StructuredKind.JSON_OBJECT)))
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    not_json = tokenizer.encode("x", add_special_tokens=False)
    assert not constraint.fill_bitmask(not_json, bitmask, 0)
    assert constraint.failed


@pytest.mark.parametrize("spec, message", [
    (StructuredOutput.json_schema({"type": "nonsense"}), "nonsense"),
    (StructuredOutput(StructuredKind.REGEX, "((("), "parenthesis"),
    (StructuredOutput(StructuredKind.GRAMMAR, "root ::= "), "grammar"),
])
def test_bad_specs_are_refused_naming_the_field(compiler, spec, message):
    with pytest.raises(InvalidArgument) as raised:
        compiler.compile(spec, field="response_format")
    assert raised.value.field == "response_format"
    assert message in str(raised.value.message).lower() or spec.kind.value in raised.value.message
    assert ".cc:" not in raised.value.message


@pytest.mark.parametrize("spec", [
    StructuredOutput(StructuredKind.JSON_SCHEMA, "{not json"),
    StructuredOutput(StructuredKind.JSON_SCHEMA, "[1, 2]"),
    StructuredOutput(StructuredKind.REGEX, ""),
    StructuredOutput(StructuredKind.CHOICE, choices=()),
    StructuredOutput(StructuredKind.CHOICE, choices=("a", "")),
    StructuredOutput(StructuredKind.GRAMMAR, "x" * 70_000),
    StructuredOutput(StructuredKind.JSON_SCHEMA, nested_arrays(MAX_SCHEMA_DEPTH)),  # one level past the bound
    StructuredOutput(StructuredKind.JSON_SCHEMA, '{"type":"array","items":' + "[" * 30_000 + "]" * 30_000 + "}"),
])
def test_specs_are_validated_before_compiling(spec):
    with pytest.raises(InvalidArgument) as raised:
        spec.validate("sampling.structured_output")
    assert raised.value.field == "sampling.structured_output"


def test_a_schema_nested_to_the_bound_compiles_at_once(compiler):
    # 63 arrays around a string: 64 levels, the most taken; the compiler's time grows
    # superlinearly with nesting (1000 levels took 46 s), so the bound keeps it short
    spec = StructuredOutput(StructuredKind.JSON_SCHEMA, nested_arrays(MAX_SCHEMA_DEPTH - 1))
    spec.validate()
    assert compiler.compile(spec) is not None
    with pytest.raises(InvalidArgument, match=f"nests {MAX_SCHEMA_DEPTH + 1} levels"):
        StructuredOutput(StructuredKind.JSON_SCHEMA, nested_arrays(MAX_SCHEMA_DEPTH)).validate()


@pytest.mark.parametrize(("schema", "is_loop"), [
    ({"$ref": "#"}, True),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"$ref": "#/$defs/b"}, "b": {"$ref": "#/$defs/a", "type": "string"}}}, True),
    ({"properties": {"p": {"$ref": "#/$defs/a"}}, "required": ["p"], "$defs": {"a": {"$ref": "#/$defs/a"}}}, True),
    ({"type": "object", "properties": {"next": {"$ref": "#"}}}, False),
    ({"$ref": "#/$defs/a", "$defs": {"a": {"anyOf": [{"type": "null"}, {"$ref": "#/$defs/a"}]}}}, False),
    ({"allOf": [{"$ref": "#"}]}, "can start"),  # compiles, but nothing ends the recursion: no answer at all
])
def test_the_gateway_refuses_the_reference_loops_the_compiler_refuses(compiler, schema, is_loop):
    # the gateway's check (`cleave.generation.schema_refs`) saves a worker's compile; it must
    # refuse no recursion the compiler takes
    spec = StructuredOutput.json_schema(schema)
    if is_loop == "can start":
        spec.validate()
        with pytest.raises(InvalidArgument, match="no token of its vocabulary can start one"):
            compiler.compile(spec)
        return
    if not is_loop:
        spec.validate()
        assert compiler.compile(spec) is not None
        return
    with pytest.raises(InvalidArgument, match="comes back to itself"):
        spec.validate()
    with pytest.raises(InvalidArgument, match="Circular"):
        compiler.compile(spec)


@pytest.mark.parametrize(("value", "depth"), [
    (1, 0), ({}, 1), ([], 1), ({"a": [1, {"b": []}]}, 4), ([[], [[[]]]], 4), ({"a": {"b": 1}, "c": 2}, 2),
])
def test_json_depth_counts_objects_and_arrays(value, depth):
    assert json_depth(value) == depth


def test_multi_token_tags_are_followed_token_by_token(tokenizer, compiler):
    # harmony-like tags of several tokens: the start tag, once begun, is finished; the end tag
    # closes the thinking only whole (a partial one followed by another token stays thinking)
    start, end = [300, 301, 302], [303, 304]  # ordinary tokens standing in for marker tokens
    constraint = compiler.constraint(compiler.compile(StructuredOutput(StructuredKind.CHOICE, choices=("ok",))),
                                     start, end, starts_in_reasoning=False)
    bitmask = torch.full((1, (VOCAB + 31) // 32), -1, dtype=torch.int32)
    assert constraint.fill_bitmask(start[:1], bitmask, 0)
    assert allowed(bitmask) == [start[1]]
    assert constraint.fill_bitmask(start[:2], bitmask, 0)
    assert allowed(bitmask) == [start[2]]
    thinking = start + [end[0], 7, end[0]]
    assert not constraint.fill_bitmask(thinking, bitmask, 0)  # inside: free
    assert constraint.phase is Phase.REASONING
    tokens = walk(constraint, random.Random(0), given=thinking + [end[1]])
    assert constraint.phase is Phase.ANSWER
    assert answer_text(tokenizer, tokens[len(thinking) + 1:]) == "ok"


@pytest.mark.parametrize("fails", [False, True])
def test_tables_built_ahead_serve_every_later_compile(tokenizer, monkeypatch, fails):
    grammars = GrammarCompiler(tokenizer, VOCAB, sorted(tokenizer.eos_token_ids))
    if fails:  # logged on the thread; the first compile builds them itself
        monkeypatch.setattr(GrammarCompiler, "build_tables", lambda self: 1 / 0)
    grammars.build_tables_in_background().join(timeout=120)
    built = grammars._built
    assert (built is None) == fails
    assert grammars.compile(StructuredOutput(StructuredKind.REGEX, "[ab]+")) is not None
    assert grammars._built is not None and (fails or grammars._built is built)
