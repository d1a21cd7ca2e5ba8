"""Structured output: JSON mode, JSON schemas, choices and regexes (vLLM's StructuredOutputsParams).

A request with SamplingParams.structured_outputs may only sample tokens whose text keeps its
output a prefix of what it asks for: one JSON object (JSON mode, the OpenAI API's
response_format {"type": "json_object"}), one JSON value that a JSON schema admits
(response_format {"type": "json_schema"}), one of a list of strings (vLLM's choice), or a
text a regex matches whole (vLLM's regex: engine/regex.py's automaton, in the REGEX mode).
Under a reasoning parser a <think> block may come first, free (the THINKING and OPENING
modes), the structure holding what follows it.
Once the output is whole, only its EOS or stop token IDs, which end it, as with vLLM's
grammars. Outside strings, at most MAX_WHITESPACE whitespace characters in a row, so a
model cannot idle in whitespace.

A schema compiles (compile_schema) into a graph of Nodes, what a value at one place may be;
the recognizer reads the output a character at a time. Its state is an immutable tuple
(mode, stack, aux, whitespace run), the stack holding the open objects and arrays as
(node, progress) frames; a schema's anyOf can leave several such states alive at once (two
objects that both begin with "{"), so what a request keeps is a tuple of them: a token is
allowed when any of them accepts each character of its text. The scheduler keeps each
request's states (in the Request, so preemption loses nothing), asks this module for the
allowed tokens of the requests that sample in a step, and advances the states with each
sampled token. Masks are cached per state by the part of it a token can reach (the mode, its
detail, the whitespace run, and the top of the stack down to the most closing brackets any
token holds), so a step mostly looks up masks it has already built.

What a schema may say: type (one or a list), properties, required, additionalProperties
(false, or with no properties true or a schema: a map), items, minItems, maxItems, enum and
const (with type at most), anyOf, oneOf whose alternatives no value fits two of (_disjoint),
allOf of one schema, $ref within the document (recursion included), and a string's pattern
(matched whole) and / or minLength / maxLength (as the regex [\\s\\S]{m,n}, with a pattern
their product automaton; without a type, they hold strings and let other values pass);
annotations (title,
description, format, default, ...) are read and ignored, as JSON Schema's own rules have it
for format. An anyOf of alternatives that begin alike keeps several states alive; nested
deep, they would double with each level: at most MAX_STATES are kept (the first ones), so
what is allowed stays valid, if less than all that is. An object's properties come in the
order the schema lists them (as OpenAI's and vLLM's strict modes write them), each at most
once, none that it does not list. Any other keyword (minimum, multipleOf, ...) is refused
rather than ignored: the output would not be held to it. A regex state's mask walks a trie
of the tokens' character classes (_ClassTrie), shared by regexes of the same classes.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import threading
from collections import OrderedDict
from typing import Any, Optional

import numpy as np

from streamserve.engine.regex import Regex, RegexError, compile_regex, intersect

logger = logging.getLogger(__name__)

MAX_WHITESPACE = 64  # whitespace characters in a row, anywhere outside strings
MASK_CACHE_SIZE = 1024  # masks kept (bytes each: the vocabulary size)
TRIE_CACHE_SIZE = 32  # token tries a Vocabulary keeps (one per regex's character classes)...
TRIE_CACHE_NODES = 500_000  # ... and at most this many nodes in all (~300 bytes each)
SCHEMA_CACHE_SIZE = 64  # compiled schemas kept (by their text): requests alike share nodes and masks
MAX_SCHEMA_DEPTH = 64  # schemas nested deeper are refused (a $ref cycle is no nesting)
MAX_ALTERNATIVES = 1024  # properties of an object, values of an enum, strings of a choice, anyOf's schemas
MAX_LENGTH_BOUND = 4096  # a string's minLength / maxLength: one regex state per character counted
MAX_STATES = 64  # states alive at once: past it the latest are dropped (what is left stays valid)


class SchemaError(ValueError):
    """A schema (or choice list) this module cannot hold an output to."""


# ---- the compiled schema -----------------------------------------------------------------

OBJECT, ARRAY, STRING_VALUE, NUMBER, INTEGER, LITERALS, UNION = range(7)


class Node:
    """What a value at one place may be. OBJECT: `keys` (JSON-encoded, in order) with their
    `values` and whether each is `required`, or with no keys, `extra`: the values of any keys
    (None: none); ARRAY: `item`, `min_items`, `max_items` (None: any); STRING_VALUE: the
    `pattern` (a Regex) its text matches whole, or None; LITERALS: the values' exact `texts`;
    UNION: `alternatives`."""

    __slots__ = ("kind", "keys", "values", "required", "extra", "item", "min_items", "max_items", "texts",
                 "alternatives", "next_required", "cap", "by_first", "pattern")

    def __init__(self, kind: int, **fields: Any) -> None:
        self.kind = kind
        self.keys, self.values, self.required = (), (), ()
        self.extra = self.item = self.max_items = self.pattern = None
        self.min_items = 0
        self.texts, self.alternatives = frozenset(), ()
        self.by_first: Optional[dict[str, tuple[Node, ...]]] = None  # a union's alternatives by first character
        for name, value in fields.items():
            setattr(self, name, value)
        self.finish()

    def finish(self) -> None:
        # An object's progress is the index of the first key that may still come; from each,
        # the first required key (len(keys): none), which bounds the keys that may be next.
        n, following = len(self.keys), []
        for i in range(n - 1, -1, -1):
            following.append(i if self.required[i] else (following[-1] if following else n))
        self.next_required = tuple(reversed(following)) + (n,)
        # An array's progress is its items so far, counted up to what its bounds can tell apart.
        self.cap = self.max_items if self.max_items is not None else self.min_items

    def candidates(self, progress: int) -> range:
        """The keys that may come next in an object at `progress`."""
        return range(progress, min(self.next_required[progress] + 1, len(self.keys)))

    def closable(self, progress: int) -> bool:
        return self.next_required[progress] == len(self.keys)


def _any_value() -> Node:
    any_value = Node(UNION)
    obj = Node(OBJECT, extra=any_value)
    any_value.alternatives = (obj, Node(ARRAY, item=any_value), Node(STRING_VALUE), Node(NUMBER),
                              Node(LITERALS, texts=frozenset(("true", "false", "null"))))
    return any_value


ANY = _any_value()
ANY_OBJECT = ANY.alternatives[0]  # JSON mode's output

_ANNOTATIONS = frozenset({"title", "description", "default", "examples", "$schema", "$id", "$comment", "deprecated",
                          "readOnly", "writeOnly", "format", "$defs", "definitions", "contentEncoding",
                          "contentMediaType", "strict"})
_KEYWORDS = _ANNOTATIONS | {"type", "properties", "required", "additionalProperties", "items", "minItems", "maxItems",
                            "enum", "const", "anyOf", "oneOf", "allOf", "$ref", "pattern", "minLength", "maxLength"}
_TYPES = ("object", "array", "string", "number", "integer", "boolean", "null")


def _json_type(value: Any) -> str:
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "integer" if float(value).is_integer() else "number"
    return {str: "string", list: "array", dict: "object", type(None): "null"}[type(value)]


def _literal_text(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"), allow_nan=False)


class _Compiler:
    def __init__(self, document: Any) -> None:
        self.document = document
        self.refs: dict[str, Node] = {}
        # $ref nodes made before what they refer to was: (the $ref's node, what it is), filled
        # once the whole schema is compiled
        self.aliases: list[tuple[Node, Node]] = []
        self.one_of: list[tuple[str, list[Node]]] = []  # oneOf's alternatives, to check once all are made

    def compile(self) -> Node:
        root = self.node(self.document, "schema")
        unfilled = {id(ref) for ref, _ in self.aliases}
        while self.aliases:
            ready = [(ref, made) for ref, made in self.aliases if id(made) not in unfilled]
            if not ready:
                raise SchemaError("a $ref refers only to itself (through other $refs or anyOfs): no value fits")
            for ref, made in ready:
                for name in Node.__slots__:
                    setattr(ref, name, getattr(made, name))
                unfilled.discard(id(ref))
            self.aliases = [pair for pair in self.aliases if id(pair[0]) in unfilled]
        for where, alternatives in self.one_of:
            for i, a in enumerate(alternatives):
                for b in alternatives[i + 1:]:
                    if not _disjoint(a, b):
                        raise SchemaError(f"{where}: oneOf whose alternatives a value could match both of is "
                                          "not supported (the output could match more than one): use anyOf")
        if not _first_characters(root):
            raise SchemaError("no value fits the schema")
        return root

    def node(self, schema: Any, where: str, depth: int = 0) -> Node:
        if depth > MAX_SCHEMA_DEPTH:
            raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels")
        if schema is True or schema == {}:
            return ANY
        if not isinstance(schema, dict):
            raise SchemaError(f"{where}: a schema must be an object or true, not {_literal_text(schema)[:60]}")
        unknown = sorted(set(schema) - _KEYWORDS)
        if unknown:
            raise SchemaError(f"{where}: JSON schema keyword {', '.join(map(repr, unknown))} is not supported "
                              "(the output could not be held to it)")
        rules = {key: value for key, value in schema.items() if key not in _ANNOTATIONS}
        for keyword in ("$ref", "allOf", "anyOf", "oneOf"):
            if keyword in rules and len(rules) > 1:
                others = ", ".join(sorted(set(rules) - {keyword}))
                raise SchemaError(f"{where}: {keyword} beside other keywords ({others}) is not supported")
        if "$ref" in rules:
            return self.ref(rules["$ref"], where, depth)
        if "allOf" in rules:
            parts = rules["allOf"]
            if not isinstance(parts, list) or len(parts) != 1:
                raise SchemaError(f"{where}: allOf is supported with one schema only")
            return self.node(parts[0], f"{where}/allOf/0", depth + 1)
        for keyword in ("anyOf", "oneOf"):
            if keyword in rules:
                parts = rules[keyword]
                if not isinstance(parts, list) or not 0 < len(parts) <= MAX_ALTERNATIVES:
                    raise SchemaError(f"{where}: {keyword} must be a list of 1 to {MAX_ALTERNATIVES} schemas")
                nodes = [self.node(p, f"{where}/{keyword}/{i}", depth + 1) for i, p in enumerate(parts)]
                if keyword == "oneOf":
                    self.one_of.append((where, nodes))
                return _union(nodes)
        if "const" in rules or "enum" in rules:
            return self.literals(rules, where)
        kind = rules.get("type")
        if kind is None:
            kind = ("object" if {"properties", "required", "additionalProperties"} & set(rules)
                    else "array" if {"items", "minItems", "maxItems"} & set(rules) else None)
            if kind is None:
                if {"pattern", "minLength", "maxLength"} & set(rules):  # for a string: any other value passes
                    patterned = Node(STRING_VALUE, pattern=self.string_pattern(rules, where))
                    return Node(UNION, alternatives=tuple(patterned if alternative.kind == STRING_VALUE
                                                          else alternative for alternative in ANY.alternatives))
                return ANY
        if isinstance(kind, list):
            if not kind or len(set(map(str, kind))) != len(kind):
                raise SchemaError(f"{where}: type must be a type or a non-empty list of distinct types")
            return _union([self.typed(rules, k, where, depth) for k in kind])
        return self.typed(rules, kind, where, depth)

    def literals(self, rules: dict, where: str) -> Node:
        """enum and/or const: the values both allow, of the type(s) given, if any."""
        others = sorted(set(rules) - {"enum", "const", "type"})
        if others:
            raise SchemaError(f"{where}: enum or const beside {', '.join(others)} is not supported")
        values = rules.get("enum", [rules.get("const")])
        if not isinstance(values, list) or not 0 < len(values) <= MAX_ALTERNATIVES:
            raise SchemaError(f"{where}: enum must be a list of 1 to {MAX_ALTERNATIVES} values")
        try:
            texts = dict.fromkeys(map(_literal_text, values))
            if "const" in rules:
                texts = dict.fromkeys(t for t in texts if t == _literal_text(rules["const"]))
        except ValueError:
            raise SchemaError(f"{where}: enum and const values must be finite JSON") from None
        kinds = rules.get("type")
        if kinds is not None:
            kinds = kinds if isinstance(kinds, list) else [kinds]
            texts = dict.fromkeys(t for t in texts if _json_type(json.loads(t)) in kinds
                                  or "number" in kinds and _json_type(json.loads(t)) == "integer")
        if not texts:
            raise SchemaError(f"{where}: no value satisfies both the enum / const and the type")
        return Node(LITERALS, texts=frozenset(texts))

    def typed(self, rules: dict, kind: Any, where: str, depth: int) -> Node:
        if kind not in _TYPES:
            raise SchemaError(f"{where}: unknown type {_literal_text(kind)[:60]}: one of {', '.join(_TYPES)}")
        if kind == "object":
            return self.object(rules, where, depth)
        if kind == "array":
            return self.array(rules, where, depth)
        if kind in ("boolean", "null"):
            return Node(LITERALS, texts=frozenset(("true", "false") if kind == "boolean" else ("null",)))
        if kind == "string":
            return Node(STRING_VALUE, pattern=self.string_pattern(rules, where))
        return Node({"number": NUMBER, "integer": INTEGER}[kind])

    def string_pattern(self, rules: dict, where: str) -> Optional[Regex]:
        """A string's pattern, or its minLength / maxLength as one ([\\s\\S]{m,n}); None: any text.
        The pattern is matched whole (as vLLM's grammars match it), which also satisfies JSON
        Schema's search for it anywhere in the text."""
        pattern, low, high = rules.get("pattern"), rules.get("minLength"), rules.get("maxLength")
        for name, bound in (("minLength", low), ("maxLength", high)):
            if bound is not None and not (isinstance(bound, int) and not isinstance(bound, bool) and bound >= 0):
                raise SchemaError(f"{where}: {name} must be a non-negative integer")
            if bound is not None and bound > MAX_LENGTH_BOUND:
                raise SchemaError(f"{where}: {name} {bound} is past what is supported ({MAX_LENGTH_BOUND})")
        if pattern is not None and not isinstance(pattern, str):
            raise SchemaError(f"{where}: pattern must be a string (a regular expression)")
        if high is not None and (low or 0) > high:
            raise SchemaError(f"{where}: minLength ({low}) is more than maxLength ({high})")
        lengths = None if low is None and high is None else "[\\s\\S]{%d,%s}" % (low or 0, "" if high is None else high)
        try:
            if pattern is not None and lengths is not None:  # both: the texts that fit both
                return intersect(compile_regex(pattern), compile_regex(lengths))
            only = pattern if pattern is not None else lengths
            return None if only is None else compile_regex(only)
        except RegexError as exc:
            raise SchemaError(f"{where}: {exc}") from None

    def object(self, rules: dict, where: str, depth: int) -> Node:
        properties = rules.get("properties", {})
        required = rules.get("required", [])
        extra = rules.get("additionalProperties")
        if not isinstance(properties, dict) or not isinstance(required, list) \
                or not all(isinstance(r, str) for r in required):
            raise SchemaError(f"{where}: properties must be an object and required a list of names")
        missing = sorted(set(required) - set(properties))
        if missing:
            raise SchemaError(f"{where}: required names {', '.join(map(repr, missing))}, which properties does not list")
        if len(properties) > MAX_ALTERNATIVES:
            raise SchemaError(f"{where}: more than {MAX_ALTERNATIVES} properties")
        if not (extra is None or isinstance(extra, (bool, dict))):
            raise SchemaError(f"{where}: additionalProperties must be true, false or a schema")
        if properties:
            if extra is not None and extra is not False:
                raise SchemaError(f"{where}: additionalProperties beside properties is not supported "
                                  "(leave it out or set it false: only the listed properties are written)")
            names = list(properties)
            return Node(OBJECT, keys=tuple(map(_literal_text, names)), required=tuple(n in required for n in names),
                        values=tuple(self.node(properties[n], f"{where}/properties/{n}", depth + 1) for n in names))
        if extra is False:
            return Node(OBJECT)  # {} only
        return Node(OBJECT, extra=ANY if extra is None or extra is True else
                    self.node(extra, f"{where}/additionalProperties", depth + 1))

    def array(self, rules: dict, where: str, depth: int) -> Node:
        low, high = rules.get("minItems", 0), rules.get("maxItems")
        for bound in (low, high):
            if bound is not None and (isinstance(bound, bool) or not isinstance(bound, int) or bound < 0):
                raise SchemaError(f"{where}: minItems and maxItems must be non-negative integers")
        if high is not None and high < low:
            raise SchemaError(f"{where}: maxItems is below minItems: no array fits")
        items = rules.get("items", True)
        if isinstance(items, list):
            raise SchemaError(f"{where}: items as a list (tuples) is not supported")
        return Node(ARRAY, item=self.node(items, f"{where}/items", depth + 1), min_items=low, max_items=high)

    def ref(self, ref: Any, where: str, depth: int) -> Node:
        """A $ref within the document ("#", "#/$defs/name", any JSON pointer): its node, made
        once, so a recursive schema is a cycle in the graph."""
        if not isinstance(ref, str) or not ref.startswith("#"):
            raise SchemaError(f"{where}: only $refs within the schema (#/...) are supported, not {ref!r}")
        node = self.refs.get(ref)
        if node is None:
            target = self.document
            for part in filter(None, ref[1:].split("/")):
                part = part.replace("~1", "/").replace("~0", "~")
                if isinstance(target, dict) and part in target:
                    target = target[part]
                elif isinstance(target, list) and part.isascii() and part.isdigit() and int(part) < len(target):
                    target = target[int(part)]
                else:
                    raise SchemaError(f"{where}: $ref {ref!r} points at nothing in the schema")
            node = self.refs[ref] = Node(UNION)  # filled by compile(): a cycle back here finds it
            self.aliases.append((node, self.node(target, ref, depth + 1)))
        return node


def _first_characters(node: Node) -> set[str]:
    """The characters a value of `node` may begin with (none: no value fits it)."""
    if node.kind == UNION:
        return set(_by_first(node))
    return {text[:1] for text in node.texts} if node.kind == LITERALS else set(_FIRST[node.kind])


def _disjoint(a: Node, b: Node) -> bool:
    """Whether no value fits both (False where that is not plain): they begin differently,
    are literals with no value in common, or objects that both require a key whose literal
    values differ (a discriminator)."""
    if not _first_characters(a) & _first_characters(b):
        return True
    if a.kind == LITERALS and b.kind == LITERALS:
        values = [_comparable(json.loads(t)) for t in a.texts]
        return not any(_comparable(json.loads(t)) in values for t in b.texts)
    if a.kind == OBJECT and b.kind == OBJECT:
        for key, value, required in zip(a.keys, a.values, a.required):
            j = b.keys.index(key) if key in b.keys else -1
            if required and j >= 0 and b.required[j] and LITERALS == value.kind == b.values[j].kind \
                    and _disjoint(value, b.values[j]):
                return True
    return False


def _comparable(value: Any) -> Any:
    """A JSON value as Python compares it, but with true and false apart from 1 and 0."""
    if isinstance(value, bool):
        return ("boolean", value)
    if isinstance(value, list):
        return [_comparable(v) for v in value]
    if isinstance(value, dict):
        return {k: _comparable(v) for k, v in value.items()}
    return value


def _union(nodes: list[Node]) -> Node:
    flat: list[Node] = []
    for node in nodes:
        for alternative in (node.alternatives if node.kind == UNION and node.alternatives else (node,)):
            if alternative not in flat:
                flat.append(alternative)
    return flat[0] if len(flat) == 1 else Node(UNION, alternatives=tuple(flat))


@functools.lru_cache(maxsize=SCHEMA_CACHE_SIZE)
def _compiled(text: str) -> Node:
    return _Compiler(json.loads(text)).compile()


def compile_schema(schema: Any) -> Node:
    """A JSON schema (a dict, or its JSON text) as a Node; raises SchemaError for one this
    module cannot hold an output to."""
    try:
        document = json.loads(schema) if isinstance(schema, str) else schema
        text = json.dumps(document, allow_nan=False)  # key order kept: it is the properties' order
    except (TypeError, ValueError) as exc:
        raise SchemaError(f"the schema is not JSON: {exc}") from None
    except RecursionError:
        raise SchemaError(f"the schema nests deeper than {MAX_SCHEMA_DEPTH} levels") from None
    return _compiled(text)


# ---- the recognizer ----------------------------------------------------------------------

# Modes. A state is (mode, stack, aux, whitespace run); stack holds the open containers as
# (node, progress); aux is the mode's detail: the node of the value to come (VALUE, COLON), a
# string's kind (KEY_STRING, VALUE_STRING, or a pattern's (Regex, its state) for a value held
# to one), a key's text so far, a number's integer-ness, a literal's possible rests, a regex's
# (Regex, its state) (REGEX: the whole output held to a regex, vLLM's structured_outputs regex),
# or a reasoning model's preamble: (how much of the tag so far, the structure's start states)
# (OPENING: "<think>" may open the reply, whitespace before it; THINKING: free text until
# "</think>", after which the structure starts).
(VALUE, ARRAY_FIRST, OBJECT_FIRST, KEY, KEY_TEXT, COLON, AFTER_VALUE, DONE, STRING, ESCAPE, UNICODE,
 NUM_MINUS, NUM_ZERO, NUM_INT, FRAC_FIRST, FRAC, EXP_FIRST, EXP_SIGN, EXP, LITERAL, REGEX, OPENING,
 THINKING) = range(23)
THINK_START, THINK_END = "<think>", "</think>"
KEY_STRING, VALUE_STRING = 0, 1
State = tuple  # (mode, stack: tuple of (Node, int), aux, whitespace: int)
States = tuple  # the states alive at once (usually one)
FINISHED: State = (DONE, (), None, 0)

_WHITESPACE = frozenset(" \t\n\r")
_WS_MODES = frozenset({VALUE, ARRAY_FIRST, OBJECT_FIRST, KEY, COLON, AFTER_VALUE})
_ESCAPES = frozenset('"\\/bfnrt')
_UNESCAPED = {'"': '"', "\\": "\\", "/": "/", "b": "\b", "f": "\f", "n": "\n", "r": "\r", "t": "\t"}
_HEX = frozenset("0123456789abcdefABCDEF")
_DIGITS = frozenset("0123456789")
_NUMBER_ENDS = frozenset({NUM_ZERO, NUM_INT, FRAC, EXP})


def start(node: Node) -> States:
    """The states before a JSON value of `node`."""
    return ((VALUE, (), node, 0),)


def start_choice(choices: list[str]) -> States:
    """The states before one of `choices`, as plain text."""
    if len(choices) > MAX_ALTERNATIVES:
        raise SchemaError(f"more than {MAX_ALTERNATIVES} choices")
    return ((LITERAL, (), frozenset(choices), 0),)


START = start(ANY_OBJECT)  # JSON mode


def start_regex(pattern: str) -> States:
    """The states before an output that matches `pattern` whole."""
    try:
        return ((REGEX, (), (compile_regex(pattern), 0), 0),)
    except RegexError as exc:
        raise SchemaError(str(exc)) from None


def start_states(params) -> States:
    """The states before the output of a StructuredOutputsParams (its schema compiled, or
    found compiled: raises SchemaError for one this module cannot hold an output to); with
    its `thinking`, a reasoning model's <think> block free before it."""
    if params.json is not None:
        states = start(compile_schema(params.json))
    elif params.choice is not None:
        states = start_choice(params.choice)
    elif params.regex is not None:
        states = start_regex(params.regex)
    else:
        states = START
    if params.thinking == "inside":  # the prompt opened the block
        return ((THINKING, (), (0, states), 0),)
    if params.thinking == "may":  # the reply may open one, or begin with the structure
        return states + ((OPENING, (), (0, states), 0),)
    return states


def accepting(state: State) -> bool:
    """Whether the output may end here: the value is whole (a top-level number or a literal
    that another could still extend, as 1 or 12, may also end at EOS), or the text matches
    the regex."""
    mode, stack, aux, _ = state
    if mode == REGEX:
        return aux[0].accepting(aux[1])
    if mode >= OPENING:  # (the structure has not begun)
        return False
    return mode == DONE or not stack and (mode in _NUMBER_ENDS or mode == LITERAL and "" in aux)


def step(state: State, ch: str) -> States:
    """The states after one more character (none where the output cannot go on so)."""
    mode, stack, aux, ws = state
    if mode == STRING:
        if ch == '"':
            if aux == KEY_STRING:
                return ((COLON, stack, stack[-1][0].extra, 0),)
            return (_after_value(stack),) if type(aux) is int or aux[0].accepting(aux[1]) else ()
        if ch == "\\":  # (in a patterned string, where some character could follow)
            return ((ESCAPE, stack, aux, 0),) if type(aux) is int or _takes_any(aux, 0, 0xFFFF) else ()
        if ch < " ":
            return ()
        return (state,) if type(aux) is int else _pattern_step(stack, aux, ch)
    if mode == REGEX:
        after = aux[0].step(aux[1], ch)
        return () if after is None else ((REGEX, stack, (aux[0], after), 0),)
    if mode == THINKING:  # free text; "</think>" ends it, and the structure starts
        matched, structure = aux
        if ch == THINK_END[matched]:
            return structure if matched + 1 == len(THINK_END) else ((THINKING, (), (matched + 1, structure), 0),)
        return ((THINKING, (), (1 if ch == "<" else 0, structure), 0),)
    if mode == OPENING:
        matched, structure = aux
        if ch == THINK_START[matched]:
            if matched + 1 == len(THINK_START):
                return ((THINKING, (), (0, structure), 0),)
            return ((OPENING, (), (matched + 1, structure), ws),)
        return ((OPENING, (), aux, ws + 1),) if matched == 0 and ch in _WHITESPACE and ws < MAX_WHITESPACE else ()
    if ch in _WHITESPACE and mode in _WS_MODES:
        return ((mode, stack, aux, ws + 1),) if ws < MAX_WHITESPACE else ()
    if mode == VALUE:
        return _value(stack, aux, ch)
    if mode in (ARRAY_FIRST, AFTER_VALUE, OBJECT_FIRST, KEY, KEY_TEXT):
        return _in_container(mode, stack, aux, ch)
    if mode == COLON:
        return ((VALUE, stack, aux, 0),) if ch == ":" else ()
    if mode == ESCAPE:
        if ch == "u":
            if type(aux) is int:
                return ((UNICODE, stack, (aux, 4), 0),)
            return ((UNICODE, stack, (aux, 4, 0), 0),) if _takes_any(aux, 0, 0xFFFF) else ()
        if ch not in _ESCAPES:
            return ()
        return ((STRING, stack, aux, 0),) if type(aux) is int else _pattern_step(stack, aux, _UNESCAPED[ch])
    if mode == UNICODE:
        kind, left = aux[0], aux[1]
        if ch not in _HEX:
            return ()
        if type(kind) is int:
            return ((STRING, stack, kind, 0),) if left == 1 else ((UNICODE, stack, (kind, left - 1), 0),)
        code = aux[2] * 16 + int(ch, 16)  # a patterned string's: the character is read whole
        if left > 1:  # where some character of the codes this prefix leaves open could follow
            span = 16 ** (left - 1)
            return ((UNICODE, stack, (kind, left - 1, code), 0),) \
                if _takes_any(kind, code * span, code * span + span - 1) else ()
        return _pattern_step(stack, kind, chr(code)) if _takes_any(kind, code, code) else ()
    if mode == LITERAL:
        rests = _literal_rests(aux, ch)
        if rests:
            return (_literal(stack, rests),)
        # a whole literal that a longer one shares (1 and 12): the character follows the value
        return step(_after_value(stack), ch) if "" in aux else ()
    if mode == DONE:
        return ()
    return _number(mode, stack, aux, ch)


def _takes_any(aux: tuple, low: int, high: int) -> bool:
    """Whether a patterned string's regex takes some character of code point low to high that
    a JSON escape can write: not a surrogate, which is half of a character (its regex state
    would count it as one)."""
    regex, state = aux
    return (low < 0xD800 and regex.takes_any(state, low, min(high, 0xD7FF))
            or high > 0xDFFF and regex.takes_any(state, max(low, 0xE000), high))


def _pattern_step(stack: tuple, aux: tuple, ch: str) -> States:
    """A patterned string's states after one more character of its text (unescaped)."""
    regex, state = aux
    after = regex.step(state, ch)
    return () if after is None else ((STRING, stack, (regex, after), 0),)


def _value(stack: tuple, node: Node, ch: str) -> States:
    kind = node.kind
    if kind == UNION:
        if node.by_first is None:
            node.by_first = _by_first(node)
        alternatives = node.by_first.get(ch, ())
        if len(alternatives) == 1:  # the first character tells most unions apart
            return _value(stack, alternatives[0], ch)
        found: list[State] = []
        for alternative in alternatives:
            found += [s for s in _value(stack, alternative, ch) if s not in found]
        return tuple(found)
    if kind == OBJECT:
        return ((OBJECT_FIRST, stack + ((node, 0),), None, 0),) if ch == "{" else ()
    if kind == ARRAY:
        return ((ARRAY_FIRST, stack + ((node, 0),), None, 0),) if ch == "[" else ()
    if kind == STRING_VALUE:
        if ch != '"':
            return ()
        return ((STRING, stack, VALUE_STRING if node.pattern is None else (node.pattern, 0), 0),)
    if kind == LITERALS:
        rests = _literal_rests(node.texts, ch)
        return (_literal(stack, rests),) if rests else ()
    integer = kind == INTEGER
    if ch == "-":
        return ((NUM_MINUS, stack, integer, 0),)
    if ch in _DIGITS:
        return ((NUM_ZERO if ch == "0" else NUM_INT, stack, integer, 0),)
    return ()


_FIRST = {OBJECT: "{", ARRAY: "[", STRING_VALUE: '"', NUMBER: "-0123456789", INTEGER: "-0123456789"}


def _by_first(union: Node) -> dict[str, tuple[Node, ...]]:
    """A union's alternatives (unions among them flattened) by the first characters they take."""
    found: dict[str, list[Node]] = {}
    pending, seen = list(union.alternatives), {id(union)}
    while pending:
        node = pending.pop(0)
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.kind == UNION:
            pending += node.alternatives
            continue
        for ch in _first_characters(node):
            found.setdefault(ch, []).append(node)
    return {ch: tuple(nodes) for ch, nodes in found.items()}


def _in_container(mode: int, stack: tuple, aux: Any, ch: str) -> States:
    node, progress = stack[-1]
    if node.kind == ARRAY:
        if mode == ARRAY_FIRST and ch != "]":
            return _value(_counted(stack), node.item, ch) if node.max_items != 0 else ()
        if ch == "]":
            return (_after_value(stack[:-1]),) if progress >= node.min_items else ()
        if ch == ",":
            more = node.max_items is None or progress < node.max_items
            return ((VALUE, _counted(stack), node.item, 0),) if more else ()
        return ()
    if mode == KEY_TEXT:  # a listed key, its text so far in aux
        text = aux + ch
        for i in node.candidates(progress):
            if node.keys[i] == text:
                return ((COLON, stack[:-1] + ((node, i + 1),), node.values[i], 0),)
        if any(node.keys[i].startswith(text) for i in node.candidates(progress)):
            return ((KEY_TEXT, stack, text, 0),)
        return ()
    if ch == "}" and mode != KEY:
        return (_after_value(stack[:-1]),) if node.closable(progress) else ()
    if ch == '"' and mode != AFTER_VALUE:
        if node.extra is not None:
            return ((STRING, stack, KEY_STRING, 0),)
        return ((KEY_TEXT, stack, '"', 0),) if node.candidates(progress) else ()
    if ch == "," and mode == AFTER_VALUE:
        return ((KEY, stack, None, 0),) if node.extra is not None or node.candidates(progress) else ()
    return ()


def _counted(stack: tuple) -> tuple:
    """The stack with one more item in its top array (counted up to the array's cap)."""
    node, progress = stack[-1]
    return stack if progress == node.cap else stack[:-1] + ((node, progress + 1),)


def _after_value(stack: tuple) -> State:
    return (AFTER_VALUE, stack, None, 0) if stack else FINISHED


@functools.lru_cache(maxsize=4096)
def _literal_rests(texts: frozenset, ch: str) -> frozenset:
    """What may follow `ch` of the literals `texts` could go on with."""
    return frozenset(text[1:] for text in texts if text[:1] == ch)


def _literal(stack: tuple, rests: frozenset) -> State:
    return _after_value(stack) if rests == {""} else (LITERAL, stack, rests, 0)


def _number(mode: int, stack: tuple, integer: bool, ch: str) -> States:
    digit = ch in _DIGITS
    if mode == NUM_MINUS:
        return ((NUM_ZERO if ch == "0" else NUM_INT, stack, integer, 0),) if digit else ()
    if mode in (FRAC_FIRST, EXP_SIGN):
        return ((FRAC if mode == FRAC_FIRST else EXP, stack, integer, 0),) if digit else ()
    if mode == EXP_FIRST:
        if ch in "+-":
            return ((EXP_SIGN, stack, integer, 0),)
        return ((EXP, stack, integer, 0),) if digit else ()
    if digit and mode != NUM_ZERO:
        return ((mode, stack, integer, 0),)
    if ch == "." and mode in (NUM_ZERO, NUM_INT) and not integer:
        return ((FRAC_FIRST, stack, integer, 0),)
    if ch in "eE" and mode in (NUM_ZERO, NUM_INT, FRAC) and not integer:
        return ((EXP_FIRST, stack, integer, 0),)
    # the number ends here (at NUM_ZERO, NUM_INT, FRAC or EXP): the character follows a value
    return step(_after_value(stack), ch)


def advance(states: Optional[States], text: str) -> Optional[States]:
    """The states after `text`, or None where the text cannot follow."""
    for ch in text:
        if not states:
            return None
        if len(states) == 1:
            states = step(states[0], ch)
            if len(states) > MAX_STATES:
                states = states[:MAX_STATES]
        else:
            after: list[State] = []
            for state in states:
                after += [s for s in step(state, ch) if s not in after]
                if len(after) >= MAX_STATES:  # alike alternatives nested deep: keep the first
                    break
            states = tuple(after[:MAX_STATES])
    return states or None


def regexes(states: States) -> set[tuple[Regex, bool]]:
    """The regexes whose token tries the masks of these states, and of those after them, may
    walk: (regex, whether it reads a JSON string's text), for Vocabulary.prepare."""
    found: set[tuple[Regex, bool]] = set()
    for mode, _, aux, _ in states:
        if mode == REGEX:
            found.add((aux[0], False))
        elif mode in (OPENING, THINKING):
            found |= regexes(aux[1])
        elif mode == VALUE:
            found |= _patterns(aux)
    return found


@functools.lru_cache(maxsize=SCHEMA_CACHE_SIZE)
def _patterns(root: Node) -> frozenset[tuple[Regex, bool]]:
    """The patterns of the strings a value of `root` may hold, anywhere within it."""
    found, seen, pending = set(), set(), [root]
    while pending:
        node = pending.pop()
        if id(node) in seen:
            continue
        seen.add(id(node))
        if node.kind == STRING_VALUE and node.pattern is not None:
            found.add((node.pattern, True))
        pending += [n for n in (*node.values, node.extra, node.item, *node.alternatives) if n is not None]
    return frozenset(found)


def is_complete(states: Optional[States]) -> bool:
    return bool(states) and any(map(accepting, states))


# ---- the tokens --------------------------------------------------------------------------

class Vocabulary:
    """Each token's text and the masks of the tokens allowed from a state, for one tokenizer."""

    def __init__(self, tokenizer, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self.texts = token_texts(tokenizer, vocab_size)
        # Tokens that inside a string stay inside it (no quote, backslash or control character):
        # allowed there without a check. The others, and everything outside strings, are checked.
        plain, special = np.zeros(vocab_size, dtype=np.bool_), []
        # first character -> second character ("" for one-character tokens) -> token IDs
        self.by_prefix: dict[str, dict[str, list[int]]] = {}
        most_closers = 0
        for token_id, text in enumerate(self.texts):
            if not text:
                continue
            if '"' in text or "\\" in text or min(text) < " ":
                special.append(token_id)
            else:
                plain[token_id] = True
            self.by_prefix.setdefault(text[0], {}).setdefault(text[1:2], []).append(token_id)
            most_closers = max(most_closers, text.count("}") + text.count("]"))
        self.plain_in_string, self.special = plain, special
        self.stack_depth = most_closers + 1  # what of the stack a token can reach
        self.masks: OrderedDict[tuple, np.ndarray] = OrderedDict()
        self.nothing = np.zeros(vocab_size, dtype=np.bool_)
        self.tries: OrderedDict[tuple, _ClassTrie] = OrderedDict()
        self.trie_nodes = 0
        self.trie_lock = threading.Lock()  # prepare builds tries on the server's threads
        self.characters: Optional[set[str]] = None  # every character of the token texts
        # a regex reads whole characters: byte-level BPE's pieces of one (read as U+FFFD) are
        # never allowed there, where each would count as a character
        self.special_whole = [t for t in special if "\ufffd" not in self.texts[t]]
        self.without_lt: Optional[np.ndarray] = None  # tokens with no "<" (a think block's free text)
        self.with_lt: list[int] = []  # and those with one

    def allowed(self, states: States, eos_token_id: Optional[int], stop_token_ids: frozenset[int]) -> np.ndarray:
        """A [vocab_size] bool mask of the tokens allowed after the output so far (not to be
        written): those that some state accepts, and once the output may end, the request's
        EOS and stop token IDs. Where no token would be allowed (a schema's key with characters
        no token spells) the ends are, so that the request stops rather than go on astray."""
        masks = [self._mask(state) for state in states]
        mask = masks[0] if len(masks) == 1 else np.logical_or.reduce(masks)
        whole = is_complete(states)
        if whole or not mask.any():
            if not whole:
                logger.warning("structured output: no token can go on from the output so far (a character no "
                               "token spells?): ending the request")
            mask = mask.copy()
            ends = [*stop_token_ids, *(() if eos_token_id is None else (eos_token_id,))]
            mask[[t for t in ends if 0 <= t < self.vocab_size]] = True
        return mask

    def after(self, states: States, token_id: int) -> States:
        """The states after a sampled token. The EOS or a stop token that ends a whole output
        leaves them as they are; a token the mask did not allow (never, while masks apply)
        ends the output where it stands: the request stops rather than go on astray."""
        text = self.texts[token_id] if 0 <= token_id < self.vocab_size else None
        after = advance(states, text) if text is not None else None
        if after is not None:
            return after
        if not is_complete(states):
            logger.error("structured output: token %d (%r) cannot follow the output; stopping the request",
                         token_id, text)
        return (FINISHED,)

    def _mask(self, state: State) -> np.ndarray:
        mode, stack, aux, ws = state
        if mode == DONE:
            return self.nothing
        key = (mode, stack[-self.stack_depth:], len(stack) > self.stack_depth, aux, ws)
        mask = self.masks.get(key)
        if mask is None:
            mask = self._build(state)
            self.masks[key] = mask
            if len(self.masks) > MASK_CACHE_SIZE:
                self.masks.popitem(last=False)
        else:
            self.masks.move_to_end(key)
        return mask

    def _build(self, state: State) -> np.ndarray:
        mode, aux = state[0], state[2]
        if mode == THINKING and aux[0] == 0:  # free text: only a token with a "<" could end it
            if self.without_lt is None:
                self.without_lt = np.array([bool(text) and "<" not in text for text in self.texts])
                self.with_lt = [t for t, text in enumerate(self.texts) if "<" in text]
            mask = self.without_lt.copy()
            candidates = self.with_lt
        elif mode == REGEX or mode == STRING and type(aux) is not int:
            # a regex's text: its tokens walk the automaton through a trie of their character
            # classes (a string's plain tokens; those with quotes or escapes one by one, below)
            regex, at = aux
            mask = np.zeros(self.vocab_size, dtype=np.bool_)
            mask[self._trie(regex, plain=mode == STRING).walk(regex, at)] = True
            candidates = self.special_whole if mode == STRING else []
        elif mode == STRING:
            mask = self.plain_in_string.copy()
            candidates = self.special
        else:
            mask = np.zeros(self.vocab_size, dtype=np.bool_)
            candidates = []
            for first, by_second in self.by_prefix.items():
                after = step(state, first)
                if after:
                    candidates += [t for second, ids in by_second.items()
                                   if not second or any(step(s, second) for s in after) for t in ids]
        texts, states = self.texts, (state,)
        for token_id in candidates:
            mask[token_id] = advance(states, texts[token_id]) is not None
        return mask


    def prepare(self, wanted: set[tuple[Regex, bool]]) -> None:
        """Build the tries these regexes' masks will walk (structured_output.regexes), so that
        the engine thread finds them built: the server calls this on a thread of its own."""
        for regex, plain in wanted:
            self._trie(regex, plain)

    def _trie(self, regex: Regex, plain: bool) -> "_ClassTrie":
        """The tokens (plain: those that stay inside a string) as a trie of `regex`'s classes,
        shared by every regex of the same classes ([a-z]+ and [a-z]{3}, or any two lengths)."""
        key = (regex.bounds, plain)
        with self.trie_lock:
            trie = self.tries.get(key)
            if trie is not None:
                self.tries.move_to_end(key)
                return trie
        ids = np.flatnonzero(self.plain_in_string) if plain else range(self.vocab_size)
        ids = [t for t in ids if self.texts[t] and "\ufffd" not in self.texts[t]]
        if self.characters is None:
            self.characters = set("".join(self.texts))
        built = _ClassTrie(regex, self.texts, ids, self.characters)  # (outside the lock: the slow part)
        with self.trie_lock:
            trie = self.tries.setdefault(key, built)
            if trie is built:
                self.trie_nodes += len(trie.children)
                while len(self.tries) > 1 and (len(self.tries) > TRIE_CACHE_SIZE
                                               or self.trie_nodes > TRIE_CACHE_NODES):
                    self.trie_nodes -= len(self.tries.popitem(last=False)[1].children)
            return trie


class _ClassTrie:
    """Token texts as sequences of a regex's character classes, in a trie: tokens alike to the
    regex share a path, so a mask walks each distinct prefix once (49152 tokens of SmolLM2
    under [A-Za-z ,.]{1,200}: ~2k nodes) rather than every token a character at a time."""

    def __init__(self, regex: Regex, texts: list[str], token_ids, characters: set[str]) -> None:
        """characters: every character of the texts. Each text is spelled in classes at once
        (str.translate, one class a character) and alike texts grouped: each distinct
        spelling is added once."""
        self.children: list[dict[int, int]] = [{}]
        self.ends: dict[int, list[int]] = {}  # node -> the tokens whose text ends there
        table = {ord(ch): regex.class_of(ch) for ch in characters}
        spelled: dict[str, list[int]] = {}
        for token_id in token_ids:
            spelled.setdefault(texts[token_id].translate(table), []).append(int(token_id))
        children = self.children
        for classes, ids in spelled.items():
            node = 0
            for cls in map(ord, classes):
                child = children[node].get(cls)
                if child is None:
                    child = children[node][cls] = len(children)
                    children.append({})
                node = child
            self.ends[node] = ids

    def walk(self, regex: Regex, state: int) -> list[int]:
        """The tokens whose whole text the regex can read on from `state`."""
        found: list[int] = []
        children, ends, moves = self.children, self.ends, regex.moves
        pending = [(0, state)]
        while pending:
            node, at = pending.pop()
            after = moves(at)
            for cls, child in children[node].items():
                following = after.get(cls)
                if following is not None:
                    if child in ends:
                        found += ends[child]
                    if children[child]:
                        pending.append((child, following))
        return found


def token_texts(tokenizer, vocab_size: int) -> list[str]:
    """The text each token adds after others (a SentencePiece token's leading space too, as
    the text after a preceding "a" shows); "" (never allowed) for special tokens, IDs past the
    tokenizer, and SentencePiece's non-ASCII byte-fallback tokens (<0x80> and up): its decoder
    turns a run of bytes that is not whole UTF-8 into U+FFFD, ASCII bytes after them too, so a
    quote written as <0x22> after a lone <0xC3> would not be a quote. (Byte-level BPE decodes
    only the broken bytes so: its partial-character tokens stay, as U+FFFD, inside strings.)"""
    special = set(tokenizer.all_special_ids) | {
        token_id for token_id, added in tokenizer.added_tokens_decoder.items() if added.special}
    anchor = tokenizer.convert_tokens_to_ids(tokenizer.tokenize("a"))[-1:]
    base = tokenizer.decode(anchor)
    known = min(vocab_size, len(tokenizer))
    pairs = tokenizer.batch_decode([anchor + [token_id] for token_id in range(known)])
    texts = [text[len(base):] if text.startswith(base) else tokenizer.decode([token_id])
             for token_id, text in enumerate(pairs)]
    pieces = tokenizer.convert_ids_to_tokens(list(range(known)))
    for token_id, piece in enumerate(pieces):
        byte = _BYTE_PIECE.fullmatch(piece or "")
        if byte and int(byte.group(1), 16) >= 0x80:
            texts[token_id] = ""
    for token_id in special:
        if token_id < known:
            texts[token_id] = ""
    return texts + [""] * (vocab_size - known)


_BYTE_PIECE = re.compile(r"<0x([0-9A-Fa-f]{2})>")
