"""``hangar.json_items``: a JSON text's values counted before it is parsed (issue 29, class
2): commas and brackets outside strings, the same in any pieces, bounded in time."""

from __future__ import annotations

import json
import random
import time

from hangar.json_items import MAX_ITEMS, Items, items, too_many


def test_only_structure_outside_strings_counts() -> None:
    assert items(b'{"a":[1,2,3],"b":{"c":"x,y,[z{"}}') == 6
    assert items(b'"a\\",b"') == 0  # an escaped quote does not end the string
    assert items(b'"' + b"a,[{" * 100_000 + b'"') == 0  # a large string counts once
    assert items(b"[" + b",".join([b"{}"] * 100) + b"]") == 1 + 100 + 99


def test_pieces_count_as_the_whole() -> None:
    text = json.dumps({"a": [1, 'x,"[{', {"k": ["\\", ",,"]}], "b": 'q"\\,',
                       "c": [[], [{}]]}).encode()
    whole = items(text)
    rng = random.Random(7)
    for _ in range(200):
        cuts = sorted(rng.sample(range(1, len(text)), 6)) + [len(text)]
        c, prev = Items(), 0
        for k in cuts:
            c.feed(text[prev:k])
            prev = k
        assert c.count == whole, cuts
    c = Items()
    for k in range(len(text)):
        c.feed(text[k:k + 1])
    assert c.count == whole


def test_over_the_limit_stops_early_and_fast() -> None:
    bomb = b'{"zz":[' + b",".join([b"{}"] * (5 << 20)) + b"]}"  # 15 MiB: 400 MiB parsed
    t = time.monotonic()
    assert too_many(bomb) and items(bomb) == MAX_ITEMS + 1
    assert time.monotonic() - t < 5
    assert too_many(b'""' * (4 * MAX_ITEMS + 20))  # strings no tokens separate: not JSON
    assert not too_many(b"[" + b",".join([b"1"] * MAX_ITEMS) + b"]")  # the limit itself
