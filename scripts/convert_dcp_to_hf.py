"""Export a checkpoint's model weights as a Hugging Face folder (config.json and model.safetensors)
that `transformers.AutoModelForCausalLM.from_pretrained` loads, for any model.name (Llama 2 and 3 as
LlamaForCausalLM, Qwen3 as Qwen3ForCausalLM, Qwen3-MoE as Qwen3MoeForCausalLM with the Hub's
per-expert weights):

    python scripts/convert_dcp_to_hf.py outputs/checkpoint/step-100 hf_model
    python scripts/convert_dcp_to_hf.py converted_from_hf hf_model --name qwen3 --flavor 0.6B  # no record

The flavour gives what the weights' shapes do not (head counts and size, RoPE theta and scaling, norm
epsilon, tied embeddings): the checkpoint records the model.name and model.flavor it was trained
with, which are the defaults of --name and --flavor (a different one given is refused, one line). A
tied model's file has no lm_head.weight, as HF's. The run's tokenizer (the record's model.tokenizer_path,
or --tokenizer) is written beside the weights (tokenizer.json and tokenizer_config.json: a Hugging Face
tokenizer's as they are, a tiktoken file converted, torchtitan/datasets/hf_export.py), with its BOS,
EOS and pad ids in config.json and generation_config.json, so that transformers'
`pipeline("text-generation", model=folder)` runs as it is.
"""

import argparse
import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, uninstalled

from torchtitan.checkpoint.folder import check_checkpoint  # noqa: E402
from torchtitan.checkpoint.load import read_model_record, read_model_weights  # noqa: E402
from torchtitan.checkpoint.state import tokenizer_sha256  # noqa: E402
from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.paths import check_writable_folder, resolve_path  # noqa: E402
from torchtitan.datasets.hf_export import write_tokenizer_files  # noqa: E402
from torchtitan.datasets.tokenizer import AnyTokenizer, build_tokenizer  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402
from torchtitan.models import MODEL_SPECS  # noqa: E402
from torchtitan.models.spec import ModelArgs  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def convert(
    checkpoint: str,
    output: str,
    model_args: ModelArgs,
    dtype: torch.dtype | None = None,
    max_position_embeddings: int = 8192,
    name: str = "llama3",
    drop_expert_bias: bool = False,
    tokenizer: AnyTokenizer | None = None,
) -> None:
    """Write config.json and model.safetensors of model.name `name`'s checkpoint into `output`, and with
    the run's `tokenizer` its files, its BOS/EOS/pad ids in config.json and generation_config.json. A
    mixture-of-experts model's routing biases (moe.bias_update_rate) have no place in HF's model: a
    non-zero one is refused unless `drop_expert_bias`, as the model routes differently without it."""
    check_checkpoint("checkpoint", checkpoint)
    check_writable_folder("output", output)
    weights = read_model_weights(checkpoint)
    biases = [key for key in weights if key.endswith(".expert_bias")]
    if not drop_expert_bias and any(weights[key].any() for key in biases):
        raise ConfigError(
            "--drop-expert-bias: the checkpoint's experts were chosen with a routing bias "
            "(moe.bias_update_rate) that Hugging Face's model has no place for, so it would route tokens "
            "differently; pass --drop-expert-bias to export it without the bias"
        )
    weights = {key: w for key, w in weights.items() if key not in biases}
    dim = weights["tok_embeddings.weight"].shape[1]
    if dim != model_args.dim:
        raise ConfigError(f"--flavor: the checkpoint's model has dim {dim}, the flavor {model_args.dim}")
    if model_args.tie_word_embeddings and not torch.equal(
        weights["output.weight"], weights["tok_embeddings.weight"]
    ):
        raise ConfigError(
            "--flavor: the flavor ties the output layer to the embeddings, the checkpoint's differ; "
            "pass the flavor the checkpoint was trained with (an untied one)"
        )
    if dtype is not None:
        weights = {key: w.to(dtype) for key, w in weights.items()}
    spec = MODEL_SPECS[name]
    adapter = spec.hf()
    folder = Path(output)
    folder.mkdir(parents=True, exist_ok=True)
    save_file(adapter.to_hf(weights, model_args), folder / "model.safetensors", {"format": "pt"})
    config = {
        "architectures": [spec.hf_architecture],
        **adapter.hf_config(model_args, weights, max_position_embeddings, weights["norm.weight"].dtype),
    }
    if tokenizer is not None:
        ids = {
            "bos_token_id": tokenizer.bos_id,
            "eos_token_id": tokenizer.eos_id,
            "pad_token_id": getattr(tokenizer, "pad_id", None),
        }
        config.update(ids)
        (folder / "generation_config.json").write_text(json.dumps(ids, indent=2) + "\n")
        write_tokenizer_files(tokenizer, folder, max_position_embeddings)
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")


def recorded_model(
    checkpoint: str, name: str | None, flavor: str | None, tokenizer_path: str | None
) -> tuple[str, str, AnyTokenizer]:
    """The model.name, model.flavor and tokenizer to export with: the checkpoint's record, which a
    --name or --flavor given must match (checked before anything else: the wrong family is the first
    thing to say) and a --tokenizer given must hash as; without a record (saved by an earlier version,
    converted from Hugging Face), those given (--name and --flavor default to llama3 debugmodel)."""
    check_checkpoint("checkpoint", checkpoint)
    record = read_model_record(checkpoint) or {}
    for option, given, saved in (
        ("--name", name, record.get("name")),
        ("--flavor", flavor, record.get("flavor")),
    ):
        if given is not None and saved is not None and given != saved:
            raise ConfigError(
                f"{option}: {checkpoint} holds a {record['name']} {record['flavor']} model (its record), "
                f"not {given}; pass {option} {saved} or leave {option} out"
            )
    tokenizer_path = tokenizer_path or record.get("tokenizer_path")
    if tokenizer_path is None:
        raise ConfigError(
            f"--tokenizer: {checkpoint} records no tokenizer; pass the run's model.tokenizer_path"
        )
    if not os.path.exists(resolve_path(tokenizer_path)):
        raise ConfigError(
            f"--tokenizer: {tokenizer_path} does not exist; pass the run's model.tokenizer_path"
        )
    if record and tokenizer_sha256(tokenizer_path) != record["tokenizer_sha256"]:
        raise ConfigError(
            f"--tokenizer: {tokenizer_path} is not the tokenizer {checkpoint} was trained with (their "
            "SHA-256 differ); pass the run's model.tokenizer_path"
        )
    name, flavor = name or record.get("name", "llama3"), flavor or record.get("flavor", "debugmodel")
    return name, flavor, build_tokenizer(resolve_path(tokenizer_path))


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad argument or checkpoint."""
    return run_with_exit_codes(lambda: run(argv))


def run(argv: list[str] | None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("checkpoint", help="DCP checkpoint folder, e.g. outputs/checkpoint/step-100")
    parser.add_argument("output", help="folder to write config.json and model.safetensors into")
    parser.add_argument(
        "--name", choices=MODEL_SPECS, help="model.name of the run (default: the checkpoint's record)"
    )
    parser.add_argument("--flavor", help="model.flavor of the run (default: the checkpoint's record)")
    parser.add_argument(
        "--tokenizer",
        help="model.tokenizer_path of the run, copied beside the weights (default: the record's)",
    )
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights (default: as saved)")
    parser.add_argument(
        "--max-position-embeddings", type=int, default=8192, help="context length written to config.json"
    )
    parser.add_argument(
        "--drop-expert-bias",
        action="store_true",
        help="export a mixture-of-experts model trained with moe.bias_update_rate without its routing "
        "biases (HF's model has none; it then routes differently)",
    )
    args = parser.parse_args(argv)
    args.name, args.flavor, tokenizer = recorded_model(
        args.checkpoint, args.name, args.flavor, args.tokenizer
    )
    flavors = MODEL_SPECS[args.name].flavors
    if args.flavor not in flavors:
        parser.error(f"--flavor: {args.name} has no flavor {args.flavor!r}; one of {', '.join(flavors)}")
    dtype = DTYPES[args.dtype] if args.dtype else None
    convert(
        args.checkpoint,
        args.output,
        flavors[args.flavor],
        dtype,
        args.max_position_embeddings,
        args.name,
        args.drop_expert_bias,
        tokenizer,
    )
    print(f"wrote {args.output}: config.json, generation_config.json, model.safetensors and the tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
