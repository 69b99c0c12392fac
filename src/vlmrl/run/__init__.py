"""A run around the loops: its datasets, the run folder's rules, preflight checks and the planner's verdict,
export, metrics logs, trackers and the report."""
