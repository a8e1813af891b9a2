"""Whether a GGUF file is a LoRA adapter llama.cpp would accept for a model.

llama.cpp takes a wrong adapter without complaint at start and crashes on the first request
(or at load), so both doors that meet an adapter ask this first: the catalog, from the two
files' headers read over HTTP (catalog.sources.check_adapter), and the node, from the files on
disk before it starts an engine (llmgw.node.replica).
"""

from __future__ import annotations

from .header import GGUFHeader, TensorInfo


def adapter_problems(
    adapter: GGUFHeader, model_architecture: str, *, model: GGUFHeader | None = None
) -> list[str]:
    """Why ``adapter`` is not a LoRA adapter llama.cpp would accept for the given architecture.

    An empty list means no problem was found. llama.cpp crashes on a bad adapter instead of
    refusing it, so this must be checked before an engine loads one. With ``model`` (whose
    tensor infos were parsed) the adapter's tensors are also checked against the model's.
    """
    problems = _type_problems(adapter)
    problems += _architecture_problems(adapter, model_architecture)
    # Tensor checks only make sense once the file is known to be a LoRA adapter at all.
    if adapter.tensors is not None and not problems:
        problems += _pairing_problems(adapter.tensors)
        if model is not None and model.tensors is not None:
            problems += _shape_problems(adapter.tensors, model.tensors)
    return problems


def _type_problems(adapter: GGUFHeader) -> list[str]:
    general_type = adapter.metadata.get("general.type")
    if general_type is None:
        return ["it is a model, not an adapter (general.type is missing)"]
    if general_type != "adapter":
        return [f"it is a {general_type}, not an adapter (general.type is {general_type!r})"]
    if adapter.adapter_type is None:
        return ["it does not say what kind of adapter it is (adapter.type is missing)"]
    if adapter.adapter_type != "lora":
        return [f"it is a {adapter.adapter_type} adapter, not a LoRA adapter"]
    return []


def _architecture_problems(adapter: GGUFHeader, model_architecture: str) -> list[str]:
    architecture = adapter.architecture
    if architecture is None:
        return ["it does not say which architecture it is for (general.architecture is missing)"]
    if architecture == model_architecture:
        return []
    if adapter.file_type == "adapter" and adapter.adapter_type == "lora":
        return [f"it is a LoRA adapter for {architecture}, not for {model_architecture}"]
    return [f"it is built for {architecture}, not for {model_architecture}"]


def _pairing_problems(tensors: list[TensorInfo]) -> list[str]:
    names = {tensor.name for tensor in tensors}
    problems = []
    for name in sorted(names):
        for have, want in ((".lora_a", ".lora_b"), (".lora_b", ".lora_a")):
            if name.endswith(have) and name[: -len(have)] + want not in names:
                problems.append(f"its tensor {name} has no matching {name[: -len(have)] + want}")
    if not any(name.endswith((".lora_a", ".lora_b")) for name in names):
        problems.append("it has no LoRA tensors (none ends in .lora_a or .lora_b)")
    return problems


def _shape_problems(
    adapter_tensors: list[TensorInfo], model_tensors: list[TensorInfo]
) -> list[str]:
    """The checks llama.cpp makes: the base exists, a's in == base's in, b's out == base's out."""
    model_dims = {tensor.name: tensor.dims for tensor in model_tensors}
    adapter_dims = {tensor.name: tensor.dims for tensor in adapter_tensors}
    problems = []
    for name, a_dims in sorted(adapter_dims.items()):
        if not name.endswith(".lora_a"):
            continue
        base = name[: -len(".lora_a")]
        b_dims = adapter_dims.get(base + ".lora_b")
        if base not in model_dims:
            problems.append(f"it changes the tensor {base}, which the model does not have")
        elif b_dims is not None and len(a_dims) == len(b_dims) == len(model_dims[base]) == 2:
            in_ok = a_dims[0] == model_dims[base][0]
            out_ok = b_dims[1] == model_dims[base][1]
            rank_ok = a_dims[1] == b_dims[0]
            if not (in_ok and out_ok and rank_ok):
                problems.append(
                    f"its tensors for {base} have the wrong shape "
                    f"(a {list(a_dims)}, b {list(b_dims)}, model {list(model_dims[base])})"
                )
    return problems
