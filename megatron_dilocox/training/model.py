"""Build the GPT model chunks, initialise them layout-independently, wrap them in DDP."""

import importlib.util
import zlib
from functools import partial

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import (
    get_gpt_layer_local_spec,
    get_gpt_layer_with_transformer_engine_spec,
)
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.enums import AttnBackend
from megatron.core.transformer.module import Float16Module
from megatron.core.transformer.transformer_layer import TransformerLayer

from megatron_dilocox.megatron_state import unwrap
from megatron_dilocox.platform.backend import on_cuda
from megatron_dilocox.run_config import ModelConfig, RunConfig
from megatron_dilocox.topology import Topology


def transformer_config(run: RunConfig) -> TransformerConfig:
    """megatron-core's TransformerConfig from a run's model, parallelism and training sections."""
    model, parallel, training = run.model, run.parallel, run.training
    vpp = run.virtual_pipeline_model_parallel_size
    dtype = torch.bfloat16 if training.bf16 else torch.float32
    full_recompute = training.recompute_granularity == "full"
    overlap_p2p = parallel.overlap_p2p_comm and vpp is not None
    on_cpu = not on_cuda()
    return TransformerConfig(
        num_layers=model.num_layers,
        hidden_size=model.hidden_size,
        num_attention_heads=model.num_attention_heads,
        num_query_groups=model.num_query_groups,
        ffn_hidden_size=model.ffn_hidden_size,
        hidden_dropout=model.hidden_dropout,
        attention_dropout=model.attention_dropout,
        attention_backend=AttnBackend[model.attention_backend],
        init_method_std=model.init_method_std,
        normalization=model.normalization,
        gated_linear_unit=model.swiglu,
        activation_func=F.silu if model.swiglu else F.gelu,
        add_bias_linear=not model.disable_bias_linear,
        tensor_model_parallel_size=parallel.tensor_model_parallel_size,
        pipeline_model_parallel_size=parallel.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp,
        sequence_parallel=parallel.sequence_parallel,
        params_dtype=dtype,
        pipeline_dtype=dtype,
        bf16=training.bf16,
        # megatron initialises (and tags TP params with partition_dim); initialize_parameters then
        # overwrites the values layout-independently.
        perform_initialization=True,
        use_cpu_initialization=on_cpu,
        recompute_granularity=training.recompute_granularity,
        recompute_method=training.recompute_method if full_recompute else None,
        recompute_num_layers=training.recompute_num_layers if full_recompute else None,
        overlap_p2p_comm=overlap_p2p,
        batch_p2p_comm=not overlap_p2p,
        # Fused kernels need CUDA, and the softmax one apex's compiled extension.
        masked_softmax_fusion=not on_cpu and importlib.util.find_spec("scaled_masked_softmax_cuda") is not None,
        bias_activation_fusion=False,
        bias_dropout_fusion=False,
        apply_rope_fusion=False,
        gradient_accumulation_fusion=False,
        cross_entropy_loss_fusion=False,
        # gloo's asynchronous sends still read a pipeline output after megatron frees it
        # (measured: wrong losses with the interleaved schedule), so keep outputs on CPU.
        deallocate_pipeline_outputs=not on_cpu,
    )


def _chunk_stages(vp_stage):
    return (
        parallel_state.is_pipeline_first_stage(ignore_virtual=False, vp_stage=vp_stage),
        parallel_state.is_pipeline_last_stage(ignore_virtual=False, vp_stage=vp_stage),
    )


def uses_transformer_engine() -> bool:
    """Whether the model is built with Transformer Engine's layer spec: with CUDA, when it imports."""
    if not on_cuda():
        return False
    try:
        import transformer_engine  # noqa: F401
    except ImportError:
        return False
    return True


def layer_spec(normalization: str):
    """Transformer Engine's layer spec (:func:`uses_transformer_engine`), megatron's local one otherwise."""
    if uses_transformer_engine():
        return get_gpt_layer_with_transformer_engine_spec(normalization=normalization)
    return get_gpt_layer_local_spec(normalization=normalization)


def build_gpt_chunks(model: ModelConfig, config: TransformerConfig, vocab_size: int) -> list[GPTModel]:
    """The model chunks this rank holds (one per virtual pipeline stage of ``config``)."""
    spec = layer_spec(model.normalization)
    vpp = config.virtual_pipeline_model_parallel_size
    chunks = []
    for vp_stage in range(vpp or 1):
        pre, post = _chunk_stages(vp_stage if vpp else None)
        chunks.append(GPTModel(
            config=config,
            transformer_layer_spec=spec,
            vocab_size=vocab_size,
            max_sequence_length=model.max_position_embeddings,
            pre_process=pre,
            post_process=post,
            share_embeddings_and_output_weights=not model.untie_embeddings_and_output_weights,
            position_embedding_type=model.position_embedding_type,
            rotary_base=model.rotary_base,
            vp_stage=vp_stage if vpp else None,
        ))
    return chunks


def _global_names(chunk, tied: bool):
    """Parameter -> name that does not depend on the layout: layer indices are global, and
    a tied output layer is named after the embedding it copies."""
    prefixes = {}
    for name, module in chunk.named_modules():
        if isinstance(module, TransformerLayer):
            prefixes[name + "."] = f"decoder.layers.{module.layer_number - 1}."
    names = {}
    for name, param in chunk.named_parameters():
        for local, global_ in prefixes.items():
            if name.startswith(local):
                name = global_ + name[len(local):]
                break
        if tied and name == "output_layer.weight":
            name = "embedding.word_embeddings.weight"
        names[param] = name
    return names


def _full_shape(param, tp_size):
    shape = list(param.shape)
    if getattr(param, "tensor_model_parallel", False):
        shape[param.partition_dim] *= tp_size
    return shape


def gated_fc1(config, name) -> bool:
    """SwiGLU's fc1: each TP rank holds [gate shard; up shard], not a block of [gate; up]."""
    return config.gated_linear_unit and name.endswith("mlp.linear_fc1.weight")


def _tp_shard(full, param, name, config, tp_rank, tp_size):
    """The slice of a full (TP1) tensor that this TP rank holds."""
    if not getattr(param, "tensor_model_parallel", False):
        return full
    dim = param.partition_dim
    if gated_fc1(config, name):
        gate, up = full.chunk(2, dim=dim)
        return torch.cat([gate.chunk(tp_size, dim)[tp_rank], up.chunk(tp_size, dim)[tp_rank]], dim)
    return full.chunk(tp_size, dim)[tp_rank]


@torch.no_grad()
def initialize_parameters(chunks, config: TransformerConfig, seed: int, tied: bool) -> None:
    """Initialises every parameter from (seed, global name) alone, so the same seed gives the
    same model on every TP/PP/VPP layout: normal(0, std) for matrices (output projections
    scaled by 1/sqrt(2L), as in Megatron), ones for norm weights, zeros for biases."""
    tp_rank = parallel_state.get_tensor_model_parallel_rank()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    output_std = config.init_method_std / (2.0 * config.num_layers) ** 0.5
    for chunk in chunks:
        for param, name in _global_names(chunk, tied).items():
            if name.endswith("bias"):
                param.zero_()
            elif param.dim() == 1:
                param.fill_(1.0)
            else:
                std = output_std if name.endswith(("linear_proj.weight", "linear_fc2.weight")) else config.init_method_std
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                full = torch.empty(_full_shape(param, tp_size)).normal_(0.0, std, generator=gen)
                param.copy_(_tp_shard(full, param, name, config, tp_rank, tp_size))


def wrap_ddp(chunks, config: TransformerConfig, topo: Topology, use_distributed_optimizer: bool):
    """Moves the chunks to the GPU (if any), wraps them for bf16, then in megatron-core DDP over
    the cluster-local data-parallel group; sets the schedule hooks."""
    if on_cuda():
        chunks = [chunk.cuda(torch.cuda.current_device()) for chunk in chunks]
    if config.bf16:
        chunks = [Float16Module(config, chunk) for chunk in chunks]
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        overlap_grad_reduce=False,
        use_distributed_optimizer=use_distributed_optimizer,
    )
    model = [
        DistributedDataParallel(config=config, ddp_config=ddp_config, module=chunk,
                                disable_bucketing=i > 0, pg_collection=topo.pg_collection)
        for i, chunk in enumerate(chunks)
    ]
    # Without this hook data-parallel replicas silently diverge.
    config.finalize_model_grads_func = partial(finalize_model_grads, pg_collection=topo.pg_collection)
    config.no_sync_func = [m.no_sync for m in model] if len(model) > 1 else model[0].no_sync
    return model



@torch.no_grad()
def gather_full_params(chunks, tied: bool) -> dict[str, torch.Tensor]:
    """This pipeline stage's parameters as full (TP1) tensors keyed by global name; the
    inverse of the sharding in :func:`initialize_parameters`. Collective over the TP group."""
    tp_group = parallel_state.get_tensor_model_parallel_group()
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    full = {}
    for chunk in map(unwrap, chunks):
        for param, name in _global_names(chunk, tied).items():
            tensor = param.detach().float()
            if getattr(param, "tensor_model_parallel", False) and tp_size > 1:
                shards = [torch.empty_like(tensor) for _ in range(tp_size)]
                torch.distributed.all_gather(shards, tensor.contiguous(), group=tp_group)
                dim = param.partition_dim
                if gated_fc1(chunk.config, name):
                    pairs = [s.chunk(2, dim) for s in shards]
                    tensor = torch.cat([torch.cat([g for g, _ in pairs], dim), torch.cat([u for _, u in pairs], dim)], dim)
                else:
                    tensor = torch.cat(shards, dim)
            full[name] = tensor.clone()
    return full
