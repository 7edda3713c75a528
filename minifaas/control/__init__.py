"""Authenticated control channels: the one mechanism every control port of a deployment uses.

``session`` (the KV link's handshake, then signed, bounded JSON messages),
``server`` (one client at a time, a second refused, a silent one dropped),
``heartbeat`` (pings and a deadline on the client side), ``schema`` (what each
message may hold) and ``secret`` (the cluster secret from a file or the
environment). Torch-free, and it knows nothing of what the messages mean.
"""
