"""Random-weight checkpoints with the shapes of real models, made with transformers (bf16 safetensors plus a
WordLevel tokenizer of the full vocabulary size), for the GPU tests and benchmarks.

    python3 benchmarks/gpu_models.py OUT_DIR [smollm2 qwen3 llama1b llama3s qwen2 d64g5 ...]

Each also gets a ChatML chat template, so `stepllm serve --model OUT_DIR/qwen3 --device cuda` serves chat requests
(for load tests, with benchmarks/serve_load.py).

The embedding (tied to the LM head) is scaled up so that logits are peaked and greedy choices are stable
under bf16 rounding.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

SHAPES = {
    "smollm2": dict(arch="llama", hidden=576, layers=30, heads=9, kv=3, head_dim=64, inter=1536, vocab=49152, theta=100000.0),
    "qwen3": dict(arch="qwen3", hidden=1024, layers=28, heads=16, kv=8, head_dim=128, inter=3072, vocab=151936, theta=1000000.0),
    "llama1b": dict(arch="llama", hidden=2048, layers=16, heads=32, kv=8, head_dim=64, inter=8192, vocab=128256, theta=500000.0),
    # SmolLM2's shape with Llama 3.1's RoPE scaling, over an original context of 32 so that a 40-token prompt
    # already reaches all three of its bands (kept, blended, divided). Random attention is nearly uniform and so
    # barely depends on positions: q and k are scaled up (attention logits x9) so that it does. Measured on the
    # CPU backend: the same weights with plain RoPE then miss test_gpu's logprob tolerance by 8 nats and change
    # the first greedy token; without the scaling up they stayed within it.
    "llama3s": dict(arch="llama", hidden=576, layers=30, heads=9, kv=3, head_dim=64, inter=1536, vocab=49152, theta=100000.0,
                    rope=dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                              original_max_position_embeddings=32), qk_scale=3.0),
    # Qwen2.5-0.5B: q/k/v bias, and 7 query heads per KV head.
    "qwen2": dict(arch="qwen2", hidden=896, layers=24, heads=14, kv=2, head_dim=64, inter=4864, vocab=151936, theta=1000000.0),
}
# Small checkpoints for the decode attention's other (head_dim, query heads per KV head) pairs, which no shape above
# has: Qwen2.5-1.5B has 6 at head_dim 128, Llama-3.2-3B 3, and the kernels are instantiated for all of 1..8.
# (transformers wants the hidden size to be a multiple of the heads, whatever head_dim is.)
GROUP_SHAPES = [f"d{d}g{g}" for d, g in [(64, 5), (64, 6), (128, 3), (128, 5), (128, 6), (128, 7)]]
for _name in GROUP_SHAPES:
    _d, _g = (int(x) for x in _name[1:].split("g"))
    SHAPES[_name] = dict(arch="llama", hidden=128 * _g, layers=3, heads=2 * _g, kv=2, head_dim=_d, inter=1024, vocab=8192,
                         theta=10000.0, qk_scale=2.0)
EMBED_SCALE = 8.0
# ChatML, so that `stepllm serve` answers chat requests on these checkpoints (load tests: the WordLevel tokenizer
# reads the template's words as t0, its unknown token).
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def make(name: str, out: Path, seed: int = 0) -> Path:
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    s = SHAPES[name]
    path = out / name
    if (path / "model.safetensors").exists():
        (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)  # checkpoints made before it had none
        return path
    torch.manual_seed(seed)
    common = dict(
        vocab_size=s["vocab"], hidden_size=s["hidden"], intermediate_size=s["inter"], num_hidden_layers=s["layers"],
        num_attention_heads=s["heads"], num_key_value_heads=s["kv"], head_dim=s["head_dim"], rope_theta=s["theta"],
        max_position_embeddings=4096, tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=1,
        torch_dtype="bfloat16",
    )
    if s["arch"] == "qwen3":
        config = transformers.Qwen3Config(**common)
        model = transformers.Qwen3ForCausalLM(config)
    elif s["arch"] == "qwen2":
        config = transformers.Qwen2Config(**common)
        model = transformers.Qwen2ForCausalLM(config)
    else:
        config = transformers.LlamaConfig(**common)
        if "rope" in s:  # transformers 5 names it rope_parameters, 4.x rope_scaling
            if getattr(config, "rope_parameters", None) is not None:
                config.rope_parameters = {"rope_theta": s["theta"], **s["rope"]}
            else:
                config.rope_scaling = dict(s["rope"])
        model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.mul_(EMBED_SCALE)
        for n, p in model.named_parameters():
            if "norm" in n:  # random norm weights exercise the kernels better than ones
                p.uniform_(0.5, 1.5)
            elif n.endswith("bias"):  # as do biases that are not zero
                p.uniform_(-0.5, 0.5)
            elif n.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(s.get("qk_scale", 1.0))
    model = model.to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True)
    vocab = {f"t{i}": i for i in range(s["vocab"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    # A byte-level decoder, as the tokenizers of real Llama and Qwen checkpoints have: the runtime then
    # detokenizes through its byte table, as it would for them, and not through the library's WordLevel
    # decode, which would make the host time of a decode tick several times what a real model pays.
    tok.decoder = decoders.ByteLevel()
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "t0", "eos_token": "t1"}))
    (path / "chat_template.jinja").write_text(CHAT_TEMPLATE)
    return path


if __name__ == "__main__":
    out = Path(sys.argv[1])
    for name in sys.argv[2:] or list(SHAPES):
        print(make(name, out))
