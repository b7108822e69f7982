"""A Slurm job that reached slurm.max_requeues records why, through the full tracking URI."""

import pytest

from pipeline.train_job import TrainJob


@pytest.mark.slow
def test_stop_reason_reaches_a_password_protected_server(password_mlflow, monkeypatch, tmp_path):
    """Issue 26: the job tagged its run through job.json's redacted URI (`alice:***@`), which a
    server behind basic auth refuses: the stop reason was never recorded."""
    from mlflow.tracking import MlflowClient

    from pipeline.redact import redact
    from pipeline.requeue import _record_stop
    from pipeline.tracking.job import SECRET_URI_ENV

    full, backend = password_mlflow
    client = MlflowClient(backend)
    exp = client.create_experiment("requeue-auth")
    run_id = client.create_run(exp).info.run_id
    monkeypatch.setenv(SECRET_URI_ENV, full)  # what the submitter hands its jobs
    job = TrainJob(config={}, run_dir=str(tmp_path), mlflow_uri=redact(full), mlflow_run_id=run_id, mlflow_finalize=True)
    _record_stop(job, "slurm.max_requeues=3 reached")
    run = client.get_run(run_id)
    assert run.data.tags.get("moe.stop_reason") == "slurm.max_requeues=3 reached"
    assert run.info.status == "FAILED"
