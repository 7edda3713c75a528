"""The model side: presets, loading, per-layer state, prefill and decode."""
