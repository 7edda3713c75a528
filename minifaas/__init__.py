"""minifaas: Prefill-as-a-Service, cross-datacenter prefill/decode disaggregation for hybrid-attention LLMs."""

__version__ = "0.1.0"
