"""Host↔guest agent: the framed protocol, the in-guest agent, and its host client.

``protocol``, ``agent`` and ``init`` run inside the guest on the bare
standard library; ``client`` runs on the host.
"""
