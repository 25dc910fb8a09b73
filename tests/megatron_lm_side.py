"""Megatron-LM's own checkpoint code on CPU (``megatron.training``, shipped with megatron-core
0.17+), for tests/test_megatron_lm_checkpoints.py: parses Megatron-LM's flags with its parser,
builds its GPT model from them, and writes a checkpoint with its ``save_checkpoint`` or reads one
with its ``load_checkpoint``; each writes the model's logits on :func:`tokens` next to it.

    python tests/megatron_lm_side.py save DIR   # iteration 7 with its LR schedule; DIR/saved_logits.pt
    python tests/megatron_lm_side.py load DIR   # weights of DIR's latest checkpoint; DIR/loaded_logits.pt
"""

import os
import socket
import sys

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), ".."))

from megatron_dilocox.platform import cpu  # noqa: E402

# One model, in both projects' flags: RoPE, RMSNorm, SwiGLU, grouped queries, untied output.
MODEL = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4", "--num-query-groups", "2",
         "--ffn-hidden-size", "96", "--seq-length", "32", "--max-position-embeddings", "32",
         "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--swiglu", "--disable-bias-linear",
         "--untie-embeddings-and-output-weights", "--init-method-std", "0.2",
         "--hidden-dropout", "0", "--attention-dropout", "0", "--vocab-size", "100", "--tokenizer-type", "NullTokenizer"]
SCHEDULE = ["--micro-batch-size", "2", "--global-batch-size", "4", "--train-iters", "20", "--lr", "1e-3",
            "--min-lr", "1e-4", "--lr-decay-style", "cosine", "--lr-warmup-iters", "2", "--weight-decay", "0.1"]
ITERATION = 7
# Megatron-LM's spelling of grouped queries, and its CPU-able choices (no Transformer Engine, no fused kernels).
MEGATRON_ONLY = ["--group-query-attention", "--mock-data", "--transformer-impl", "local", "--no-persist-layer-norm",
                 "--no-gradient-accumulation-fusion", "--no-masked-softmax-fusion", "--no-bias-swiglu-fusion",
                 "--no-bias-dropout-fusion", "--no-rope-fusion", "--ckpt-format", "torch_dist", "--no-save-rng",
                 "--no-load-rng", "--no-load-optim", "--save-interval", "10"]


def tokens():
    import torch

    return torch.randint(0, 100, (2, 32), generator=torch.Generator().manual_seed(0))


def logits(model):
    import torch

    batch = tokens()
    positions = torch.arange(batch.shape[1]).expand_as(batch)
    with torch.no_grad():
        return model(batch, positions, None).float()


def _megatron_lm(directory: str, action: str):
    """Megatron-LM's args and model (a 1-rank gloo world, its parser, its model config)."""
    import torch
    import torch.distributed as dist

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    from megatron.core import parallel_state
    from megatron.core.models.gpt import GPTModel
    from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
    from megatron.core.tensor_parallel.random import model_parallel_cuda_manual_seed
    from megatron.training.arguments import core_transformer_config_from_args, parse_args, validate_args
    from megatron.training.global_vars import set_global_variables
    from megatron.training.vocab_utils import calculate_padded_vocab_size

    sys.argv = ["pretrain_gpt.py", *MODEL, *SCHEDULE, *MEGATRON_ONLY, "--" + action, directory]
    args = parse_args()
    validate_args(args)
    set_global_variables(args, build_tokenizer=False)
    args.padded_vocab_size = calculate_padded_vocab_size(args.vocab_size, args.make_vocab_size_divisible_by, 1)
    parallel_state.initialize_model_parallel()
    model_parallel_cuda_manual_seed(1234 if action == "save" else 4321)  # a load must not start from the same weights
    model = GPTModel(config=core_transformer_config_from_args(args), transformer_layer_spec=get_gpt_layer_local_spec(),
                     vocab_size=args.padded_vocab_size, max_sequence_length=args.max_position_embeddings,
                     position_embedding_type=args.position_embedding_type,
                     share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights)
    with torch.no_grad():  # norm weights off their ones, so a misplaced one shows in the logits
        for p in model.parameters():
            if p.dim() == 1:
                p.add_(0.3 * torch.randn(p.shape, generator=torch.Generator().manual_seed(p.numel())))
    return args, model.eval()


def main(action: str, directory: str) -> None:
    import torch

    cpu.prepare()
    args, model = _megatron_lm(directory, action)
    if action == "save":
        from megatron.training.checkpointing import save_checkpoint
        from megatron.training.training import get_optimizer_param_scheduler

        scheduler = get_optimizer_param_scheduler(torch.optim.AdamW(model.parameters()))
        for _ in range(ITERATION):  # Megatron-LM steps its schedule by the global batch, in samples
            scheduler.step(increment=args.global_batch_size)
        save_checkpoint(ITERATION, [model], None, scheduler, 0)
        torch.save(logits(model), os.path.join(directory, "saved_logits.pt"))
    else:
        from megatron.training.checkpointing import load_checkpoint

        iteration, _ = load_checkpoint([model], None, None)
        torch.save({"iteration": iteration, "logits": logits(model)}, os.path.join(directory, "loaded_logits.pt"))


if __name__ == "__main__":  # the guard is needed: megatron-core's checkpoint writer starts spawn processes
    main(*sys.argv[1:])
