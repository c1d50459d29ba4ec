"""Speculative decoding: proposers (n-gram prompt lookup) and the per-request state the engine verifies against."""
