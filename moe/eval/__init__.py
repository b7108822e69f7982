"""Evaluation: ranked-classification scoring of in-context-learning requests and their metrics
(torch only; the task data and prompts live in pipeline/eval)."""
