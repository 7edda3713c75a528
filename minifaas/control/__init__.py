"""Authenticated control channels: the one mechanism every control port of a deployment uses.

A signed session, a one-client server, heartbeats, message schemas and the cluster secret. Torch-free, and it
knows nothing of what the messages mean.
"""
