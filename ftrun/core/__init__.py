"""Vocabulary, specs, states and the pure decisions: what everything else builds on.

Owns: errors with hints, named timeouts, the run spec, state enums with their transitions, exit
descriptions, fault kinds, worker roles and membership, and `policy` (every recovery and
detection decision, with its reason). No I/O, no clocks read in decisions.
Must not import: anything outside the standard library and `ftrun.core`.
"""
