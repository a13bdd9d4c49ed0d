"""Small, offline models and data modules for lightning_muon's shipped configs, tests and benchmarks.

Installed with the package: class paths like ``lightning_muon.examples.char_gpt.CharGPT`` work in a
LightningCLI config from any directory, and ``python -m lightning_muon.examples.char_gpt`` trains the main job.
Nothing else in ``lightning_muon`` imports them.
"""
