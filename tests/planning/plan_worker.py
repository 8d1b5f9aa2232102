"""Plans and a real run of the same small model on 8 CPU devices; prints their figures as
JSON (tests/planning/test_plan.py reads them)."""

from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
)

import dataclasses  # noqa: E402
import json  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
from pathlib import Path  # noqa: E402

import datasets  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402

from jaxtrain import Trainer, TrainingArguments  # noqa: E402
from jaxtrain.observability.flops import attention_flops_per_token, dense_flops_per_token  # noqa: E402
from jaxtrain.planning.program import build_config, model_factory, plan_program  # noqa: E402

SEQ, ROWS, ACCUM = 128, 16, 2
MODEL = {
    "model_type": "llama",
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 384,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "pad_token_id": 0,
}


def arguments(out: str, mesh: tuple[int, ...]) -> TrainingArguments:
    return TrainingArguments(
        output_dir=out,
        max_steps=1,
        total_batch_size=ROWS,
        gradient_accumulation_steps=ACCUM,
        max_sequence_length=SEQ,
        sharding_axis_dims=mesh,
        report_to=["jsonl"],
        progress_bar="none",
        compilation_cache_dir=None,
        run_report=False,
        evaluation_strategy="no",
        save_steps=None,
    )


def collectives(figures: dict) -> dict:
    return {k: v for k, v in figures["collectives"].items() if v["count"]}


def main() -> None:
    tmp = tempfile.mkdtemp()
    config = build_config(MODEL)
    fsdp = (1, 8, 1, 1, 1)
    args = arguments(str(Path(tmp) / "run"), fsdp)
    plan = plan_program(config, args, jax.devices())

    # The real run: rows of random tokens, every position real.
    rows = np.random.default_rng(0).integers(1, 512, (ROWS * 2, SEQ)).tolist()
    trainer = Trainer(
        arguments=args,
        model=model_factory(config),
        dataset_train=datasets.Dataset.from_dict({"input_ids": rows}),
    )
    trainer.train()
    run_info = json.loads((Path(tmp) / "run" / "run_info.json").read_text())
    host_batch = next(trainer.train_source.loader.batches())
    trainer_flops = trainer.monitor.flops.batch_flops(host_batch)

    tokens = ROWS * SEQ
    analytic_full_attention = tokens * (
        dense_flops_per_token(config) + attention_flops_per_token(config, SEQ, causal=False)
    )
    deep = dataclasses.replace(config, num_hidden_layers=6)
    whole = plan_program(deep, args, jax.devices(), layers="all")
    unit = plan_program(deep, args, jax.devices(), layers="unit")
    tp = plan_program(
        config, dataclasses.replace(args, sharding_axis_dims=(4, 1, 1, 2, 1)), jax.devices()
    )
    parameter_bytes = 4 * plan["num_parameters"]
    json.dump(
        {
            "plan_peak": plan["peak_bytes"],
            "run_peak": run_info["train_step_memory"]["peak"],
            "plan_model_flops": plan["model_flops"],
            "trainer_flops": trainer_flops,
            "plan_matmul_flops": plan["matmul_flops"] * 8,
            "analytic_full_attention": analytic_full_attention,
            "parameter_bytes": parameter_bytes,
            "fsdp_collectives": collectives(plan),
            "tp_collectives": collectives(tp),
            "layers": config.num_hidden_layers,
            "whole": {k: whole[k] for k in ("peak_bytes", "matmul_flops", "bytes_accessed")},
            "unit": {k: unit[k] for k in ("peak_bytes", "matmul_flops", "bytes_accessed")},
            "whole_collectives": collectives(whole),
            "unit_collectives": collectives(unit),
            "unit_method": unit["method"],
        },
        sys.stdout,
    )


if __name__ == "__main__":
    main()
