r"""Regular expressions as character automata: what holds an output to a regex in full (vLLM's
structured_outputs={"regex": ...}, its guided_regex).

compile_regex(pattern) gives a Regex: a deterministic automaton over characters whose states
are small ints. structured_output drives it as it drives its JSON recognizer, a character at a
time: step(state, ch) is the state after one more character (None where no text that goes on
so can match), accepting(state) whether the text so far matches the whole regex. Every state
step returns is live (some continuation reaches acceptance), so an output held to the regex
can always be finished. The automaton accepts the strings s that match the whole pattern as
ECMA-262 (JSON Schema's patterns) and Python's re both read it: re.fullmatch(pattern, s,
re.ASCII) but for ".", \s and \S, below. Every regex is anchored at both ends.

How a pattern becomes the automaton:
  1. A recursive-descent parser reads the pattern into a syntax tree of four nodes: Chars (a
     set of characters, as sorted code-point ranges), Concat, Alt and Repeat. Counted
     repetitions are kept as counts here; each node knows how many automaton states it will
     take once they are expanded, so a pattern too big is refused before anything is built.
  2. The tree becomes a Thompson NFA, counted repetitions expanded: x{2,4} is x x (x (x)?)?,
     nested so that after k copies only the next copy's first states are current (x?x?x?
     would keep every later copy current at once). States from which no accepting state can
     be reached (behind an empty class such as [^\s\S]) are pruned.
  3. The NFA is determinised up front, by subset construction over character classes: the
     code points split into the intervals that no character set of the NFA tells apart, and
     a DFA state moves on classes, not characters. A DFA state is a frozenset of NFA states
     while it is built; only the transition table is kept.

Why up front rather than lazily per (state, character) as texts reach them: a server masks
the whole vocabulary from each state an output reaches, which walks every token's text from
it, so a lazy automaton of a pathological pattern ((a|b)*a(a|b){30}: 2^31 subsets) would grow
by a vocabulary's worth of subsets per step, each one a set of NFA states, with no bound. Built
up front, it is either small (MAX_DFA_STATES, within MAX_WORK) or refused at compile time with
a RegexError that says so, and the ids it hands out stay valid for as long as it lives. The
patterns structured output sees (dates, e-mail addresses, phone numbers, enumerations,
identifiers) take tens to a few thousand states and compile in milliseconds; compile_regex
caches by pattern text, so requests alike share one automaton.

The step per character is two dict lookups: the character's class (cached per character), then
the state's transition on that class.

The syntax is the common subset of Python's re and ECMA-262 (JSON Schema's "pattern"), read as
Python's re reads it where they differ ([]a] is a class of "]" and "a"; a "{" that begins no
valid {m,n} is a literal; {,n} is {0,n}):
  - literals; "." (any character but the line terminators \n \r \u2028 \u2029: ECMA's, of
    which re's is \n alone); classes [abc] [a-z] [^...]
    with escapes and \d-style classes inside them; groups ( ), (?: ), (?P<name> ),
    (?<name> ); alternation | (empty alternatives too); quantifiers * + ? {m} {m,} {m,n} {,n}
    and their lazy forms *? +? ?? {m,n}? (the same language);
  - escapes \d \D \w \W with ECMA's ASCII meanings ([0-9], [A-Za-z0-9_]), \s the whitespace
    both ECMA and re's Unicode \s count (NBSP and the other Unicode spaces too), \S the
    characters neither counts (the few only one counts are in neither \s nor \S),
    \n \t \r \f \v \a, \0 and octal \0oo (and \ooo inside a class), \xHH, \uHHHH,
    \UHHHHHHHH, \N{name}, \b inside a class (backspace), and any escaped character that is
    not an ASCII letter or digit (\. \* \\ \/ \- ...);
  - ^ as the pattern's first character and $ as its last: accepted and ignored (the whole
    output must match anyway).
Refused with a RegexError that names the construct and its position: ^ and $ elsewhere,
backreferences ((?P=name), \k<name>, and \1 to \9 outside a class, where re reads \ooo as
octal or a backreference), lookahead and lookbehind, \b and \B, \A and \Z, inline flags ((?i),
(?i:...)), atomic groups, possessive quantifiers (*+), conditionals, comments, \p{...}
property escapes; so is an invalid pattern (unbalanced parentheses, {3,2}, nothing to
repeat, a bad escape or range), one that matches no string, and one past the limits below.
Where a pattern's parts overlap so that its DFA has more than MAX_DFA_STATES states, it is
refused though few texts would reach them all: .{0,30}foo.{0,30} must track every "foo" seen.
"""

from __future__ import annotations

import bisect
import functools
import re
import unicodedata
from typing import NamedTuple, Optional, Union

MAX_NFA_STATES = 10_000  # after expanding counted repetitions; bigger patterns are refused
MAX_DFA_STATES = 20_000  # states of the determinised automaton; more are refused
MAX_WORK = 1_000_000  # NFA states and classes visited while determinising (~0.5 s); more is refused
MAX_PATTERN_LENGTH = 100_000  # characters; longer patterns are refused
MAX_NESTING = 100  # groups nested deeper are refused (the parser and the NFA builder recurse per group)
REGEX_CACHE_SIZE = 64  # compiled patterns kept (by their text)
CLASS_CACHE_SIZE = 1 << 16  # characters whose class a Regex remembers (a vocabulary's are far fewer)

MAX_CODE_POINT = 0x10FFFF

Ranges = tuple[tuple[int, int], ...]  # inclusive code-point ranges, sorted, disjoint and not adjacent


class RegexError(ValueError):
    """A pattern that is invalid, uses a construct not supported, or is too big to hold an
    output to. `position` is the offset in the pattern of what is wrong (None: the whole)."""

    def __init__(self, message: str, position: Optional[int] = None) -> None:
        super().__init__(message if position is None else f"{message} at position {position}")
        self.position = position


# ---- character sets ----------------------------------------------------------------------

def _normalize(ranges: list[tuple[int, int]]) -> Ranges:
    """Sorted, with overlapping and adjacent ranges merged."""
    merged: list[list[int]] = []
    for lo, hi in sorted(ranges):
        if merged and lo <= merged[-1][1] + 1:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return tuple((lo, hi) for lo, hi in merged)


def _complement(ranges: Ranges) -> Ranges:
    gaps, next_lo = [], 0
    for lo, hi in ranges:
        if lo > next_lo:
            gaps.append((next_lo, lo - 1))
        next_lo = hi + 1
    if next_lo <= MAX_CODE_POINT:
        gaps.append((next_lo, MAX_CODE_POINT))
    return tuple(gaps)


_DIGIT = ((0x30, 0x39),)
_WORD = ((0x30, 0x39), (0x41, 0x5A), (0x5F, 0x5F), (0x61, 0x7A))
# \s: the whitespace both ECMA-262 (JSON Schema's patterns) and Python's re (unicode) count as
# such; the characters only one of them counts (\x1c-\x1f and \x85, Python's; \ufeff, ECMA's)
# are in neither \s nor \S, nor in a negated class that names either, so that an output
# matches under both readings.
_SPACE = ((0x09, 0x0D), (0x20, 0x20), (0xA0, 0xA0), (0x1680, 0x1680), (0x2000, 0x200A), (0x2028, 0x2029),
          (0x202F, 0x202F), (0x205F, 0x205F), (0x3000, 0x3000))
_SPACE_DISPUTED = ((0x1C, 0x1F), (0x85, 0x85), (0xFEFF, 0xFEFF))
_CLASS_ESCAPES = {"d": _DIGIT, "D": _complement(_DIGIT), "w": _WORD, "W": _complement(_WORD),
                  "s": _SPACE, "S": _complement(_normalize(list(_SPACE + _SPACE_DISPUTED)))}
_CHAR_ESCAPES = {"n": 0x0A, "t": 0x09, "r": 0x0D, "f": 0x0C, "v": 0x0B, "a": 0x07}
# "." as both read it: anything but ECMA's line terminators (Python's is "\n" alone)
_DOT = _complement(((0x0A, 0x0A), (0x0D, 0x0D), (0x2028, 0x2029)))
_REFUSED_ESCAPES = {"b": "word boundaries (\\b) are", "B": "\\B (not a word boundary) is", "A": "anchors (\\A) are",
                    "Z": "anchors (\\Z) are", "k": "backreferences (\\k<name>) are",
                    "p": "Unicode property escapes (\\p{...}) are", "P": "Unicode property escapes (\\P{...}) are"}
_OCTAL = "01234567"
_HEX = frozenset("0123456789abcdefABCDEF")


# ---- the syntax tree ---------------------------------------------------------------------
# Each node carries `size`: the NFA states it expands to (see _NFA.build), checked against
# MAX_NFA_STATES as the tree is parsed. A node of size 0 matches only the empty string.

class Chars(NamedTuple):
    ranges: Ranges  # () matches no character
    size: int = 1


class Concat(NamedTuple):
    items: tuple[Node, ...]
    size: int


class Alt(NamedTuple):
    items: tuple[Node, ...]
    size: int


class Repeat(NamedTuple):
    item: Node
    least: int
    most: Optional[int]  # None: no bound
    size: int


Node = Union[Chars, Concat, Alt, Repeat]
EMPTY = Concat((), 0)

# {m}, {m,}, {m,n} and {,n} ({,} too, as re reads it); "{}" and anything else is a literal "{"
_COUNTED = re.compile(r"\{(\d*)(,(\d*))?\}")


def _too_big(position: Optional[int]) -> RegexError:
    return RegexError(f"the regex needs more than {MAX_NFA_STATES} automaton states once its counted "
                      "repetitions ({m,n}) are expanded", position)


class _Parser:
    """Recursive descent over the pattern; `pos` is the offset of the next character."""

    def __init__(self, pattern: str) -> None:
        self.pattern = pattern
        self.pos = 0
        self.depth = 0  # groups open
        self.names: set[str] = set()

    def error(self, message: str, position: Optional[int] = None) -> RegexError:
        return RegexError(message, self.pos if position is None else position)

    def peek(self, ahead: int = 0) -> str:
        """The character `ahead` past the next one, or "" past the end."""
        return self.pattern[self.pos + ahead:self.pos + ahead + 1]

    def parse(self) -> Node:
        if len(self.pattern) > MAX_PATTERN_LENGTH:
            raise RegexError(f"the regex is longer than {MAX_PATTERN_LENGTH} characters")
        if self.peek() == "^":  # at the very start: the output's start anyway
            self.pos = 1
        node = self.alternation()
        if self.pos < len(self.pattern):  # only a ")" ends an alternation early
            raise self.error("unbalanced parenthesis")
        return node

    def alternation(self) -> Node:
        items = [self.sequence()]
        while self.peek() == "|":
            self.pos += 1
            items.append(self.sequence())
        if len(items) == 1:
            return items[0]
        if not any(item.size for item in items):
            return EMPTY
        size = 1 + sum(item.size for item in items)
        if size > MAX_NFA_STATES:
            raise _too_big(self.pos)
        return Alt(tuple(items), size)

    def sequence(self) -> Node:
        items: list[Node] = []
        size = 0
        while self.peek() not in ("", "|", ")"):
            start = self.pos
            node = self.quantified(self.atom())
            size += node.size
            if size > MAX_NFA_STATES:
                raise _too_big(start)
            if node.size:  # what matches only "" adds nothing to a sequence
                items.append(node)
        return items[0] if len(items) == 1 else Concat(tuple(items), size)

    # -- quantifiers --

    def counted(self) -> Optional[re.Match]:
        """The {m,n} quantifier at pos, if one is (else a "{" there is a literal)."""
        found = _COUNTED.match(self.pattern, self.pos)
        return found if found and (found.group(1) or found.group(2)) else None

    def quantifier(self) -> Optional[tuple[int, Optional[int]]]:
        """The bounds of the quantifier at pos (consumed), or None where there is none."""
        ch = self.peek()
        if ch in ("*", "+", "?"):
            self.pos += 1
            return {"*": (0, None), "+": (1, None), "?": (0, 1)}[ch]
        found = self.counted() if ch == "{" else None
        if found is None:
            return None
        lo, comma, hi = found.groups()
        if len(lo) > 9 or len(hi or "") > 9:
            raise self.error("repetition count too large")
        least = int(lo) if lo else 0
        most = (int(hi) if hi else None) if comma else least
        if most is not None and most < least:
            raise self.error("min repeat greater than max repeat")
        self.pos = found.end()
        return least, most

    def quantified(self, node: Node) -> Node:
        at = self.pos
        bounds = self.quantifier()
        if bounds is None:
            return node
        if self.peek() == "?":  # lazy: the same language
            self.pos += 1
        elif self.peek() == "+":
            raise self.error("possessive quantifiers (*+, ++, ?+, {m,n}+) are not supported")
        if self.peek() in ("*", "+", "?") or self.peek() == "{" and self.counted():
            raise self.error("multiple repeat")
        least, most = bounds
        if node.size == 0 or most == 0:
            return EMPTY
        if most is None:
            size = node.size * (least + 1) + 1  # least copies, then a loop state and one more
        else:
            size = node.size * most + (most - least)  # a branching state per optional copy
        if size > MAX_NFA_STATES:
            raise _too_big(at)
        return Repeat(node, least, most, size)

    # -- atoms --

    def atom(self) -> Node:
        ch = self.peek()
        if ch == "(":
            return self.group()
        if ch == "[":
            return self.char_class()
        if ch == "\\":
            found = self.escape(in_class=False)
            return Chars(found if isinstance(found, tuple) else ((found, found),))
        if ch in "*+?" or ch == "{" and self.counted():
            raise self.error("nothing to repeat")
        if ch == "^":
            raise self.error("^ (an anchor) is supported only as the first character of the regex")
        if ch == "$":
            if self.pos == len(self.pattern) - 1:  # at the very end: the output's end anyway
                self.pos += 1
                return EMPTY
            raise self.error("$ (an anchor) is supported only as the last character of the regex")
        self.pos += 1
        if ch == ".":
            return Chars(_DOT)
        return Chars(((ord(ch), ord(ch)),))

    def group(self) -> Node:
        start = self.pos
        self.pos += 1
        if self.peek() == "?":
            self.pos += 1
            self.extension(start)
        if self.depth >= MAX_NESTING:
            raise self.error(f"groups nested more than {MAX_NESTING} deep", start)
        self.depth += 1
        body = self.alternation()
        self.depth -= 1
        if self.peek() != ")":
            raise self.error("missing ), unterminated subpattern", start)
        self.pos += 1
        return body

    def extension(self, start: int) -> None:
        """Read what follows "(?" up to the group's body, or refuse it."""
        rest = self.pattern[self.pos:self.pos + 2]
        if rest.startswith(":"):
            self.pos += 1
        elif rest == "P<":
            self.pos += 2
            self.group_name()
        elif rest in ("<=", "<!"):
            raise self.error(f"lookbehind (?{rest}...) is not supported", start)
        elif rest.startswith("<"):
            self.pos += 1
            self.group_name()
        elif rest.startswith(("=", "!")):
            raise self.error(f"lookahead (?{rest[0]}...) is not supported", start)
        elif rest == "P=":
            raise self.error("backreferences ((?P=name)) are not supported", start)
        elif rest.startswith(">"):
            raise self.error("atomic groups (?>...) are not supported", start)
        elif rest.startswith("#"):
            raise self.error("comments (?#...) are not supported", start)
        elif rest.startswith("("):
            raise self.error("conditional groups (?(...)...) are not supported", start)
        elif rest[:1] and rest[0] in "aiLmsux-":
            raise self.error(f"inline flags (?{rest[0]}...) are not supported", start)
        else:
            raise self.error(f"unknown extension ?{rest[:1]}", start)

    def group_name(self) -> None:
        end = self.pattern.find(">", self.pos)
        if end < 0:
            raise self.error("missing >, unterminated name")
        name = self.pattern[self.pos:end]
        if not name.isidentifier():
            raise self.error(f"bad character in group name {name!r}")
        if name in self.names:
            raise self.error(f"redefinition of group name {name!r}")
        self.names.add(name)
        self.pos = end + 1

    def char_class(self) -> Chars:
        start = self.pos
        self.pos += 1
        negated = self.peek() == "^"
        if negated:
            self.pos += 1
        ranges: list[tuple[int, int]] = []
        first, spaces = True, False
        while True:
            ch = self.peek()
            if not ch:
                raise self.error("unterminated character set", start)
            if ch == "]" and not first:  # a "]" first is a literal, as in re
                self.pos += 1
                break
            first = False
            item_start = self.pos
            lo = self.class_item()
            if self.peek() == "-" and self.peek(1) not in ("]", ""):
                self.pos += 1
                hi = self.class_item()
                if isinstance(lo, tuple) or isinstance(hi, tuple) or lo > hi:
                    raise self.error(f"bad character range {self.pattern[item_start:self.pos]}", item_start)
                ranges.append((lo, hi))
            elif isinstance(lo, tuple):
                ranges.extend(lo)
                spaces = spaces or self.pattern[item_start:self.pos] in ("\\s", "\\S")
            else:
                ranges.append((lo, lo))
        found = _normalize(ranges)
        if not negated:
            return Chars(found)
        if spaces:  # (see _SPACE_DISPUTED)
            found = _normalize(list(found + _SPACE_DISPUTED))
        return Chars(_complement(found))

    def class_item(self) -> Union[int, Ranges]:
        if self.peek() == "\\":
            return self.escape(in_class=True)
        self.pos += 1
        return ord(self.pattern[self.pos - 1])

    def escape(self, in_class: bool) -> Union[int, Ranges]:
        """The escape at pos: a code point, or the ranges of a class escape (\\d ...)."""
        start = self.pos
        ch = self.peek(1)
        self.pos += 2
        if not ch:
            raise self.error("bad escape (end of pattern)", start)
        if ch in _CLASS_ESCAPES:
            return _CLASS_ESCAPES[ch]
        if ch in _CHAR_ESCAPES:
            return _CHAR_ESCAPES[ch]
        if ch in "xuU":
            return self.hex_escape(start, {"x": 2, "u": 4, "U": 8}[ch])
        if ch == "N":
            return self.named_escape(start)
        if ch == "0" or in_class and ch in _OCTAL:
            return self.octal_escape(start)
        if ch == "b" and in_class:
            return 0x08
        if ch in _REFUSED_ESCAPES:
            raise self.error(f"{_REFUSED_ESCAPES[ch]} not supported", start)
        if ch in "123456789" and not in_class:
            raise self.error(f"backreferences (\\{ch}) are not supported", start)
        if ch.isascii() and ch.isalnum():
            raise self.error(f"bad escape \\{ch}", start)
        return ord(ch)

    def hex_escape(self, start: int, digits: int) -> int:
        text = self.pattern[self.pos:self.pos + digits]
        if len(text) < digits or not set(text) <= _HEX:
            raise self.error(f"incomplete escape {self.pattern[start:self.pos + digits]}", start)
        self.pos += digits
        value = int(text, 16)
        if value > MAX_CODE_POINT:
            raise self.error(f"bad escape {self.pattern[start:self.pos]}", start)
        return value

    def octal_escape(self, start: int) -> int:
        while self.pos - start < 4 and self.peek() and self.peek() in _OCTAL:  # at most three digits
            self.pos += 1
        value = int(self.pattern[start + 1:self.pos], 8)
        if value > 0o377:
            raise self.error(f"octal escape value {self.pattern[start:self.pos]} outside of range 0-0o377", start)
        return value

    def named_escape(self, start: int) -> int:
        end = self.pattern.find("}", self.pos)
        if self.peek() != "{" or end < 0:
            raise self.error("\\N must be followed by {name}", start)
        try:
            value = ord(unicodedata.lookup(self.pattern[self.pos + 1:end]))
        except (KeyError, TypeError):  # TypeError: a named sequence, more than one character
            raise self.error(f"undefined character name {self.pattern[self.pos + 1:end]!r}", start) from None
        self.pos = end + 1
        return value


# ---- the automata ------------------------------------------------------------------------

ACCEPT = 0  # the NFA's accepting state


class _NFA:
    """A Thompson automaton. State i either reads one character of charsets[i] and goes on to
    targets[i][0], or (charsets[i] is None) goes on to any of targets[i] without reading one.
    ACCEPT is such a state, with no targets."""

    def __init__(self) -> None:
        self.charsets: list[Optional[Ranges]] = [None]
        self.targets: list[list[int]] = [[]]

    def add(self, charset: Optional[Ranges], targets: list[int]) -> int:
        self.charsets.append(charset)
        self.targets.append(targets)
        return len(self.charsets) - 1

    def build(self, node: Node, after: int) -> int:
        """Add the states of `node`, which go on to state `after` once it is matched; its entry."""
        if isinstance(node, Chars):
            return self.add(node.ranges, [after])
        if isinstance(node, Concat):
            for item in reversed(node.items):
                after = self.build(item, after)
            return after
        if isinstance(node, Alt):
            return self.add(None, [self.build(item, after) for item in node.items])
        item, least, most, _ = node
        if most is None:  # x{m,}: m copies, then a loop over one more
            loop = self.add(None, [])
            self.targets[loop] += [self.build(item, loop), after]
            entry = loop
        else:  # x{m,n}: m copies, then x (x (x)?)? ... nested n - m deep
            entry = after
            for _ in range(most - least):
                entry = self.add(None, [self.build(item, entry), after])
        for _ in range(least):
            entry = self.build(item, entry)
        return entry

    def coreachable(self) -> list[bool]:
        """Whether each state can reach ACCEPT (through no empty character set)."""
        before: list[list[int]] = [[] for _ in self.charsets]
        for state, (charset, targets) in enumerate(zip(self.charsets, self.targets)):
            if charset != ():
                for target in targets:
                    before[target].append(state)
        alive = [False] * len(self.charsets)
        alive[ACCEPT] = True
        pending = [ACCEPT]
        while pending:
            for state in before[pending.pop()]:
                if not alive[state]:
                    alive[state] = True
                    pending.append(state)
        return alive


class _Determinizer:
    """Subset construction over the pruned NFA, up to MAX_DFA_STATES states and MAX_WORK."""

    def __init__(self, nfa: _NFA, alive: list[bool]) -> None:
        self.nfa, self.alive = nfa, alive
        self.work = 0
        # The character classes: the intervals between the bounds of every live character set.
        # Class k is [bounds[k - 1], bounds[k]), so a code point's is bisect_right(bounds, it).
        points = {p for charset, live in zip(nfa.charsets, alive) if charset and live
                  for lo, hi in charset for p in (lo, hi + 1)}
        self.bounds = sorted(points - {0, MAX_CODE_POINT + 1})
        self.classes: dict[Ranges, tuple[int, ...]] = {}  # each character set's classes, as needed

    def spend(self, work: int) -> None:
        self.work += work
        if self.work > MAX_WORK:
            raise RegexError("the regex is too complex to determinise (its alternatives and "
                             "optional parts overlap too much): simplify it")

    def classes_of(self, charset: Ranges) -> tuple[int, ...]:
        classes = self.classes.get(charset)
        if classes is None:
            bounds = self.bounds
            classes = self.classes[charset] = tuple(
                c for lo, hi in charset
                for c in range(bisect.bisect_right(bounds, lo), bisect.bisect_right(bounds, hi) + 1))
        return classes

    def closure(self, seeds: list[int]) -> frozenset[int]:
        """The live states that read a character (and ACCEPT) reachable from `seeds` without one."""
        charsets, targets, alive = self.nfa.charsets, self.nfa.targets, self.alive
        seen: set[int] = set()
        found = []
        pending = [s for s in seeds if alive[s]]
        while pending:
            state = pending.pop()
            if state in seen:
                continue
            seen.add(state)
            if charsets[state] is None and state != ACCEPT:
                pending += [t for t in targets[state] if alive[t] and t not in seen]
            else:
                found.append(state)
        self.spend(len(seen))
        return frozenset(found)

    def run(self, entry: int) -> tuple[list[dict[int, int]], list[bool]]:
        """Each DFA state's transitions by class, and whether it accepts; state 0 is the start."""
        start = self.closure([entry])
        if not start:
            raise RegexError("the regex matches no string")
        subsets, ids = [start], {start: 0}
        delta: list[dict[int, int]] = []
        charsets, targets = self.nfa.charsets, self.nfa.targets
        # Invariant: every subset is non-empty and made of live states, so every DFA state is
        # live: a live state's character leads to a live state, whose closure is not empty.
        while len(delta) < len(subsets):
            moves: dict[int, list[int]] = {}
            for state in subsets[len(delta)]:
                if state != ACCEPT:
                    classes = self.classes_of(charsets[state])
                    self.spend(len(classes))
                    for c in classes:
                        moves.setdefault(c, []).append(targets[state][0])
            row: dict[int, int] = {}
            by_targets: dict[tuple[int, ...], int] = {}  # classes that lead alike share a closure
            for c, seeds in moves.items():
                key = tuple(seeds)
                if key not in by_targets:
                    by_targets[key] = _number(ids, subsets, self.closure(seeds),
                                              f"the regex needs more than {MAX_DFA_STATES} deterministic automaton "
                                              "states (a pattern such as (a|b)*a(a|b){20} does)")
                row[c] = by_targets[key]
            delta.append(row)
        return delta, [ACCEPT in subset for subset in subsets]


def _number(ids: dict, states: list, state, too_many: str) -> int:
    """The state's number in `states` (a new one, appended, where it has none); past
    MAX_DFA_STATES, RegexError(too_many)."""
    number = ids.get(state)
    if number is None:
        if len(states) == MAX_DFA_STATES:
            raise RegexError(too_many)
        number = ids[state] = len(states)
        states.append(state)
    return number


class Regex:
    """A compiled regex: a deterministic automaton over characters. States are ints (start is
    0), every one live; step is the hot path of mask building, two dict lookups once warm."""

    def __init__(self, pattern: str, bounds: list[int], delta: list[dict[int, int]], accepts: list[bool]) -> None:
        self.pattern = pattern
        self.start = 0
        self._bounds = bounds
        self.bounds = tuple(bounds)  # its character classes: regexes alike in them share tokens' tries
        self._delta = delta
        self._accepts = accepts
        self._class_of: dict[str, int] = {}  # character -> class, filled as characters come

    @property
    def num_states(self) -> int:
        return len(self._delta)

    def step(self, state: int, ch: str) -> Optional[int]:
        """The state after one more character `ch`, or None where no text going on so matches."""
        return self._delta[state].get(self.class_of(ch))

    def class_of(self, ch: str) -> int:
        """The class of `ch`: characters of one class move every state alike."""
        cls = self._class_of.get(ch)
        if cls is None:
            cls = bisect.bisect_right(self._bounds, ord(ch))
            if len(self._class_of) < CLASS_CACHE_SIZE:
                self._class_of[ch] = cls
        return cls

    def takes_any(self, state: int, low: int, high: int) -> bool:
        """Whether some character of code point low to high (inclusive) moves the state."""
        moves = self._delta[state]
        first, last = bisect.bisect_right(self._bounds, low), bisect.bisect_right(self._bounds, high)
        return any(cls in moves for cls in range(first, last + 1))

    def moves(self, state: int) -> dict[int, int]:
        """The state's transitions: class -> the state after a character of it (none: no move)."""
        return self._delta[state]

    def accepting(self, state: int) -> bool:
        """Whether the text so far matches the whole regex."""
        return self._accepts[state]

    def live(self, state: int) -> bool:
        """Whether some continuation can still reach acceptance: true of every state this
        automaton has (dead ones are pruned before determinising), false of other ints."""
        return 0 <= state < len(self._delta)

    def __repr__(self) -> str:
        return f"Regex({self.pattern!r}, {self.num_states} states)"


@functools.lru_cache(maxsize=REGEX_CACHE_SIZE)
def compile_regex(pattern: str) -> Regex:
    """The automaton that accepts what the whole pattern matches (as the module says)
    (cached by pattern text); raises RegexError for a pattern it cannot hold an output to."""
    tree = _Parser(pattern).parse()
    nfa = _NFA()
    entry = nfa.build(tree, ACCEPT)
    determinizer = _Determinizer(nfa, nfa.coreachable())
    delta, accepts = determinizer.run(entry)
    return Regex(pattern, determinizer.bounds, delta, accepts)


@functools.lru_cache(maxsize=REGEX_CACHE_SIZE)
def intersect(a: Regex, b: Regex) -> Regex:
    """The automaton of the texts both a and b match whole (a JSON schema string's pattern and
    its minLength / maxLength): the product of the two, over classes both tell apart, its
    states that cannot reach a match (where no text fits both on) pruned; refused past
    MAX_DFA_STATES, or where no text fits both."""
    bounds = sorted(set(a.bounds) | set(b.bounds))
    lows = [0] + bounds  # each class's first code point, which tells its class in a and in b
    in_a = [bisect.bisect_right(a.bounds, low) for low in lows]
    in_b = [bisect.bisect_right(b.bounds, low) for low in lows]
    pairs, ids = [(0, 0)], {(0, 0): 0}
    delta: list[dict[int, int]] = []
    while len(delta) < len(pairs):
        state_a, state_b = pairs[len(delta)]
        moves_a, moves_b = a.moves(state_a), b.moves(state_b)
        row: dict[int, int] = {}
        for c in range(len(lows)):
            after = (moves_a.get(in_a[c]), moves_b.get(in_b[c]))
            if after[0] is not None and after[1] is not None:
                row[c] = _number(ids, pairs, after, f"the pattern and the length together need more than "
                                                    f"{MAX_DFA_STATES} automaton states")
        delta.append(row)
    accepts = [a.accepting(x) and b.accepting(y) for x, y in pairs]
    # Keep the states from which a match can be reached, numbered as they were found (the start first).
    back: list[list[int]] = [[] for _ in pairs]
    for state, row in enumerate(delta):
        for target in row.values():
            back[target].append(state)
    alive, pending = list(accepts), [s for s, ok in enumerate(accepts) if ok]
    while pending:
        for source in back[pending.pop()]:
            if not alive[source]:
                alive[source] = True
                pending.append(source)
    if not alive[0]:
        raise RegexError("no text matches both the pattern and the length")
    number = {old: new for new, old in enumerate(s for s in range(len(pairs)) if alive[s])}
    kept = [{c: number[t] for c, t in delta[s].items() if alive[t]} for s in number]
    return Regex(f"({a.pattern})&({b.pattern})", bounds, kept, [accepts[s] for s in number])
