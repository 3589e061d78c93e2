"""Expert parallelism: each of the `ep` ranks of the expert-parallel mesh holds num_experts / ep of every
mixture-of-experts layer's experts (their weights sharded on the expert dimension), and the tokens
travel to the rank of their expert and back by all-to-all.

The model is unchanged (torchtitan/models/moe.py): `GroupedExperts(x, tokens_per_expert)` receives the
(token, choice) pairs of this rank grouped by expert. The style below wraps that call: before it, the
pairs for other ranks' experts are sent there (the split sizes exchanged first, uneven, possibly empty)
and those this rank's experts take from every rank are received and regrouped by local expert; after
it, each output goes back to the rank and position its pair came from. Both all-to-alls carry autograd,
so a pair's gradient returns the same way. Each received group is an expert's rows in order of source
rank, so the result does not depend on arrival order.
"""

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ParallelStyle, parallelize_module

from torchtitan.models.moe import MoE


def _exclusive_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


class ExpertParallel(ParallelStyle):
    """Shard a GroupedExperts' weights over the mesh on the expert dimension and route its inputs to
    their experts' ranks (one instance per module: it keeps a forward's routing for its output)."""

    def _partition(self, name: str, module: nn.Module, mesh: DeviceMesh) -> None:
        for param_name, param in list(module.named_parameters(recurse=False)):
            sharded = nn.Parameter(distribute_tensor(param, mesh, [Shard(0)]), param.requires_grad)
            module.register_parameter(param_name, sharded)

    def _dispatch(self, module: nn.Module, inputs: tuple, mesh: DeviceMesh) -> tuple:
        x, tokens_per_expert = inputs
        group, ep = mesh.get_group(), mesh.size()
        counts = tokens_per_expert  # this rank's pairs per global expert, on the device
        received = funcol.all_to_all_single(counts, None, None, group)  # [source rank, local expert]
        # The layer's one host sync: the all-to-all's split sizes.
        sent_and_received = torch.cat([counts.view(ep, -1).sum(1), received]).cpu()
        sent = sent_and_received[:ep].tolist()
        received = sent_and_received[ep:].view(ep, -1)
        arrived = received.sum(1).tolist()
        x = funcol.all_to_all_single_autograd(x, arrived, sent, group)
        # Received rows are grouped by (source rank, local expert): regroup them by (expert, source).
        starts = _exclusive_cumsum(received.flatten()).view_as(received)
        lengths, firsts = received.t().flatten(), starts.t().flatten()
        order = torch.repeat_interleave(firsts - _exclusive_cumsum(lengths), lengths)
        order = (order + torch.arange(int(lengths.sum()))).to(x.device)
        self._routing = (order, sent, arrived)
        return x[order], received.sum(0).to(x.device)

    def _combine(self, module: nn.Module, output: torch.Tensor, mesh: DeviceMesh) -> torch.Tensor:
        order, sent, arrived = self._routing
        self._routing = None
        output = output[torch.argsort(order)]
        return funcol.all_to_all_single_autograd(output, sent, arrived, mesh.get_group())

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(module, device_mesh, self._partition, self._dispatch, self._combine)


def apply_ep(model: nn.Module, ep_mesh: DeviceMesh) -> None:
    """Expert parallelism on every mixture-of-experts layer of `model` (a whole model or a stage)."""
    for parent, name, _ in model.blocks():  # multi-token prediction's blocks too
        for module in parent.get_submodule(name).modules():
            if isinstance(module, MoE):
                parallelize_module(module, ep_mesh, {"experts": ExpertParallel()})
