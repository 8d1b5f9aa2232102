import os

# Tests share one tokenizer cache per session, never the user's ~/.cache.
os.environ.setdefault("JAXTRAIN_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))
