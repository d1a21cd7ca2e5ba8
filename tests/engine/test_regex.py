"""Regexes as character automata: the automaton against Python's re.fullmatch (re.ASCII, the
meanings engine/regex.py gives \\d \\w \\s) on every short string over small alphabets and on
mutations of realistic matches, its prefixes against brute force, and what it refuses."""

from __future__ import annotations

import itertools
import random
import re
from collections import deque
from typing import Optional

import pytest

from streamserve.engine import regex as rx
from streamserve.engine.regex import Regex, RegexError, compile_regex


def python_pattern(pattern: str) -> str:
    """The pattern as Python's re spells it: ECMA's named group (?<name>...) is (?P<name>...),
    and "." outside a class stops at ECMA's line terminators too, as engine/regex.py reads it."""
    out, escaped, in_class = [], False, False
    for i, ch in enumerate(re.sub(r"\(\?<(?![=!])", "(?P<", pattern)):
        if escaped:
            escaped = False
        elif ch == "\\":
            escaped = True
        elif ch == "[" and not in_class:
            in_class, start = True, len(out)
        elif ch == "]" and in_class and len(out) > start + 1 + (out[start + 1:start + 2] == ["^"]):
            in_class = False
        elif ch == "." and not in_class:
            ch = "[^\n\r\u2028\u2029]"
        out.append(ch)
    return "".join(out)


def walk(regex: Regex, text: str) -> Optional[int]:
    state = regex.start
    for ch in text:
        state = regex.step(state, ch)
        if state is None:
            return None
    return state


def matches(regex: Regex, text: str) -> bool:
    state = walk(regex, text)
    return state is not None and regex.accepting(state)


def completion(regex: Regex, state: int, alphabet: str) -> Optional[str]:
    """A shortest text over `alphabet` that takes `state` to acceptance (breadth first)."""
    seen, pending = {state: ""}, deque([state])
    while pending:
        current = pending.popleft()
        if regex.accepting(current):
            return seen[current]
        for ch in alphabet:
            after = regex.step(current, ch)
            if after is not None and after not in seen:
                seen[after] = seen[current] + ch
                pending.append(after)
    return None


# (pattern, alphabet): every string over the alphabet up to a length is checked. Each alphabet
# holds the pattern's characters and, mostly, one it does not take.
SMALL = [
    ("", "ab"), ("a", "ab"), ("abc", "abc"), ("a|b", "abc"), ("a|", "ab"), ("|a", "ab"), ("(|a)b", "ab"),
    ("a*", "ab"), ("a+", "ab"), ("a?", "ab"), ("a*?b", "ab"), ("a+?b??", "ab"), ("(ab)*", "ab"),
    ("(a|b)*abb", "ab"), ("(a*)*", "ab"), ("(a*|b)+", "abc"), ("(?:a|bc)+c?", "abc"), ("a{3}", "ab"),
    ("a{2,}", "ab"), ("a{1,3}b", "ab"), ("a{,2}", "ab"), ("a{0}b", "ab"), ("a{0,0}", "ab"), ("(ab){1,2}", "ab"),
    ("(a|b){2,3}", "abc"), ("(a?){3}", "ab"), ("(a?b?){2}c", "abc"), ("(a|ab)(c|bcd)", "abcd"),
    ("a{2}{", "a{"), ("a{", "a{"), ("a{}", "a{}"), ("a{1", "a{1"), ("x{,}", "x,"), ("a*{", "a{"),
    ("a{2,3}?b", "ab"), ("((a|b){0,2}c){1,2}", "abc"), ("(a|b)*a(a|b)", "ab"), ("((a|b)(c|d))*", "abcd"),
    ("(?:(?:a)|(?:b))*?c", "abc"), ("[abc]", "abcd"), ("[a-c]+", "abcd"), ("[^a-c]", "abd\n"),
    ("[]a]", "a]b"), ("[^]a]", "a]b"), ("[a-]", "a-b"), ("[-a]", "a-b"), ("[%-,-]", "%,-."), ("[\\-a]", "-ab"),
    ("[\\]]", "]a"), ("[\\\\]", "\\a"), ("[.]", ".a"), ("[\\d]x", "1x."), ("[\\da-b]+", "1ab-"),
    ("[^\\d]", "1a\n"), ("[\\s]", " \ta"), ("[\\b]", "\bb"), ("[a-cb-d]", "abde"), ("[^\\w\\s]", "a _-\n"),
    ("\\d+", "09a"), ("\\D", "0a"), ("\\w\\W", "a_ -"), ("\\s\\S", " \na"), (".", "a\n\r"), (".*", "a\n"),
    ("a.b", "ab\n"), ("\\.\\*\\+\\?", ".*+?a"), ("\\(\\)\\[", "()[a"), ("\\]\\{\\}", "]{}a"), ("\\/\\-", "/-a"),
    ("\\^\\$\\|", "^$|"), ("\\x41\\u0062", "Ab"), ("\\U0001F600", "\U0001F600a"), ("\\n\\t", "\n\t "),
    ("\\0", "\x00a"), ("\\012", "\n1"), ("[\\1-\\3]", "\x01\x02\x03\x04"),
    ("\\N{LATIN SMALL LETTER E WITH ACUTE}", "\u00e9e"), ("\u00e9+", "\u00e9a"), ("[^a]", "ab\n\U0001F600"),
    ("(?P<x>a)(?<y>b)", "ab"), ("^ab$", "ab"), ("^$", "a"), ("^", "a"), ("$", "a"), ("^(a|b)$", "abc"),
    ("a|b$", "ab"), ("^a|b", "ab"), ("[^\\s\\S]|a", "ab"), ("a[^\\s\\S]|b", "ab"), ("()", "a"), ("(a|)+", "ab"),
    ("[a-c]{2,3}-?\\d", "ab-1"), ("(ab|a)(bc|c)?", "abc"), ("a(b|c*)*d", "abcd"),
]


def check_exhaustively(pattern: str, alphabet: str, budget: int = 2000) -> None:
    """Every string over `alphabet` up to the length `budget` allows: accepted exactly when
    re.fullmatch matches; step gives None exactly where no string with that prefix matches (a
    string that does is looked for up to that length; one that step lets through is found by
    the automaton and checked with re.fullmatch)."""
    regex, expected = compile_regex(pattern), re.compile(python_pattern(pattern), re.ASCII)
    depth, total = 0, 1
    while depth < 10 and total + len(alphabet) ** (depth + 1) <= budget:
        depth += 1
        total += len(alphabet) ** depth
    witnesses: dict[int, Optional[str]] = {}

    def visit(text: str, state: Optional[int]) -> bool:
        """Whether some string with prefix `text` (within the depth) matches."""
        matched = expected.fullmatch(text) is not None
        if state is None:
            assert not matched, (pattern, text)
        else:
            assert regex.live(state) and regex.accepting(state) == matched, (pattern, text)
            if state not in witnesses:
                witnesses[state] = completion(regex, state, alphabet)
            assert witnesses[state] is not None, (pattern, text)
            assert expected.fullmatch(text + witnesses[state]), (pattern, text, witnesses[state])
        any_match = matched
        if len(text) < depth:
            for ch in alphabet:
                after = regex.step(state, ch) if state is not None else None
                any_match |= visit(text + ch, after)
        return any_match

    visit("", regex.start)


@pytest.mark.parametrize("pattern,alphabet", SMALL)
def test_the_automaton_matches_exactly_what_re_fullmatch_matches(pattern, alphabet):
    check_exhaustively(pattern, alphabet)


# realistic patterns, with strings they match
REALISTIC = {
    r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}": ["jane.doe+news@example.co.uk", "a@b.cd", "x_1%@mail-1.org"],
    r"\d{4}-\d{2}-\d{2}": ["2024-01-31", "1999-12-05", "0000-00-00"],
    r"\+?1?[ .-]?\(?\d{3}\)?[ .-]?\d{3}[ .-]?\d{4}": [
        "+1 (555) 123-4567", "555.123.4567", "5551234567", "1-555-123-4567"],
    r"(yes|no|maybe)": ["yes", "no", "maybe"],
    r"((25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)\.){3}(25[0-5]|2[0-4]\d|1\d\d|[1-9]?\d)": [
        "192.168.0.1", "255.255.255.0", "8.8.8.8"],
    r"([01]\d|2[0-3]):[0-5]\d(:[0-5]\d)?": ["23:59", "00:00:00", "12:30:45"],
    r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}": ["123e4567-e89b-12d3-a456-426614174000"],
    r"-?(0|[1-9]\d*)(\.\d+)?([eE][+-]?\d+)?": ["0", "-12.5e+3", "3.14159", "10E7"],
    r"https?://[a-z0-9.-]+(/[\w.-]*)*": ["https://example.com/a/b.html", "http://x.y/", "http://a-b.c/d_e/f"],
    r"^[A-Z]{3}-\d{3,5}$": ["ABC-123", "XYZ-98765"],
    r"[A-Z][a-z ,']{0,40}[.!?]": ["Hello, world.", "It's fine!", "Why?"],
    r"(?P<key>[a-z_]+)=(?<value>\w*)(;(?P<more>[a-z_]+)=\w*)*": ["a=1", "max_len=200;seed=7;x="],
}


@pytest.mark.parametrize("pattern", list(REALISTIC))
def test_realistic_patterns_match_as_re_fullmatch_does(pattern):
    """Their examples and every prefix of them go through; random edits of them, and random
    walks through the automaton, match exactly when re.fullmatch says so."""
    regex, expected = compile_regex(pattern), re.compile(python_pattern(pattern), re.ASCII)
    alphabet = sorted(set("".join(REALISTIC[pattern])) | set("aZ09 .-_@/:;=\n\u00e9"))
    rng = random.Random(pattern)
    for example in REALISTIC[pattern]:
        assert expected.fullmatch(example)
        state = regex.start
        for i, ch in enumerate(example):
            state = regex.step(state, ch)
            assert state is not None and regex.live(state), (example, i)
        assert regex.accepting(state)
        for _ in range(150):
            text = list(example)
            for _ in range(rng.randrange(1, 4)):
                at = rng.randrange(len(text) + 1)
                edit = rng.randrange(3)
                if edit == 0:
                    text.insert(at, rng.choice(alphabet))
                elif text and at < len(text):
                    text[at:at + 1] = [] if edit == 1 else [rng.choice(alphabet)]
            mutated = "".join(text)
            assert matches(regex, mutated) == bool(expected.fullmatch(mutated)), mutated
    for _ in range(100):
        state, text = regex.start, ""
        while not (regex.accepting(state) and rng.random() < 0.2):
            choices = [ch for ch in alphabet if regex.step(state, ch) is not None]
            if not choices:
                break
            text += rng.choice(choices)
            state = regex.step(state, text[-1])
        assert regex.accepting(state) and expected.fullmatch(text), text


def test_realistic_prefixes_are_live_and_wrong_characters_are_refused():
    date = compile_regex(r"\d{4}-\d{2}-\d{2}")
    assert walk(date, "2024-0") is not None and not date.accepting(walk(date, "2024-0"))
    assert walk(date, "2024-1x") is None and walk(date, "20245") is None
    assert walk(date, "2024-01-31") is not None and walk(date, "2024-01-311") is None
    choice = compile_regex("(yes|no|maybe)")
    assert not choice.accepting(walk(choice, "may")) and choice.accepting(walk(choice, "maybe"))
    assert walk(choice, "yess") is None and walk(choice, "n") is not None and walk(choice, "x") is None
    email = compile_regex(r"[a-zA-Z0-9._%+-]+@[a-zA-Z0-9.-]+\.[a-zA-Z]{2,}")
    assert not email.accepting(walk(email, "a@b.c")) and email.accepting(walk(email, "a@b.cd"))
    assert walk(email, "a@@") is None and walk(email, "@") is None and walk(email, "a b") is None


def test_character_classes_read_as_ecma_and_python_both_read_them():
    """\\d and \\w are ASCII (ECMA's, a part of re's Unicode ones); \\s is the whitespace both
    ECMA and re's Unicode \\s count, and the characters only one counts (\\x1c-\\x1f, \\x85,
    \\ufeff) are in neither \\s nor \\S; "." stops at every ECMA line terminator."""
    disputed = "\x1c\x1d\x1e\x1f\x85\ufeff"
    for escape in ("d", "D", "w", "W", "s", "S"):
        for pattern in (f"\\{escape}", f"[\\{escape}]", f"[^\\{escape}]"):
            regex, expected = compile_regex(pattern), re.compile(pattern, re.ASCII)
            ascii_chars = [chr(c) for c in range(128) if chr(c) not in disputed]
            assert [matches(regex, ch) for ch in ascii_chars] == [bool(expected.fullmatch(ch)) for ch in ascii_chars]
            if escape in "sS":
                assert not any(matches(regex, ch) for ch in disputed), pattern
    assert not matches(compile_regex(r"\d"), "\u0663")  # ARABIC-INDIC DIGIT THREE: re's Unicode \d takes it
    assert not matches(compile_regex(r"\w"), "\u00e9") and matches(compile_regex(r"\W"), "\u00e9")
    for space in "\u00a0\u3000\u2028":  # (NBSP: both read it as \\s)
        assert matches(compile_regex(r"\s"), space) and not matches(compile_regex(r"\S"), space)
        assert not matches(compile_regex(r"[^\s]"), space) and re.fullmatch(r"\s", space)
    dot = compile_regex(".")
    assert all(matches(dot, ch) for ch in "a\x00\u4f60\U0001F600\uffff")
    assert not any(matches(dot, ch) for ch in "\n\r\u2028\u2029")
    assert matches(compile_regex("[^a]"), "\n") and matches(compile_regex("[^a]"), "\U0010FFFF")


def test_states_are_small_ints_and_live():
    regex = compile_regex("(a|b)*c")
    states = {walk(regex, text) for text in ("", "a", "ab", "abba", "c")}
    assert all(isinstance(state, int) for state in states) and regex.start == 0
    assert all(regex.live(state) for state in range(regex.num_states))
    assert not regex.live(-1) and not regex.live(regex.num_states)
    assert regex.step(walk(regex, "abc"), "a") is None  # nothing follows the whole match


# (pattern, what the message names, position)
REFUSED = [
    ("a(?=b)", "lookahead", 1), ("a(?!b)", "lookahead", 1), ("(?<=a)b", "lookbehind", 0),
    ("(?<!a)b", "lookbehind", 0), (r"(a)\1", "backreferences", 3), ("(?P<x>a)(?P=x)", "backreferences", 8),
    (r"(?<x>a)\k<x>", "backreferences", 7), (r"a\b", "word boundaries", 1), (r"\Ba", r"\B", 0),
    (r"\Aa", "anchors", 0), (r"a\Z", "anchors", 1), ("(?i)a", "inline flags", 0), ("(?i:a)", "inline flags", 0),
    ("a(?-i:b)", "inline flags", 1), ("(?>a)", "atomic groups", 0), ("a*+", "possessive", 2),
    ("a{2}+", "possessive", 4), ("a^b", "^", 1), ("(^a)", "^", 1), ("a$b", "$", 1), ("(a$)", "$", 2),
    (r"\p{L}", "property", 0), ("(?#note)a", "comments", 0), ("(a)(?(1)b|c)", "conditional", 3),
]


@pytest.mark.parametrize("pattern,construct,position", REFUSED)
def test_unsupported_constructs_are_refused_by_name_and_position(pattern, construct, position):
    with pytest.raises(RegexError) as raised:
        compile_regex(pattern)
    assert construct in str(raised.value) and raised.value.position == position
    assert str(raised.value).endswith(f"at position {position}")


# patterns re refuses too: (pattern, what the message says)
INVALID = [
    ("(a", "missing ), unterminated subpattern"), ("a)", "unbalanced parenthesis"), ("(a))", "unbalanced"),
    ("a{3,2}", "min repeat greater than max repeat"), ("*a", "nothing to repeat"), ("a|+", "nothing to repeat"),
    ("(?:?)", "nothing to repeat"), ("{2}", "nothing to repeat"), ("^*", "nothing to repeat"),
    ("a**", "multiple repeat"), ("a{2}{3}", "multiple repeat"), ("a*?+", "multiple repeat"),
    ("[a", "unterminated character set"), ("[]", "unterminated character set"), ("[z-a]", "bad character range"),
    (r"[\d-z]", "bad character range"), ("\\", "bad escape"), (r"\q", r"bad escape \q"), (r"\xZZ", "incomplete escape"),
    (r"\u12", "incomplete escape"), (r"\U00110000", "bad escape"), (r"\N{NO SUCH NAME}", "undefined character name"),
    (r"\N{LATIN CAPITAL LETTER A WITH MACRON AND GRAVE}", "undefined character name"),  # a named sequence
    ("(?P<1>a)", "bad character in group name"), ("(?P<x>a)(?P<x>b)", "redefinition of group name"),
    ("(?P<x", "missing >"), ("(?", "unknown extension"), ("(?Pa)", "unknown extension"), (r"\400", "backreferences"),
    (r"[\400]", "octal escape value"),
]


@pytest.mark.parametrize("pattern,message", INVALID)
def test_invalid_patterns_are_refused(pattern, message):
    with pytest.raises(re.error):
        re.compile(pattern)
    with pytest.raises(RegexError, match=re.escape(message)):
        compile_regex(pattern)


def test_groups_nest_up_to_the_limit():
    deepest = "(" * rx.MAX_NESTING + "a|b" + ")*" * rx.MAX_NESTING
    assert matches(compile_regex(deepest), "abba") and matches(compile_regex(deepest), "")
    with pytest.raises(RegexError, match="nested more than 100 deep") as raised:
        compile_regex("(" * (rx.MAX_NESTING + 1) + "a" + ")" * (rx.MAX_NESTING + 1))
    assert raised.value.position == rx.MAX_NESTING


def test_a_pattern_that_matches_nothing_is_refused_and_dead_branches_are_pruned():
    for pattern in (r"[^\s\S]", r"a[^\s\S]", r"(a[^\s\S])+"):
        with pytest.raises(RegexError, match="matches no string"):
            compile_regex(pattern)
    regex = compile_regex(r"a[^\s\S]b|ac")
    assert walk(regex, "a") is not None and walk(regex, "ab") is None and matches(regex, "ac")


def test_size_caps_refuse_patterns_too_big_up_front():
    cases = [
        ("a{10001}", "10000 automaton states", 1),
        ("(?:a{100}){101}", "10000 automaton states", 10),
        ("x" * 10_001, "10000 automaton states", 10_000),
        ("(a|b)*a(a|b){15}", "20000 deterministic automaton states", None),  # 2^16 subsets
        ("(a?){5000}", "too complex", None),  # 5000 subsets of up to 5000 NFA states
        ("a" * (rx.MAX_PATTERN_LENGTH + 1), "longer than", None),
    ]
    for pattern, message, position in cases:
        with pytest.raises(RegexError, match=re.escape(message)) as raised:
            compile_regex(pattern)
        assert raised.value.position == position, pattern
    assert compile_regex("a{9999}").num_states == 10_000  # just under the NFA cap
    assert compile_regex("(a|b)*a(a|b){10}").num_states == 2 ** 11
    assert matches(compile_regex("(?:){100000000}a"), "a")  # what matches only "" is not expanded


def test_the_dfa_cap_counts_every_state_a_pattern_needs(monkeypatch):
    """Determinised up front: a pattern is refused for the states any text could reach."""
    monkeypatch.setattr(rx, "MAX_DFA_STATES", 16)
    build = compile_regex.__wrapped__  # past the cache, so the patched cap applies
    assert build("(a|b)*a(a|b){3}").num_states == 16
    with pytest.raises(RegexError, match="more than 16 deterministic"):
        build("(a|b)*a(a|b){4}")


def test_compiled_patterns_are_cached_by_text():
    assert compile_regex(r"\d+(\.\d+)?") is compile_regex(r"\d+(\.\d+)?")
    assert compile_regex("a+") is not compile_regex("a*")
    assert compile_regex.cache_info().maxsize == rx.REGEX_CACHE_SIZE == 64


@pytest.mark.parametrize("pattern, other", [
    ("[a-z]+", r"[\s\S]{2,4}"), ("(ab|a)*c?", r"[\s\S]{0,3}"), (r"\d+(\.\d+)?", "[0-9.]{3}"),
    ("(a|b)*a", "(a|b)*b(a|b)*"), ("x*", r"[\s\S]{1,}"),
])
def test_an_intersection_matches_what_both_match(pattern, other):
    from streamserve.engine.regex import intersect

    both = intersect(compile_regex(pattern), compile_regex(other))
    alphabet = "ab1.xc Z"
    texts = [""] + ["".join(t) for n in range(1, 6) for t in itertools.product(alphabet, repeat=n)][:20000]
    for text in texts:
        expected = re.fullmatch(pattern, text) is not None and re.fullmatch(other, text) is not None
        assert matches(both, text) == expected, (pattern, other, text)
    for state in range(both.num_states):  # every state can still reach a match (dead pairs pruned)
        seen, pending = {state}, [state]
        while pending and not any(both.accepting(s) for s in pending):
            pending = [t for s in pending for t in both.moves(s).values() if t not in seen]
            seen.update(pending)
        assert pending, (pattern, other, state)
    with pytest.raises(RegexError, match="no text matches both"):
        intersect(compile_regex("a{3}"), compile_regex(r"[\s\S]{0,2}"))
