"""What a request's answer must look like: a JSON schema, any JSON object, a regex, one of
a list of strings, or an EBNF grammar.

`StructuredOutput` is the typed, torch-free form the gateway builds from OpenAI's
`response_format` (and tool_choice "required" / a named function) and the gRPC
`SamplingParams.structured_output`; the engine compiles it into a token-level grammar
(`cleave.engine.grammar`) that masks every step's logits. Reasoning models think freely
first: the constraint starts where the answer starts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from enum import Enum

from cleave.errors import InvalidArgument
from cleave.generation.schema_refs import check_refs

# A schema, regex or grammar larger than this is refused before it is compiled (compiling is
# done per request on the serving engine's thread).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 256
# Objects and arrays a JSON schema may nest (JSON levels: an object property takes two). A
# schema's nesting, unlike its length, costs the compiler superlinear time
# and memory (arrays 500 deep: 5.2 s, 1000 deep: 47.1 s and 250 MB; 64 deep: 0.013 s;
# `bench/schema_nesting.py`); real schemas nest a few levels (OpenAI's structured outputs take
# 10 levels of objects). A chain of $refs does too: `schema_refs.MAX_REF_CHAIN` bounds it.
MAX_SCHEMA_DEPTH = 64


class StructuredKind(str, Enum):
    JSON_SCHEMA = "json_schema"
    JSON_OBJECT = "json_object"
    REGEX = "regex"
    CHOICE = "choice"
    GRAMMAR = "grammar"


@dataclass(frozen=True)
class StructuredOutput:
    """A constraint on the answer's text.

    Attributes:
        kind: which form `spec` / `choices` take.
        spec: the JSON schema (JSON text), the regex or the EBNF grammar; empty for
            json_object and choice.
        choices: the strings the answer must be one of (choice only).
    """

    kind: StructuredKind
    spec: str = ""
    choices: tuple[str, ...] = ()

    @classmethod
    def json_schema(cls, schema: dict | str) -> StructuredOutput:
        text = schema if isinstance(schema, str) else json.dumps(schema, ensure_ascii=False, separators=(",", ":"))
        return cls(StructuredKind.JSON_SCHEMA, text)

    def validate(self, field: str = "structured_output") -> None:
        """Raise InvalidArgument (naming `field`) unless the spec can be handed to the compiler."""
        if not isinstance(self.kind, StructuredKind):
            raise InvalidArgument(f"unknown kind {self.kind!r}", field=field)
        if len(self.spec) > MAX_SPEC_CHARS:
            raise InvalidArgument(f"is {len(self.spec)} characters; at most {MAX_SPEC_CHARS}", field=field)
        for text in (self.spec, *self.choices):
            if isinstance(text, str) and not _is_utf8(text):
                raise InvalidArgument("is not valid Unicode text (a lone surrogate escape); send UTF-8 text",
                                      field=field)
        if self.kind is StructuredKind.CHOICE:
            if not self.choices or len(self.choices) > MAX_CHOICES:
                raise InvalidArgument(f"must list 1 to {MAX_CHOICES} choices", field=field)
            if not all(isinstance(choice, str) and choice for choice in self.choices):
                raise InvalidArgument("choices must be non-empty strings", field=field)
            if sum(len(choice) for choice in self.choices) > MAX_SPEC_CHARS:
                raise InvalidArgument(f"choices hold more than {MAX_SPEC_CHARS} characters", field=field)
        elif self.kind is StructuredKind.JSON_SCHEMA:
            try:
                schema = json.loads(self.spec)
            except RecursionError:
                raise InvalidArgument(f"schema nests more than {MAX_SCHEMA_DEPTH} levels", field=field) from None
            except ValueError as error:
                raise InvalidArgument(f"schema is not JSON: {error}", field=field) from None
            if not isinstance(schema, (dict, bool)):
                raise InvalidArgument("schema must be a JSON object", field=field)
            if (depth := json_depth(schema)) > MAX_SCHEMA_DEPTH:
                raise InvalidArgument(f"schema nests {depth} levels of objects and arrays; at most {MAX_SCHEMA_DEPTH}",
                                      field=field)
            check_refs(schema, field)
        elif self.kind in (StructuredKind.REGEX, StructuredKind.GRAMMAR) and not self.spec:
            raise InvalidArgument(f"{self.kind.value} must not be empty", field=field)

    def ebnf_of_choices(self) -> str:
        """The choice list as an EBNF grammar: root ::= "a" | "b" (JSON string escapes)."""
        return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in self.choices)


def json_depth(value: object) -> int:
    """Levels of objects and arrays nested in a parsed JSON value (0 for a scalar), without
    recursion."""
    deepest, pending = 0, [(value, 1)]
    while pending:
        item, depth = pending.pop()
        children = item.values() if isinstance(item, dict) else item if isinstance(item, list) else None
        if children is None:
            continue
        deepest = max(deepest, depth)
        pending.extend((child, depth + 1) for child in children)
    return deepest


def _is_utf8(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
