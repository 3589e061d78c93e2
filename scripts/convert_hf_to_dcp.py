"""Import a Hugging Face Llama or Qwen3 folder (config.json and *.safetensors, sharded or not) as a
DCP checkpoint of the model weights, to start a run from:

    python scripts/convert_hf_to_dcp.py path/to/Meta-Llama-3-8B outputs/llama3_8b_dcp
    ./run_llama_train.sh --model.flavor 8B --checkpoint.initial_load_path outputs/llama3_8b_dcp
    python scripts/convert_hf_to_dcp.py path/to/Qwen3-0.6B outputs/qwen3
    ./run_llama_train.sh --model.name qwen3 --model.flavor 0.6B --checkpoint.initial_load_path outputs/qwen3

config.json's model_type picks the conversion. A tied model (no lm_head.weight) gets output.weight, a
copy of the embeddings, as our model's state dict has both. The run's model.name, model.flavor and
tokenizer must match the HF model; the run checks the shapes.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, uninstalled

from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.paths import check_file, check_folder, check_writable_folder  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402
from torchtitan.models import MODEL_SPECS  # noqa: E402

FIX = "give a Hugging Face model folder (config.json and *.safetensors)"
# config.json's model_type -> the family's adapter (torchtitan/models/hf_convert.py).
ADAPTERS = {adapter.MODEL_TYPE: adapter for adapter in (spec.hf() for spec in MODEL_SPECS.values())}


def read_config(hf_folder: str) -> dict:
    """The HF config, with the keys the conversion needs."""
    config_path = os.path.join(hf_folder, "config.json")
    check_file("hf_folder", config_path, text=True, fix=FIX)
    try:
        config = json.loads(Path(config_path).read_text())
    except ValueError as e:  # malformed, or not UTF-8 past the part check_file reads
        raise ConfigError(f"hf_folder: {config_path} is not valid JSON ({e})") from None
    for key in ("hidden_size", "num_hidden_layers", "num_attention_heads"):
        if not isinstance(config, dict) or not isinstance(config.get(key), int):
            raise ConfigError(f"hf_folder: {config_path} has no integer {key}; {FIX}")
    return config


def convert(hf_folder: str, output: str) -> dict:
    """Write the DCP checkpoint; returns the HF config."""
    check_folder("hf_folder", hf_folder, fix=FIX)
    config = read_config(hf_folder)
    files = sorted(Path(hf_folder).glob("*.safetensors"))
    if not files:
        raise ConfigError(f"hf_folder: no .safetensors files in {hf_folder}; {FIX}")
    for file in files:
        check_file("hf_folder", str(file), fix=FIX)
    check_writable_folder("output", output)
    adapter = ADAPTERS.get(config.get("model_type"))
    if adapter is None:
        raise ConfigError(
            f"hf_folder: {hf_folder}/config.json has model_type {config.get('model_type')!r}; "
            f"give a model of a supported type ({', '.join(sorted(ADAPTERS))})"
        )
    hf_weights = {}
    for file in files:
        hf_weights.update(load_file(file))
    weights = adapter.from_hf(hf_weights, config)
    dcp.save({"model": weights}, checkpoint_id=output, no_dist=True)
    return config


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad argument or model folder."""
    return run_with_exit_codes(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("hf_folder", help="folder with config.json and *.safetensors")
    parser.add_argument("output", help="DCP checkpoint folder to write")
    args = parser.parse_args(argv)
    config = convert(args.hf_folder, args.output)
    # transformers 5 writes rope_theta into rope_parameters, earlier versions (and the Hub) at the top.
    rope_theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    print(
        f"wrote {args.output}: {config['model_type']}, dim {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} heads "
        f"({config.get('num_key_value_heads')} kv), vocab {config.get('vocab_size')}, rope_theta {rope_theta}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
