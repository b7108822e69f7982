"""Training: the loop, checkpoints, accounting, telemetry, the memory plan and determinism."""
