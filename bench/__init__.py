"""Benchmarks: run on the accelerator machine, print a table, write JSON to bench/results/."""
