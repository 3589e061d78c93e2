"""A tokenizer as Hugging Face files, for an exported model folder that transformers loads as it is
(`AutoTokenizer`, `pipeline("text-generation")`): a tokenizer.json tokenizer's own files, copied; a
tiktoken BPE file (Llama 3's tokenizer.model, the bundled kjv_bpe.tiktoken) written as the tokenizer.json
of a byte-level BPE that `PreTrainedTokenizerFast` reads with the same ids.

A tiktoken file lists each token's bytes and rank, the order in which BPE merges: a text piece is merged
pair by pair, always the adjacent pair whose concatenation ranks lowest. HF's BPE merges by a list of
pairs in priority order, so each token of rank r is listed with every split into two tokens, at priority
r: the same merges, in the same order (as transformers' own TikTokenConverter builds them).
"""

import json
import shutil
from pathlib import Path

from tokenizers import AddedToken, Regex, decoders, pre_tokenizers, processors
from tokenizers import Tokenizer as Backend
from tokenizers.models import BPE

from torchtitan.config.chat_options import ChatConfig
from torchtitan.config.options import ModelConfig
from torchtitan.config.paths import resolve_path
from torchtitan.datasets.chat_template import TEMPLATE_FILE, ChatTemplate, TemplateRefused, load_chat_template
from torchtitan.datasets.hf_tokenizer import TOKENIZER_CONFIG, TOKENIZER_JSON, HFTokenizer
from torchtitan.datasets.tokenizer import LLAMA3_PAT_STR, AnyTokenizer, build_tokenizer, load_bpe_ranks


def byte_to_unicode() -> dict[int, str]:
    """GPT-2's printable stand-in for each byte, the alphabet of byte-level BPE vocabularies."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    stand_ins, extra = {}, 0
    for byte in range(256):
        if byte in printable:
            stand_ins[byte] = chr(byte)
        else:
            stand_ins[byte] = chr(256 + extra)
            extra += 1
    return stand_ins


def tiktoken_as_hf(bpe_file: str | Path, special_tokens: dict[str, int], bos: str) -> Backend:
    """The tiktoken BPE file's tokenizer, with Llama 3's pre-tokenizer and `special_tokens` (name ->
    id), adding `bos` before each text as the tiktoken reader's generate.py and Llama 3's HF files do."""
    ranks = load_bpe_ranks(bpe_file)
    stand_in = byte_to_unicode()

    def text(token: bytes) -> str:
        return "".join(stand_in[b] for b in token)

    vocab = {text(token): rank for token, rank in ranks.items()}
    merges = []
    for token in sorted(ranks, key=ranks.__getitem__):
        splits = [(token[:i], token[i:]) for i in range(1, len(token))]
        splits = [(a, b) for a, b in splits if a in ranks and b in ranks]
        merges += [(text(a), text(b)) for a, b in sorted(splits, key=lambda s: (ranks[s[0]], ranks[s[1]]))]
    tokenizer = Backend(BPE(vocab=vocab, merges=merges, fuse_unk=False, byte_fallback=False))
    tokenizer.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(LLAMA3_PAT_STR), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.add_special_tokens(
        [
            AddedToken(name, special=True, normalized=False)
            for name, _ in sorted(special_tokens.items(), key=lambda t: t[1])
        ]
    )
    tokenizer.post_processor = processors.Sequence(
        [
            processors.ByteLevel(trim_offsets=False),
            processors.TemplateProcessing(
                single=f"{bos}:0 $A:0",
                pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
                special_tokens=[(bos, special_tokens[bos])],
            ),
        ]
    )
    return tokenizer


def trained_chat_template(model_config: ModelConfig, chat: ChatConfig) -> str | None:
    """The chat template a run with `chat` trains with (the tokenizer's own, else chat.template_path),
    None without chat.enable: the checkpoint records it, so that its export carries it."""
    tokenizer = build_tokenizer(resolve_path(model_config.tokenizer_path)) if chat.enable else None
    if not isinstance(tokenizer, HFTokenizer):  # chat.enable refuses another (chat_data.py)
        return None
    return load_chat_template(tokenizer.folder, tokenizer.config, chat.template_path).source


def end_of_turn_id(template: ChatTemplate, tokenizer: HFTokenizer) -> int | None:
    """The token ending an assistant turn under `template` (ChatML's <|im_end|>): the last special token
    of a reply's render after its prompt, as chat.py finds the trained turn's end; None if it has none."""
    user = [{"role": "user", "content": "Hello"}]
    try:
        prompt, _ = template.render(user, add_generation_prompt=True)
        through, _ = template.render([*user, {"role": "assistant", "content": "Hi"}])
    except TemplateRefused:
        return None
    start, ids = len(tokenizer.encode_rendered(prompt)[0]), tokenizer.encode_rendered(through)[0]
    return next((i for i in reversed(ids[start:]) if i in tokenizer.special_ids), None)


def write_tokenizer_files(
    tokenizer: AnyTokenizer, folder: str | Path, max_length: int, chat_template: str | None = None
) -> list[int]:
    """tokenizer.json and tokenizer_config.json into `folder`: a Hugging Face tokenizer's as they are
    with its chat_template.jinja, a tiktoken tokenizer's made from its BPE file (BOS added before each
    text, EOS its end-of-text); `chat_template` (the one a chat run trained with) as chat_template.jinja,
    which transformers' apply_chat_template and chat.enable read before tokenizer_config.json's. Returns
    the ids generation stops at: EOS, and the chat template's end-of-turn token where there is one."""
    folder = Path(folder)
    if isinstance(tokenizer, HFTokenizer):
        source = Path(tokenizer.model_path)
        source = source if source.is_dir() else source.parent
        for name in (TOKENIZER_JSON, TOKENIZER_CONFIG, TEMPLATE_FILE):
            if (source / name).is_file():
                shutil.copyfile(source / name, folder / name)
        if chat_template is not None:
            (folder / TEMPLATE_FILE).write_text(chat_template)
        stops = [tokenizer.eos_id] if tokenizer.eos_id is not None else []
        try:
            template = load_chat_template(folder, tokenizer.config, None)
        except ValueError:  # no template: a base model
            return stops
        end = end_of_turn_id(template, tokenizer)
        return stops + [end] if end is not None and end not in stops else stops
    names = {i: name for name, i in tokenizer.special_tokens.items()}
    bos, eos = names[tokenizer.bos_id], names[tokenizer.eos_id]
    tiktoken_as_hf(tokenizer.model_path, tokenizer.special_tokens, bos).save(str(folder / TOKENIZER_JSON))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": bos,
        "eos_token": eos,
        "add_bos_token": True,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
    }
    (folder / TOKENIZER_CONFIG).write_text(json.dumps(config, indent=2) + "\n")
    return [tokenizer.eos_id]
