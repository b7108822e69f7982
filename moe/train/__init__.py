"""Training: the loop and its callbacks (checkpoint cadence, step profile, monitors), checkpoints,
throughput, telemetry and determinism. The memory plan and parameter counts: moe.plan."""
