"""Fault tolerance for loops people already have: PyTorch Lightning's Trainer
(`ftrun.integrations.lightning`) and Hugging Face's Trainer (`ftrun.integrations.transformers`).

Each integration drives the worker API (`ftrun.worker.api`) from its framework's own hooks, so
a user's LightningModule or Trainer script runs unchanged apart from one argument.
Must not import: the frameworks at package import (each module imports its framework itself,
and `import ftrun` never loads this package), typer, rich, NVML, the agent or the CLI.
"""
