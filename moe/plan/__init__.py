"""`moe plan`: what a config costs before it runs. Parameter counts and FLOPs per token from the
model config (accounting), every rank's weight and optimizer bytes from the real layout code on
a meta model (ranks), what an FP8 recipe releases, copies and saves, read from its own rule and
layers (fp8), activation bytes per token (activations, scaled by calibration.json), the plan of
a job with its verdict, knobs and the GPU count that fits (planner) and its text (report); the
CPU host's memory check before a local run (host)."""
