"""Benchmark evaluations with lm-eval-harness tasks, during training and after it.

  task_files.py  task YAML files found and checked: local files and local data only
  harness.py     TaskSuite: the tasks loaded once, evaluated as often as asked
  lm.py          JaxLM: a jaxtrain model behind lm-eval's LM interface
  scoring.py     the compiled, batched log-likelihood step
  examples/      two small local tasks (multiple choice, generate-until exact match)

lm-eval is imported only when tasks are used (the `eval` extra).
"""

from jaxtrain.evaluation.task_files import EXAMPLES, example_tasks, read_task

__all__ = ["EXAMPLES", "example_tasks", "read_task"]
