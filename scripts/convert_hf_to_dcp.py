"""Import a Hugging Face Llama, Qwen3, Qwen3-MoE, Qwen3.5 (text-only or the released vision-language
folders: the text model), Qwen3.5-MoE (the same), Qwen3-Next or DeepSeek-V3 folder (config.json and
safetensors, sharded with model.safetensors.index.json or not) as a DCP checkpoint of the model
weights, to start a run from:

    python scripts/convert_hf_to_dcp.py path/to/Meta-Llama-3-8B outputs/llama3_8b_dcp
    ./run_llama_train.sh --model.flavor 8B --checkpoint.initial_load_path outputs/llama3_8b_dcp
    python scripts/convert_hf_to_dcp.py path/to/Qwen3-0.6B outputs/qwen3
    ./run_llama_train.sh --model.name qwen3 --model.flavor 0.6B --checkpoint.initial_load_path outputs/qwen3

config.json's model_type picks the conversion. The folder is read as checkpoint.initial_load_path reads
it (torchtitan/checkpoint/hf_reader.py): the index and its shards must agree, damaged files are one
line, a tensor missing is named, and tensors no model here has a place for are named as skipped.
DeepSeek-V3's multi-token prediction depths are kept (--mtp-layers N keeps the first N, 0 none), to
train with model.mtp_layers of as many. A tied model (no lm_head.weight) gets output.weight, a copy of
the embeddings, as our model's state dict has both. The output is a new or empty folder (--overwrite
replaces one), never a run's checkpoint, written whole or not at all. The run's model.name,
model.flavor and tokenizer must match the HF model; the run checks the shapes.
"""

import argparse
import sys
from pathlib import Path

import torch.distributed.checkpoint as dcp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, uninstalled

from torchtitan.checkpoint.folder import check_output_folder, replacing_folder  # noqa: E402
from torchtitan.checkpoint.hf_reader import HFReader, read_hf_config  # noqa: E402
from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.paths import check_folder  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402

FIX = "give a Hugging Face model folder (config.json and *.safetensors)"


def convert(hf_folder: str, output: str, overwrite: bool = False, mtp_layers: int | None = None) -> HFReader:
    """Write the DCP checkpoint with `mtp_layers` multi-token prediction depths (None: all the folder's,
    its config.json's num_nextn_predict_layers); returns the reader (the HF config, the tensors skipped).
    Everything is checked, every tensor read, before anything is written."""
    check_folder("hf_folder", hf_folder, fix=FIX)
    check_output_folder("output", output, overwrite, [hf_folder])
    config, _ = read_hf_config("hf_folder", hf_folder, None)
    depths = config.get("num_nextn_predict_layers") or 0
    if mtp_layers is not None and not 0 <= mtp_layers <= depths:
        raise ConfigError(
            f"--mtp-layers: {hf_folder} has {depths} multi-token prediction depths (its config.json's "
            f"num_nextn_predict_layers), not {mtp_layers}; pass 0 to {depths} (default: all)"
        )
    reader = HFReader(hf_folder, "hf_folder", mtp_layers=depths if mtp_layers is None else mtp_layers)
    weights = reader.read_all()
    with replacing_folder(output) as new:
        dcp.save({"model": weights}, checkpoint_id=new, no_dist=True)
    return reader


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad argument or model folder."""
    return run_with_exit_codes(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("hf_folder", help="folder with config.json and *.safetensors")
    parser.add_argument("output", help="DCP checkpoint folder to write: new or empty")
    parser.add_argument(
        "--mtp-layers",
        type=int,
        help="multi-token prediction depths to keep, for model.mtp_layers (default: all the folder's, its "
        "config.json's num_nextn_predict_layers; 0 drops them)",
    )
    parser.add_argument("--overwrite", action="store_true", help="replace an output folder that holds files")
    args = parser.parse_args(argv)
    reader = convert(args.hf_folder, args.output, args.overwrite, args.mtp_layers)
    config = reader.config
    # transformers 5 writes rope_theta into rope_parameters, earlier versions (and the Hub) at the top.
    rope_theta = config.get("rope_theta", (config.get("rope_parameters") or {}).get("rope_theta"))
    print(
        f"wrote {args.output}: {config['model_type']}, dim {config['hidden_size']}, "
        f"{config['num_hidden_layers']} layers, {config['num_attention_heads']} heads "
        f"({config.get('num_key_value_heads')} kv), vocab {config['vocab_size']}, rope_theta {rope_theta}"
    )
    if depths := len({name.split(".")[1] for name in reader.sources if name.startswith("mtp.")}):
        print(f"kept {depths} multi-token prediction depths: train it with --model.mtp_layers {depths}")
    if reader.skipped:
        print(f"skipped (no model here has a place for them): {reader.skipped_summary()}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
