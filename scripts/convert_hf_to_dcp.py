"""Import a Hugging Face Llama folder (config.json and *.safetensors, sharded or not) as a DCP
checkpoint of the model weights, to start a run from:

    python scripts/convert_hf_to_dcp.py path/to/Meta-Llama-3-8B outputs/llama3_8b_dcp
    ./run_llama_train.sh --model.flavor 8B --checkpoint.initial_load_path outputs/llama3_8b_dcp

The run's model.flavor and tokenizer must match the HF model; the run checks the shapes.
"""

import argparse
import json
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, uninstalled

from torchtitan.models.llama.hf_convert import from_hf  # noqa: E402


def convert(hf_folder: str, output: str) -> dict:
    """Write the DCP checkpoint; returns the HF config."""
    folder = Path(hf_folder)
    config = json.loads((folder / "config.json").read_text())
    files = sorted(folder.glob("*.safetensors"))
    if not files:
        raise SystemExit(f"error: no .safetensors files in {folder}")
    hf_weights = {}
    for file in files:
        hf_weights.update(load_file(file))
    n_heads = config["num_attention_heads"]
    weights = from_hf(hf_weights, n_heads, config.get("num_key_value_heads", n_heads))
    dcp.save({"model": weights}, checkpoint_id=output, no_dist=True)
    return config


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("hf_folder", help="folder with config.json and *.safetensors")
    parser.add_argument("output", help="DCP checkpoint folder to write")
    args = parser.parse_args(argv)
    config = convert(args.hf_folder, args.output)
    print(
        f"wrote {args.output}: dim {config['hidden_size']}, {config['num_hidden_layers']} layers, "
        f"{config['num_attention_heads']} heads ({config.get('num_key_value_heads')} kv), "
        f"vocab {config['vocab_size']}, rope_theta {config.get('rope_theta')}"
    )


if __name__ == "__main__":
    main()
