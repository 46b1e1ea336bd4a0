"""E2B's data plane: envd's protocol, served under ``/e2b/envd`` for E2B's unmodified SDKs.

``E2B_SANDBOX_URL=http://HOST:8080/e2b/envd``: every request names its
sandbox in ``E2b-Sandbox-Id`` (and a guest port in ``E2b-Sandbox-Port``), so
no wildcard DNS is needed. HTTP only: it calls the core's typed operations.

==============  ================================================================
``gateway``     the ASGI middleware: routing by header, credentials, dispatch
``tokens``      the sandbox's envd access token, signed file URLs
``versions``    the envd version reported, envd's port, the prefix
``connect``     Connect RPC: codecs, envelopes, errors, unary/server/client streams
``messages``    envd's messages (process, filesystem) as run-time descriptors
``process_run`` Start, Connect, List
``process_io``  SendInput, StreamInput, CloseStdin, SendSignal, Update
``fs_entries``  Stat, MakeDir, Move, ListDir, Remove
``fs_watch``    WatchDir, CreateWatcher, GetWatcherEvents, RemoveWatcher
``rest``        /health, /files, /envs, /metrics; internal routes refused
``ports``       other guest ports, through Hangar's port proxy
==============  ================================================================

What is served, partly served or not: docs/e2b.md.
"""
