"""`python -m pipeline.paper ...`: the `moe paper` commands without the rest of the CLI."""

from pipeline.paper.cli import paper_app
from pipeline.verbosity import configure_logging

if __name__ == "__main__":
    configure_logging()
    paper_app()
