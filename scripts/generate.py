"""Sample text from a training run's checkpoint.

    python scripts/generate.py --job.config_file F --job.dump_folder D [--prompt TEXT]
        [--chat MESSAGE [--system TEXT]] [--max_new_tokens N] [--temperature T] [--top_k K] [--seed S]
        [--section.key VALUE ...]

The model, tokenizer and checkpoint come from the run's own options (any train.py option may be
given, e.g. --checkpoint.load_step 200): the latest complete checkpoint in
{dump_folder}/{checkpoint.folder}, a model_weights_only export included, else
checkpoint.initial_load_path (a DCP checkpoint or a Hugging Face model folder). One process, on the
GPU if there is one. The text goes to stdout, the checkpoint's path to stderr.

--chat MESSAGE asks a chat model: the conversation (an optional --system prompt, the user's MESSAGE)
rendered with the chat template the run trains with (the tokenizer's own, else chat.template_path)
and its generation prompt, the reply sampled until the end of the turn (the
template's end-of-turn token, e.g. <|im_end|>) or EOS, and printed alone.
"""

import argparse
import difflib
import os
import sys
import warnings

import torch
import torch.distributed.checkpoint as dcp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from torchtitan.checkpoint.folder import is_hf_folder, latest_checkpoint_path  # noqa: E402
from torchtitan.checkpoint.hf_reader import load_hf_weights  # noqa: E402
from torchtitan.checkpoint.load import check_model_record  # noqa: E402
from torchtitan.checkpoint.safe_reader import SafeLoadPlanner, SafeReader, saved_entries  # noqa: E402
from torchtitan.config.options import ConfigError, JobConfig  # noqa: E402
from torchtitan.config.parser import OneLineParser, parse_args  # noqa: E402
from torchtitan.config.paths import check_folder, resolve_path  # noqa: E402
from torchtitan.datasets.chat_template import load_chat_template  # noqa: E402
from torchtitan.datasets.hf_export import end_of_turn_id  # noqa: E402
from torchtitan.datasets.hf_tokenizer import HFTokenizer  # noqa: E402
from torchtitan.datasets.tokenizer import AnyTokenizer, build_tokenizer  # noqa: E402
from torchtitan.errors import bad_input, run_with_exit_codes  # noqa: E402
from torchtitan.models import build_model_args, model_spec  # noqa: E402
from torchtitan.reliability.preflight import check_model_files  # noqa: E402


def build_parser() -> OneLineParser:
    parser = OneLineParser(
        prog="generate.py",
        description="Sample text from a run's checkpoint. Every train.py option (--section.key VALUE) "
        "is accepted too and selects the run: see `python train.py --help`.",
        allow_abbrev=False,
    )
    parser.add_argument("--prompt", default="", help="text to continue (default: start a new document)")
    parser.add_argument(
        "--chat", metavar="MESSAGE", help="a user message to answer with the chat template; prints the reply"
    )
    parser.add_argument("--system", help="with --chat: a system prompt before the message")
    parser.add_argument("--max_new_tokens", type=int, default=100, help="tokens to sample (default 100)")
    parser.add_argument(
        "--temperature", type=float, default=1.0, help="softmax temperature; 0 picks the likeliest token"
    )
    parser.add_argument("--top_k", type=int, default=None, help="sample among the K likeliest tokens only")
    parser.add_argument(
        "--seed", type=int, default=0, help="sampling seed: the same seed gives the same text"
    )
    return parser


def load_model(job_config: JobConfig, tokenizer: AnyTokenizer, device: torch.device) -> torch.nn.Module:
    """The model as train.py builds it (the vocabulary padded to model.vocab_size, the context of
    training.seq_len), with the checkpoint's weights (or a Hugging Face folder's)."""
    model_args = build_model_args(job_config, tokenizer.n_words, tokenizer.eos_id, tokenizer.bos_id)
    path = latest_checkpoint_path(job_config)
    warnings.filterwarnings("ignore", message="torch.distributed is disabled")
    if not is_hf_folder(path):  # a folder's family and shapes are checked as its weights are read
        check_model_record(path, job_config.model)
    with torch.device(device):
        model = model_spec(job_config.model).build(model_args)  # random weights, then replaced
    if is_hf_folder(path):
        load_hf_weights(model, path, job_config.model, model_args)
    else:
        load_checkpoint_weights(model, path)
    print(f"Loaded {job_config.model.name} {job_config.model.flavor} from {path}", file=sys.stderr)
    return model.eval()


def load_checkpoint_weights(model: torch.nn.Module, path: str) -> None:
    """In place, converting an export's dtype; the safe reader runs no code from the checkpoint's files."""
    state = {"model": model.state_dict()}
    saved = saved_entries(path)
    for key, tensor in state["model"].items():
        entry = saved.get(f"model.{key}")
        if entry is None or tuple(entry.size) != tuple(tensor.shape):
            raise ConfigError(
                f"checkpoint: {path} does not hold {key} of shape {tuple(tensor.shape)}; was it saved with "
                "another model.flavor or model.tokenizer_path?"
            )
    dcp.load(state, storage_reader=SafeReader(path), planner=SafeLoadPlanner())


@torch.no_grad()
def generate(
    model: torch.nn.Module,
    prompt: list[int],
    max_new_tokens: int,
    temperature: float,
    top_k: int | None,
    generator: torch.Generator,
    vocab_size: int,
    stop_ids: frozenset[int] = frozenset(),
) -> list[int]:
    """Sample up to `max_new_tokens` tokens after `prompt`, stopping before any of `stop_ids` (EOS, a
    chat template's end of turn), among the first `vocab_size` (the
    tokenizer's: rows that pad the embedding are never picked). No KV cache: each token re-reads the
    context (at most the model's max_seq_len tokens), which is simple and fine for a quick look."""
    device = next(model.parameters()).device
    tokens = torch.tensor([prompt], device=device)
    new = []
    for _ in range(max_new_tokens):
        logits = model(tokens[:, -model.model_args.max_seq_len :])[0, -1, :vocab_size]
        if temperature == 0:
            next_id = int(logits.argmax())
        else:
            logits = logits / temperature
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.numel())).values[-1]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            next_id = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if next_id in stop_ids:
            break
        new.append(next_id)
        tokens = torch.cat([tokens, torch.tensor([[next_id]], device=device)], dim=1)
    return new


def main(argv: list[str] | None = None) -> int:
    """The exit code (errors.py's): 2 and one line for a bad option, file or checkpoint."""
    return run_with_exit_codes(lambda: run(sys.argv[1:] if argv is None else argv))


def check_sampling(parser: OneLineParser, args: argparse.Namespace, job_argv: list[str]) -> None:
    """The sampling options; what is left must be train.py's, which all have a section: --section.key."""
    for arg in job_argv:
        name = arg[2:].split("=", 1)[0]
        if arg.startswith("--") and "." not in name:
            own = [a.dest for a in parser._actions if a.dest != "help"]
            match = difflib.get_close_matches(name, own, n=1)
            hint = f"did you mean --{match[0]}?" if match else f"valid: --{', --'.join(own)}"
            raise ConfigError(f"unknown option --{name}; {hint}")
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max_new_tokens: must be >= 1, got {args.max_new_tokens}")
    if args.temperature < 0:
        raise ConfigError(f"--temperature: must be >= 0, got {args.temperature}")
    if args.top_k is not None and args.top_k < 1:
        raise ConfigError(f"--top_k: must be >= 1, got {args.top_k}")
    if args.chat is not None and args.prompt:
        raise ConfigError("--prompt: continues a text, --chat answers a message; give one of them")
    if args.system is not None and args.chat is None:
        raise ConfigError("--system: a system prompt for --chat; give --chat MESSAGE too")


def chat_prompt(
    args: argparse.Namespace, job_config: JobConfig, tokenizer: AnyTokenizer
) -> tuple[list[int], frozenset[int]]:
    """--chat's conversation as the template renders it for the assistant's reply, and the ids that end
    the reply: EOS and the template's end of turn. The template is the one training uses: the
    tokenizer's own, else chat.template_path (the job's options select the run, and so its template)."""
    if not isinstance(tokenizer, HFTokenizer):
        raise ConfigError(
            "--chat: needs a Hugging Face tokenizer (model.tokenizer_path: a tokenizer.json folder)"
        )
    with bad_input("chat.template_path"):
        template = load_chat_template(tokenizer.folder, tokenizer.config, job_config.chat.template_path)
    system = [{"role": "system", "content": args.system}] if args.system is not None else []
    text, _ = template.render([*system, {"role": "user", "content": args.chat}], add_generation_prompt=True)
    end = end_of_turn_id(template, tokenizer)
    return tokenizer.encode_rendered(text)[0], frozenset(i for i in (tokenizer.eos_id, end) if i is not None)


def run(argv: list[str]) -> int:
    parser = build_parser()
    if any(a in ("-h", "--help") for a in argv):
        parser.print_help()
        return 0
    args, job_argv = parser.parse_known_args(argv)
    check_sampling(parser, args, job_argv)
    job_config = parse_args(job_argv)
    check_model_files(job_config)
    if os.path.lexists(job_config.job.dump_folder):
        check_folder("job.dump_folder", job_config.job.dump_folder)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with bad_input("model.tokenizer_path"):
        tokenizer = build_tokenizer(resolve_path(job_config.model.tokenizer_path))
    model = load_model(job_config, tokenizer, device)
    generator = torch.Generator(device=device).manual_seed(args.seed)
    if args.chat is not None:
        prompt, stops = chat_prompt(args, job_config, tokenizer)
    else:
        # A document starts after BOS or, for a tokenizer without one, after the EOS ending the one before.
        start = tokenizer.eos_id if tokenizer.bos_id is None else tokenizer.bos_id
        prompt = [start, *tokenizer.encode(args.prompt, bos=False, eos=False)]
        stops = frozenset([tokenizer.eos_id])
    new = generate(
        model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator, tokenizer.n_words, stops
    )
    print((args.prompt or "") + tokenizer.decode(new))
    return 0


if __name__ == "__main__":
    sys.exit(main())
