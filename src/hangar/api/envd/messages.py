"""The messages of envd's two Connect services, defined here at run time.

Hangar's own definitions of the wire shapes that E2B publishes as
``process.proto`` and ``filesystem.proto`` (same packages, names and field
numbers, so both codecs interoperate with E2B's SDKs). They are built as
descriptors with the ``protobuf`` package (no generated code): a message is
a list of ``F`` (name, number, type), and ``build`` turns the lot into a
``FileDescriptorProto`` in a private pool, whose classes give the binary
codec (``SerializeToString``/``FromString``) and, through
``google.protobuf.json_format``, the JSON codec of the proto3 JSON mapping.

Use the classes as ``P.StartRequest``, ``FS.EntryInfo`` (``P``, ``FS``:
namespaces of message classes, nested ones as ``P.ProcessEvent.DataEvent``),
and the enums' numbers as ``FS.FILE_TYPE_FILE`` etc.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

from google.protobuf import descriptor_pb2, descriptor_pool, message_factory, timestamp_pb2

_T = descriptor_pb2.FieldDescriptorProto
_KIND = {
    "string": _T.TYPE_STRING, "bytes": _T.TYPE_BYTES, "bool": _T.TYPE_BOOL,
    "uint32": _T.TYPE_UINT32, "int64": _T.TYPE_INT64, "sint32": _T.TYPE_SINT32,
}


@dataclass(frozen=True)
class F:
    """One field: ``kind`` a scalar name, ``.pkg.Message``/``.pkg.Enum`` for a message or
    enum (``enum=True``), or ``map`` (string to string). ``optional``: proto3 presence;
    ``oneof``: the name of the oneof it belongs to; ``repeated``."""

    name: str
    number: int
    kind: str
    optional: bool = False
    repeated: bool = False
    oneof: str | None = None
    enum: bool = False


@dataclass(frozen=True)
class M:
    """A message: its fields and nested messages."""

    name: str
    fields: tuple[F, ...] = ()
    nested: tuple["M", ...] = ()


def _camel(name: str) -> str:
    head, *rest = name.split("_")
    return head + "".join(p.title() for p in rest)


def _message(m: M, scope: str) -> descriptor_pb2.DescriptorProto:
    d = descriptor_pb2.DescriptorProto(name=m.name)
    for n in m.nested:
        d.nested_type.append(_message(n, f"{scope}.{m.name}"))
    oneofs: list[str] = []
    for f in m.fields:
        if f.oneof and f.oneof not in oneofs:
            oneofs.append(f.oneof)
    synthetic = [f for f in m.fields if f.optional]
    for name in oneofs:
        d.oneof_decl.add(name=name)
    for f in synthetic:  # proto3 optional: a synthetic oneof each, after the real ones
        d.oneof_decl.add(name=f"_{f.name}")
    for f in m.fields:
        fd = d.field.add(name=f.name, number=f.number, json_name=_camel(f.name),
                         label=_T.LABEL_REPEATED if f.repeated or f.kind == "map"
                         else _T.LABEL_OPTIONAL)
        if f.kind == "map":
            entry = d.nested_type.add(name=_camel(f.name).title()[0] + _camel(f.name)[1:]
                                      + "Entry")
            entry.options.map_entry = True
            entry.field.add(name="key", number=1, type=_T.TYPE_STRING, label=_T.LABEL_OPTIONAL,
                            json_name="key")
            entry.field.add(name="value", number=2, type=_T.TYPE_STRING,
                            label=_T.LABEL_OPTIONAL, json_name="value")
            fd.type = _T.TYPE_MESSAGE
            fd.type_name = f"{scope}.{m.name}.{entry.name}"
        elif f.kind in _KIND:
            fd.type = _KIND[f.kind]
        else:
            fd.type = _T.TYPE_ENUM if f.enum else _T.TYPE_MESSAGE
            fd.type_name = f.kind
        if f.oneof:
            fd.oneof_index = oneofs.index(f.oneof)
        if f.optional:
            fd.proto3_optional = True
            fd.oneof_index = len(oneofs) + synthetic.index(f)
    return d


def build(pool: descriptor_pool.DescriptorPool, package: str, messages: list[M],
          enums: dict[str, dict[str, int]], deps: tuple[str, ...] = ()) -> SimpleNamespace:
    """Add ``package``'s messages and enums to ``pool``; returns a namespace of their
    classes (nested ones as attributes of their parent) and enum numbers."""
    fdp = descriptor_pb2.FileDescriptorProto(name=f"hangar/envd/{package}.proto",
                                             package=package, syntax="proto3")
    fdp.dependency.extend(deps)
    for name, values in enums.items():
        e = fdp.enum_type.add(name=name)
        for vname, number in values.items():
            e.value.add(name=vname, number=number)
    for m in messages:
        fdp.message_type.append(_message(m, f".{package}"))
    pool.Add(fdp)
    ns = SimpleNamespace()

    def attach(owner: Any, m: M, full: str) -> None:
        cls = message_factory.GetMessageClass(pool.FindMessageTypeByName(full))
        setattr(owner, m.name, cls)
        for n in m.nested:
            attach(cls, n, f"{full}.{n.name}")

    for m in messages:
        attach(ns, m, f"{package}.{m.name}")
    for values in enums.values():
        for vname, number in values.items():
            setattr(ns, vname, number)
    return ns


POOL = descriptor_pool.DescriptorPool()
POOL.AddSerializedFile(timestamp_pb2.DESCRIPTOR.serialized_pb)

_SEL = (F("pid", 1, "uint32", oneof="selector"), F("tag", 2, "string", oneof="selector"))
_SELECTOR = F("process", 1, ".process.ProcessSelector")
_PTY = F("pty", 2, ".process.PTY", optional=True)

P = build(POOL, "process", [
    M("PTY", (F("size", 1, ".process.PTY.Size"),),
      nested=(M("Size", (F("cols", 1, "uint32"), F("rows", 2, "uint32"))),)),
    M("ProcessConfig", (F("cmd", 1, "string"), F("args", 2, "string", repeated=True),
                        F("envs", 3, "map"), F("cwd", 4, "string", optional=True))),
    M("ListRequest"),
    M("ProcessInfo", (F("config", 1, ".process.ProcessConfig"), F("pid", 2, "uint32"),
                      F("tag", 3, "string", optional=True))),
    M("ListResponse", (F("processes", 1, ".process.ProcessInfo", repeated=True),)),
    M("StartRequest", (F("process", 1, ".process.ProcessConfig"), _PTY,
                       F("tag", 3, "string", optional=True),
                       F("stdin", 4, "bool", optional=True))),
    M("UpdateRequest", (_SELECTOR, _PTY)),
    M("UpdateResponse"),
    M("ProcessEvent", (
        F("start", 1, ".process.ProcessEvent.StartEvent", oneof="event"),
        F("data", 2, ".process.ProcessEvent.DataEvent", oneof="event"),
        F("end", 3, ".process.ProcessEvent.EndEvent", oneof="event"),
        F("keepalive", 4, ".process.ProcessEvent.KeepAlive", oneof="event"),
    ), nested=(
        M("StartEvent", (F("pid", 1, "uint32"),)),
        M("DataEvent", (F("stdout", 1, "bytes", oneof="output"),
                        F("stderr", 2, "bytes", oneof="output"),
                        F("pty", 3, "bytes", oneof="output"))),
        M("EndEvent", (F("exit_code", 1, "sint32"), F("exited", 2, "bool"),
                       F("status", 3, "string"), F("error", 4, "string", optional=True))),
        M("KeepAlive"),
    )),
    M("StartResponse", (F("event", 1, ".process.ProcessEvent"),)),
    M("ConnectResponse", (F("event", 1, ".process.ProcessEvent"),)),
    M("ProcessInput", (F("stdin", 1, "bytes", oneof="input"),
                       F("pty", 2, "bytes", oneof="input"))),
    M("SendInputRequest", (_SELECTOR, F("input", 2, ".process.ProcessInput"))),
    M("SendInputResponse"),
    M("StreamInputRequest", (
        F("start", 1, ".process.StreamInputRequest.StartEvent", oneof="event"),
        F("data", 2, ".process.StreamInputRequest.DataEvent", oneof="event"),
        F("keepalive", 3, ".process.StreamInputRequest.KeepAlive", oneof="event"),
    ), nested=(M("StartEvent", (_SELECTOR,)),
               M("DataEvent", (F("input", 2, ".process.ProcessInput"),)),
               M("KeepAlive"))),
    M("StreamInputResponse"),
    M("SendSignalRequest", (_SELECTOR, F("signal", 2, ".process.Signal", enum=True))),
    M("SendSignalResponse"),
    M("CloseStdinRequest", (_SELECTOR,)),
    M("CloseStdinResponse"),
    M("ConnectRequest", (_SELECTOR,)),
    M("ProcessSelector", _SEL),
], {"Signal": {"SIGNAL_UNSPECIFIED": 0, "SIGNAL_SIGTERM": 15, "SIGNAL_SIGKILL": 9}})

_ENTRY = F("entry", 1, ".filesystem.EntryInfo")
_WATCH = (F("path", 1, "string"), F("recursive", 2, "bool"), F("include_entry", 3, "bool"),
          F("allow_network_mounts", 4, "bool"))

FS = build(POOL, "filesystem", [
    M("MoveRequest", (F("source", 1, "string"), F("destination", 2, "string"))),
    M("MoveResponse", (_ENTRY,)),
    M("MakeDirRequest", (F("path", 1, "string"),)),
    M("MakeDirResponse", (_ENTRY,)),
    M("RemoveRequest", (F("path", 1, "string"),)),
    M("RemoveResponse"),
    M("StatRequest", (F("path", 1, "string"),)),
    M("StatResponse", (_ENTRY,)),
    M("EntryInfo", (
        F("name", 1, "string"), F("type", 2, ".filesystem.FileType", enum=True),
        F("path", 3, "string"), F("size", 4, "int64"), F("mode", 5, "uint32"),
        F("permissions", 6, "string"), F("owner", 7, "string"), F("group", 8, "string"),
        F("modified_time", 9, ".google.protobuf.Timestamp"),
        F("symlink_target", 10, "string", optional=True), F("metadata", 11, "map"),
        F("is_symlink", 12, "bool"),
    )),
    M("ListDirRequest", (F("path", 1, "string"), F("depth", 2, "uint32"))),
    M("ListDirResponse", (F("entries", 1, ".filesystem.EntryInfo", repeated=True),)),
    M("WatchDirRequest", _WATCH),
    M("FilesystemEvent", (F("name", 1, "string"),
                          F("type", 2, ".filesystem.EventType", enum=True),
                          F("entry", 3, ".filesystem.EntryInfo", optional=True))),
    M("WatchDirResponse", (
        F("start", 1, ".filesystem.WatchDirResponse.StartEvent", oneof="event"),
        F("filesystem", 2, ".filesystem.FilesystemEvent", oneof="event"),
        F("keepalive", 3, ".filesystem.WatchDirResponse.KeepAlive", oneof="event"),
    ), nested=(M("StartEvent"), M("KeepAlive"))),
    M("CreateWatcherRequest", _WATCH),
    M("CreateWatcherResponse", (F("watcher_id", 1, "string"),)),
    M("GetWatcherEventsRequest", (F("watcher_id", 1, "string"),)),
    M("GetWatcherEventsResponse", (F("events", 1, ".filesystem.FilesystemEvent",
                                     repeated=True),)),
    M("RemoveWatcherRequest", (F("watcher_id", 1, "string"),)),
    M("RemoveWatcherResponse"),
], {
    "FileType": {"FILE_TYPE_UNSPECIFIED": 0, "FILE_TYPE_FILE": 1, "FILE_TYPE_DIRECTORY": 2,
                 "FILE_TYPE_SYMLINK": 3},
    "EventType": {"EVENT_TYPE_UNSPECIFIED": 0, "EVENT_TYPE_CREATE": 1, "EVENT_TYPE_WRITE": 2,
                  "EVENT_TYPE_REMOVE": 3, "EVENT_TYPE_RENAME": 4, "EVENT_TYPE_CHMOD": 5},
}, deps=("google/protobuf/timestamp.proto",))
