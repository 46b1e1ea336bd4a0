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


def test_json_that_is_not_utf8_counts_as_over() -> None:
    """``json.loads`` takes UTF-16 and UTF-32 bytes, whose quotes a count of UTF-8 misreads:
    in UTF-16-LE ``∀`` holds a quote byte, and 1.4 million values counted as one (review
    29g G-H3). Such text always holds a NUL byte, which UTF-8 JSON never does: over."""
    text = json.dumps(["∀", *([{}] * 50_000)], ensure_ascii=False)
    assert json.loads(text.encode("utf-16-le")) == json.loads(text)  # what json.loads takes
    for encoding in ("utf-16-le", "utf-16", "utf-32"):
        assert too_many(text.encode(encoding), 10)
    assert not too_many(b'{"a": 1}', 10)
    assert not too_many(json.dumps({"k": "\x00"}).encode())  # an escaped NUL is fine
    counter = Items(10)
    assert not counter.feed(b'{"a": ') and counter.feed(b"\x00") and counter.over


def test_the_cluster_gateway_counts_a_create_whatever_its_type() -> None:
    """The cluster's router parses a create's body itself, whatever its content type, on
    the loop: its values are counted as it arrives (review 29g G-M1)."""
    import asyncio
    from types import SimpleNamespace

    import pytest

    from hangar.cluster.routing import CREATE_ITEMS, Router
    from hangar.errors import TooLarge

    def receive_of(*pieces: bytes):  # noqa: ANN202
        queue = list(pieces)

        async def receive() -> dict[str, object]:
            return {"type": "http.request", "body": queue.pop(0), "more_body": bool(queue)}
        return receive

    me = SimpleNamespace(node=SimpleNamespace(settings=SimpleNamespace(max_json_bytes=8 << 20)))
    many = b"[" + b",".join([b"{}"] * (CREATE_ITEMS + 1)) + b"]"
    with pytest.raises(TooLarge, match=f"more than {CREATE_ITEMS} values"):
        asyncio.run(Router._read_body(me, receive_of(many[:1000],  # type: ignore[arg-type]
                                                     many[1000:])))
    body = json.dumps({"image": "base"}).encode()
    assert asyncio.run(Router._read_body(me, receive_of(body))) == body  # type: ignore[arg-type]
