"""What runs inside the guest, on its bare standard library.

==================  ===========================================================================
``protocol``        the framed host↔guest protocol (also imported by the host's agent client)
``paths``           every guest path, named once (also imported by the host)
``init``            PID 1: mounts, identity, network, the agent, reaping, power-off
``agent``           the agent: sessions, HELLO, and the dispatch of requests to ``ops.OPS``
``transports``      where the agent's host connections come from: virtio-serial, vsock, Unix
``channel``         a host connection (``Session``) and its requests (``Channel``)
``ops``             the one table of operations (op name → handler) and their modules:
                    ``commands`` (exec), ``files``, ``tunnels`` (connect), ``terminals``
                    (pty), ``watches`` (watch), ``machine`` (hello, set_time, reseed,
                    identity); ``common`` and ``process`` are what they share
``spawn``           starting a command in its own process group, its pipes read paced
``users``           who a command runs as: a user the host names, its ids taken at the spawn
``terminal``        a program on a pseudo-terminal (the ``pty`` op's machinery)
``watch``           file changes from inotify (the ``watch`` op's machinery)
``identity``        a guest's hostname, machine-id and fork generation
``net``             the guest's network from ``hangar.net=``
``desktop``         the X desktop supervisor (Xvfb, openbox, x11vnc), run by its own process
==================  ===========================================================================

Every module here travels into the guest in the initramfs
(``hangar.images.initramfs.guest_sources``) and imports only the standard
library and ``hangar.guest`` (``tests/test_guest_ops.py``).
"""
