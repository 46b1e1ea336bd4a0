"""envd's Connect RPC layer without a VM: Hangar's messages against the E2B SDK's own
classes (an independent implementation of the same wire), and the protocol's framing,
errors and deadlines on a bare ASGI call."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from typing import Any

from e2b.envd.filesystem import filesystem_pb
from e2b.envd.process import process_pb
from google.protobuf import json_format
from protobuf import Oneof

from hangar.api.envd import connect
from hangar.api.envd.messages import FS, P


def test_messages_match_the_sdks_both_codecs() -> None:
    req = process_pb.StartRequest(
        process=process_pb.ProcessConfig(cmd="/bin/bash", args=["-l", "-c", "echo hi"],
                                         envs={"A": "1"}, cwd="/tmp"),
        pty=process_pb.PTY(size=process_pb.PTY.Size(cols=100, rows=30)), stdin=False)
    from_json = json_format.Parse(req.to_json(), P.StartRequest())
    assert P.StartRequest.FromString(req.to_binary()) == from_json
    assert (from_json.process.args, dict(from_json.process.envs), from_json.process.cwd) == \
        (["-l", "-c", "echo hi"], {"A": "1"}, "/tmp")
    assert from_json.HasField("stdin") and not from_json.stdin
    assert (from_json.pty.size.cols, from_json.pty.size.rows) == (100, 30)
    assert not json_format.Parse("{}", P.StartRequest()).HasField("stdin")  # absent: envd's true

    end = P.StartResponse(event=P.ProcessEvent(end=P.ProcessEvent.EndEvent(
        exit_code=-1, exited=False, status="signal: killed", error="boom")))
    for sdk in (process_pb.StartResponse.from_binary(end.SerializeToString()),
                process_pb.StartResponse.from_json(connect.CODECS["json"].encode(end))):
        e = sdk.event.event
        assert (e.field, e.value.exit_code, e.value.status, e.value.error) == (
            "end", -1, "signal: killed", "boom")

    info = FS.EntryInfo(name="a.txt", type=FS.FILE_TYPE_FILE, path="/root/a.txt", size=1 << 40,
                        mode=0o644, permissions="-rw-r--r--", is_symlink=False)
    info.modified_time.FromSeconds(1_700_000_000)
    for sdk in (filesystem_pb.StatResponse.from_binary(FS.StatResponse(entry=info)
                                                       .SerializeToString()),
                filesystem_pb.StatResponse.from_json(
                    connect.CODECS["json"].encode(FS.StatResponse(entry=info)))):
        assert (sdk.entry.size, sdk.entry.type, sdk.entry.modified_time.seconds) == (
            1 << 40, filesystem_pb.FileType.FILE, 1_700_000_000)

    sig = process_pb.SendSignalRequest(
        process=process_pb.ProcessSelector(selector=Oneof("tag", "web")),
        signal=process_pb.Signal.SIGTERM)
    mine = json_format.Parse(sig.to_json(), P.SendSignalRequest())
    assert (mine.process.WhichOneof("selector"), mine.process.tag, mine.signal) == (
        "tag", "web", 15)


class Asgi:
    """One ASGI request: its body in ``chunks``, the answer collected."""

    def __init__(self, chunks: list[bytes]) -> None:
        self.chunks = list(chunks)
        self.status = 0
        self.headers: dict[bytes, bytes] = {}
        self.body = b""

    async def receive(self) -> dict[str, Any]:
        if self.chunks:
            return {"type": "http.request", "body": self.chunks.pop(0),
                    "more_body": bool(self.chunks)}
        await asyncio.sleep(3600)  # the client stays
        return {"type": "http.disconnect"}

    async def send(self, msg: dict[str, Any]) -> None:
        if msg["type"] == "http.response.start":
            self.status, self.headers = msg["status"], dict(msg["headers"])
        else:
            self.body += msg.get("body", b"")


def frames(data: bytes) -> list[tuple[int, bytes]]:
    out = []
    while data:
        flags, size = struct.unpack(">BI", data[:5])
        out.append((flags, data[5:5 + size]))
        data = data[5 + size:]
    return out


def run(method: connect.Method, ctype: str, chunks: list[bytes], **headers: str) -> Asgi:
    a = Asgi(chunks)
    call = connect.new_call({"content-type": ctype, **headers})
    asyncio.run(connect.serve(method, call, a.receive, a.send))
    return a


async def _echo(req: Any, call: connect.Call) -> Any:
    if req.path == "slow":
        await asyncio.sleep(5)
    if req.path == "missing":
        raise connect.RpcError("not_found", "no such path")
    return FS.StatResponse(entry=FS.EntryInfo(path=req.path))


async def _count(req: Any, call: connect.Call) -> AsyncIterator[Any]:
    for i in range(3):
        yield FS.WatchDirResponse(filesystem=FS.FilesystemEvent(name=f"{req.path}{i}"))
    if req.recursive:
        raise connect.RpcError("deadline_exceeded", "too long")


async def _gather(reqs: AsyncIterator[Any], call: connect.Call) -> Any:
    names = [r.path async for r in reqs]
    return FS.StatResponse(entry=FS.EntryInfo(path="+".join(names)))


ECHO = connect.Method("unary", FS.StatRequest, FS.StatResponse, _echo)
ECHO_LARGE = connect.Method("unary", FS.StatRequest, FS.StatResponse, _echo,
                            max_message=connect.MAX_MESSAGE)
COUNT = connect.Method("server", FS.WatchDirRequest, FS.WatchDirResponse, _count)
GATHER = connect.Method("client", FS.StatRequest, FS.StatResponse, _gather)


def test_unary_codecs_errors_and_deadline() -> None:
    a = run(ECHO, "application/json", [b'{"pa', b'th": "/x"}'])
    assert (a.status, a.headers[b"content-type"], json.loads(a.body)) == (
        200, b"application/json", {"entry": {"path": "/x"}})
    a = run(ECHO, "application/proto", [FS.StatRequest(path="/y").SerializeToString()])
    assert FS.StatResponse.FromString(a.body).entry.path == "/y"
    a = run(ECHO, "application/json", [b'{"path": "missing"}'])
    assert (a.status, json.loads(a.body)) == (404, {"code": "not_found",
                                                    "message": "no such path"})
    a = run(ECHO, "application/json", [b'{"path": "slow"}'], **{"connect-timeout-ms": "50"})
    assert (a.status, json.loads(a.body)["code"]) == (504, "deadline_exceeded")
    a = run(ECHO, "application/json", [b"not json"])
    assert (a.status, json.loads(a.body)["code"]) == (400, "invalid_argument")
    a = run(ECHO, "text/plain", [b"{}"])
    assert (a.status, json.loads(a.body)["code"]) == (400, "invalid_argument")
    # values counted before the parse builds them (hangar.json_items), strings once
    from hangar.json_items import MAX_ITEMS

    many = b'{"zz":[' + b",".join([b"{}"] * (MAX_ITEMS + 1)) + b'],"path":"/z"}'
    a = run(ECHO, "application/json", [many])  # past the method's size first
    assert (a.status, json.loads(a.body)) == (429, {
        "code": "resource_exhausted", "message": f"a message over {connect.SMALL_MESSAGE} "
        "bytes, the limit of this method"})
    a = run(ECHO_LARGE, "application/json", [many])
    assert (a.status, json.loads(a.body)) == (429, {
        "code": "resource_exhausted", "message": f"a JSON message with more than "
        f"{MAX_ITEMS} values, the limit: send fewer, or send application/proto"})
    commas = "/" + "," * (MAX_ITEMS * 2)
    a = run(ECHO_LARGE, "application/json", [json.dumps({"path": commas}).encode()])
    assert (a.status, json.loads(a.body)["entry"]["path"]) == (200, commas)
    # nested past the parser's recursion: refused as not its message, never a 500
    a = run(ECHO, "application/json", [b'{"path": ' + b"[" * 5_000 + b"}"])
    assert (a.status, json.loads(a.body)["code"]) == (400, "invalid_argument")


def test_server_stream_envelopes_and_end() -> None:
    body = connect.envelope(connect.CODECS["json"].encode(FS.WatchDirRequest(path="e")))
    a = run(COUNT, "application/connect+json", [body[:3], body[3:]])
    got = frames(a.body)
    assert a.headers[b"content-type"] == b"application/connect+json"
    assert [f for f, _ in got] == [0, 0, 0, 2]
    assert [json.loads(m)["filesystem"]["name"] for _, m in got[:3]] == ["e0", "e1", "e2"]
    assert json.loads(got[3][1]) == {}
    body = connect.envelope(FS.WatchDirRequest(path="p", recursive=True).SerializeToString())
    got = frames(run(COUNT, "application/connect+proto", [body]).body)
    assert FS.WatchDirResponse.FromString(got[0][1]).filesystem.name == "p0"
    assert json.loads(got[-1][1]) == {"error": {"code": "deadline_exceeded",
                                                "message": "too long"}}


def test_client_stream_reads_every_message() -> None:
    msgs = b"".join(connect.envelope(FS.StatRequest(path=p).SerializeToString())
                    for p in ("a", "b", "c"))
    got = frames(run(GATHER, "application/connect+proto", [msgs[:7], msgs[7:]]).body)
    assert FS.StatResponse.FromString(got[0][1]).entry.path == "a+b+c"
    assert got[1] == (2, b"{}")
