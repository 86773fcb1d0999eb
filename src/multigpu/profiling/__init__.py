"""Measure: step phases, per-device memory, bytes moved, bandwidth probes."""
