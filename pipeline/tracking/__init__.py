"""MLflow tracking, one module a job: the client and its limits, provenance tags, a stage's run,
the job's sink, and the offline spool."""
