"""Generation as an engine: continuous batching over a paged KV cache (engine.py), used by
GRPO's rollouts and by `jaxtrain serve` (server.py)."""

from jaxtrain.serving.engine import Engine
from jaxtrain.serving.requests import Completion
from jaxtrain.serving.sampling import SamplingParams

__all__ = ["Completion", "Engine", "SamplingParams"]
