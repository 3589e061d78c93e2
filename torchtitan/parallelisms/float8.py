"""Float8 training of the model's linear layers through torchao's float8 API (`[float8]`).

On the meta-device model, before any parallelism (and before the pipeline split), the selected
`nn.Linear` layers become torchao `Float8Linear`s: their matmuls run in float8 with dynamic scales
(one per tensor with the tensorwise recipe, one per row with rowwise) while their weights, gradients
and optimizer state keep their dtypes and names, so checkpoints are those of the plain model.
Tensor parallelism then uses torchao's float8 styles (tensorwise), FSDP may all-gather the weights in
float8 (tensorwise), and after each optimizer step the weights' scales may be computed in one
all-reduce for the next all-gathers.

torchao is an optional dependency, imported only here and only when float8 is on; the rules between
the options, the device and torchao's presence are torchtitan/config_rules.py's `check_float8`."""

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, PrepareModuleInput, RowwiseParallel

from torchtitan.config.options import ConfigError, Float8Config, JobConfig
from torchtitan.errors import torchao_missing
from torchtitan.logging import logger
from torchtitan.parallelisms.parallel_dims import ParallelDims


def fqn_matches(fqn: str, name: str) -> bool:
    """Whether `name` is the FQN `fqn` or a run of its dotted parts: "wq", "attention.wq" and
    "layers.1" match "layers.1.attention.wq"; "layers.1" does not match "layers.10.attention.wq"."""
    return f".{name}." in f".{fqn}."


def float8_linear_fqns(model: nn.Module, float8_config: Float8Config) -> list[str]:
    """The FQNs of the linear layers that float8 training converts: every `nn.Linear` whose weight's
    dimensions are both multiples of 16 (what float8 tensor cores take) and that no name in
    `float8_config.filter_fqns` matches. Needs no torchao: works on any model, the meta device's too."""
    return [
        fqn
        for fqn, module in model.named_modules()
        if isinstance(module, nn.Linear)
        and module.weight.shape[0] % 16 == 0
        and module.weight.shape[1] % 16 == 0
        and not any(fqn_matches(fqn, name) for name in float8_config.filter_fqns)
    ]


def check_filter_fqns(model: nn.Module, float8_config: Float8Config) -> None:
    """Every name in `float8.filter_fqns` matches a module of the model (a typo would silently
    convert the layer it meant to keep)."""
    fqns = [fqn for fqn, _ in model.named_modules() if fqn]
    for name in float8_config.filter_fqns:
        if not any(fqn_matches(fqn, name) for fqn in fqns):
            linears = {fqn.split(".")[-1] for fqn, m in model.named_modules() if isinstance(m, nn.Linear)}
            raise ConfigError(
                f"float8.filter_fqns: {name!r} names no module of the model; give a module's name or a "
                f"dotted part of it, e.g. one of {', '.join(sorted(linears))}"
            )


def _torchao_float8():
    """torchao.float8, or the one-line error saying how to install it."""
    try:
        import torchao.float8
    except ImportError as e:
        raise ConfigError(torchao_missing(f"importing it failed ({e})")) from e
    return torchao.float8


def float8_linear_config(float8_config: Float8Config, parallel_dims: ParallelDims):
    """torchao's Float8LinearConfig for the job: the tensorwise recipe with FSDP's float8 all-gather
    if asked, or the rowwise recipe."""
    float8 = _torchao_float8()
    if float8_config.recipe_name == "rowwise":
        return float8.Float8LinearConfig.from_recipe_name("rowwise")
    all_gather = float8_config.enable_fsdp_float8_all_gather and parallel_dims.fsdp_enabled
    return float8.Float8LinearConfig(enable_fsdp_float8_all_gather=all_gather)


def convert_to_float8(model: nn.Module, job_config: JobConfig, parallel_dims: ParallelDims) -> None:
    """Swap the layers `float8_linear_fqns` lists for torchao Float8Linears, in place. Call it on the
    whole meta-device model, before the pipeline split, TP and FSDP."""
    float8_config = job_config.float8
    if not float8_config.enable_float8_linear:
        return
    check_filter_fqns(model, float8_config)
    selected = set(float8_linear_fqns(model, float8_config))
    config = float8_linear_config(float8_config, parallel_dims)

    def module_filter(module: nn.Module, fqn: str) -> bool:
        return fqn in selected

    _torchao_float8().convert_to_float8_training(model, module_filter_fn=module_filter, config=config)
    kept = [
        fqn for fqn, module in model.named_modules() if isinstance(module, nn.Linear) and fqn not in selected
    ]
    logger.info(
        f"Float8 {float8_config.recipe_name}: {len(selected)} linear layers converted"
        f"{' (float8 FSDP all-gather)' if config.enable_fsdp_float8_all_gather else ''}; "
        f"kept in {job_config.training.mixed_precision_param}: {', '.join(kept) or 'none'}"
    )


def float8_tensorwise_tp(job_config: JobConfig) -> bool:
    """Whether TP uses torchao's float8 styles (float8 all-gathers of the activations): with the
    tensorwise recipe only; rowwise runs the plain styles, gathering in high precision."""
    float8_config = job_config.float8
    return float8_config.enable_float8_linear and float8_config.recipe_name == "tensorwise"


def tp_styles(module: nn.Module, float8_tensorwise: bool) -> tuple[type, type, type]:
    """The (ColwiseParallel, RowwiseParallel, PrepareModuleInput) styles for the linear layers of
    `module` (a block's attention or feed-forward) and its input: torchao's float8 ones when
    `float8_tensorwise` and every linear layer of it is a Float8Linear (they take nothing else), else
    torch's."""
    plain = (ColwiseParallel, RowwiseParallel, PrepareModuleInput)
    if not float8_tensorwise:
        return plain
    _torchao_float8()
    from torchao.float8.float8_linear import Float8Linear
    from torchao.float8.float8_tensor_parallel import (
        Float8ColwiseParallel,
        Float8RowwiseParallel,
        PrepareFloat8ModuleInput,
    )

    linears = [m for m in module.modules() if isinstance(m, nn.Linear)]
    if not all(isinstance(m, Float8Linear) for m in linears):
        return plain
    return Float8ColwiseParallel, Float8RowwiseParallel, PrepareFloat8ModuleInput


def float8_scales_are_precomputed(job_config: JobConfig, parallel_dims: ParallelDims) -> bool:
    """Whether each optimizer step is followed by `precompute_float8_scales`."""
    float8_config = job_config.float8
    return (
        float8_config.enable_float8_linear
        and float8_config.enable_fsdp_float8_all_gather
        and float8_config.precompute_float8_dynamic_scale_for_fsdp
        and parallel_dims.fsdp_enabled
    )


def precompute_float8_scales(model_parts: list[nn.Module]) -> None:
    """After the optimizer step: the float8 scales of every FSDP-sharded Float8Linear weight for the
    next all-gathers, in one all-reduce of their amaxes instead of one per layer."""
    precompute = _torchao_float8().precompute_float8_dynamic_scale_for_fsdp
    for part in model_parts:
        precompute(part)
