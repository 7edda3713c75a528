"""The KV transport: the wire format, the sender and receiver, reassembly, and the transfer table."""
