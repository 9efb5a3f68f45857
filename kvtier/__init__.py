"""kvtier: node-local KV-cache tiering for hybrid-attention LLM inference."""

__version__ = "0.1.0"
