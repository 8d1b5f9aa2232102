"""FLOPs/MFU count GPT-2's two-matrix GELU MLP, not SwiGLU's three."""

from jaxtrain.models import GPT2Config, LlamaConfig
from jaxtrain.observability.flops import matmul_parameters


def test_gpt2_matmul_parameters_by_hand():
    c = GPT2Config(vocab_size=100, hidden_size=32, num_hidden_layers=2, num_attention_heads=4)
    attention = 32 * 3 * 32 + 32 * 32  # c_attn + c_proj
    mlp = 2 * 32 * 128  # c_fc + c_proj, intermediate 4 * 32
    assert matmul_parameters(c) == 2 * (attention + mlp) + 32 * 100
    llama = LlamaConfig(vocab_size=100, hidden_size=32, intermediate_size=128,
                        num_hidden_layers=2, num_attention_heads=4)  # fmt: skip
    assert matmul_parameters(llama) == 2 * (attention + 3 * 32 * 128) + 32 * 100
