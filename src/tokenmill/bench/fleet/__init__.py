"""The planner and the fleet simulator: simulated and live planner runs, live-versus-simulated agreement, simulator speed."""
