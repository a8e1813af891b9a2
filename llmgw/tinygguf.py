"""Tiny GGUF files for tests and the demo: a random-weight llama model, a LoRA adapter for it,
and a vision projector (mmproj) that lets llama-server take images with it.

Minimal (2 layers, about 0.7 MB) but complete enough for llama.cpp to load and generate; each
file is generated from a seed, so two seeds give two "revisions" of one model. Also a command:
``python -m llmgw.tinygguf model OUT.gguf --seed 1`` (or ``adapter OUT.gguf --rank 4``, or
``mmproj OUT.gguf``). This
module must not import Django.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
from gguf import GGUFWriter, TokenType

# The shape of the tiny model. Heads and KV heads differ on purpose so grouped-query attention
# (and the KV-cache arithmetic that depends on head_count_kv) is exercised.
BLOCK_COUNT = 2
EMBEDDING_LENGTH = 64
HEAD_COUNT = 4
HEAD_COUNT_KV = 2
FEED_FORWARD_LENGTH = 128
HEAD_DIM = EMBEDDING_LENGTH // HEAD_COUNT
KV_DIM = HEAD_DIM * HEAD_COUNT_KV
RMS_EPSILON = 1e-5


@dataclass(frozen=True)
class Shape:
    """A generated model's dimensions; the default is the tiny test model."""

    block_count: int = BLOCK_COUNT
    embedding_length: int = EMBEDDING_LENGTH
    head_count: int = HEAD_COUNT
    head_count_kv: int = HEAD_COUNT_KV
    feed_forward_length: int = FEED_FORWARD_LENGTH

    @property
    def head_dim(self) -> int:
        return self.embedding_length // self.head_count

    @property
    def kv_dim(self) -> int:
        return self.head_dim * self.head_count_kv


TINY = Shape()
# About 52 MB (all F32): big enough that computing, not HTTP and bookkeeping, dominates a
# request, which is what an engine benchmark must measure. Adapters fit only TINY.
LARGE = Shape(
    block_count=4, embedding_length=512, head_count=8, head_count_kv=4, feed_forward_length=1408
)

# A deliberately plain template: llama-cpp-python renders it with its Jinja2 chat formatter
# (it matches none of the built-in formats, so nothing is guessed from it).
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)

# SentencePiece marks a word boundary with U+2581; llama.cpp adds it in front of the text too.
_SPACE = "\u2581"
_WORDS = (
    "the", "a", "and", "of", "to", "in", "is", "it", "you", "that", "hello", "world", "model",
    "tiny", "llama", "test", "small", "random", "weights", "answer", "question", "yes", "no",
    "user", "assistant", "system",
)  # fmt: skip

UNK_ID, BOS_ID, EOS_ID = 0, 1, 2


@dataclass(frozen=True)
class Vocabulary:
    tokens: list[str]
    scores: list[float]
    token_types: list[int]


def build_vocabulary() -> Vocabulary:
    """The tiny SentencePiece ("llama") vocabulary: control tokens, byte fallback, then pieces.

    llama.cpp's SPM tokenizer builds a word by merging adjacent symbols only when the merged
    text is itself a token, so every prefix of a word piece must be in the vocabulary as well;
    otherwise the word silently falls back to single bytes.
    """
    tokens = ["<unk>", "<s>", "</s>"]
    types = [TokenType.UNKNOWN, TokenType.CONTROL, TokenType.CONTROL]
    tokens += [f"<0x{byte:02X}>" for byte in range(256)]
    types += [TokenType.BYTE] * 256

    pieces = _pieces_with_prefixes(_WORDS)
    tokens += pieces
    types += [TokenType.NORMAL] * len(pieces)

    # Scores are log-probability-like: the tokenizer merges the highest-scoring bigram first.
    # Control and byte tokens never take part in merges, so 0 is fine for them.
    scores = [0.0] * (len(tokens) - len(pieces)) + [-float(i) for i in range(len(pieces))]
    return Vocabulary(tokens=tokens, scores=scores, token_types=[int(t) for t in types])


def _pieces_with_prefixes(words: Iterable[str]) -> list[str]:
    """Single letters, the space marker, and every prefix of each "▁word", without duplicates."""
    pieces: dict[str, None] = {_SPACE: None}
    for letter in "abcdefghijklmnopqrstuvwxyz":
        pieces[letter] = None
    for word in words:
        marked = _SPACE + word
        for end in range(2, len(marked) + 1):
            pieces[marked[:end]] = None
    return list(pieces)


def write_tiny_model(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    architecture: str = "llama",
    context_length: int = 2048,
    shape: Shape = TINY,
) -> None:
    """Write a random-weight llama model of about 0.7 MB that llama.cpp can load and run.

    Another ``architecture`` only changes the names in the header (for mismatch tests); such a
    file is not meant to load.
    """
    rng = np.random.default_rng(seed)
    vocab = build_vocabulary()
    writer = GGUFWriter(os.fspath(path), architecture)
    writer.add_name(f"tiny-{architecture}-seed{seed}")
    _add_hyperparameters(writer, architecture, context_length, shape)
    _add_tokenizer(writer, vocab)
    for name, tensor in _model_tensors(rng, len(vocab.tokens), shape):
        writer.add_tensor(name, tensor)
    _write_and_close(writer)


def _add_hyperparameters(
    writer: GGUFWriter, architecture: str, context_length: int, shape: Shape
) -> None:
    # Written with explicit keys (rather than writer.add_block_count & co.) so the prefix follows
    # `architecture` even when it is not the writer's usual one.
    prefix = architecture
    writer.add_uint32(f"{prefix}.context_length", context_length)
    writer.add_uint32(f"{prefix}.embedding_length", shape.embedding_length)
    writer.add_uint32(f"{prefix}.block_count", shape.block_count)
    writer.add_uint32(f"{prefix}.feed_forward_length", shape.feed_forward_length)
    writer.add_uint32(f"{prefix}.attention.head_count", shape.head_count)
    writer.add_uint32(f"{prefix}.attention.head_count_kv", shape.head_count_kv)
    writer.add_uint32(f"{prefix}.rope.dimension_count", shape.head_dim)
    writer.add_float32(f"{prefix}.attention.layer_norm_rms_epsilon", RMS_EPSILON)
    writer.add_file_type(0)  # 0 = all tensors F32


def _add_tokenizer(writer: GGUFWriter, vocab: Vocabulary) -> None:
    writer.add_tokenizer_model("llama")
    writer.add_token_list(vocab.tokens)
    writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    writer.add_bos_token_id(BOS_ID)
    writer.add_eos_token_id(EOS_ID)
    writer.add_unk_token_id(UNK_ID)
    writer.add_add_bos_token(True)
    writer.add_add_eos_token(False)
    writer.add_chat_template(CHAT_TEMPLATE)


def _model_tensors(
    rng: np.random.Generator, vocab_size: int, shape: Shape
) -> list[tuple[str, np.ndarray]]:
    """All tensors of the model, numpy shape (out, in), small random values, norms at one."""
    width = shape.embedding_length
    tensors = [("token_embd.weight", _random(rng, vocab_size, width))]
    for block in range(shape.block_count):
        tensors += [
            (f"blk.{block}.{name}.weight", array) for name, array in _block_tensors(rng, shape)
        ]
    tensors.append(("output_norm.weight", np.ones(width, dtype=np.float32)))
    tensors.append(("output.weight", _random(rng, vocab_size, width)))
    return tensors


def _block_tensors(rng: np.random.Generator, shape: Shape) -> list[tuple[str, np.ndarray]]:
    width, kv, ff = shape.embedding_length, shape.kv_dim, shape.feed_forward_length
    return [
        ("attn_norm", np.ones(width, dtype=np.float32)),
        ("attn_q", _random(rng, width, width)),
        ("attn_k", _random(rng, kv, width)),
        ("attn_v", _random(rng, kv, width)),
        ("attn_output", _random(rng, width, width)),
        ("ffn_norm", np.ones(width, dtype=np.float32)),
        ("ffn_gate", _random(rng, ff, width)),
        ("ffn_up", _random(rng, ff, width)),
        ("ffn_down", _random(rng, width, ff)),
    ]


def _random(rng: np.random.Generator, *shape: int, scale: float = 0.02) -> np.ndarray:
    # Small values keep activations finite through the untrained layers.
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# Much larger than the model's weights so that the adapter visibly changes greedy output (a
# trained LoRA starts with lora_b at zero; a test adapter that changes nothing proves nothing).
LORA_VALUE_SCALE = 0.5

# The base tensors each adapter targets, with their (out, in) shapes in the tiny model.
LORA_TARGETS: dict[str, tuple[int, int]] = {
    "attn_q": (EMBEDDING_LENGTH, EMBEDDING_LENGTH),
    "attn_v": (KV_DIM, EMBEDDING_LENGTH),
}


def write_lora_adapter(
    path: str | os.PathLike[str],
    *,
    architecture: str = "llama",
    seed: int = 0,
    rank: int = 4,
    alpha: float = 8.0,
) -> None:
    """Write a LoRA adapter for the tiny model that llama.cpp accepts.

    Tensors come in pairs ``<base>.lora_a`` (numpy shape rank x in) and ``<base>.lora_b``
    (out x rank) for attn_q and attn_v of every block.
    """
    if rank < 1:
        raise ValueError(f"A LoRA rank must be at least 1, not {rank}.")
    rng = np.random.default_rng(seed)
    writer = GGUFWriter(os.fspath(path), architecture)
    writer.add_name(f"tiny-{architecture}-lora-seed{seed}")
    writer.add_type("adapter")
    writer.add_string("adapter.type", "lora")
    writer.add_float32("adapter.lora.alpha", alpha)
    for name, tensor in _lora_tensors(rng, rank):
        writer.add_tensor(name, tensor)
    _write_and_close(writer)


def _lora_tensors(rng: np.random.Generator, rank: int) -> list[tuple[str, np.ndarray]]:
    tensors: list[tuple[str, np.ndarray]] = []
    for block in range(BLOCK_COUNT):
        for target, (out_dim, in_dim) in LORA_TARGETS.items():
            base = f"blk.{block}.{target}.weight"
            # lora_a must directly precede its lora_b: gguf's writer (and some readers) pair them
            # by order when counting parameters.
            tensors.append((f"{base}.lora_a", _random(rng, rank, in_dim, scale=LORA_VALUE_SCALE)))
            tensors.append((f"{base}.lora_b", _random(rng, out_dim, rank, scale=LORA_VALUE_SCALE)))
    return tensors


# The tiny projector: a LLaVA-style ("mlp") CLIP encoder, the simplest projector llama.cpp's mtmd
# loads (tools/mtmd/clip.cpp: a ViT of `block_count` layers, then mm.0 -> GELU -> mm.2). An image
# is resized to MMPROJ_IMAGE_SIZE and cut into (size / patch)^2 patches, each one text embedding.
MMPROJ_IMAGE_SIZE = 32
MMPROJ_PATCH_SIZE = 8
MMPROJ_EMBEDDING_LENGTH = 32
MMPROJ_HEAD_COUNT = 2
# Not the embedding length: llama.cpp swaps ffn_up and ffn_down of old llava files when ffn_down's
# input equals it, and that would turn these tensors around.
MMPROJ_FEED_FORWARD_LENGTH = 48
MMPROJ_BLOCK_COUNT = 2
MMPROJ_PROJECTION_HIDDEN = 64


def write_tiny_mmproj(
    path: str | os.PathLike[str],
    *,
    seed: int = 0,
    text_embedding_length: int = EMBEDDING_LENGTH,
) -> None:
    """Write a random-weight vision projector of about 0.1 MB that llama-server accepts with
    ``--mmproj`` beside the model of ``write_tiny_model``.

    Its output is one vector of ``text_embedding_length`` per image patch, which llama.cpp
    requires to equal the text model's embedding length (a mismatch stops the engine at start).
    Two seeds give two revisions of it, as for the model.
    """
    rng = np.random.default_rng(seed)
    width, ff = MMPROJ_EMBEDDING_LENGTH, MMPROJ_FEED_FORWARD_LENGTH
    patches = (MMPROJ_IMAGE_SIZE // MMPROJ_PATCH_SIZE) ** 2
    writer = GGUFWriter(os.fspath(path), "clip")
    writer.add_name(f"tiny-mmproj-seed{seed}")
    writer.add_type("mmproj")
    writer.add_bool("clip.has_vision_encoder", True)
    writer.add_string("clip.projector_type", "mlp")
    writer.add_bool("clip.use_gelu", True)
    writer.add_uint32("clip.vision.image_size", MMPROJ_IMAGE_SIZE)
    writer.add_uint32("clip.vision.patch_size", MMPROJ_PATCH_SIZE)
    writer.add_uint32("clip.vision.embedding_length", width)
    writer.add_uint32("clip.vision.feed_forward_length", ff)
    writer.add_uint32("clip.vision.block_count", MMPROJ_BLOCK_COUNT)
    writer.add_uint32("clip.vision.projection_dim", text_embedding_length)
    writer.add_uint32("clip.vision.attention.head_count", MMPROJ_HEAD_COUNT)
    writer.add_float32("clip.vision.attention.layer_norm_epsilon", 1e-5)
    writer.add_array("clip.vision.image_mean", [0.5, 0.5, 0.5])
    writer.add_array("clip.vision.image_std", [0.5, 0.5, 0.5])
    writer.add_file_type(0)
    tensors = [
        # numpy shapes are ggml's reversed: the patch convolution is (out, channels, h, w).
        ("v.patch_embd.weight", _random(rng, width, 3, MMPROJ_PATCH_SIZE, MMPROJ_PATCH_SIZE)),
        ("v.position_embd.weight", _random(rng, patches, width)),
        ("v.pre_ln.weight", np.ones(width, dtype=np.float32)),
        ("v.pre_ln.bias", np.zeros(width, dtype=np.float32)),
    ]
    for block in range(MMPROJ_BLOCK_COUNT):
        for name, array in (
            ("ln1.weight", np.ones(width, dtype=np.float32)),
            ("ln1.bias", np.zeros(width, dtype=np.float32)),
            ("attn_q.weight", _random(rng, width, width)),
            ("attn_q.bias", np.zeros(width, dtype=np.float32)),
            ("attn_k.weight", _random(rng, width, width)),
            ("attn_k.bias", np.zeros(width, dtype=np.float32)),
            ("attn_v.weight", _random(rng, width, width)),
            ("attn_v.bias", np.zeros(width, dtype=np.float32)),
            ("attn_out.weight", _random(rng, width, width)),
            ("attn_out.bias", np.zeros(width, dtype=np.float32)),
            ("ln2.weight", np.ones(width, dtype=np.float32)),
            ("ln2.bias", np.zeros(width, dtype=np.float32)),
            ("ffn_up.weight", _random(rng, ff, width)),
            ("ffn_up.bias", np.zeros(ff, dtype=np.float32)),
            ("ffn_down.weight", _random(rng, width, ff)),
            ("ffn_down.bias", np.zeros(width, dtype=np.float32)),
        ):
            tensors.append((f"v.blk.{block}.{name}", array))
    hidden = MMPROJ_PROJECTION_HIDDEN
    tensors += [
        ("mm.0.weight", _random(rng, hidden, width)),
        ("mm.0.bias", np.zeros(hidden, dtype=np.float32)),
        ("mm.2.weight", _random(rng, text_embedding_length, hidden)),
        ("mm.2.bias", np.zeros(text_embedding_length, dtype=np.float32)),
    ]
    for name, tensor in tensors:
        writer.add_tensor(name, tensor)
    _write_and_close(writer)


def _write_and_close(writer: GGUFWriter) -> None:
    try:
        writer.write_header_to_file()
        writer.write_kv_data_to_file()
        writer.write_tensors_to_file()
    finally:
        writer.close()


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m llmgw.tinygguf",
        description="Write a tiny random-weight GGUF model or a LoRA adapter for it.",
    )
    commands = parser.add_subparsers(dest="command", required=True)
    model = commands.add_parser("model", help="a tiny llama model (about 0.7 MB)")
    model.add_argument("out", help="the file to write")
    model.add_argument("--seed", type=int, default=0)
    model.add_argument("--architecture", default="llama")
    model.add_argument("--context-length", type=int, default=2048)
    adapter = commands.add_parser("adapter", help="a LoRA adapter for the tiny model")
    adapter.add_argument("out", help="the file to write")
    adapter.add_argument("--seed", type=int, default=0)
    adapter.add_argument("--architecture", default="llama")
    adapter.add_argument("--rank", type=int, default=4)
    adapter.add_argument("--alpha", type=float, default=8.0)
    mmproj = commands.add_parser("mmproj", help="a vision projector for the tiny model")
    mmproj.add_argument("out", help="the file to write")
    mmproj.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    if args.command == "model":
        write_tiny_model(
            args.out,
            seed=args.seed,
            architecture=args.architecture,
            context_length=args.context_length,
        )
    elif args.command == "mmproj":
        write_tiny_mmproj(args.out, seed=args.seed)
    else:
        write_lora_adapter(
            args.out,
            architecture=args.architecture,
            seed=args.seed,
            rank=args.rank,
            alpha=args.alpha,
        )
    print(f"wrote {args.out} ({os.path.getsize(args.out)} bytes)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
