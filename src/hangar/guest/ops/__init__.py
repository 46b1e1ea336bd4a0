"""The guest agent's operations: ``OPS``, the one table of op name → handler.

The agent (``hangar.guest.agent``) looks each REQUEST's ``meta["op"]`` up
here and awaits the handler (``common.Handler``: ``handler(agent, meta,
ch)``); an op not in the table is answered ERROR ``invalid``. The host
sends each of these names and no other (``tests/test_guest_ops.py`` holds
the two sides to one list).

==============  ===========  =====================================================
op              module       what it does
==============  ===========  =====================================================
``hello``       machine      agent version, protocol version, boot id, uptime (s),
                             window, requests in progress, fork generation
``exec``        commands     run a command; output captured or streamed
``read_file``   files        stream a file's bytes as DATA frames (stream ``file``)
``write_file``  files        receive DATA frames until EOF; write atomically
``list_dir``    files        entries of a directory
``stat``        files        one entry
``mkdir``       files        make a directory (``parents`` like ``mkdir -p``)
``remove``      files        remove a file, or a directory (``recursive``)
``connect``     tunnels      a TCP tunnel to a port inside the guest
``pty``         terminals    a program on a pseudo-terminal (``hangar.guest.terminal``)
``watch``       watches      file changes under a path (``hangar.guest.watch``)
``set_time``    machine      set the wall clock, used after a restore
``reseed``      machine      mix host entropy into the kernel's pool, after a restore
``identity``    machine      a fork's own hostname, machine-id and fork generation
``proc_*``      processes    processes that outlive their connection
                             (``hangar.guest.procs``): ``proc_start``,
                             ``proc_list``, ``proc_attach``, ``proc_input``,
                             ``proc_close_stdin``, ``proc_signal``,
                             ``proc_resize``, ``proc_remove``
==============  ===========  =====================================================

Shared by the handlers: ``common`` (``OpError``, the errno → code map, path
resolution, the base environment) and ``process`` (a command's argv, env
and cwd, checked; the shell's answer for a program that cannot start).
"""

from __future__ import annotations

from hangar.guest.ops import commands, files, machine, processes, terminals, tunnels, watches
from hangar.guest.ops.common import AgentView, Handler, OpError, Result

OPS: dict[str, Handler] = {
    "hello": machine.hello,
    "exec": commands.exec_command,
    "read_file": files.read_file,
    "write_file": files.write_file,
    "list_dir": files.list_dir,
    "stat": files.stat,
    "mkdir": files.mkdir,
    "remove": files.remove,
    "connect": tunnels.connect,
    "pty": terminals.pty,
    "watch": watches.watch,
    "set_time": machine.set_time,
    "reseed": machine.reseed,
    "identity": machine.identity,
    "proc_start": processes.proc_start,
    "proc_list": processes.proc_list,
    "proc_attach": processes.proc_attach,
    "proc_input": processes.proc_input,
    "proc_close_stdin": processes.proc_close_stdin,
    "proc_signal": processes.proc_signal,
    "proc_resize": processes.proc_resize,
    "proc_remove": processes.proc_remove,
}
"""Every operation the agent serves, by the name a REQUEST gives in ``meta["op"]``."""

__all__ = ["OPS", "AgentView", "Handler", "OpError", "Result"]
