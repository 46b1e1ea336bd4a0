"""What runs inside the guest, on its bare standard library.

``protocol`` (the framed host↔guest protocol, also imported by the host's
``hangar.engines.agent_client``), ``agent``, ``init``, ``identity`` (a
guest's hostname, machine-id and fork generation), ``net`` and ``desktop``. Every module here travels into the guest in the initramfs
(``hangar.images.initramfs.guest_sources``).
"""
