"""Small, offline models and data modules for lightning_muon's configs, tests and benchmarks.

Run from the repository root, so that ``examples`` is importable
(``python -m examples.char_gpt``, or class paths like
``examples.char_gpt.CharGPT`` in a LightningCLI config).
"""
