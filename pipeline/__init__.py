"""The pipeline around the moe library: stages, tracking, launch and the `moe` CLI."""
