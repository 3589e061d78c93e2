"""A checkpoint's model as a Hugging Face folder that transformers runs as it is: config.json,
generation_config.json, model.safetensors, the tokenizer's files and the chat template the run trained
with. The one export: scripts/convert_dcp_to_hf.py and `checkpoint.last_save_in_hf` at the end of a run
both call `export_hf`, which reads everything but the flavour from the checkpoint (its weights, their
multi-token prediction depths, its record's chat template), so the two write the same folder."""

import json
from dataclasses import replace
from pathlib import Path

import torch
from safetensors.torch import save_file

from torchtitan.checkpoint.folder import check_checkpoint, check_output_folder, replacing_folder
from torchtitan.checkpoint.load import read_model_record, read_model_weights
from torchtitan.config.options import ConfigError
from torchtitan.datasets.hf_export import write_tokenizer_files
from torchtitan.datasets.tokenizer import AnyTokenizer
from torchtitan.models import MODEL_SPECS
from torchtitan.models.spec import ModelArgs


def export_hf(
    checkpoint: str,
    output: str,
    model_args: ModelArgs,
    dtype: torch.dtype | None = None,
    max_position_embeddings: int = 8192,
    name: str = "llama3",
    drop_expert_bias: bool = False,
    tokenizer: AnyTokenizer | None = None,
    overwrite: bool = False,
    option: str = "output",
    bias_option: str = "--drop-expert-bias",
) -> None:
    """Write config.json and model.safetensors of model.name `name`'s checkpoint into `output`, and with
    the run's `tokenizer` its files, its BOS/EOS/pad ids in config.json and generation_config.json (whose
    eos_token_id lists the chat template's end-of-turn token too, where there is one: the checkpoint's
    recorded template, a chat run's, else the tokenizer's own). The blocks and multi-token prediction's
    depths are those the weights hold, whatever `model_args` say (model.n_layers and model.mtp_layers). A
    mixture-of-experts model's routing biases (moe.bias_update_rate) have no place in HF's model but
    DeepSeek-V3's (the spec's `hf_expert_bias`, where they are exported): elsewhere a non-zero one is
    refused unless `drop_expert_bias`, as the model routes differently without it.
    `output` is new or empty, or replaced whole when `overwrite` (torchtitan/checkpoint/folder.py's
    rules); errors name `option` (the folder) and `bias_option` (the bias)."""
    check_checkpoint("checkpoint", checkpoint)
    check_output_folder(option, output, overwrite, [checkpoint])
    weights = read_model_weights(checkpoint)
    spec = MODEL_SPECS[name]
    biases = [] if spec.hf_expert_bias else [key for key in weights if key.endswith(".expert_bias")]
    if not drop_expert_bias and any(weights[key].any() for key in biases):
        raise ConfigError(
            f"{bias_option}: the checkpoint's experts were chosen with a routing bias "
            "(moe.bias_update_rate) that Hugging Face's model has no place for, so it would route tokens "
            "differently; export it with scripts/convert_dcp_to_hf.py --drop-expert-bias to leave it out"
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
    # The blocks the weights hold (a run's model.n_layers may have cut the flavour's), then DeepSeek's
    # layout of its depths: num_nextn_predict_layers, each depth with its copies, after the blocks.
    blocks = {key.split(".")[1] for key in weights if key.startswith("layers.")}
    model_args = replace(model_args, n_layers=len(blocks))
    if spec.mtp:
        model_args = replace(
            model_args, mtp_layers=len({key.split(".")[1] for key in weights if key.startswith("mtp.")})
        )
    if dtype is not None:
        # A routing bias stays fp32, as transformers keeps DeepSeek-V3's.
        weights = {key: w if key.endswith(".expert_bias") else w.to(dtype) for key, w in weights.items()}
    adapter = spec.hf()
    config = {
        "architectures": [spec.hf_architecture],
        **adapter.hf_config(model_args, weights, max_position_embeddings, weights["norm.weight"].dtype),
    }
    chat_template = (read_model_record(checkpoint) or {}).get("chat_template")  # a chat run's
    with replacing_folder(output) as new:
        folder = Path(new)
        save_file(adapter.to_hf(weights, model_args), folder / "model.safetensors", {"format": "pt"})
        if tokenizer is not None:
            stops = write_tokenizer_files(tokenizer, folder, max_position_embeddings, chat_template)
            ids = {
                "bos_token_id": tokenizer.bos_id,
                "eos_token_id": tokenizer.eos_id,
                "pad_token_id": getattr(tokenizer, "pad_id", None),
            }
            config.update(ids)
            generation = {**ids, "eos_token_id": stops if len(stops) > 1 else tokenizer.eos_id}
            (folder / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
        (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
