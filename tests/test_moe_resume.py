"""A mixture of experts resumes exactly across expert-parallel layouts, its routing biases and their
history with it (both balancing methods on, Muon's momentum for the experts each rank holds).

DeepSeek-V3's debug model runs the whole proof, as it exercises strictly more than Qwen3-MoE: the same
shared MoE layer with its routing bias, plus MLA's latent projections and norms, sigmoid group-limited
routing, a shared expert, a dense first layer and a multi-token prediction depth (a MoE block of its
own, on a pipeline's last stage). Saved by one process and resumed on EP 2 (on 2 ranks: the experts
split over them, everything else FSDP-sharded over the same 2, "EP 2 x FSDP 2") within 1e-5 of the run
that never stopped (the biases within 1e-6); PP 2 resumed from the same checkpoint, and PP 2 killed with
SIGKILL once an asynchronous save is complete and relaunched: bit for bit the PP 2 run that never
stopped (biases and optimizer state included; a pipeline's auxiliary loss is each micro-batch's, so PP 2
is compared with PP 2); EP 2's checkpoint resumed by one process within 1e-5.

Qwen3-MoE keeps a resume proof of its own (its state names, softmax routing and per-head norms):
test_qwen3_moe_cp2_ep2_checkpoint_resumes_on_one_process, CP 2 x EP 2's checkpoint resumed by one
process within 1e-5 of CP 2 x EP 2's own run. Parity with one process on every layout: test_parity.py,
scripts/parity_matrix.py."""

import shutil

import torch
from launch import read_metrics, run_train

from scripts import chaos
from scripts.parity_layouts import DEEPSEEK_V3, MUON, QWEN3_MOE_MUON, cp, ep, pp
from torchtitan.checkpoint.load import read_model_weights

# DEEPSEEK_V3 turns the routing bias on (moe.bias_update_rate) next to the auxiliary losses.
MOE = [*DEEPSEEK_V3, "--validation.enable", "false", *MUON, "--model.mtp_layers", "1"]
MOE_LAYERS = (1,)  # the debug flavours on 2 blocks: a dense first block, then a sparse one
MTP_BIAS = "mtp.0.block.feed_forward.expert_bias"  # the multi-token prediction depth's block
CHECKPOINTS = ["--checkpoint.enable_checkpoint", "true"]
STEPS = ["--training.steps", "8", *CHECKPOINTS, *MOE]
EP2 = [*ep(2), "--training.batch_size", "2", "--checkpoint.interval", "2"]
PP2 = [*pp(2), "--training.batch_size", "4"]
ONE = ["--training.batch_size", "4", "--checkpoint.interval", "4"]
ASYNC = ["--checkpoint.async_mode", "async"]


def check(result):
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def biases(step_dir, layers=MOE_LAYERS, mtp: bool = False) -> dict[str, torch.Tensor]:
    weights = read_model_weights(str(step_dir))
    found = {name: w for name, w in weights.items() if name.endswith("expert_bias")}
    expected = [f"layers.{i}.feed_forward.expert_bias" for i in layers] + ([MTP_BIAS] if mtp else [])
    assert sorted(found) == sorted(expected)
    return found


def copy_step(source, step, dump_folder):
    name = f"step-{step}"
    shutil.copytree(source / "checkpoint" / name, dump_folder / "checkpoint" / name)


def assert_close(resumed: dict, straight: dict) -> None:
    for step, metrics in resumed.items():
        # DeepSeek-V3's runs log the sequence-wise balance loss too.
        keys = ("loss", "grad_norm", "aux_loss", "expert_load", "seq_aux_loss")
        for key in (k for k in keys if k in straight[step] or k in metrics):
            assert abs(metrics[key] - straight[step][key]) < 1e-5, (step, key, metrics, straight[step])


def test_deepseek_v3_resumes_across_layouts_and_after_sigkill_on_pp2(tmp_path):
    single, ep2, killed, pp2, back = (tmp_path / name for name in ("single", "ep2", "killed", "pp2", "back"))
    check(run_train(1, single, *STEPS, *ONE))
    straight = {m["step"]: m for m in read_metrics(single)}
    assert sorted(straight) == list(range(1, 9))
    assert all(b.abs().sum() > 0 for b in biases(single / "checkpoint" / "step-4", mtp=True).values())
    assert all("mtp_loss_1" in m for m in straight.values())

    # EP 1 -> EP 2.
    copy_step(single, 4, ep2)
    result = run_train(2, ep2, *STEPS, *EP2)
    check(result)
    assert "Resumed from step 4" in result.stdout
    resumed = {m["step"]: m for m in read_metrics(ep2)}
    assert sorted(resumed) == [5, 6, 7, 8]
    assert_close(resumed, straight)
    ep2_biases = biases(ep2 / "checkpoint" / "step-8", mtp=True)
    for name, bias in biases(single / "checkpoint" / "step-8", mtp=True).items():
        torch.testing.assert_close(ep2_biases[name], bias, rtol=0, atol=1e-6)

    # One process -> PP 2 (the depth and its routing bias on the last stage), to the end.
    copy_step(single, 4, pp2)
    check(run_train(2, pp2, *STEPS, *PP2))
    piped = {m["step"]: m for m in read_metrics(pp2)}
    assert sorted(piped) == [5, 6, 7, 8]
    pp2_biases = biases(pp2 / "checkpoint" / "step-8", mtp=True)

    # PP 2 killed once step 6 is saved (by background processes: async), relaunched: PP 2's losses, MTP
    # losses and biases, bit for bit.
    copy_step(single, 4, killed)
    chaos.kill_once_saved(chaos.Job(2, killed, *chaos.JOB, *MOE, *PP2, *ASYNC), killed, 6)
    relaunch = chaos.run_to_end(2, killed, *MOE, *PP2, *ASYNC)
    assert "Resumed from step 6" in relaunch.output(0)
    logged = chaos.losses(killed)  # both launches'
    assert sorted({step for step, _ in logged}) == [5, 6, 7, 8]
    assert [loss for _, loss in logged] == [piped[step]["loss"] for step, _ in logged]
    relaunched = {m["step"]: m for m in read_metrics(killed)}
    assert [relaunched[s]["mtp_loss_1"] for s in (7, 8)] == [piped[s]["mtp_loss_1"] for s in (7, 8)]
    for name, bias in biases(killed / "checkpoint" / "step-8", mtp=True).items():
        assert torch.equal(bias, pp2_biases[name]), name

    # EP 2 -> EP 1.
    copy_step(ep2, 6, back)
    check(run_train(1, back, *STEPS, *ONE))
    assert_close({m["step"]: m for m in read_metrics(back)}, straight)


def test_qwen3_moe_cp2_ep2_checkpoint_resumes_on_one_process(tmp_path):
    """Qwen3-MoE's own resume proof, kept cheap (the whole one above runs DeepSeek-V3): CP 2 x EP 2 on 4
    ranks (biases and auxiliary loss on, Muon; the experts split over the ep ranks and FSDP-sharded over
    the cp ranks, every sequence over the cp ranks) saves step 4 and runs on to step 6; one process
    resumes its step-4 checkpoint, the experts each rank held gathered into one, and steps 5 and 6
    match CP 2 x EP 2's within 1e-5 (both equal one process: scripts/parity_matrix.py)."""
    ep2, back = tmp_path / "cp2_ep2", tmp_path / "back"
    qwen3_moe = ["--training.steps", "6", *CHECKPOINTS, "--checkpoint.interval", "4", *QWEN3_MOE_MUON]
    qwen3_moe += ["--validation.enable", "false"]
    check(run_train(4, ep2, *qwen3_moe, *cp(2), *ep(2), "--training.batch_size", "2"))
    straight = {m["step"]: m for m in read_metrics(ep2)}
    assert sorted(straight) == list(range(1, 7))
    assert all(b.abs().sum() > 0 for b in biases(ep2 / "checkpoint" / "step-4").values())

    copy_step(ep2, 4, back)
    result = run_train(1, back, *qwen3_moe, "--training.batch_size", "4")
    check(result)
    assert "Resumed from step 4" in result.stdout
    resumed = {m["step"]: m for m in read_metrics(back)}
    assert sorted(resumed) == [5, 6]
    assert_close(resumed, straight)
