"""Speculative decoding: proposers that guess the next tokens cheaply, and the exact check that
keeps the target model's output distribution (docs/speculative.md)."""
