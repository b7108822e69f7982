"""`python -m pipeline.paper ...`: the `moe paper` commands without the rest of the CLI."""

from pipeline.paper.cli import paper_app

if __name__ == "__main__":
    paper_app()
