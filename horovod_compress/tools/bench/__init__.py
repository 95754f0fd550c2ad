"""Benchmarks and the demo; each module may add ``hvdc`` sub-commands (see cli.py)."""
