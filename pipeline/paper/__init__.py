"""The paper's system experiments as a pipeline: one stage per claim, then a report.

``bench/paper/dvc.yaml`` runs the stages (``moe paper stage NAME``) and the report
(``moe paper report``); ``moe paper repro`` wraps ``dvc repro`` of that file (bench/paper is a
DVC project of its own, apart from the main pipeline's lock and status), or runs the
stages in order itself (``--no-dvc``) where DVC is not installed, e.g. inside a GPU image.
"""
