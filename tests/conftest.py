import os

# Tests share one tokenizer cache per session, never the user's ~/.cache.
os.environ.setdefault("JAXTRAIN_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))


# The file that runs longest (every docs block, ~5 minutes) starts first: started last, it
# alone kept one worker busy after the other had finished (make test: --no-loadscope-reorder).
LONGEST_FIRST = ("tests/test_docs.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in LONGEST_FIRST)
