"""Document masking (model.attn_mask_type = "block_causal", torchtitan/models/documents.py): where the
documents of a packed window are, and the exactness oracle: a packed document's logits, loss and
gradients are those it gets when run alone."""

from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F

from torchtitan.models import MODEL_SPECS
from torchtitan.models.documents import block_causal_mask, document_positions, find_documents
from torchtitan.models.llama import ModelArgs
from torchtitan.models.qwen3 import Qwen3ModelArgs
from torchtitan.models.qwen3_moe import Qwen3MoeModelArgs

BOS, EOS = 1, 2


def test_documents_end_with_eos_and_start_at_bos():
    tokens = torch.tensor([[7, 8, EOS, 9, EOS, BOS, 5, 6], [BOS, 5, 6, 7, 8, 9, 5, 6]])
    assert find_documents(tokens, EOS, BOS).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0, 0, 0, 0, 0, 0, 0, 0]]
    assert find_documents(tokens, EOS, None).tolist() == [[0, 0, 0, 1, 1, 2, 2, 2], [0] * 8]
    # A BOS that follows no EOS starts a document too; an EOS at the end starts nothing.
    tokens = torch.tensor([[5, BOS, 6, EOS]])
    assert find_documents(tokens, EOS, BOS).tolist() == [[0, 1, 1, 1]]
    assert document_positions(find_documents(tokens, EOS, BOS)).tolist() == [[0, 0, 1, 2]]
    ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2]])
    assert document_positions(ids).tolist() == [[0, 1, 2, 0, 1, 0, 1, 2]]


TINY = {
    "llama3": ModelArgs(dim=64, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=64, max_seq_len=64),
    "qwen3": Qwen3ModelArgs(
        dim=64, n_layers=2, n_heads=4, n_kv_heads=2, head_dim=32, hidden_dim=96, vocab_size=64, max_seq_len=64
    ),
    "qwen3_moe": Qwen3MoeModelArgs(
        dim=64,
        n_layers=2,
        n_heads=4,
        n_kv_heads=2,
        head_dim=16,
        hidden_dim=96,
        vocab_size=64,
        max_seq_len=64,
        num_experts=4,
        top_k=2,
        moe_hidden_dim=32,
    ),
}


def _document(generator: torch.Generator, length: int, bos: bool, eos: bool) -> list[int]:
    body = torch.randint(3, 64, (length,), generator=generator).tolist()
    return ([BOS] if bos else []) + body + ([EOS] if eos else [])


def _windows() -> tuple[torch.Tensor, list[list[list[int]]]]:
    """Two packed windows of 41 tokens (inputs and labels): the first opens inside a document (no BOS)
    and the last runs past the window's end (no EOS), as the data path cuts them; each row's documents."""
    generator = torch.Generator().manual_seed(0)
    rows = [
        [
            _document(generator, 6, False, True),
            _document(generator, 3, True, True),
            _document(generator, 30, True, False),
        ],
        [
            _document(generator, 12, False, True),
            _document(generator, 1, True, True),
            _document(generator, 30, True, False),
        ],
    ]
    for docs in rows:
        docs[-1] = docs[-1][: 41 - sum(len(d) for d in docs[:-1])]
    return torch.tensor([sum(docs, []) for docs in rows]), rows


def _model(name: str, seed: int = 0) -> torch.nn.Module:
    args = replace(TINY[name], attn_mask_type="block_causal", eos_id=EOS, bos_id=BOS)
    model = MODEL_SPECS[name].build(args)
    model.init_weights(seed)
    return model


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
def test_packed_documents_equal_each_document_run_alone(name):
    """Each document's logits, its next-token loss (its own tokens' predictions) and the gradients of
    all of them, packed into windows with other documents, equal those of the documents run one by
    one, each as a sequence of its own (positions from 0), within 1e-5."""
    window, rows = _windows()
    packed, alone = _model(name), _model(name)
    inputs, labels = window[:, :-1], window[:, 1:]
    logits = packed(inputs)
    # A document's predictions: each of its tokens but its last, whose next token starts another.
    ids = find_documents(window, EOS, BOS)
    own = ids[:, :-1] == ids[:, 1:]
    loss = F.cross_entropy(logits[own], labels[own], reduction="sum")
    loss.backward()

    alone_loss = 0.0
    for r, docs in enumerate(rows):
        start = 0
        for doc in docs:
            n_in = min(len(doc), inputs.shape[1] - start)  # the document's tokens among the inputs
            tokens = torch.tensor([doc[: n_in + 1]])  # and the label after them, if it is the document's
            doc_logits = alone(tokens[:, :n_in])[0]
            torch.testing.assert_close(logits[r, start : start + n_in], doc_logits, rtol=0, atol=1e-5)
            predicted = min(n_in, len(doc) - 1)
            doc_loss = F.cross_entropy(doc_logits[:predicted], tokens[0, 1 : predicted + 1], reduction="sum")
            doc_loss.backward()
            alone_loss += doc_loss.item()
            start += n_in
    assert abs(loss.item() - alone_loss) <= 1e-5 * abs(alone_loss)
    for (param_name, p), q in zip(packed.named_parameters(), alone.parameters()):
        torch.testing.assert_close(p.grad, q.grad, rtol=1e-4, atol=1e-6, msg=param_name)


def test_causal_is_one_document_per_window():
    """block_causal on windows without EOS or BOS is the causal mask."""
    window = torch.randint(3, 64, (2, 33), generator=torch.Generator().manual_seed(1))
    causal = MODEL_SPECS["llama3"].build(TINY["llama3"])
    causal.init_weights(0)
    torch.testing.assert_close(_model("llama3")(window), causal(window), rtol=0, atol=1e-6)


def test_flex_attention_mask_is_the_cpu_path():
    """The CUDA path's FlexAttention block mask against the CPU path (per-document flash attention),
    forward (FlexAttention has no CPU backward in torch 2.13); on a GPU both directions."""
    from torch.nn.attention.flex_attention import flex_attention

    from torchtitan.models.documents import _segment_attention

    window, _ = _windows()
    ids = find_documents(window, EOS, BOS)
    generator = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 4, window.shape[1], 16, generator=generator) for _ in range(3))
    expected = _segment_attention(q, k, v, ids)
    flex = torch.compile(flex_attention)(q, k, v, block_mask=block_causal_mask(ids)).transpose(1, 2)
    torch.testing.assert_close(flex, expected, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama3", "qwen3_moe"])
def test_blocks_compile_whole_with_the_flex_attention_path(name, monkeypatch):
    """The CUDA path in compiled blocks (fullgraph): the model's forward makes FlexAttention's block
    mask before its blocks; made inside the first block, it broke the block's graph (found on an H100:
    the Llama 3 GPU recipes failed at their first step). Forward on the CPU, the path forced (no CPU
    backward); dynamo only (aot_eager), against the uncompiled model."""
    from torchtitan.models import documents

    monkeypatch.setattr(documents, "uses_flex_attention", lambda device: True)
    window, _ = _windows()
    model = _model(name)
    masks_made = []
    model.layers["0"].register_forward_pre_hook(lambda _, args: masks_made.append(list(args[2].cache)))
    with torch.no_grad():
        eager = model(window)
    assert masks_made == [[("block mask", "all")]]
    with torch.no_grad():
        for layer_id, block in model.layers.items():
            model.layers.register_module(layer_id, torch.compile(block, fullgraph=True, backend="aot_eager"))
        compiled = model(window)
    torch.testing.assert_close(compiled, eager, rtol=0, atol=1e-5)


@pytest.mark.parametrize("name", ["llama3", "qwen3", "qwen3_moe"])
def test_packed_documents_equal_transformers_on_each_document(name, tmp_path):
    """Our packed block_causal logits, exported as a Hugging Face folder: transformers' model run on
    each document of the windows alone gives that document's logits within 1e-5."""
    transformers = pytest.importorskip("transformers")
    import torch.distributed.checkpoint as dcp

    from scripts import convert_dcp_to_hf

    model = _model(name)
    with torch.no_grad():  # random norms (and q/k norms, router) too, so that no two are alike
        for p in model.parameters():
            p.normal_(0.0, 0.1 if p.ndim > 1 else 1.0)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    convert_dcp_to_hf.convert(str(tmp_path / "dcp"), str(tmp_path / "hf"), model.model_args, name=name)
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf", dtype=torch.float32).eval()

    window, rows = _windows()
    with torch.no_grad():
        logits = model(window)
        for r, docs in enumerate(rows):
            start = 0
            for doc in docs:
                theirs = hf_model(torch.tensor([doc])).logits[0]
                torch.testing.assert_close(logits[r, start : start + len(doc)], theirs, rtol=0, atol=1e-5)
                start += len(doc)
