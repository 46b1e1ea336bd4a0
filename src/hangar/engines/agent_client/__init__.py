"""Host side of the guest agent protocol (see ``hangar.guest.protocol``).

One ``AgentClient`` holds one connection to one guest's agent channel and
multiplexes any number of calls over it. An engine says only how to open
its channel (``AgentChannel``); ``AgentClient.handshake`` does the rest.
This package runs on the host; ``hangar.guest`` holds only what runs in the
guest. One module per job:

    connection  ``Connection``: the framed session: the one handshake
                (``AgentChannel``, ``unix_channel``), the read loop, the
                channel table, plain calls, ``Deadlines``, agent error codes
    channel     ``Channel``: one call's frames, its flow-control windows both
                ways and its deadline
    client      ``AgentClient``: every call, one typed method per guest
                operation; itself the calls that carry streams (exec, file
                read and write) and open long-lived channels
    files       plain file calls (``FileCalls``: stat, list_dir, mkdir,
                remove) and their answers (``GuestFile``, ``GuestFolder``)
    machine     calls on the guest as a machine (``MachineCalls``: ping,
                set_time, reseed, set_identity) and their answers
                (``ClockSet``, ``Reseeded``, ``Identity``)
    streams     handles of long-lived channels: ``Tunnel``, ``PtyChannel``
                (a terminal), ``WatchChannel`` (a file watch)
    processes   processes that outlive their connection: ``ProcInfo`` (an
                entry of the guest's table), ``ProcEvent``, ``ProcessStream``
                (an attached output) and the start request (``proc_meta``)
    results     ``ExecResult``, ``StreamCapture``, ``ExecEvent``, ``PtyExit``
                and the exec request (``exec_meta``; ``OWN_HEAD``/``OWN_TAIL``,
                the capture of an exec that names none)

Bounds. A guest is hostile, so nothing it sends is buffered without bound:

* Flow control (protocol version 2, ``channel``): per channel the guest may
  have at most ``WINDOW`` bytes that the host's consumer has not taken; a
  guest that sends more loses the call (``GuestError``). The host's own
  DATA keeps to the guest's window and waits for the stream to drain.
* Deadlines (``Deadlines``): every call has one; a call whose guest does
  not answer in time fails with ``Timeout`` (504), the guest is told to
  CANCEL it, and ``on_unanswered`` is called (the orchestrator marks the
  sandbox ``unresponsive``).
* A consumer that gives up (an iterator closed early, an HTTP client gone)
  CANCELs the call in the guest: an exec's process group is killed, a file
  or socket closed, a terminal hung up, a watch stopped.
* An exec's captured output is what its request asked for at most
  (``head`` + ``tail`` bytes a stream; ``OWN_HEAD``/``OWN_TAIL`` when it
  names none): an answer with more is a ``GuestError``, never read.
* A HELLO with another ``boot_id`` on an open connection means the agent
  restarted: every open call fails at once instead of waiting for its
  deadline.

Agent error codes become ``hangar.errors`` classes (``ERRORS``):

==================  ======================
agent code          raised
==================  ======================
not_found           NotFound
is_directory,       InvalidRequest
not_directory,
invalid,
permission_denied
exists, not_empty,  Conflict
closed
busy                Busy (409, retryable)
too_many            LimitExceeded (429)
anything else       GuestError
==================  ======================

A lost connection fails every open request with ``GuestError``.
"""

from hangar.engines.agent_client.channel import Channel
from hangar.engines.agent_client.client import AgentClient
from hangar.engines.agent_client.connection import (
    ERRORS,
    PROBE_CHANNEL_BASE,
    SessionRestarted,
    AgentChannel,
    Connection,
    Deadlines,
    Streams,
    unix_channel,
)
from hangar.engines.agent_client.files import GuestFile, GuestFolder
from hangar.engines.agent_client.machine import ClockSet, Identity, Reseeded
from hangar.engines.agent_client.processes import (
    ProcEvent,
    ProcessStream,
    ProcInfo,
    ProcSignalled,
    proc_meta,
)
from hangar.engines.agent_client.results import (
    OWN_HEAD,
    OWN_TAIL,
    CaptureTooLong,
    ExecEvent,
    ExecResult,
    PtyExit,
    StreamCapture,
    exec_meta,
)
from hangar.engines.agent_client.streams import PtyChannel, Tunnel, WatchChannel

__all__ = [
    "ERRORS",
    "OWN_HEAD",
    "OWN_TAIL",
    "CaptureTooLong",
    "PROBE_CHANNEL_BASE",
    "AgentChannel",
    "AgentClient",
    "Channel",
    "ClockSet",
    "Connection",
    "Deadlines",
    "ExecEvent",
    "ExecResult",
    "GuestFile",
    "GuestFolder",
    "Identity",
    "ProcEvent",
    "ProcInfo",
    "ProcessStream",
    "ProcSignalled",
    "PtyChannel",
    "PtyExit",
    "Reseeded",
    "SessionRestarted",
    "StreamCapture",
    "Streams",
    "Tunnel",
    "WatchChannel",
    "exec_meta",
    "proc_meta",
    "unix_channel",
]
