from tests.pipeline.conftest import workspace  # noqa: F401  (the pipeline working-directory fixture)
