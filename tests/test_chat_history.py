"""Chat templates that re-render the history (chat.py): Qwen3's published template shows an assistant
turn's reasoning (``<think>...</think>``) only after the last user query, so a later turn's render drops
the reasoning of earlier ones and one render cannot train every turn as the model saw it at inference.
Each assistant turn is then a sample of its own, whose tokens are transformers' ``apply_chat_template``
of the conversation up to that turn and whose mask is that turn's tokens, every turn trained once; and
every template, with ``{% generation %}`` tags or without, renders the ids transformers renders."""

import json
import os
from pathlib import Path

os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("HF_HUB_OFFLINE", "1")

import pytest  # noqa: E402
import torch  # noqa: E402
from test_data import merged_state  # noqa: E402

from torchtitan.datasets.chat import PER_TURN, ChatEncoder  # noqa: E402
from torchtitan.datasets.chat_data import ChatDataset, load_chat_dataset  # noqa: E402
from torchtitan.datasets.chat_shards import PretokenizedChats, pretokenize_chats  # noqa: E402
from torchtitan.datasets.chat_template import ChatTemplate  # noqa: E402
from torchtitan.datasets.layout import IGNORE_INDEX, BatchLayout  # noqa: E402
from torchtitan.datasets.loader import DataLoader  # noqa: E402

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("hf_cache")

FOLDER = Path(__file__).resolve().parents[1] / "assets" / "tokenizer" / "kjv_bpe_hf"

# Modelled on Qwen3's published chat template (its tool branches left out): the last user query is
# found from the end; an assistant turn after it shows its reasoning (its reasoning_content, else parsed
# out of its content) in a <think> block (the last turn always, empty reasoning included); earlier ones
# show their answer only.
QWEN3 = """\
{%- if messages[0].role == 'system' %}
    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- set ns = namespace(multi_step_tool=true, last_query_index=messages|length - 1) %}
{%- for message in messages[::-1] %}
    {%- set index = (messages|length - 1) - loop.index0 %}
    {%- if ns.multi_step_tool and message.role == "user" %}
        {%- set ns.multi_step_tool = false %}
        {%- set ns.last_query_index = index %}
    {%- endif %}
{%- endfor %}
{%- for message in messages %}
    {%- set content = message.content %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) %}
        {{- '<|im_start|>' + message.role + '\\n' + content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {%- set reasoning_content = '' %}
        {%- if message.reasoning_content is string %}
            {%- set reasoning_content = message.reasoning_content %}
        {%- elif '</think>' in content %}
            {%- set reasoning_content = content.split('</think>')[0].rstrip('\\n') %}
            {%- set reasoning_content = reasoning_content.split('<think>')[-1].lstrip('\\n') %}
            {%- set content = content.split('</think>')[-1].lstrip('\\n') %}
        {%- endif %}
        {{- '<|im_start|>' + message.role + '\\n' }}
        {%- if loop.index0 > ns.last_query_index and (loop.last or reasoning_content) %}
            {{- '<think>\\n' + reasoning_content.strip('\\n') + '\\n</think>\\n\\n' + content.lstrip('\\n') }}
        {%- else %}
            {{- content }}
        {%- endif %}
        {{- '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# The same with the assistant's output (its <|im_end|> included) in {% generation %} tags.
QWEN3_TAGGED = QWEN3.replace(
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n",
    "        {{- '<|im_start|>' + message.role + '\\n' }}\n        {%- generation %}\n",
).replace(
    "        {{- '<|im_end|>\\n' }}\n    {%- endif %}",
    "        {{- '<|im_end|>' }}\n        {%- endgeneration %}\n        {{- '\\n' }}\n    {%- endif %}",
)
assert QWEN3_TAGGED.count("generation %}") == 2
SYSTEM = {"role": "system", "content": "You answer from the book of Genesis."}


def think(reasoning: str, answer: str) -> dict[str, str]:
    return {"role": "assistant", "content": f"<think>\n{reasoning}\n</think>\n\n{answer}"}


def user(text: str) -> dict[str, str]:
    return {"role": "user", "content": text}


CONVERSATIONS = [
    [
        SYSTEM,
        user("Who begat Enos?"),
        think("Genesis 4:26 names Seth's son.", "Seth begat Enos."),
        user("And then?"),
        think("Genesis 5:9.", "Enos begat Cainan."),
        user("Who was first?"),
        think("Genesis 5:1.", "Adam."),
    ],
    [user("Where was Eden?"), think("Genesis 2:8.", "Eastward."), user("Why?"), think("", "To till it.")],
    [user("What was first?"), think("The first verse.", "In the beginning God created the heaven.")],
]


@pytest.fixture(scope="module")
def hf_chat_tokenizer():
    """transformers' fast tokenizer on the bundled Qwen3-style tokenizer.json (the oracle)."""
    return transformers.PreTrainedTokenizerFast(tokenizer_file=str(FOLDER / "tokenizer.json"))


def encoder(hf_tok, template: str, max_tokens: int = 10_000, loss_on: str = "assistant") -> ChatEncoder:
    return ChatEncoder(
        ChatTemplate(template, {"eos_token": "<|endoftext|>"}, "qwen3"), hf_tok, loss_on, "drop", max_tokens
    )


def hf_ids(hf_chat_tokenizer, messages, template: str, **kwargs) -> list[int]:
    return hf_chat_tokenizer.apply_chat_template(
        messages, chat_template=template, tokenize=True, return_dict=True, **kwargs
    )["input_ids"]


@pytest.mark.parametrize("template", [QWEN3, QWEN3_TAGGED], ids=["without tags", "with tags"])
@pytest.mark.parametrize("conversation", CONVERSATIONS, ids=["3 turns", "2 turns", "1 turn"])
def test_every_turn_trained_once_in_its_inference_context(hf_tok, hf_chat_tokenizer, template, conversation):
    """One sample per assistant turn (one only where one render serves): its ids are transformers'
    render of the conversation up to that turn, its mask exactly that turn's tokens, from the generation
    prompt to its <|im_end|>, reasoning included (transformers' assistant mask where tags exist)."""
    encoding = encoder(hf_tok, template)
    samples = encoding.encode(conversation).samples()
    turns = [i for i, m in enumerate(conversation) if m["role"] == "assistant"]
    assert len(samples) == len(turns)
    assert encoding.counts.counts == ({PER_TURN: 1} if len(turns) > 1 else {})
    for sample, turn in zip(samples, turns):
        expected = hf_ids(hf_chat_tokenizer, conversation[: turn + 1], template)
        assert sample.ids == expected
        prompt = hf_ids(hf_chat_tokenizer, conversation[:turn], template, add_generation_prompt=True)
        assert expected[: len(prompt)] == prompt
        end = len(expected) - 1 - expected[::-1].index(hf_tok.encode_rendered("<|im_end|>")[0][0])
        assert sample.trained == [len(prompt) <= i <= end for i in range(len(expected))]
        reasoning, answer = conversation[turn]["content"].split("</think>\n\n")
        trained_text = hf_chat_tokenizer.decode([t for t, m in zip(sample.ids, sample.trained) if m])
        assert trained_text == f"{reasoning}</think>\n\n{answer}<|im_end|>"
        if template is QWEN3_TAGGED:
            mask = hf_chat_tokenizer.apply_chat_template(
                conversation[: turn + 1], chat_template=template, return_assistant_tokens_mask=True
            )["assistant_masks"]
            assert sample.trained == [bool(m) and i >= len(prompt) for i, m in enumerate(mask)]
    # The extra tokens beyond one render: every sample but the last, in the per-epoch summary.
    assert encoding.counts.extra_tokens == sum(len(s.ids) for s in samples[:-1])
    if len(turns) > 1:
        assert (
            f"costing {encoding.counts.extra_tokens:,} tokens beyond one render" in encoding.counts.summary()
        )


def test_last_assistant_and_all_need_one_render(hf_tok, hf_chat_tokenizer):
    """loss_on last_assistant trains the last turn in the whole render; all trains every token of it."""
    conversation = CONVERSATIONS[0]
    whole = hf_ids(hf_chat_tokenizer, conversation, QWEN3)
    last = encoder(hf_tok, QWEN3, loss_on="last_assistant").encode(conversation)
    assert last.ids == whole and last.starts == (0,)
    assert hf_chat_tokenizer.decode([t for t, m in zip(last.ids, last.trained) if m]).startswith(
        "<think>\nGenesis 5:1."
    )
    every = encoder(hf_tok, QWEN3, loss_on="all").encode(conversation)
    assert every.ids == whole and all(every.trained)


def test_overflow_keeps_the_leading_turns_samples(hf_tok):
    """Each sample fits training.seq_len: truncate keeps the leading turns' samples, drop drops it."""
    conversation = CONVERSATIONS[0]
    samples = encoder(hf_tok, QWEN3).encode(conversation).samples()
    limit = len(samples[-1].ids) - 1
    cut = ChatEncoder(ChatTemplate(QWEN3, {}, "qwen3"), hf_tok, "assistant", "truncate", limit).encode(
        conversation
    )
    assert cut.samples() == samples[:-1]
    assert encoder(hf_tok, QWEN3, max_tokens=limit).encode(conversation) is None


def test_samples_packed_whole_and_resumed_mid_conversation(hf_tok, tmp_path):
    """The stream places each sample whole (positions from 0), a conversation's samples possibly in
    consecutive windows; each turn's trained tokens are labels once per epoch; a state taken between
    two samples of one conversation resumes on the next sample."""
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": c}) + "\n" for c in CONVERSATIONS))
    ds = load_chat_dataset("chats", str(path), "train", "auto")
    seq_len = 128

    def loader() -> DataLoader:
        dataset = ChatDataset("chats", ds, encoder(hf_tok, QWEN3, seq_len), seq_len, 0, BatchLayout(1, 1, 0))
        return DataLoader(dataset, 1, 0)

    windows = [torch.stack(b.parts(), dim=1)[0] for b, _ in zip(loader(), range(12))]
    samples = [s for c in CONVERSATIONS for s in encoder(hf_tok, QWEN3).encode(c).samples()]
    placed = []
    for ids, labels, positions in windows:
        starts = (positions == 0).nonzero().flatten().tolist()
        for start, end in zip(starts, [*starts[1:], seq_len]):
            if ids[start:end].tolist() in [s.ids for s in samples]:
                placed.append(ids[start:end].tolist())
                assert labels[end - 1] == IGNORE_INDEX
    # 6 samples, in order, once per epoch (an epoch's windows then start again).
    assert (
        placed[: len(samples)] == [s.ids for s in samples]
        and placed[len(samples) :] == placed[: len(placed) - len(samples)]
    )
    first = loader()
    batches = iter(first)
    for steps in range(1, 12):  # noqa: B007 (the steps taken, after the loop)
        next(batches)
        if _mid(first):
            break
    assert _mid(first), "no window ended between two samples of a conversation"
    resumed = loader()
    resumed.load_state_dict(merged_state([first]))
    again = [torch.stack(b.parts(), dim=1)[0] for b, _ in zip(resumed, range(3))]
    assert all(torch.equal(a, b) for a, b in zip(again, windows[steps : steps + 3]))


def _mid(loader: DataLoader) -> bool:
    """The loader's stream is between two samples of one conversation."""
    (streams,) = loader.state_dict()["dataset_state"].values()
    return int(streams["stream_0"][2]) > 0


def test_pretokenized_conversations_keep_their_samples(hf_tok, tmp_path):
    """A pre-tokenized chat folder holds each conversation's samples as written (their starts in bit 1
    of the trained bytes): read back, the same samples as encoding the conversation."""
    encoding = encoder(hf_tok, QWEN3)
    texts = [json.dumps(c) for c in CONVERSATIONS]
    manifest = pretokenize_chats(
        iter([texts[:2], texts[2:]]), encoding, str(FOLDER / "tokenizer.json"), 2003, tmp_path / "out", {}
    )
    chats = PretokenizedChats("out", tmp_path / "out", manifest, encoding, 1)
    for i, conversation in enumerate(CONVERSATIONS):
        assert chats.encode_document(i) == encoding.encode(conversation)
    assert [len(chats.encode_document(i).samples()) for i in range(3)] == [3, 2, 1]


def test_reasoning_in_a_field_of_its_own(hf_tok, hf_chat_tokenizer, tmp_path):
    """A message's reasoning given apart (reasoning_content, or thinking/reasoning as transformers
    aliases them) reaches the template: the samples are transformers' renders of the same rows."""
    rows = [
        [
            user("Who begat Enos?"),
            {"role": "assistant", "content": "Seth.", "reasoning_content": "Gen 4:26."},
        ],
        [user("And then?"), {"role": "assistant", "content": "Enos begat Cainan.", "thinking": "Gen 5:9."}],
    ]
    conversation = [*rows[0], *rows[1]]
    path = tmp_path / "reasoning.jsonl"
    path.write_text(json.dumps({"messages": conversation}) + "\n")
    (text,) = load_chat_dataset("mine", str(path), "train", "auto")["text"]
    samples = encoder(hf_tok, QWEN3).encode(json.loads(text)).samples()
    assert [s.ids for s in samples] == [
        hf_ids(hf_chat_tokenizer, conversation[:2], QWEN3),
        hf_ids(hf_chat_tokenizer, conversation, QWEN3),
    ]
    assert "<think>\nGen 4:26.\n</think>" in hf_chat_tokenizer.decode(samples[0].ids)
    assert "<think>\nGen 5:9.\n</think>" in hf_chat_tokenizer.decode(samples[1].ids)
