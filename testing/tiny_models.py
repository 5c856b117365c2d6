"""Tiny random models with a real byte-level BPE tokenizer, built offline and saved as normal model folders,
so tests load them through the same `from_pretrained` path users use."""

from __future__ import annotations

from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import (
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    PreTrainedTokenizerFast,
    Qwen2Config,
    Qwen2ForCausalLM,
)

CHAT_TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
# Hermes-style tool calling, as Qwen2.5's template writes it: the tools as JSON in the system turn, calls as
# `<tool_call>` tags, tool answers as `<tool_response>` in a user turn.
TOOL_CHAT_TEMPLATE = (
    "{% if tools %}<|system|>You may call functions. Tools:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools>\n"
    'Answer a call as <tool_call>\n{"name": <name>, "arguments": <args>}\n</tool_call>\n{% endif %}'
    "{% for m in messages %}"
    "{% if m['role'] == 'tool' %}<|user|><tool_response>\n{{ m['content'] }}\n</tool_response>\n"
    "{% elif m['role'] == 'assistant' and m.get('tool_calls') %}<|assistant|>{{ m.get('content') or '' }}"
    "{% for call in m['tool_calls'] %}<tool_call>\n"
    '{"name": "{{ call.function.name }}", "arguments": {{ call.function.arguments | tojson }}}\n</tool_call>'
    "{% endfor %}\n"
    "{% else %}<|{{ m['role'] }}|>{{ m['content'] }}\n{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CORPUS = [
    "The quick brown fox jumps over the lazy dog. ",
    "Continuous batching lets short requests finish early. ",
    "Paris is the capital of France; Tokyo is the capital of Japan. ",
    "emoji 😀🚀🎉 and CJK 日本語の文章 中文字符 한국어 text. ",
    "def main():\n    return 42\n",
]


def build_tokenizer(vocab_size: int = 512, chat_template: str = CHAT_TEMPLATE) -> PreTrainedTokenizerFast:
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<eos>", "<bos>", "<pad>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tokenizer.train_from_iterator(CORPUS * 20, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<eos>", bos_token="<bos>", pad_token="<pad>")
    fast.chat_template = chat_template
    return fast


def save_tiny_model(
    folder: Path, arch: str = "llama", *, max_positions: int = 1024, seed: int = 0, chat_template: str = CHAT_TEMPLATE
) -> Path:
    """A 2-layer random model (`llama`; `qwen2` with grouped-query attention and q/k/v biases; `mistral`, grouped,
    full attention) saved with its tokenizer (and `chat_template`: `TOOL_CHAT_TEMPLATE` renders tools)."""
    torch.manual_seed(seed)
    tokenizer = build_tokenizer(chat_template=chat_template)
    common = {
        "vocab_size": len(tokenizer),
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "max_position_embeddings": max_positions,
        "eos_token_id": tokenizer.eos_token_id,
        "bos_token_id": tokenizer.bos_token_id,
        "pad_token_id": tokenizer.pad_token_id,
        # Larger than the 0.02 default, so logits are decisive: the top two tokens of a greedy step are rarely
        # closer than float32 rounding, which differs with batch composition (continuous batching is not
        # batch-invariant). With the default, a rare near-tie flipped a greedy comparison.
        "initializer_range": 0.3,
    }
    if arch == "llama":
        model = LlamaForCausalLM(LlamaConfig(num_key_value_heads=4, **common))
    elif arch == "qwen2":
        model = Qwen2ForCausalLM(Qwen2Config(num_key_value_heads=2, **common))
    elif arch == "mistral":
        model = MistralForCausalLM(MistralConfig(num_key_value_heads=2, sliding_window=None, **common))
    else:
        raise ValueError(arch)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
