"""DeepSeek-V3 (torchtitan/models/deepseek_v3) against transformers' DeepseekV3ForCausalLM: tiny random
models made and saved by transformers (sigmoid routing in groups with a random routing bias, a q LoRA,
YaRN), the same with a plain wq, and a Kimi-K2-shaped one (one group, many experts), loaded through
checkpoint.initial_load_path's reader: the same logits on plain and packed batches, and an export after
0 steps bit for bit the folder's tensors; each path the comparison covers changes the logits (so that
dropping one would fail it), YaRN's softmax scale included below the original context (torchtitan's
#4117); a folder in the Hub's form (legacy rope_scaling, an MTP layer, skipped) loads; bad flavours,
a folder whose settings differ from the flavour's and another family's folder are refused in one line.
Layouts: scripts/parity_layouts.py's DeepSeek-V3 rows."""

import json
import shutil
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from launch import TINY_JOB, run_train_in_process
from safetensors.torch import load_file, save_file
from test_hf_load import hub_folder

from torchtitan.checkpoint.hf_export import export_hf
from torchtitan.checkpoint.hf_reader import load_hf_weights
from torchtitan.checkpoint.load import read_model_weights
from torchtitan.config.options import ConfigError
from torchtitan.config.parser import parse_args
from torchtitan.models import MODEL_SPECS
from torchtitan.models.deepseek_v3 import DeepSeekV3ModelArgs, deepseek_flops_per_token, deepseek_v3_configs
from torchtitan.models.deepseek_v3 import hf_convert as adapter
from torchtitan.models.documents import document_positions, find_documents

transformers = pytest.importorskip("transformers")

SPEC = MODEL_SPECS["deepseek_v3"]
VOCAB, SEQ, EOS = 300, 32, 7
DEBUG = deepseek_v3_configs["debugmodel"]
# Kimi K2's shape, tiny: its experts in one group (n_group 1), one dense layer, its routed scale, theta
# and YaRN.
KIMI_TINY = replace(
    DEBUG, num_experts=16, top_k=4, n_group=1, topk_group=1, routed_scaling_factor=2.827, rope_theta=50000.0
)
KIMI_TINY = replace(KIMI_TINY, rope_factor=32.0, beta_fast=1.0)
FLAVORS = {
    "debugmodel": DEBUG,
    "debugmodel_plain_q": deepseek_v3_configs["debugmodel_plain_q"],
    "kimi": KIMI_TINY,
}


def job_args(flavor: str, mask: str = "causal") -> DeepSeekV3ModelArgs:
    return replace(FLAVORS[flavor], vocab_size=VOCAB, max_seq_len=SEQ, attn_mask_type=mask, eos_id=EOS)


def make_hub(folder: Path, args: DeepSeekV3ModelArgs) -> Path:
    """A random DeepseekV3ForCausalLM of `args`' shape, config.json ours (hf_convert.hf_config), saved by
    transformers; every weight random, the norms and the routing bias too."""
    with torch.device("meta"):
        meta = SPEC.build(args).state_dict()
    config = adapter.hf_config(args, meta, SEQ, torch.float32)
    torch.manual_seed(0)
    hf_model = transformers.DeepseekV3ForCausalLM(transformers.DeepseekV3Config(**config))
    with torch.no_grad():
        for p in hf_model.parameters():
            p.normal_(0.0, 0.05 if p.ndim > 1 else 1.0)
        for name, b in hf_model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.normal_(0.0, 0.1)
    hf_model.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module", params=list(FLAVORS))
def hub(request, tmp_path_factory) -> tuple[str, Path]:
    return request.param, make_hub(tmp_path_factory.mktemp(request.param), job_args(request.param))


def ours(flavor: str, folder: Path, mask: str = "causal") -> torch.nn.Module:
    """Our model of `flavor` loaded from the folder as checkpoint.initial_load_path loads it."""
    args = job_args(flavor, mask)
    model = SPEC.build(args)
    model.init_weights(seed=0)
    job = parse_args(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"])
    load_hf_weights(model, str(folder), job.model, args)
    return model.eval()


def batch() -> torch.Tensor:
    """Two rows with EOS inside them: three documents in one, two in the other (block_causal)."""
    tokens = torch.randint(8, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))
    tokens[0, [5, 20]] = EOS
    tokens[1, 12] = EOS
    return tokens


def transformers_logits(folder: Path, tokens: torch.Tensor, packed: bool) -> torch.Tensor:
    hf_model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    assert type(hf_model).__name__ == "DeepseekV3ForCausalLM"
    # Packed: positions restart in each document and, without a cache, attention stays within it.
    positions = document_positions(find_documents(tokens, EOS, None)) if packed else None
    with torch.no_grad():
        return hf_model(tokens, position_ids=positions, use_cache=False).logits


@pytest.mark.parametrize("mask", ["causal", "block_causal"])
def test_logits_equal_transformers(hub, mask):
    flavor, folder = hub
    tokens = batch()
    with torch.no_grad():
        logits = ours(flavor, folder, mask)(tokens)
    expected = transformers_logits(folder, tokens, packed=mask == "block_causal")
    assert (logits - expected).abs().max() <= 1e-5, (logits - expected).abs().max()


def test_an_export_after_0_steps_is_the_folder(hub, tmp_path):
    """Loaded, saved as our checkpoint and exported: every tensor of the folder bit for bit (the routing
    bias included), and transformers runs the export as the folder."""
    flavor, folder = hub
    model = ours(flavor, folder)
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    export_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), job_args(flavor), name="deepseek_v3")
    exported, original = (load_file(f / "model.safetensors") for f in (tmp_path / "hf", folder))
    assert exported.keys() == original.keys()
    assert all(torch.equal(exported[name], original[name]) for name in original)
    tokens = batch()
    expected = transformers_logits(folder, tokens, packed=False)
    assert torch.equal(transformers_logits(tmp_path / "hf", tokens, packed=False), expected)


def test_each_path_changes_the_logits(tmp_path):
    """What the comparison with transformers covers is not a no-op: without the group limit, the routing
    bias, the routed scale or YaRN's softmax scale (at 32 tokens, far below the original 4,096: #4117
    dropped it there) the logits differ, so the parity test would fail without any of them."""
    folder = make_hub(tmp_path / "hub", job_args("debugmodel"))
    model, tokens = ours("debugmodel", folder), batch()
    with torch.no_grad():
        reference = model(tokens)
    assert model.layers["0"].attention.query_scale == pytest.approx(
        (0.1 * torch.log(torch.tensor(40.0)) + 1) ** 2
    )
    moes = [layer.feed_forward for layer in list(model.layers.values())[1:]]
    changes = {
        "group limit": [(moe, "n_group", 1) for moe in moes],
        "routed scale": [(moe, "route_scale", 1.0) for moe in moes],
        "routing bias": [(moe, "expert_bias", torch.zeros_like(moe.expert_bias)) for moe in moes],
        "YaRN's softmax scale": [(layer.attention, "query_scale", 1.0) for layer in model.layers.values()],
    }
    for path, edits in changes.items():
        kept = [(module, name, getattr(module, name)) for module, name, _ in edits]
        for module, name, value in edits:
            setattr(module, name, value)
        with torch.no_grad():
            assert (model(tokens) - reference).abs().max() > 1e-3, path
        for module, name, value in kept:
            setattr(module, name, value)


@pytest.mark.parametrize(
    "change, message",
    [
        (dict(routed_scaling_factor=2.827), "has routed_scaling_factor 2.5, the flavour 2.827"),
        (dict(rope_factor=32.0), "has factor 40.0, the flavour 32.0"),
        (dict(topk_group=2), "has topk_group 1, the flavour 2"),
        (dict(score_func="softmax"), "has scoring sigmoid, the flavour softmax"),
    ],
)
def test_a_folder_computing_otherwise_than_the_flavor_is_refused(tmp_path, change, message):
    """Settings the shapes do not show (routing, YaRN, the router's scores): one line, before loading."""
    folder = make_hub(tmp_path / "hub", job_args("debugmodel"))
    args = replace(job_args("debugmodel"), **change)
    with torch.device("meta"):
        model = SPEC.build(args)
    job = parse_args(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel"])
    with pytest.raises(
        ConfigError, match=f"model.flavor: {folder}'s config.json {message}; set model.flavor"
    ):
        load_hf_weights(model, str(folder), job.model, args)


def test_a_folder_in_the_hubs_form_loads_without_its_mtp_layer(tmp_path):
    """A folder as the Hub's DeepSeek-V3 is: its RoPE as `rope_scaling` ("type": "yarn") and
    `rope_theta`, and a multi-token prediction layer (`model.layers.{N}`, after the decoder's N), which
    is left out, named in the reader's one line; the logits are transformers' on that folder."""
    folder = make_hub(tmp_path / "hub", job_args("debugmodel_plain_q"))
    weights = load_file(folder / "model.safetensors")
    n = DEBUG.n_layers
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        weights[f"model.layers.{n}.{name}"] = torch.ones(DEBUG.dim)
    weights[f"model.layers.{n}.eh_proj.weight"] = torch.zeros(DEBUG.dim, 2 * DEBUG.dim)
    save_file(weights, folder / "model.safetensors", {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    rope = config.pop("rope_parameters")
    config["rope_theta"] = rope.pop("rope_theta")
    config["rope_scaling"] = {"type": rope.pop("rope_type"), **rope}
    (folder / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    args = job_args("debugmodel_plain_q")
    model = SPEC.build(args)
    model.init_weights(seed=0)
    job = parse_args(["--model.name", "deepseek_v3", "--model.flavor", "debugmodel_plain_q"])
    reader = load_hf_weights(model, str(folder), job.model, args)
    skipped = f"multi-token prediction layers: 4 tensors (model.layers.{n}.eh_proj.weight, ...)"
    assert reader.skipped_summary() == skipped
    with torch.no_grad():
        logits = model.eval()(batch())
    assert (logits - transformers_logits(folder, batch(), packed=False)).abs().max() <= 1e-5


def test_flops_count_the_active_parameters_and_mla_attention():
    """671B: 37B parameters active per token (DeepSeek-V3's report), and MLA's attention at its head
    sizes (192 for scores, 128 for values)."""
    args = replace(deepseek_v3_configs["671B"], vocab_size=129280, max_seq_len=4096)
    with torch.device("meta"):
        model = SPEC.build(args)
    total = model.num_params(exclude_embedding=True)
    attention = 6 * 61 * 128 * (192 + 128) * 4096
    active = (deepseek_flops_per_token(args, total, 4096) - attention) / 6
    assert 660e9 < model.num_params() < 680e9 and 36e9 < active < 38e9, (model.num_params(), active)


def test_softmax_routing_trains_but_has_no_hugging_face_form():
    """Softmax scores (torchtitan's debug and 16B flavours) are an option; transformers' router is sigmoid
    only, so their export is refused rather than written to route differently."""
    args = replace(job_args("debugmodel"), score_func="softmax")
    model = SPEC.build(args)
    model.init_weights(seed=0)
    model(batch()).sum().backward()
    assert model.layers["1"].feed_forward.router.weight.grad.abs().sum() > 0
    with pytest.raises(ConfigError, match="routes with sigmoid scores only, and this model with softmax"):
        adapter.hf_config(args, model.state_dict(), SEQ, torch.float32)


BAD = {
    "groups not dividing the experts": (dict(n_group=3), "splits 8 experts into n_group 3 groups"),
    "one expert per group": (dict(n_group=8, topk_group=1), "splits 8 experts into n_group 8 groups"),
    "topk_group above n_group": (dict(topk_group=3), "keeps topk_group 3 of n_group 2 expert groups"),
    "topk_group above one group": (
        dict(n_group=1, topk_group=2),
        "keeps topk_group 2 of n_group 1 expert groups",
    ),
    "no group": (dict(n_group=0), "splits 8 experts into n_group 0 groups"),
    "too few groups for top_k": (
        dict(top_k=5),
        "routes each token to top_k 5 experts of topk_group 1 groups of 4",
    ),
    "no rope features": (dict(qk_rope_head_dim=0), "has qk_rope_head_dim 0"),
    "negative nope features": (
        dict(qk_nope_head_dim=-16),
        "has qk_rope_head_dim 16 and qk_nope_head_dim -16",
    ),
    "rope dims not fitting": (dict(qk_rope_head_dim=7), "has qk_rope_head_dim 7"),
}


@pytest.mark.parametrize("case", BAD, ids=list(BAD))
def test_a_bad_flavor_is_one_line(case, tmp_path, capsys, monkeypatch):
    changes, message = BAD[case]
    monkeypatch.setitem(deepseek_v3_configs, "bad", replace(DEBUG, **changes))
    argv = [
        *TINY_JOB,
        "--model.name",
        "deepseek_v3",
        "--model.flavor",
        "bad",
        "--job.dump_folder",
        str(tmp_path),
    ]
    assert run_train_in_process(*argv) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and f"model.flavor: deepseek_v3 bad {message}" in errors[0], errors


def test_a_qwen3_moe_folder_is_refused(tmp_path, capsys):
    hub = hub_folder(tmp_path, "qwen3_moe")
    capsys.readouterr()
    argv = [*TINY_JOB, "--model.name", "deepseek_v3", "--checkpoint.initial_load_path", str(hub)]
    assert run_train_in_process(*argv, "--job.dump_folder", str(tmp_path / "run")) == 2
    errors = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert (
        len(errors) == 1
        and "holds a qwen3_moe model" in errors[0]
        and "not this job's deepseek_v3" in errors[0]
    )


def make_hub_with_mtp(folder: Path, args: DeepSeekV3ModelArgs) -> Path:
    """A Hub-style DeepSeek-V3 folder with one multi-token prediction layer in DeepSeek's names: transformers
    makes N + 1 layers, the last becoming the MTP layer N's block, beside random enorm, hnorm, eh_proj and
    shared_head.norm and the copies of the embeddings and head; config.json says N layers and 1 MTP layer."""
    make_hub(folder, replace(args, n_layers=args.n_layers + 1))
    weights = load_file(folder / "model.safetensors")
    n, generator = args.n_layers, torch.Generator().manual_seed(2)
    for name in ("enorm.weight", "hnorm.weight", "shared_head.norm.weight"):
        weights[f"model.layers.{n}.{name}"] = 1 + 0.1 * torch.randn(args.dim, generator=generator)
    weights[f"model.layers.{n}.eh_proj.weight"] = 0.05 * torch.randn(
        args.dim, 2 * args.dim, generator=generator
    )
    weights[f"model.layers.{n}.embed_tokens.weight"] = weights["model.embed_tokens.weight"].clone()
    weights[f"model.layers.{n}.shared_head.head.weight"] = weights["lm_head.weight"].clone()
    save_file(weights, folder / "model.safetensors", {"format": "pt"})
    config = json.loads((folder / "config.json").read_text())
    config.update(num_hidden_layers=n, num_nextn_predict_layers=1)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


MTP_ARGS = replace(job_args("debugmodel"), mtp_layers=1)
MTP_JOB = parse_args(["--model.name", "deepseek_v3", "--model.mtp_layers", "1"])


@pytest.fixture(scope="module")
def mtp_hub(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, torch.nn.Module, Any]:
    """make_hub_with_mtp's folder, and model.mtp_layers 1's model loaded from it with its reader, made
    once for the tests that read them (a test that damages the folder damages a copy)."""
    folder = make_hub_with_mtp(tmp_path_factory.mktemp("mtp") / "hub", MTP_ARGS)
    model = SPEC.build(MTP_ARGS)
    model.init_weights(seed=0)
    return folder, model, load_hf_weights(model, str(folder), MTP_JOB.model, MTP_ARGS)


def test_an_mtp_layer_round_trips_and_transformers_loads_the_export(tmp_path, mtp_hub):
    """model.mtp_layers 1 on a folder with DeepSeek's MTP layer: loaded (every tensor but the copies of the
    embeddings and head, which the model shares), saved as our checkpoint after 0 steps and exported:
    every tensor of the folder bit for bit, the MTP layer's included; transformers loads the export
    (skipping the MTP layer, as it does DeepSeek's) and computes the folder's logits."""
    (folder, model, reader), args, job = mtp_hub, MTP_ARGS, MTP_JOB
    n = args.n_layers
    assert reader.skipped_summary() == (
        "multi-token prediction's copies of the embeddings and output head (shared here): 2 tensors "
        f"(model.layers.{n}.embed_tokens.weight, ...)"
    )
    weights = load_file(folder / "model.safetensors")
    assert torch.equal(model.mtp["0"].eh_proj.weight.detach(), weights[f"model.layers.{n}.eh_proj.weight"])
    assert torch.equal(
        model.mtp["0"].block.feed_forward.expert_bias,
        weights[f"model.layers.{n}.mlp.gate.e_score_correction_bias"],
    )
    dcp.save({"model": model.state_dict()}, checkpoint_id=str(tmp_path / "dcp"), no_dist=True)
    export_hf(str(tmp_path / "dcp"), str(tmp_path / "hf"), args, name="deepseek_v3")
    exported = load_file(tmp_path / "hf" / "model.safetensors")
    assert exported.keys() == weights.keys()
    assert all(torch.equal(exported[name], weights[name]) for name in weights)
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["num_nextn_predict_layers"] == 1
    tokens = batch()
    expected = transformers_logits(folder, tokens, packed=False)
    assert torch.equal(transformers_logits(tmp_path / "hf", tokens, packed=False), expected)
    # Without MTP the folder's layer is skipped whole, in the reader's one line.
    reader = load_hf_weights(
        SPEC.build(job_args("debugmodel")), str(folder), job.model, job_args("debugmodel")
    )
    assert reader.skipped_summary().startswith(
        f"multi-token prediction layers: 44 tensors (model.layers.{n}."
    )


def test_hf_to_dcp_keeps_a_folders_mtp_depth_and_refuses_it_cut(tmp_path, capsys, mtp_hub):
    """convert_hf_to_dcp.py keeps the folder's depth by default (the tensors of model.mtp_layers 1's
    checkpoint), refuses more depths than the folder's; a depth's tensor gone is one line naming it,
    exit 2, nothing written, and --mtp-layers 0 then converts the folder without the depth (not needed)."""
    from scripts import convert_hf_to_dcp

    folder, model, _ = mtp_hub
    assert convert_hf_to_dcp.main([str(folder), str(tmp_path / "dcp")]) == 0
    assert "kept 1 multi-token prediction depths" in capsys.readouterr().out
    back = read_model_weights(str(tmp_path / "dcp"))
    expected = model.state_dict()
    assert back.keys() == expected.keys() and all(torch.equal(back[k], w) for k, w in expected.items())
    capsys.readouterr()
    assert convert_hf_to_dcp.main([str(folder), str(tmp_path / "two"), "--mtp-layers", "2"]) == 2
    assert "--mtp-layers: " in capsys.readouterr().err and not (tmp_path / "two").exists()
    n = MTP_ARGS.n_layers
    from test_convert import drop_tensor

    folder = Path(shutil.copytree(folder, tmp_path / "hub"))
    drop_tensor(folder, f"model.layers.{n}.enorm.weight")
    assert convert_hf_to_dcp.main([str(folder), str(tmp_path / "cut")]) == 2
    err = capsys.readouterr().err
    assert (
        err.count("\n") == 1
        and f"has no model.layers.{n}.enorm.weight" in err
        and not (tmp_path / "cut").exists()
    )
    assert convert_hf_to_dcp.main([str(folder), str(tmp_path / "none"), "--mtp-layers", "0"]) == 0
    assert not any(k.startswith("mtp.") for k in read_model_weights(str(tmp_path / "none")))
