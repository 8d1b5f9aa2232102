import os

# Tests share one tokenizer cache per session, never the user's ~/.cache.
os.environ.setdefault("JAXTRAIN_CACHE", os.path.join(os.path.dirname(__file__), ".cache"))


# The longest file (every block of the docs, ~5 minutes alone) first: under pytest-xdist
# (`make test`) one worker starts it at once while the other takes the rest, instead of the
# whole suite waiting for it at the end.
FIRST = ("tests/test_docs.py",)


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.nodeid.split("::")[0] not in FIRST)  # stable
