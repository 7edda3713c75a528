"""The hybrid prefix cache: chained block keys, the prefix pool, and the gateway's global view."""
