"""Placement planning: hardware profiles, cost model, planner, what-if simulation (numpy only)."""
