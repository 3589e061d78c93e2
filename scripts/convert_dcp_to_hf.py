"""Export a checkpoint's model weights as a Hugging Face Llama folder (config.json and
model.safetensors) that `transformers.LlamaForCausalLM.from_pretrained` loads:

    python scripts/convert_dcp_to_hf.py outputs/checkpoint/step-100 hf_model --name llama3 --flavor debugmodel

The flavour gives what the weights' shapes do not (head counts, RoPE theta and scaling, norm epsilon):
pass the model.name and model.flavor the checkpoint was trained with. The tokenizer is not copied.
"""

import argparse
import json
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, uninstalled

from torchtitan.checkpoint import read_model_weights  # noqa: E402
from torchtitan.config_manager import ConfigError  # noqa: E402
from torchtitan.models.llama import ModelArgs, llama2_configs, llama3_configs  # noqa: E402
from torchtitan.models.llama.hf_convert import hf_config, to_hf  # noqa: E402
from torchtitan.reliability.errors import run_with_exit_codes  # noqa: E402
from torchtitan.reliability.paths import check_checkpoint, check_writable_folder  # noqa: E402

MODEL_CONFIGS = {"llama2": llama2_configs, "llama3": llama3_configs}
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(
    checkpoint: str,
    output: str,
    model_args: ModelArgs,
    dtype: torch.dtype | None = None,
    max_position_embeddings: int = 8192,
) -> None:
    check_checkpoint("checkpoint", checkpoint)
    check_writable_folder("output", output)
    weights = read_model_weights(checkpoint)
    dim = weights["tok_embeddings.weight"].shape[1]
    if dim != model_args.dim:
        raise ConfigError(f"--flavor: the checkpoint's model has dim {dim}, the flavor {model_args.dim}")
    if dtype is not None:
        weights = {name: w.to(dtype) for name, w in weights.items()}
    n_kv_heads = model_args.n_kv_heads or model_args.n_heads
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(to_hf(weights, model_args.n_heads, n_kv_heads), folder / "model.safetensors", {"format": "pt"})
    config = hf_config(model_args, weights, max_position_embeddings, weights["norm.weight"].dtype)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad argument or checkpoint."""
    return run_with_exit_codes(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="DCP checkpoint folder, e.g. outputs/checkpoint/step-100")
    parser.add_argument("output", help="folder to write config.json and model.safetensors into")
    parser.add_argument("--name", default="llama3", choices=MODEL_CONFIGS, help="model.name of the run")
    parser.add_argument("--flavor", default="debugmodel", help="model.flavor of the run")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as saved)")
    parser.add_argument(
        "--max-position-embeddings", type=int, default=8192, help="context length written to config.json"
    )
    args = parser.parse_args(argv)
    flavors = MODEL_CONFIGS[args.name]
    if args.flavor not in flavors:
        parser.error(f"--flavor: {args.name} has no flavor {args.flavor!r}; one of {', '.join(flavors)}")
    dtype = DTYPES[args.dtype] if args.dtype else None
    convert(args.checkpoint, args.output, flavors[args.flavor], dtype, args.max_position_embeddings)
    print(f"wrote {args.output}/config.json and model.safetensors")
    return 0


if __name__ == "__main__":
    sys.exit(main())
