#!/bin/bash
# One device call (issue 40, part 1): deviceless XLA:GPU plans, validated against the H100
# campaign's measured 1.1B step (34.9 GiB), and the README's 8B on 8 H100s.
export PYTHONPATH=$PWD XLA_PYTHON_CLIENT_MEM_FRACTION=0.95
OUT=${OUT:-/tmp/gpu_probe}; mkdir -p "$OUT"
nvidia-smi -L > "$OUT/gpu.txt" 2>&1
timeout 60 python3 bench/gpu_probe/probe.py "$OUT" > "$OUT/probe.log" 2>&1
JAX_PLATFORMS=cpu timeout 40 python3 bench/gpu_probe/probe.py "$OUT" > "$OUT/probe_cpu.log" 2>&1
python3 -c "import json; json.dump({'model_type': 'llama', 'vocab_size': 32000, 'hidden_size': 2048, 'intermediate_size': 5632, 'num_hidden_layers': 22, 'num_attention_heads': 32, 'num_key_value_heads': 4, 'max_position_embeddings': 4096, 'rope_theta': 10000.0}, open('$OUT/tinyllama.json', 'w'))"
timeout 90 python3 -m jaxtrain.cli plan --hf_config "$OUT/tinyllama.json" --devices 1 --accelerator h100 \
  --total_batch_size 4 --max_sequence_length 4096 --dtype bfloat16 --gradient_checkpointing none \
  --optimizer adamw --model.attention_implementation cudnn --layers all --output "$OUT/plan_1b.json" > "$OUT/plan_1b.log" 2>&1
timeout 120 python3 -m jaxtrain.cli plan --hf_config configs/llama-3-8b.json --devices 8 --accelerator h100 \
  --dtype bfloat16 --total_batch_size 8 --max_sequence_length 4096 --gradient_checkpointing nothing_saveable \
  --output "$OUT/plan_8b.json" > "$OUT/plan_8b.log" 2>&1
tail -5 "$OUT"/*.log
