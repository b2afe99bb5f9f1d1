"""Evaluation: synthetic long-context tasks, string-match scoring, a resumable grid runner,
and reports (JSON, markdown, plots). See ``docs/evaluation.md``."""

from .engines import Engine, EngineError, Reply, TransformersEngine
from .report import build_report, markdown_report, markdown_table
from .runner import Grid, run_grid
from .scoring import mean_ci, score, string_match_all, string_match_part, wilson
from .tasks import Sample, TaskError, expand_tasks, make_sample, make_samples, task_names

__all__ = [
    "Engine", "EngineError", "Grid", "Reply", "Sample", "TaskError", "TransformersEngine",
    "build_report", "expand_tasks", "make_sample", "make_samples", "markdown_report",
    "markdown_table", "mean_ci", "run_grid", "score", "string_match_all", "string_match_part",
    "task_names", "wilson",
]  # fmt: skip
