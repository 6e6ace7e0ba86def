"""Attention and fused ops. Each GPU kernel has a plain-torch twin with the same
signature: the twin is the CPU path and the test oracle."""
