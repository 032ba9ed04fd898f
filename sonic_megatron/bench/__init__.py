"""Benchmarks behind ``python -m sonic_megatron bench <name>``; shared helpers in ``common.py``."""
