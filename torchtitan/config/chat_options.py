"""The `[chat]` section's options (conversations with loss masks, docs/datasets.md), declared here to keep
options.py within the 500 lines of a file; JobConfig holds it as any other section."""

from dataclasses import dataclass

from torchtitan.config.declare import opt


@dataclass
class ChatConfig:
    enable: bool = opt(
        False,
        "Train on conversations (training.dataset or dataset_path): each rendered with the tokenizer's chat "
        "template, trained on the tokens loss_on names, packed whole into windows as documents; needs "
        "model.attn_mask_type block_causal and a Hugging Face tokenizer folder (docs/datasets.md)",
    )
    format: str = opt(
        "auto",
        "How a row holds its conversation: messages (role/content), sharegpt (conversations of from/value), "
        "alpaca (instruction, input, output); auto: from the columns",
        choices=("auto", "messages", "sharegpt", "alpaca"),
    )
    template_path: str | None = opt(
        None,
        "Jinja chat template file, used when the tokenizer has none (no chat_template.jinja beside its "
        "tokenizer.json, no chat_template in its tokenizer_config.json)",
    )
    loss_on: str = opt(
        "assistant",
        "Tokens trained on: every assistant turn's (its end-of-turn token included), the last assistant "
        "turn's, or all of the conversation's",
        choices=("assistant", "last_assistant", "all"),
    )
    overflow: str = opt(
        "truncate",
        "A conversation longer than training.seq_len: truncate (keep its whole leading turns that fit) or "
        "drop it (counted in the log)",
        choices=("truncate", "drop"),
    )
