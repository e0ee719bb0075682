"""Discrete-event simulation of one training step: Mobius (bound; the dispatched schedule in
:mod:`mobius.sim.dispatched`) and its baselines."""

from mobius.sim.engine import Link, SimResult, Simulator, link_for
from mobius.sim.schedules import SimOutcome, simulate_gpipe, simulate_mobius, simulate_zero3_offload

__all__ = ["Link", "SimOutcome", "SimResult", "Simulator", "link_for", "simulate_gpipe", "simulate_mobius",
           "simulate_zero3_offload"]
