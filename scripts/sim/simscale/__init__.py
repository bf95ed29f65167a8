"""Pieces of `scripts/sim/sim_scale.py` (issue #52): the store-only simulation of a rebuild's
bootstrap exchange (`rebuild`), and what measures the control plane per fault at thousands
of simulated nodes. Each module says what it owns; none imports `sim_scale` itself.
"""
