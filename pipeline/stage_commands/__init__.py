"""The `moe` command of each pipeline stage, one module each: ``pipeline/stage_commands/<stage>.py``
holds the function ``command`` (its options, its help text, and the body that runs
``pipeline/stages/<stage>.py``). These modules are light: a body imports its stage (torch, numpy,
mlflow) only when it runs, so `moe --help` stays fast. pipeline/cli.py makes one command of
each module listed here, under the module's name, in this order (the pipeline's, as dvc.yaml
runs them); tests/pipeline/test_stage_declarations.py holds the list to the stage modules and
dvc.yaml. A new stage: its stage module, its command module listed here, its dvc.yaml entry."""

from pipeline.stage_commands import convert, evaluate, release, tokenize, train

STAGE_COMMANDS = (tokenize, train, convert, evaluate, release)
