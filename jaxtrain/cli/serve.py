"""`jaxtrain serve MODEL_OR_RUN_DIR`: the OpenAI-compatible server (jaxtrain/serving/server.py).

jaxtrain serve runs/demo [--host 127.0.0.1] [--port 8000] [--api_key KEY] [--max_slots 8] ...

The options, their defaults and what each limit answers: SERVE_HELP (cli/help.py) and
docs/serving.md. Binding anything but loopback without a key is refused here, before the
model loads, unless `--allow_unauthenticated true` says it is meant. Before the port opens the
engine compiles every shape a request can reach (`--warm_up false` skips it: a faster start,
and the first requests of each new shape pay its compile); the programs go to JAX's persistent
compilation cache (`--compilation_cache_dir`, as training's), so a restart loads them.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import sys
import time
from typing import TYPE_CHECKING, Any

from jaxtrain.errors import ArgumentError

if TYPE_CHECKING:
    from jaxtrain.serving import Engine
    from jaxtrain.serving.limits import ServeLimits

SERVE_USAGE = (
    "jaxtrain serve MODEL_OR_RUN_DIR [--host 127.0.0.1] [--port 8000] [--api_key KEY] "
    "[--allow_unauthenticated false] [--max_slots 8] [--page_size 16] [--max_length N] "
    "[--num_pages N] [--model_name NAME] [--max_body_bytes 4194304] [--max_prompt_tokens N] "
    "[--max_tokens N] [--max_n N] [--max_stop 4] [--max_stop_length 128] [--max_queue 128] "
    "[--request_timeout 600] [--warm_up true] [--kv_cache_gib G] [--memory_fraction F] "
    "[--prefill_tokens 512] [--speculative_tokens 0] [--decode_steps 1] [--attention auto] "
    "[--max_images 1] [--compilation_cache_dir auto] "
    "[--lora NAME=ADAPTER_DIR[,NAME=ADAPTER_DIR...]]"
)
API_KEY_VARIABLE = "JAXTRAIN_API_KEY"


def _flag(value: str) -> bool:
    if value.lower() in ("true", "1", "yes"):
        return True
    if value.lower() in ("false", "0", "no"):
        return False
    raise ValueError(value)


_flag.__name__ = "true or false"


def _adapters(value: str) -> dict[str, str]:
    """--lora's NAME=DIR pairs (PEFT adapter directories served on the model, by name)."""
    pairs = [item.split("=", 1) for item in value.split(",") if item.strip()]
    if not pairs or any(len(p) != 2 or not p[0].strip() or not p[1].strip() for p in pairs):
        raise ValueError(value)
    names = [name.strip() for name, _ in pairs]
    if len(set(names)) != len(names):
        raise ValueError(value)
    return {name.strip(): path.strip() for name, path in pairs}


_adapters.__name__ = "NAME=ADAPTER_DIR pairs, comma-separated, each name once"


def _cache_dir(value: str) -> str | None:
    """--compilation_cache_dir: "auto", a directory, or off (None)."""
    return None if value.strip().lower() in ("", "null", "none", "off", "false") else value


_cache_dir.__name__ = "auto, a directory, or null"
OPTIONS = {
    "host": str,
    "port": int,
    "api_key": str,
    "allow_unauthenticated": _flag,
    "max_slots": int,
    "page_size": int,
    "max_length": int,
    "num_pages": int,
    "model_name": str,
    "max_body_bytes": int,
    "max_prompt_tokens": int,
    "max_tokens": int,
    "max_n": int,
    "max_stop": int,
    "max_stop_length": int,
    "max_queue": int,
    "request_timeout": float,
    "warm_up": _flag,
    "kv_cache_gib": float,
    "memory_fraction": float,
    "prefill_tokens": int,
    "speculative_tokens": int,
    "decode_steps": int,
    "attention": str,
    "max_images": int,
    "lora": _adapters,
    "compilation_cache_dir": _cache_dir,
}
# Options handed to the Engine as they are (it checks them and names the one that is wrong).
ENGINE_OPTIONS = ("max_length", "num_pages", "kv_cache_gib", "memory_fraction",
                  "prefill_tokens", "speculative_tokens", "decode_steps", "attention",
                  "max_images")  # fmt: skip
LIMITS = (
    "max_body_bytes",
    "max_prompt_tokens",
    "max_tokens",
    "max_n",
    "max_stop",
    "max_stop_length",
    "max_queue",
    "request_timeout",
)


def is_loopback(host: str) -> bool:
    """Whether `host` is reachable from this machine only (127.0.0.0/8, ::1, localhost)."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name: it may resolve to any address
        return False


def parse_serve_options(tokens: list[str]) -> tuple[str, dict]:
    """(the model path, the options) of the command line; ArgumentError naming what is wrong."""
    from jaxtrain.cli.run_config import parse_overrides
    from jaxtrain.cli.usage import split_positional

    path, rest = split_positional(tokens)
    if path is None:
        raise ArgumentError(f"jaxtrain serve needs MODEL_OR_RUN_DIR.\nusage: {SERVE_USAGE}")
    options: dict = {
        "host": "127.0.0.1", "port": 8000, "max_slots": 8, "page_size": 16, "warm_up": True,
        "compilation_cache_dir": "auto",
    }  # fmt: skip
    for key, value in parse_overrides(rest).items():
        if key not in OPTIONS:
            raise ArgumentError(f"unknown option --{key}.\nusage: {SERVE_USAGE}")
        try:
            options[key] = OPTIONS[key](value)
        except (TypeError, ValueError):
            raise ArgumentError(f"--{key} {value!r}: expected {OPTIONS[key].__name__}.") from None
    for key in ("port", "max_slots", "page_size", "max_length", "num_pages"):
        if key in options and options[key] <= 0:
            raise ArgumentError(f"--{key} must be positive, got {options[key]}.")
    if options["port"] > 65535:
        raise ArgumentError(f"--port must be at most 65535, got {options['port']}.")
    options["api_key"] = options.get("api_key") or os.environ.get(API_KEY_VARIABLE) or None
    host = options["host"]
    if (
        not options["api_key"]
        and not is_loopback(host)
        and not options.get("allow_unauthenticated")
    ):
        raise ArgumentError(
            f"--host {host} is reachable from other machines and no API key is set: pass "
            f"--api_key KEY (or set {API_KEY_VARIABLE}), or --allow_unauthenticated true."
        )
    return path, options


def serve_limits(options: dict) -> ServeLimits:
    """The limits the options set (ServeLimits' defaults for the others)."""
    from jaxtrain.serving.limits import ServeLimits

    try:
        return ServeLimits(**{key: options[key] for key in LIMITS if key in options})
    except ValueError as err:
        raise ArgumentError(f"--{err}.") from None


def warm_up(engine: Engine, max_prompt_tokens: int | None) -> str:
    """Compile every shape a request within `max_prompt_tokens` can reach (Engine.warm_up),
    so that serving compiles nothing; the line `jaxtrain serve` prints about it."""
    began = time.perf_counter()
    shapes = engine.warm_up(max_prompt_tokens=max_prompt_tokens)
    longest = min(max_prompt_tokens or engine.max_length, engine.max_length)
    return (
        f"jaxtrain serve: compiled {shapes} shapes in {time.perf_counter() - began:.1f} s "
        f"(prompts up to {longest} tokens)"
    )


def build_engine(model: Any, tokenizer: Any, options: dict) -> Engine:
    """The engine the options describe (slots, pages, memory budget, prefill chunk,
    speculation, attention kernel)."""
    from jaxtrain.data.vision import text_tokenizer
    from jaxtrain.serving import Engine

    engine_options = {key: options[key] for key in ENGINE_OPTIONS if key in options}
    return Engine(model, tokenizer=text_tokenizer(tokenizer), max_slots=options["max_slots"],
                  page_size=options["page_size"], **engine_options)  # fmt: skip


def serve_adapters(model: Any, name: str, directories: dict[str, str]) -> list[str]:
    """The --lora adapters loaded onto `model` (serving/adapters.py), by name."""
    if name in directories:
        raise ArgumentError(f"--lora {name}=...: {name!r} is the base model's name; rename it.")
    if not directories:
        return []
    from jaxtrain.serving.adapters import load_adapters

    return load_adapters(model, directories)


def cmd_serve(tokens: list[str], own_process: bool = False) -> int:
    """`jaxtrain serve`; `own_process`: the process is the command's (its entry point)."""
    path, options = parse_serve_options(tokens)
    try:
        import fastapi  # noqa: F401
        import uvicorn  # noqa: F401
    except ImportError:
        raise ArgumentError(
            "jaxtrain serve needs the serve extra: pip install 'jaxtrain[serve]'."
        ) from None
    limits = serve_limits(options)  # before the model loads: a bad limit fails fast
    listener = bind_listener(options["host"], options["port"])  # a taken port fails fast too
    from jaxtrain.runtime import serving_environment

    # A restart loads the warm-up's programs instead of compiling them (minutes on a CPU).
    serving_environment(options["compilation_cache_dir"])
    from jaxtrain.cli.collector import freeze_the_heap
    from jaxtrain.cli.served_model import load_served_model
    from jaxtrain.serving.drain import serve_until_drained
    from jaxtrain.serving.server import create_app

    model, tokenizer, name = load_served_model(path)
    name = options.get("model_name") or name
    adapters = serve_adapters(model, name, options.get("lora") or {})
    engine = build_engine(model, tokenizer, options)
    if options["warm_up"]:  # before the port opens: the first request compiles nothing
        print(warm_up(engine, limits.max_prompt_tokens), flush=True)
    app = create_app(
        engine, model_name=name, tokenizer=tokenizer, api_key=options["api_key"], limits=limits,
        adapters=adapters,
    )  # fmt: skip
    host, port = options["host"], options["port"]
    key = "an API key" if options["api_key"] else "no API key"
    print(
        f"jaxtrain serve: {name} at http://{host}:{port}/v1 ({engine.max_slots} slots, "
        f"context {engine.max_length} tokens, {engine.pages.num_pages - 1} KV pages of "
        f"{engine.page_size}, {key})",
        flush=True,
    )
    if adapters:
        print(f"jaxtrain serve: LoRA adapters {', '.join(adapters)} on {name}", flush=True)
    if own_process:
        freeze_the_heap()  # fewer and shorter collection pauses between decode steps
    serve_until_drained(app, listener)
    return 0


def bind_listener(host: str, port: int) -> socket.socket:
    """The server's socket, bound now, before minutes of loading and warm-up (uvicorn listens
    on it once the app is ready: until then a connection is refused, as no server is there)."""
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET  # as uvicorn binds a host
    try:
        listener = socket.socket(family, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind((host, port))
    except OSError as err:
        raise ArgumentError(
            f"--host {host} --port {port}: cannot listen there ({err.strerror or err}); another "
            "server may hold the port: pick another --port, or stop that server."
        ) from None
    return listener


if __name__ == "__main__":
    sys.exit(cmd_serve(sys.argv[1:], own_process=True))
