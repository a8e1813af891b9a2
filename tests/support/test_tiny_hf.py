"""tests/support/tiny_hf.py: the tiny Llama checkpoint the vLLM tests serve, checked without vLLM."""

import json
import subprocess
import sys
from pathlib import Path

import jinja2
from safetensors.numpy import load_file
from tokenizers import Tokenizer

from tests.support.system import ROOT
from tests.support.tiny_hf import BOS, EOS, make_tiny_llama, make_tiny_lora


def file_bytes(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_it_writes_the_same_bytes_for_a_seed_even_in_another_process(tmp_path):
    # Another process: the tokenizer trains on threads, and a revision made by one test run must
    # match the one another run made.
    make_tiny_llama(tmp_path / "here", seed=3)
    code = (
        "import sys; from pathlib import Path; from tests.support.tiny_hf import make_tiny_llama;"
        " make_tiny_llama(Path(sys.argv[1]), seed=3)"
    )
    subprocess.run([sys.executable, "-c", code, tmp_path / "there"], cwd=ROOT, check=True)

    assert file_bytes(tmp_path / "here") == file_bytes(tmp_path / "there")


def test_it_changes_only_the_weights_with_the_seed(tmp_path):
    first = file_bytes(make_tiny_llama(tmp_path / "first", seed=0))
    second = file_bytes(make_tiny_llama(tmp_path / "second", seed=1))

    assert [name for name in first if first[name] != second[name]] == ["model.safetensors"]


def test_it_splits_the_weights_in_two_files_with_an_index(tmp_path):
    whole = load_file(make_tiny_llama(tmp_path / "one") / "model.safetensors")
    folder = make_tiny_llama(tmp_path / "two", shards=2)

    index = json.loads((folder / "model.safetensors.index.json").read_text())
    files = sorted(set(index["weight_map"].values()))
    assert files == ["model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors"]
    assert not (folder / "model.safetensors").exists()
    split = {}
    for file in files:
        split |= load_file(folder / file)
    assert sorted(split) == sorted(whole) == sorted(index["weight_map"])
    assert all((split[name] == whole[name]).all() for name in whole)
    assert index["metadata"]["total_size"] == sum(array.nbytes for array in whole.values())


def test_it_has_weights_of_the_shapes_the_config_declares(tmp_path):
    folder = make_tiny_llama(tmp_path)
    config = json.loads((folder / "config.json").read_text())
    weights = load_file(folder / "model.safetensors")

    vocab, hidden = config["vocab_size"], config["hidden_size"]
    assert weights["model.embed_tokens.weight"].shape == (vocab, hidden)
    assert weights["lm_head.weight"].shape == (vocab, hidden)
    kv = config["num_key_value_heads"] * config["head_dim"]
    assert weights["model.layers.1.self_attn.k_proj.weight"].shape == (kv, hidden)
    assert f"model.layers.{config['num_hidden_layers'] - 1}.mlp.down_proj.weight" in weights
    assert f"model.layers.{config['num_hidden_layers']}.mlp.down_proj.weight" not in weights


def test_it_encodes_any_text_and_decodes_it_back(tmp_path):
    folder = make_tiny_llama(tmp_path, vocab_lines=["hello there", "general kenobi"])
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    config = json.loads((folder / "config.json").read_text())
    text = "Hello world, déjà vu 🙂\n\tdef main(): pass"

    encoding = tokenizer.encode(text)

    assert encoding.tokens[0] == BOS
    assert tokenizer.decode(encoding.ids) == text
    assert tokenizer.get_vocab_size() == config["vocab_size"]
    assert tokenizer.token_to_id(EOS) == config["eos_token_id"]


def test_its_chat_template_renders_text_and_content_parts(tmp_path):
    folder = make_tiny_llama(tmp_path)
    settings = json.loads((folder / "tokenizer_config.json").read_text())
    template = jinja2.Environment().from_string(settings["chat_template"])
    messages = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "Hi"}]},
        {"role": "assistant", "content": None, "tool_calls": []},
    ]

    prompt = template.render(messages=messages, add_generation_prompt=True, bos_token=BOS)

    assert prompt == (
        "<s><|system|>\nBe brief.</s>\n<|user|>\nHi</s>\n<|assistant|>\n</s>\n<|assistant|>\n"
    )


def test_its_lora_adapts_q_and_v_of_every_layer_with_the_rank_asked(tmp_path):
    model = json.loads((make_tiny_llama(tmp_path / "model") / "config.json").read_text())
    folder = make_tiny_lora(tmp_path / "lora", seed=1, rank=4)

    adapter = json.loads((folder / "adapter_config.json").read_text())
    weights = load_file(folder / "adapter_model.safetensors")
    assert (adapter["peft_type"], adapter["r"], adapter["target_modules"]) == (
        "LORA",
        4,
        ["q_proj", "v_proj"],
    )
    assert len(weights) == 2 * 2 * model["num_hidden_layers"]
    prefix = "base_model.model.model.layers.1.self_attn"
    kv = model["num_key_value_heads"] * model["head_dim"]
    assert weights[f"{prefix}.v_proj.lora_A.weight"].shape == (4, model["hidden_size"])
    assert weights[f"{prefix}.v_proj.lora_B.weight"].shape == (kv, 4)
    assert file_bytes(folder) == file_bytes(make_tiny_lora(tmp_path / "again", seed=1, rank=4))
