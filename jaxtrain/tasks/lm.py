"""--task lm: the plain causal LM Trainer on text or token rows."""

from jaxtrain.arguments import TrainingArguments
from jaxtrain.tasks.batches import lm_batch
from jaxtrain.tasks.task import Task

TASK = Task(
    name="lm",
    arguments=TrainingArguments,
    trainer="jaxtrain.training.trainer:Trainer",
    rows="text or input_ids",
    batch=lm_batch,
    wrapped=False,
)
