"""Training a tiny hybrid checkpoint on the CPU: ``minifaas train``."""
