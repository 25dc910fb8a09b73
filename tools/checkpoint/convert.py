"""Convert checkpoints to and from Hugging Face ``transformers`` and Megatron-LM (one CPU
process, any layout).

    python tools/checkpoint/convert.py to-hf --load CKPT_DIR --save HF_DIR [--check-logits]
    python tools/checkpoint/convert.py from-hf --load HF_DIR --save CKPT_DIR
    python tools/checkpoint/convert.py to-megatron-lm --load CKPT_DIR --save MLM_DIR

``to-hf`` takes the global weights of a checkpoint (the latest one, or ``--iteration N``; under
DiLoCoX: the outer parameters) and writes a ``LlamaForCausalLM`` when the run used RoPE, RMSNorm
and SwiGLU, a ``GPT2LMHeadModel`` when it used learned positions, LayerNorm and GELU
(``save_pretrained``, safetensors). A run with a SentencePiece tokenizer also gets it, as a
Hugging Face tokenizer that encodes as SentencePiece does, with the model file beside it
(``tokenizer.model``), and the model's bos/eos/pad ids from it, so that ``AutoTokenizer`` and
``generate`` work on the folder; ``--tokenizer-model`` names the file when it has moved since
training. ``--check-logits`` reloads the written folder with ``from_pretrained`` and prints the
largest logit difference to our model on random tokens.

``to-megatron-lm`` writes the global weights as Megatron-LM's ``pretrain_gpt.py --ckpt-format
torch_dist`` saves them (``MLM_DIR/iter_NNNNNNN/`` and its tracker), with the iteration and the
run's flags as its ``args``, and no optimizer or RNG state: Megatron-LM loads it with
``--load MLM_DIR --no-load-optim --no-load-rng`` (or ``--finetune``) into any TP/PP layout.
``--load`` of both ``to-*`` directions, and of ``pretrain_gpt.py`` itself, also takes a directory
Megatron-LM saved.

``from-hf`` writes a weights-only checkpoint at iteration 0 that ``pretrain_gpt.py --load``
reads into any TP/PP layout; it prints the model flags the run must use, with
``--tokenizer-model`` when the folder carries a SentencePiece ``tokenizer.model`` (copied into
the checkpoint directory, its vocabulary and eos id checked against the model's config).
"""

import os
import sys

# This folder holds inspect.py, which would shadow the standard library's inspect module (used by
# torch) for every script started from here: take the script's folder off the import path.
sys.path = [p for p in sys.path if p != os.path.dirname(os.path.abspath(__file__))]

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import shutil  # noqa: E402
import socket  # noqa: E402
from pathlib import Path  # noqa: E402

# torch, transformers and megatron-core are imported where they are used, after the flags are
# parsed: --help and flag errors come without their seconds of start-up.


def _fail(message: str):
    sys.exit(f"convert.py: error: {message}")


def _single_process_world():
    """A 1-rank gloo world with megatron at TP1/PP1 (checkpoint I/O is collective)."""
    from megatron_dilocox.platform import cpu

    cpu.install()
    import torch.distributed as dist

    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed

    from megatron_dilocox.topology import build_topology

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    build_topology(1, 1, None)
    model_parallel_cuda_manual_seed(0)  # megatron builds layers under its RNG tracker


def _tp1_run(model_flags: dict, vocab_size: int):
    """The settings of a one-process fp32 run (TP1/PP1, mock data) of the model ``model_flags``
    describes (model flags by attribute name; None: not given)."""
    from megatron_dilocox.arguments import parse_args
    from megatron_dilocox.checkpoint import hf

    given = {name: value for name, value in model_flags.items() if value is not None}
    return parse_args(hf.as_argv(given) + ["--micro-batch-size", "1", "--train-iters", "1", "--lr", "1",
                                           "--mock-data", "--tokenizer-type", "NullTokenizer",
                                           "--vocab-size", str(vocab_size)])


def _build_model(run, vocab_size: int):
    """The model of a :func:`_tp1_run` in eval mode, and its megatron config."""
    from megatron_dilocox.training.model import build_gpt_chunks, transformer_config

    config = transformer_config(run)
    (chunk,) = build_gpt_chunks(run.model, config, vocab_size)
    return chunk.eval(), config


def _our_logits(chunk, tokens):
    import torch

    positions = torch.arange(tokens.shape[1]).expand_as(tokens)
    with torch.no_grad():
        return chunk(tokens, positions, None).float()


def _run_tokenizer(manifest_args: dict, override: str | None) -> str | None:
    """The SentencePiece model file of the run (None for NullTokenizer)."""
    if manifest_args.get("tokenizer_type") != "SentencePieceTokenizer":
        return None
    path = override or manifest_args.get("tokenizer_model")
    if not path or not os.path.isfile(path):
        _fail(f"--tokenizer-model {path}: file not found (the run's SentencePiece model; name where it is now)")
    return path


def _load_model(load: str, iteration: int | None):
    """The checkpoint folder in ``load`` (the tracked one, or ``iter_N``; ours or Megatron-LM's),
    its manifest, and the TP1 run, model and megatron config holding its weights."""
    from megatron_dilocox.checkpoint import files
    from megatron_dilocox.checkpoint.checkpointing import load_weights, open_folder, tracked_folder
    from megatron_dilocox.run_config import ModelConfig

    folder = files.iteration_dir(load, iteration) if iteration is not None else tracked_folder(load)
    manifest = open_folder(folder)
    vocab = manifest["model"]["padded_vocab_size"]
    run = _tp1_run({f.name: manifest["args"].get(f.name) for f in dataclasses.fields(ModelConfig)}, vocab)
    _single_process_world()
    chunk, model_config = _build_model(run, vocab)
    load_weights([chunk], folder)
    return folder, manifest, run, chunk, model_config


def to_megatron_lm(load: str, save: str, iteration: int | None) -> None:
    from megatron_dilocox.checkpoint import megatron_lm

    folder, manifest, _, chunk, _ = _load_model(load, iteration)
    args = megatron_lm.megatron_args({**manifest["args"], **manifest["model"]}, manifest["iteration"])
    written = megatron_lm.save(save, manifest["iteration"], chunk.sharded_state_dict(), args)
    print(f"> wrote {written} (Megatron-LM torch_dist, iteration {manifest['iteration']}) from {folder}")
    print(f"> Megatron-LM loads it with: --load {save} --no-load-optim --no-load-rng --ckpt-format torch_dist")


def to_hf(load: str, save: str, iteration: int | None, check_logits: bool, tokenizer_model: str | None) -> None:
    import sentencepiece as spm
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_dilocox.checkpoint import hf, hf_tokenizer
    from megatron_dilocox.training.model import gather_full_params

    folder, manifest, run, chunk, model_config = _load_model(load, iteration)
    vocab = manifest["model"]["padded_vocab_size"]
    sp_model = _run_tokenizer(manifest["args"], tokenizer_model)
    sp = spm.SentencePieceProcessor(model_file=sp_model) if sp_model else None
    if sp is not None and sp.get_piece_size() > vocab:
        _fail(f"--tokenizer-model {sp_model}: {sp.get_piece_size()} pieces, more than the model's {vocab} embeddings")
    family = hf.hf_family(run.model)
    tied = not run.model.untie_embeddings_and_output_weights
    config, state_dict = hf.to_hf(gather_full_params([chunk], tied), run.model, model_config, vocab)
    if sp is not None:
        ids = hf_tokenizer.special_ids(sp)
        for kind in ("bos", "eos", "pad"):  # the ids a model config holds
            setattr(config, f"{kind}_token_id", ids.get(kind))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(state_dict, strict=True)
    out = Path(save)
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    if sp is not None:
        hf_tokenizer.save_hf_tokenizer(sp_model, str(partial))
    if out.exists():
        shutil.rmtree(out)
    os.replace(partial, out)
    print(f"> wrote {family} model ({model.num_parameters():,} parameters) from {folder} (iteration {manifest['iteration']}) to {out}")
    print(f"> tokenizer: {sp_model} ({sp.get_piece_size()} pieces, bos {config.bos_token_id}, eos {config.eos_token_id})"
          if sp is not None else "> no tokenizer written: the run used NullTokenizer (token ids only)")
    if check_logits:
        reloaded = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
        tokens = torch.randint(0, vocab, (2, min(64, run.model.seq_length)), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            theirs = reloaded(tokens).logits.float()
        print(f"> logits check on {tuple(tokens.shape)} random tokens: max abs difference "
              f"{(theirs - _our_logits(chunk, tokens)).abs().max().item():.3e}")


def from_hf(load: str, save: str) -> None:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from megatron_dilocox.arguments import padded_vocab_size
    from megatron_dilocox.checkpoint import hf
    from megatron_dilocox.checkpoint.checkpointing import save_weights

    config = AutoConfig.from_pretrained(load)
    params, flags = hf.from_hf(AutoModelForCausalLM.from_pretrained(load, dtype=torch.float32), config)
    vocab = flags.pop("vocab_size")
    model_flags = hf.as_argv(flags)
    run = _tp1_run({**flags, "seq_length": flags["max_position_embeddings"]}, vocab)
    run.padded_vocab_size = padded_vocab_size(vocab, run.model)
    _single_process_world()
    chunk, _ = _build_model(run, run.padded_vocab_size)
    ours = dict(chunk.named_parameters())
    if set(ours) != set(params):
        _fail(f"{load}: converted names do not match the model: {sorted(set(ours) ^ set(params))[:5]}")
    with torch.no_grad():
        for name, param in ours.items():
            param.copy_(params[name])
    folder = save_weights([chunk], run, save, source=f"huggingface:{os.path.abspath(load)}")
    print(f"> wrote a weights-only checkpoint to {folder}")
    tokenizer_flags = _import_tokenizer(load, save, config, vocab)
    print("> train or evaluate it with these model flags (plus your layout, data and training flags):")
    print("  " + " ".join(model_flags + tokenizer_flags) + f" --load {save}")


def _import_tokenizer(load: str, save: str, config, vocab: int) -> list[str]:
    """Copies the folder's SentencePiece model into ``save`` after checking it against the model's
    config; returns the tokenizer flags for the run (none when the folder has no such file)."""
    import sentencepiece as spm

    from megatron_dilocox.checkpoint.hf_tokenizer import SENTENCEPIECE_FILE, special_ids

    source = os.path.join(load, SENTENCEPIECE_FILE)
    if not os.path.isfile(source):
        print(f"> no {SENTENCEPIECE_FILE} in {load}: give the run a SentencePiece --tokenizer-model whose ids match "
              f"this model's {vocab} embeddings")
        return []
    try:
        sp = spm.SentencePieceProcessor(model_file=source)
    except (OSError, RuntimeError):
        _fail(f"--load {load}: {SENTENCEPIECE_FILE} is not a SentencePiece model")
    if sp.get_piece_size() > vocab:
        _fail(f"--load {load}: {SENTENCEPIECE_FILE} has {sp.get_piece_size()} pieces, the model {vocab} embeddings")
    eos = special_ids(sp).get("eos")
    if config.eos_token_id is not None and config.eos_token_id != eos:
        _fail(f"--load {load}: {SENTENCEPIECE_FILE} has eos id {eos}, config.json says {config.eos_token_id}")
    target = os.path.join(save, SENTENCEPIECE_FILE)
    shutil.copyfile(source, target + ".partial")
    os.replace(target + ".partial", target)
    print(f"> tokenizer: {target} ({sp.get_piece_size()} pieces, eos {eos})")
    return ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", target]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="convert.py", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="direction", required=True)
    out = sub.add_parser("to-hf", help="our checkpoint -> Hugging Face folder")
    out.add_argument("--load", required=True, help="checkpoint directory (the one --save wrote)")
    out.add_argument("--save", required=True, help="Hugging Face output folder (replaced if it exists)")
    out.add_argument("--iteration", type=int, default=None, help="convert iter_N instead of the latest")
    out.add_argument("--check-logits", action="store_true", help="compare logits after writing")
    out.add_argument("--tokenizer-model", default=None,
                     help="the run's SentencePiece model, where it is now (default: the path the run recorded)")
    mlm = sub.add_parser("to-megatron-lm", help="our checkpoint -> Megatron-LM torch_dist checkpoint directory")
    mlm.add_argument("--load", required=True, help="checkpoint directory (the one --save wrote)")
    mlm.add_argument("--save", required=True, help="Megatron-LM checkpoint directory to write (its --load)")
    mlm.add_argument("--iteration", type=int, default=None, help="convert iter_N instead of the latest")
    into = sub.add_parser("from-hf", help="Hugging Face folder -> our weights-only checkpoint")
    into.add_argument("--load", required=True, help="Hugging Face folder (config.json + weights)")
    into.add_argument("--save", required=True, help="checkpoint directory to write")
    args = parser.parse_args(argv)
    from megatron_dilocox.errors import ConfigError, missing_dependency

    try:
        if args.direction == "to-hf":
            to_hf(args.load, args.save, args.iteration, args.check_logits, args.tokenizer_model)
        elif args.direction == "to-megatron-lm":
            to_megatron_lm(args.load, args.save, args.iteration)
        else:
            if not os.path.isfile(os.path.join(args.load, "config.json")):
                _fail(f"--load {args.load}: no config.json (not a Hugging Face model folder)")
            from_hf(args.load, args.save)
    except ConfigError as err:
        _fail(str(err))
    except ModuleNotFoundError as err:
        _fail(missing_dependency(err))
    return 0


if __name__ == "__main__":  # the guard is needed: checkpoint writers start spawn processes
    sys.exit(main())
