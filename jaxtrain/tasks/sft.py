"""--task sft: supervised fine-tuning on text, chats or prompt/completion pairs (the causal LM
loss on the completions)."""

from jaxtrain.task_arguments import SFTArguments
from jaxtrain.tasks.batches import lm_batch
from jaxtrain.tasks.task import Task

SFT_ROWS = "text, messages or prompt+completion"

TASK = Task(
    name="sft",
    arguments=SFTArguments,
    trainer="jaxtrain.trainers.sft:SFTTrainer",
    rows=SFT_ROWS,
    batch=lm_batch,
    wrapped=False,
)
