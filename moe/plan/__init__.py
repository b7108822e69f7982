"""`moe plan`: what a config costs before it runs. Parameter counts and FLOPs per token from the
model config (accounting), every rank's weight and optimizer bytes from the real layout code on
a meta model (ranks), activation bytes per token (activations, scaled by calibration.json), the
plan of a job with its verdict and knobs (planner) and its text (report); the CPU host's memory
check before a local run (host)."""
