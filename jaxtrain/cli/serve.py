"""`jaxtrain serve MODEL_OR_RUN_DIR`: the OpenAI-compatible server (jaxtrain/serving/server.py).

jaxtrain serve runs/demo [--host 127.0.0.1] [--port 8000] [--max_slots 8]
               [--page_size 16] [--max_length N] [--num_pages N] [--model_name NAME]
"""

from __future__ import annotations

import sys

from jaxtrain.errors import ArgumentError

SERVE_USAGE = (
    "jaxtrain serve MODEL_OR_RUN_DIR [--host 127.0.0.1] [--port 8000] [--max_slots 8] "
    "[--page_size 16] [--max_length N] [--num_pages N] [--model_name NAME]"
)
OPTIONS = {
    "host": str,
    "port": int,
    "max_slots": int,
    "page_size": int,
    "max_length": int,
    "num_pages": int,
    "model_name": str,
}


def parse_serve_options(tokens: list[str]) -> tuple[str, dict]:
    """(the model path, the options) of the command line; ArgumentError naming what is wrong."""
    from jaxtrain.cli.run_config import parse_overrides
    from jaxtrain.cli.usage import split_positional

    path, rest = split_positional(tokens)
    if path is None:
        raise ArgumentError(f"jaxtrain serve needs MODEL_OR_RUN_DIR.\nusage: {SERVE_USAGE}")
    options: dict = {"host": "127.0.0.1", "port": 8000, "max_slots": 8, "page_size": 16}
    for key, value in parse_overrides(rest).items():
        if key not in OPTIONS:
            raise ArgumentError(f"jaxtrain serve: unknown option --{key}.\nusage: {SERVE_USAGE}")
        try:
            options[key] = OPTIONS[key](value)
        except (TypeError, ValueError):
            raise ArgumentError(f"--{key} {value!r}: expected {OPTIONS[key].__name__}.") from None
    for key in ("port", "max_slots", "page_size", "max_length", "num_pages"):
        if key in options and options[key] <= 0:
            raise ArgumentError(f"--{key} must be positive, got {options[key]}.")
    return path, options


def cmd_serve(tokens: list[str]) -> int:
    path, options = parse_serve_options(tokens)
    try:
        import fastapi  # noqa: F401
        import uvicorn
    except ImportError:
        raise ArgumentError(
            "jaxtrain serve needs the serve extra: pip install 'jaxtrain[serve]'."
        ) from None
    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.serving import Engine
    from jaxtrain.serving.server import create_app

    model, tokenizer, name = load_served_model(path)
    name = options.get("model_name") or name
    engine = Engine(
        model,
        tokenizer=tokenizer,
        max_slots=options["max_slots"],
        page_size=options["page_size"],
        max_length=options.get("max_length"),
        num_pages=options.get("num_pages"),
    )
    app = create_app(engine, model_name=name, tokenizer=tokenizer)
    host, port = options["host"], options["port"]
    print(
        f"jaxtrain serve: {name} at http://{host}:{port}/v1 ({engine.max_slots} slots, "
        f"context {engine.max_length} tokens)",
        flush=True,
    )
    uvicorn.run(app, host=host, port=port, log_level="warning")
    return 0


if __name__ == "__main__":
    sys.exit(cmd_serve(sys.argv[1:]))
