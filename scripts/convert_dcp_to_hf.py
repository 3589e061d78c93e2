"""Export a checkpoint's model weights as a Hugging Face folder (config.json and model.safetensors)
that `transformers.AutoModelForCausalLM.from_pretrained` loads, for any model.name (Llama 2 and 3 as
LlamaForCausalLM, Qwen3 as Qwen3ForCausalLM, Qwen3-MoE as Qwen3MoeForCausalLM with the Hub's
per-expert weights, DeepSeek-V3 as DeepseekV3ForCausalLM):

    python scripts/convert_dcp_to_hf.py outputs/checkpoint/step-100 hf_model
    python scripts/convert_dcp_to_hf.py converted_from_hf hf_model --name qwen3 --flavor 0.6B  # no record

The flavour gives what the weights' shapes do not (head counts and size, RoPE theta and scaling, norm
epsilon, tied embeddings): the checkpoint records the model.name and model.flavor it was trained
with, which are the defaults of --name and --flavor (a different one given is refused, one line). A
tied model's file has no lm_head.weight, as HF's. The run's tokenizer (the record's model.tokenizer_path,
or --tokenizer) is written beside the weights (tokenizer.json and tokenizer_config.json: a Hugging Face
tokenizer's as they are, a tiktoken file converted, torchtitan/datasets/hf_export.py), with its BOS,
EOS and pad ids in config.json and generation_config.json, so that transformers'
`pipeline("text-generation", model=folder)` runs as it is; a chat run's template (its record) as
chat_template.jinja, with its end-of-turn token in generation_config.json's eos_token_id; DeepSeek-V3's
multi-token prediction depths as DeepSeek's layers N + i. The same function writes
`checkpoint.last_save_in_hf`'s folder, so the two are the same files. The output is a new or empty folder
(--overwrite replaces one whole, so that no stale shard is loaded with the new weights), never a run's
checkpoint nor a folder holding the checkpoint read.
"""

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere, uninstalled

from torchtitan.checkpoint.folder import check_checkpoint, check_output_folder  # noqa: E402
from torchtitan.checkpoint.hf_export import export_hf as convert  # noqa: E402
from torchtitan.checkpoint.load import read_model_record  # noqa: E402
from torchtitan.checkpoint.state import tokenizer_sha256  # noqa: E402
from torchtitan.config.options import ConfigError  # noqa: E402
from torchtitan.config.paths import resolve_path  # noqa: E402
from torchtitan.datasets.tokenizer import AnyTokenizer, build_tokenizer  # noqa: E402
from torchtitan.errors import run_with_exit_codes  # noqa: E402
from torchtitan.models import MODEL_SPECS  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def recorded_model(
    checkpoint: str,
    output: str,
    name: str | None,
    flavor: str | None,
    tokenizer_path: str | None,
    overwrite: bool = False,
) -> tuple[str, str, AnyTokenizer]:
    """The model.name, model.flavor and tokenizer to export with: the checkpoint's record, which a
    --name or --flavor given must match (checked before anything else: the wrong family is the first
    thing to say; then the output folder) and a --tokenizer given must hash as; without a record (saved
    by an earlier version, converted from Hugging Face), those given (--name and --flavor default to
    llama3 debugmodel)."""
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
    check_output_folder("output", output, overwrite, [checkpoint])
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
    parser.add_argument("output", help="folder to write config.json and model.safetensors into: new or empty")
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
    parser.add_argument("--overwrite", action="store_true", help="replace an output folder that holds files")
    args = parser.parse_args(argv)
    args.name, args.flavor, tokenizer = recorded_model(
        args.checkpoint, args.output, args.name, args.flavor, args.tokenizer, args.overwrite
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
        args.overwrite,
    )
    print(f"wrote {args.output}: config.json, generation_config.json, model.safetensors and the tokenizer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
