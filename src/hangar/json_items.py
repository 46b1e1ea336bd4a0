"""A bound on what JSON text costs once parsed, checked before it is parsed.

``json.loads`` (and protobuf's ``json_format.Parse``, which calls it) builds every object
of a text before anything can look at it: 16 MiB of ``[{},{},...]`` become about 400 MiB
of Python dicts (25 times the text, measured), so a cap on bytes alone does not bound a
decoder's memory. What costs is the number of values, and each value after the first of
an array or an object needs a comma, each container a bracket: ``items`` counts those
structural ``,``, ``[`` and ``{`` outside strings (strings cost about their length, so a
large string, such as base64 data, counts once), and stops counting past the limit.

The count reads UTF-8, the only encoding JSON between systems may use (RFC 8259), in which
a JSON text never holds a NUL byte; ``json.loads`` also takes UTF-16 and UTF-32 bytes,
whose quotes the count would misread (review 29g G-H3), so a NUL byte anywhere counts as
over the limit.

``MAX_ITEMS`` (32,768) holds every message the servers take (Hangar's and E2B's JSON
bodies, envd's Connect messages, the code interpreter's answers) with room to spare, and
bounds their parse at about 7 MiB (32,768 small objects in a list, measured).
"""

from __future__ import annotations

import re

MAX_ITEMS = 32_768
"""Most structural commas and brackets a JSON text may hold (see the module docstring)."""

_TOKENS = re.compile(rb'"(?:[^"\\]++|\\.)*+"|[,\[{]|"')
"""A JSON string (skipped whole, escapes included), one structural token, or a quote that
opens a string this piece of the text does not end."""
_IN_STRING = re.compile(rb'(?:[^"\\]++|\\.)*+')
"""The rest of a string up to its closing quote (or to the end of the piece)."""


class Items:
    """Counts the structural commas and brackets of a JSON text fed in pieces, outside its
    strings (a string may span pieces), up to ``limit + 1``: ``over`` once past ``limit``.

    The scan is linear in the bytes fed and visits at most ``4 * limit + 16`` strings and
    tokens: JSON separates its strings by tokens (two strings, a key and its value, to a
    comma), so a text with more strings than that is not JSON of ``limit`` items and is
    counted as over it. Text that is not JSON is otherwise counted all the same (its parse
    then fails)."""

    def __init__(self, limit: int = MAX_ITEMS) -> None:
        self.limit = limit
        self.count = 0
        self._seen = 0
        self._in_string = False
        self._escape = False  # the piece ended on a backslash inside a string

    @property
    def over(self) -> bool:
        return self.count > self.limit

    def feed(self, piece: bytes) -> bool:
        """Count ``piece``; returns ``over``."""
        if b"\0" in piece:  # not UTF-8 JSON: UTF-16 or UTF-32 (see the module docstring)
            self.count = self.limit + 1
            return True
        i = 0
        if self._escape and piece:
            i, self._escape = 1, False
        if self._in_string:
            i = self._string_rest(piece, i)
            if self._in_string:
                return self.over
        most = 4 * self.limit + 16
        for m in _TOKENS.finditer(piece, i):
            self._seen += 1
            if m.end() - m.start() == 1:
                if piece[m.start()] == 0x22:  # a string left open: the rest is in it
                    self._in_string = True
                    self._string_rest(piece, m.end())
                    break
                self.count += 1
            if self.count > self.limit or self._seen > most:
                self.count = self.limit + 1
                break
        return self.over

    def _string_rest(self, piece: bytes, i: int) -> int:
        """Where the open string ends in ``piece`` (after its quote), from ``i``; the
        string stays open when ``piece`` ends first."""
        m = _IN_STRING.match(piece, i)
        j = m.end() if m is not None else i
        if j < len(piece) and piece[j] == 0x22:
            self._in_string = False
            return j + 1
        self._escape = j < len(piece)  # a last backslash: its escaped byte comes next
        return len(piece)


def items(data: bytes, limit: int = MAX_ITEMS) -> int:
    """The structural commas and brackets of the JSON text ``data`` outside its strings,
    counted up to ``limit + 1`` (over ``limit``: refuse the text, unparsed; see ``Items``)."""
    counter = Items(limit)
    counter.feed(data)
    return counter.count


def too_many(data: bytes, limit: int = MAX_ITEMS) -> bool:
    """Whether the JSON text ``data`` holds more than ``limit`` structural items
    (``items``)."""
    return items(data, limit) > limit
