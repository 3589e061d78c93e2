"""Chat data (torchtitan/datasets/chat*.py): the tokens and mask of a conversation are transformers'
(`apply_chat_template` with `return_assistant_tokens_mask`), from `{% generation %}` spans or, without
them, from prefix renders; the formats, loss_on policies and overflow; conversations packed whole as
documents, the same global rows on every data-parallel layout, resumed from the loader's state."""

import json
import logging
import os
import re
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_data import merged_state  # noqa: E402

from torchtitan.config.options import ChatConfig, ConfigError  # noqa: E402
from torchtitan.config.parser import parse_args  # noqa: E402
from torchtitan.config_rules import check_layout  # noqa: E402
from torchtitan.datasets.chat import ChatEncoder, detect_format, to_messages  # noqa: E402
from torchtitan.datasets.chat_data import build_chat_dataset  # noqa: E402
from torchtitan.datasets.chat_template import ChatTemplate, load_chat_template  # noqa: E402
from torchtitan.datasets.layout import IGNORE_INDEX, BatchLayout  # noqa: E402
from torchtitan.datasets.loader import DataLoader  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("hf_cache")

FOLDER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "kjv_bpe_hf"
TEMPLATE = (FOLDER / "chat_template.jinja").read_text()
WITHOUT_TAGS = re.sub(r"\{%-? *(end)?generation *-?%\}\n?", "", TEMPLATE)
SYSTEM = {"role": "system", "content": "You answer from the book of Genesis."}


def turn(question: str, answer: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": question}, {"role": "assistant", "content": answer}]


CONVERSATIONS = [
    [SYSTEM, *turn("Who begat Enos?", "Seth begat Enos."), *turn("And then?", "Enos begat Cainan.")],
    [
        SYSTEM,
        *turn("Where was Eden?", "Eastward."),
        *turn("Who dwelt there?", "Adam."),
        *turn("Why?", "To till it."),
    ],
    [*turn("What was first?", "In the beginning God created the heaven and the earth.")],
]


def encoder(
    hf_tok,
    template: str = TEMPLATE,
    loss_on: str = "assistant",
    overflow: str = "truncate",
    max_tokens: int = 10_000,
) -> ChatEncoder:
    template = ChatTemplate(template, {"eos_token": "<|endoftext|>"}, "test")
    return ChatEncoder(template, hf_tok, loss_on, overflow, max_tokens)


@pytest.fixture(scope="module")
def hf_chat_tokenizer():
    return transformers.AutoTokenizer.from_pretrained(FOLDER)


@pytest.mark.parametrize("conversation", CONVERSATIONS)
def test_tokens_and_mask_are_transformers(hf_tok, hf_chat_tokenizer, conversation):
    """The bundled template (found beside tokenizer.json) renders as transformers renders it, its
    generation spans give transformers' assistant mask, and prefix renders find the same mask on the
    template without the tags."""
    expected = hf_chat_tokenizer.apply_chat_template(
        conversation,
        chat_template=TEMPLATE,
        tokenize=True,
        return_dict=True,
        return_assistant_tokens_mask=True,
    )
    template = load_chat_template(hf_tok.folder, hf_tok.config, None)
    assert template.has_generation and template.source == TEMPLATE
    ours = ChatEncoder(template, hf_tok, "assistant", "truncate", 10_000).encode(conversation)
    assert ours.ids == expected["input_ids"]
    assert [int(t) for t in ours.trained] == expected["assistant_masks"]
    assert sum(ours.trained) > len(conversation) // 2  # each assistant turn, its <|im_end|> included
    by_prefixes = encoder(hf_tok, WITHOUT_TAGS).encode(conversation)
    assert by_prefixes.ids == ours.ids and by_prefixes.trained == ours.trained


def test_loss_on_policies(hf_tok, hf_chat_tokenizer):
    conversation = CONVERSATIONS[1]
    assistant = encoder(hf_tok).encode(conversation)
    last = encoder(hf_tok, loss_on="last_assistant").encode(conversation)
    assert encoder(hf_tok, WITHOUT_TAGS, loss_on="last_assistant").encode(conversation) == last
    every = encoder(hf_tok, loss_on="all").encode(conversation)
    assert all(every.trained) and every.ids == assistant.ids == last.ids
    last_turn = [t for t, m in zip(last.ids, last.trained) if m]
    assert hf_chat_tokenizer.decode(last_turn) == "To till it.<|im_end|>"
    # The last turn's tokens are the end of the assistant ones, whose other turns are not in `last`.
    assert all(a or not b for a, b in zip(assistant.trained, last.trained)) and sum(last.trained) < sum(
        assistant.trained
    )
    trained = [t for t, m in zip(assistant.ids, assistant.trained) if m]
    assert hf_chat_tokenizer.decode(trained) == "Eastward.<|im_end|>Adam.<|im_end|>To till it.<|im_end|>"


def test_formats():
    messages = [SYSTEM, *turn("Q?", "A.")]
    turns = [("system", SYSTEM["content"]), ("human", "Q?"), ("gpt", "A.")]
    sharegpt = {"conversations": [{"from": who, "value": text} for who, text in turns]}
    assert to_messages({"messages": messages}, detect_format(["messages"], "auto")) == messages
    assert to_messages(sharegpt, detect_format(["conversations"], "auto")) == messages
    alpaca = {"instruction": "Q?", "input": "Genesis 1", "output": "A."}
    assert detect_format(["instruction", "input", "output"], "auto") == "alpaca"
    assert to_messages(alpaca, "alpaca") == turn("Q?\n\nGenesis 1", "A.")
    assert to_messages({**alpaca, "input": ""}, "alpaca") == turn("Q?", "A.")
    with pytest.raises(ValueError, match="unknown role 'robot'"):
        to_messages({"messages": [{"role": "robot", "content": "beep"}]}, "messages")
    with pytest.raises(ValueError, match="unknown role 'bot'"):
        to_messages({"conversations": [{"from": "bot", "value": "beep"}]}, "sharegpt")
    with pytest.raises(ValueError, match=r"columns \['text'\] are none of"):
        detect_format(["text"], "auto")
    with pytest.raises(ValueError, match="chat.format sharegpt: the data has no conversations column"):
        detect_format(["messages"], "sharegpt")


def test_overflow_truncates_whole_turns_or_drops(hf_tok, caplog):
    conversation = CONVERSATIONS[1]
    whole = encoder(hf_tok).encode(conversation)
    two_turns = encoder(hf_tok).encode(conversation[:5])
    assert len(two_turns.ids) < len(whole.ids)
    truncated = encoder(hf_tok, max_tokens=len(whole.ids) - 1).encode(conversation)
    assert truncated == two_turns
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        dropping = encoder(hf_tok, overflow="drop", max_tokens=len(whole.ids) - 1)
        assert dropping.encode(conversation) is None
        assert encoder(hf_tok, max_tokens=5).encode(conversation) is None  # not even one turn fits
    assert dropping.counts.counts == {"dropped as longer than training.seq_len": 1}
    assert "a conversation dropped as longer than training.seq_len (each counted once" in caplog.text
    # Read again (another epoch, a resume), a conversation is counted and logged once.
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="torchtitan"):
        assert dropping.encode(conversation) is None
    assert dropping.counts.counts == {"dropped as longer than training.seq_len": 1} and not caplog.text


def test_refused_and_untrained_conversations_are_counted(hf_tok):
    # A template that drops the earlier turns from the history: prefixes are not token prefixes.
    last_only = (
        "{% for m in messages %}{% if loop.last or add_generation_prompt %}"
        "{{ m['role'] + ': ' + m['content'] + '<|im_end|>' }}{% endif %}{% endfor %}"
    )
    refusing = encoder(hf_tok, last_only)
    assert refusing.encode(CONVERSATIONS[0]) is None
    assert refusing.counts.counts == {
        "refused (the prompt before an assistant turn is not a token prefix of the turn's render)": 1
    }
    plain = encoder(hf_tok)
    assert plain.encode([SYSTEM, {"role": "user", "content": "No answer."}]) is None
    raising = encoder(hf_tok, "{{ raise_exception('roles must alternate') }}")
    assert raising.encode(CONVERSATIONS[0]) is None
    assert plain.counts.counts == {"skipped (no assistant turn)": 1}
    assert raising.counts.counts == {"refused by the chat template": 1}


def test_a_tokenizer_without_template_takes_the_template_file(hf_tok, tmp_path):
    (tmp_path / "tok").mkdir()
    (tmp_path / "tok" / "tokenizer.json").write_bytes((FOLDER / "tokenizer.json").read_bytes())
    config = {"eos_token": "<|endoftext|>"}
    with pytest.raises(ValueError, match="has no chat template .* set chat.template_path"):
        load_chat_template(tmp_path / "tok", config, None)
    (tmp_path / "t.jinja").write_text(WITHOUT_TAGS)
    assert load_chat_template(tmp_path / "tok", config, str(tmp_path / "t.jinja")).source == WITHOUT_TAGS
    named = {**config, "chat_template": [{"name": "default", "template": TEMPLATE}]}
    assert load_chat_template(tmp_path / "tok", named, str(tmp_path / "t.jinja")).source == TEMPLATE


# 40 conversations of 1 to 3 turns, some long enough to leave a window part empty.
def chat(i: int) -> list[dict[str, str]]:
    turns = [turn(f"Question {i}.{k}?", "and it came to pass " * (i % 5 + 1)) for k in range(i % 3 + 1)]
    return [SYSTEM, *(m for t in turns for m in t)]


CHATS = [chat(i) for i in range(40)]
SEQ_LEN = 96


@pytest.fixture(scope="module")
def chats_file(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("chats") / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CHATS))
    return path


def chat_loaders(hf_tok, path: Path, layout: tuple[int, ...], workers: int = 0) -> list[DataLoader]:
    """One loader per rank of a (dp_world_size, batch_size[, grad_accum_steps]) layout."""
    world, batch, accum = (*layout, 1)[:3]
    chat = ChatConfig(enable=True)
    return [
        DataLoader(
            build_chat_dataset(
                chat, "chats", str(path), hf_tok, SEQ_LEN, BatchLayout(batch, world, rank, accum)
            ),
            batch,
            workers,
        )
        for rank in range(world)
    ]


def global_steps(loaders: list[DataLoader], steps: int, accum: int = 1) -> list[torch.Tensor]:
    """Each step's global batch, rows in global order, as (rows, 3, seq_len): ids, labels, positions."""
    iters = [iter(loader) for loader in loaders]
    out = []
    for _ in range(steps):
        micro = [torch.stack(next(it).parts(), dim=1) for _ in range(accum) for it in iters]
        # micro-batch m of rank r is rows m * D * b + r * b + [0, b): taken in that order above
        out.append(torch.cat(micro))
    return out


def test_conversations_packed_whole_as_documents(hf_tok, chats_file):
    """Each window is whole conversations, in their order, then padding: positions restart at 0 for
    each, a label is the next token of the same conversation where it is trained, else -100 (its last
    token's and the padding's too)."""
    encoding = encoder(hf_tok, max_tokens=SEQ_LEN)
    expected = {tuple(e.ids): e for c in CHATS if (e := encoding.encode(c)) is not None}
    (loader,) = chat_loaders(hf_tok, chats_file, (1, 4))
    conversations, paddings = 0, 0
    for step in global_steps([loader], 6):
        for ids, labels, positions in step:
            starts = (positions == 0).nonzero().flatten().tolist()
            for start, end in zip(starts, [*starts[1:], SEQ_LEN]):
                assert positions[start:end].tolist() == list(range(end - start))
                if ids[start] == hf_tok.pad_id:  # the rest of the window
                    assert end == SEQ_LEN and (ids[start:] == hf_tok.pad_id).all()
                    assert labels[start:].eq(IGNORE_INDEX).all()
                    paddings += 1
                    continue
                conversation = expected[tuple(ids[start:end].tolist())]  # whole, never cut
                pairs = zip(conversation.ids[1:], conversation.trained[1:])
                assert labels[start:end].tolist() == [
                    *(t if m else IGNORE_INDEX for t, m in pairs),
                    IGNORE_INDEX,
                ]
                conversations += 1
    assert conversations >= 24 and paddings >= 12


LAYOUTS = [(1, 4), (2, 2), (4, 1), (1, 2, 2), (2, 1, 2)]  # (ranks, batch, micro-batches)


@pytest.mark.parametrize("layout", LAYOUTS[1:])
def test_layout_invariance_and_resume(hf_tok, chats_file, layout):
    """Global row j of step k is the same on every layout (data workers too), and a state taken after
    2 steps on one layout resumes on another."""
    reference = global_steps(chat_loaders(hf_tok, chats_file, LAYOUTS[0]), 5)
    accum = (*layout, 1)[2]
    loaders = chat_loaders(hf_tok, chats_file, layout, workers=1 if layout[0] == 2 else 0)
    assert all(torch.equal(a, b) for a, b in zip(global_steps(loaders, 5, accum), reference))

    first = chat_loaders(hf_tok, chats_file, layout)
    global_steps(first, 2, accum)
    resumed = chat_loaders(hf_tok, chats_file, LAYOUTS[0])
    resumed[0].load_state_dict(merged_state(first))
    assert all(torch.equal(a, b) for a, b in zip(global_steps(resumed, 3), reference[2:]))


def test_a_whole_validation_pass_is_refused():
    """Chat data never ends: validation evaluates a number of global batches."""
    recipe = [
        "--job.config_file",
        str(Path(__file__).resolve().parents[1] / "train_configs/qwen3_chat_debug.toml"),
    ]
    with pytest.raises(
        ConfigError, match="validation.steps: -1 .a whole pass. is not supported on chat data"
    ):
        check_layout(parse_args([*recipe, "--validation.steps", "-1"]), 1)


def test_every_parallelism_takes_chat_data():
    """TP, CP and PP pass the conversations' positions on (their parity: tests/test_chat_train.py and
    scripts/parity_matrix.py --only Chat)."""
    recipe = [
        "--job.config_file",
        str(Path(__file__).resolve().parents[1] / "train_configs/qwen3_chat_debug.toml"),
    ]
    for degree in ("tensor", "context", "pipeline"):
        check_layout(parse_args([*recipe, f"--parallelism.{degree}_parallel_degree", "2"]), 2)


# Block tags as templates write them: own lines or inline, with and without whitespace control, the
# generation tags inside or outside the assistant's branch.
TEMPLATE_SHAPES = {
    "inline": "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}"
    "{% generation %}{{ m['content'] }}<|im_end|>{% endgeneration %}\n{% else %}{{ m['content'] }}"
    "<|im_end|>\n{% endif %}{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
    "own lines": "{% for m in messages %}\n<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}\n"
    "    {% generation %}\n{{ m['content'] }}<|im_end|>\n    {% endgeneration %}\n{% else %}\n"
    "{{ m['content'] }}<|im_end|>\n{% endif %}\n{% endfor %}\n{% if add_generation_prompt %}\n"
    "<|im_start|>assistant\n{% endif %}\n",
    "minus signs": "{%- for m in messages -%}\n{{- '<|im_start|>' + m['role'] + '\\n' -}}\n"
    "{%- if m['role'] == 'assistant' -%}\n{%- generation -%}\n{{- m['content'] + '<|im_end|>' -}}\n"
    "{%- endgeneration -%}\n{{- '\\n' -}}\n{%- else -%}\n{{- m['content'] + '<|im_end|>\\n' -}}\n"
    "{%- endif -%}\n{%- endfor -%}\n{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}"
    "{% endif %}",
    "bundled": TEMPLATE,
}


@pytest.mark.parametrize("tags", [True, False], ids=["with tags", "without tags"])
@pytest.mark.parametrize("shape", list(TEMPLATE_SHAPES))
def test_templates_render_transformers_ids(hf_tok, hf_chat_tokenizer, shape, tags):
    """Every shape of block tags renders transformers' ids (its Jinja environment: trim_blocks,
    lstrip_blocks, the generation extension), and the mask is transformers' assistant mask where tags
    exist (found from prefix renders where not: the same tokens)."""
    template = TEMPLATE_SHAPES[shape]
    if not tags:
        template = re.sub(r"\{%-? *(end)?generation *-?%\}", "", template)
    tagged = TEMPLATE_SHAPES[shape]
    for conversation in CONVERSATIONS:
        expected = hf_chat_tokenizer.apply_chat_template(
            conversation, chat_template=template, tokenize=True, return_dict=True
        )["input_ids"]
        ours = encoder(hf_tok, template).encode(conversation)
        assert ours.ids == expected and ours.starts == (0,)
        mask = hf_chat_tokenizer.apply_chat_template(
            conversation, chat_template=tagged, return_dict=True, return_assistant_tokens_mask=True
        )
        if mask["input_ids"] == expected:  # removing the tags left the same text
            assert [int(t) for t in ours.trained] == mask["assistant_masks"]


def test_a_warning_counted_once_per_conversation_and_summed_up_each_epoch(hf_tok, tmp_path, caplog):
    """One over-long conversation read again every epoch: one warning naming the data, then one line of
    totals per epoch (not one warning per reading); the data trained on is named."""
    path = tmp_path / "mine.jsonl"
    rows = [*([SYSTEM, *turn(f"Question {i}?", "Amen.")] for i in range(7))]
    rows.append([SYSTEM, *turn("Long?", "and it came to pass " * 60)])
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in rows))
    chat = ChatConfig(enable=True, overflow="drop")
    with caplog.at_level(logging.INFO, logger="torchtitan"):
        dataset = build_chat_dataset(chat, "kjv_chat", str(path), hf_tok, SEQ_LEN, BatchLayout(2))
        for _ in zip(DataLoader(dataset, 2, 0), range(20)):
            pass
    warnings = [r.message for r in caplog.records if r.levelno == logging.WARNING and "dropped" in r.message]
    assert warnings == [
        f"Chat data {path}: a conversation dropped as longer than training.seq_len (each counted once; "
        "totals at epochs' ends)"
    ]
    summaries = [r.message for r in caplog.records if "distinct conversations" in r.message]
    epochs = [r.message for r in caplog.records if "re-looped" in r.message]
    # One line per epoch that every stream of the rank has ended (the streams' epochs drift apart).
    ended = [int(re.search(r"to epoch (\d+)'s end", m).group(1)) for m in summaries]
    assert ended == list(range(len(summaries))) and 3 <= len(summaries) <= len(epochs)
    assert all(str(path) in m for m in epochs)
    assert all(
        m.startswith(f"Chat data {path}: 1 dropped as longer than training.seq_len") for m in summaries
    )
    assert f"Chat data for training: {path}" in caplog.text and "kjv_chat" not in caplog.text
