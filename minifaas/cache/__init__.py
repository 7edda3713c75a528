"""The hybrid prefix cache: chained block keys, the per-cluster pool, and the gateway's global view."""
