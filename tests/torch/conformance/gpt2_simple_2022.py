"""The shape of aws/amazon-sagemaker-examples' GPT-2 ``train_gpt_simple.py`` of May 2022 (fp32 path).

What it keeps from the original: argparse ints for every switch (``--gather_if_shard 1`` goes to
``optimizer.local_state_dict(gather_if_shard=args.gather_if_shard)``), ``PreTrainedModel.init_weights
= lambda x: None`` before creating the model under ``smp.tensor_parallelism`` and
``smp.delay_param_initialization``, ``model.module.module.transformer.seq_layers``, manual layer
assignment, activation checkpointing of the layers, ``smp.save(..., partial=..., v3=not
gather_if_shard)`` of a dict with ``model.local_state_dict()`` and ``optimizer.local_state_dict``,
resume by file-name regex + ``smp.load`` + ``model.load_state_dict(same_partition_load=...)`` + an
optimizer load in ``register_post_step_hook``, and the final full model translated to Hugging Face
names (``translate_state_dict_to_hf_gpt2(sd, seq_length)``), loaded back with the SMP v1 name of
that release, ``translate_hf_state_dict_to_smdistributed(sd, max_seq_len)``.
Data: each step's batch is drawn from a seed per step and rdp rank (no files).
"""

import argparse
import json
import os
import re

import numpy as np
import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp
import torch
import torch.nn as nn
from smp.torch.nn import FusedLayerNorm as LayerNorm
from smp.torch.nn.huggingface.gpt2 import (
    translate_hf_state_dict_to_smdistributed,
    translate_state_dict_to_hf_gpt2,
)
from torch import optim
from transformers import AutoModelForCausalLM, GPT2Config, set_seed


def get_param_groups_by_weight_decay(module):
    weight_decay_params = {"params": []}
    no_weight_decay_params = {"params": [], "weight_decay": 0.0}
    param_ids = set()
    for module_ in module.modules():
        if isinstance(module_, (LayerNorm, nn.LayerNorm)):
            for p in list(module_._parameters.values()):
                if p is not None and id(p) not in param_ids:
                    no_weight_decay_params["params"].append(p)
                    param_ids.add(id(p))
        else:
            for n, p in list(module_._parameters.items()):
                if p is not None and n != "bias" and id(p) not in param_ids:
                    weight_decay_params["params"].append(p)
                    param_ids.add(id(p))
            for n, p in list(module_._parameters.items()):
                if p is not None and n == "bias" and id(p) not in param_ids:
                    no_weight_decay_params["params"].append(p)
                    param_ids.add(id(p))
    return weight_decay_params, no_weight_decay_params


@smp.step
def train_step(model, optimizer, input_ids, attention_mask, args):
    loss = model(input_ids=input_ids, attention_mask=attention_mask, labels=input_ids)["loss"]
    model.backward(loss)
    return loss


def batches(args, dp_rank):
    """The original reads json shards; here each batch is a counting sequence from a seeded start."""
    for step in range(args.max_steps):
        g = torch.Generator().manual_seed(1000 * step + dp_rank)
        start = torch.randint(0, args.vocab_size, (args.train_batch_size, 1), generator=g)
        ids = (start + torch.arange(args.max_context_width)) % args.vocab_size
        yield ids, torch.ones_like(ids)


def save(output_save_file, model, optimizer, lr_scheduler, model_config, num_params, total_steps, args,
         partial=True, translate_to_hf=False, seq_length=1024, batch_idx=0):
    save_dict = {"cli_args": args.__dict__, "num_params": num_params, "total_steps": total_steps,
                 "model_config": model_config, "batch_idx": batch_idx}
    if lr_scheduler is not None:
        save_dict["lr_scheduler"] = lr_scheduler.state_dict()
    if partial:
        if args.gather_if_shard > 0 or smp.rdp_rank() == 0:
            save_dict["model"] = model.local_state_dict()
    else:
        model_state_dict = model.state_dict(gather_to_rank0=True)
        if smp.rank() == 0:
            save_dict["model"] = (translate_state_dict_to_hf_gpt2(model_state_dict, seq_length)
                                  if translate_to_hf else model_state_dict)
    if partial:
        save_dict["optimizer"] = optimizer.local_state_dict(gather_if_shard=args.gather_if_shard)
    elif not args.skip_full_optimizer:
        save_dict["optimizer"] = optimizer.state_dict()
    if not args.gather_if_shard or (smp.rdp_rank() == 0 and partial) or smp.rank() == 0:
        smp.save(save_dict, output_save_file, partial=partial, v3=not args.gather_if_shard)
    print(f"Finished checkpointing after {total_steps} steps: {output_save_file}")


def load_model_and_optimizer(output_dir, model, optimizer, lr_scheduler, partial, args, translate_from_hf=False,
                             seq_length=1024, load_model=True, load_optimizer=True, num_params=0):
    re_pattern = rf"trained_gpt_nparams-{num_params}_steps-(?P<total_steps>\d+)\.pt"
    if partial:
        re_pattern += r"_(?P<rank>\d+)"
    else:
        re_pattern += "$"
    ckpt_paths = sorted([(int(re.match(re_pattern, p).group("total_steps")), os.path.join(output_dir, p))
                         for p in os.listdir(output_dir) if re.match(re_pattern, p)], reverse=True)
    if not ckpt_paths:
        raise Exception(f'No checkpoints could be found in "{output_dir}".  Candidates: {os.listdir(output_dir)}')
    local_ckpt_path = ckpt_paths[0][1]
    if partial:
        local_ckpt_path = local_ckpt_path.split(".pt")[0] + ".pt"  # the prefix without ranks, for smp
    checkpoint = smp.load(local_ckpt_path, partial=partial)
    if load_model:
        checkpointed_model = (translate_hf_state_dict_to_smdistributed(checkpoint["model"], seq_length)
                              if translate_from_hf else checkpoint["model"])
        model.load_state_dict(checkpointed_model, same_partition_load=args.same_partition_load > 0)
        if lr_scheduler is not None:
            lr_scheduler.load_state_dict(checkpoint["lr_scheduler"])
    if load_optimizer:
        def opt_load_hook(mod, opt):
            opt.load_state_dict(checkpoint["optimizer"])

        model.register_post_step_hook(opt_load_hook)
    print(f'Loaded model from "{local_ckpt_path}"')
    return model, optimizer, checkpoint["total_steps"], checkpoint.get("batch_idx", 0)


def train(model, optimizer, lr_scheduler, model_config, start_batch_index, num_params, total_steps, args):
    model.train()
    dp_rank = smp.dp_rank() if not args.prescaled_batch else smp.rdp_rank()
    losses = []
    set_seed(args.seed)
    for batch_idx, (input_ids, attention_mask) in enumerate(batches(args, dp_rank)):
        if batch_idx < start_batch_index:
            continue
        if total_steps >= args.max_steps:
            break
        optimizer.zero_grad()
        loss_mb = train_step(model, optimizer, input_ids, attention_mask, args)
        loss = loss_mb.reduce_mean()
        optimizer.step()
        lr_scheduler.step()
        total_steps += 1
        losses.append(loss.item())
        if smp.rank() == 0 and not total_steps % args.logging_freq:
            print(f"Batch {total_steps - 1} Loss: {loss.item()}")
        if not (total_steps % args.checkpoint_freq):
            base_path = f"trained_gpt_nparams-{num_params}_steps-{total_steps}.pt"
            save(os.path.join(args.checkpoint_dir, base_path), model, optimizer, lr_scheduler, model_config,
                 num_params, total_steps, args, partial=True, batch_idx=batch_idx + 1)
    return total_steps, losses


def parse_args():
    parser = argparse.ArgumentParser()
    parser.add_argument("--train_batch_size", type=int, default=4)
    parser.add_argument("--max_steps", type=int, default=8)
    parser.add_argument("--seed", type=int, default=12345)
    parser.add_argument("--fp16", default=0, type=int)
    parser.add_argument("--weight_decay", default=0.01, type=float)
    parser.add_argument("--beta1", default=0.9, type=float)
    parser.add_argument("--beta2", default=0.95, type=float)
    parser.add_argument("--activation_checkpointing", type=int, default=1)
    parser.add_argument("--logging_freq", type=int, default=1)
    parser.add_argument("--checkpoint-dir", type=str, default="checkpoints")
    parser.add_argument("--model-dir", type=str, default="model")
    parser.add_argument("--save_final_full_model", type=int, default=0)
    parser.add_argument("--skip_full_optimizer", type=int, default=1)
    parser.add_argument("--load_partial", type=int, default=0)
    parser.add_argument("--load_full", type=int, default=0)
    parser.add_argument("--prescaled_batch", type=int, default=1)
    parser.add_argument("--max_context_width", type=int, default=32)
    parser.add_argument("--vocab_size", type=int, default=256)
    parser.add_argument("--hidden_width", type=int, default=64)
    parser.add_argument("--num_layers", type=int, default=4)
    parser.add_argument("--num_heads", type=int, default=4)
    parser.add_argument("--tensor_parallel_degree", type=int, default=2)
    parser.add_argument("--pipeline_parallel_degree", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--optimize", type=str, default="speed")
    parser.add_argument("--activation_strategy", type=str, default="each")
    parser.add_argument("--shard_optimizer_state", type=int, default=0)
    parser.add_argument("--delayed_param", type=int, default=0)
    parser.add_argument("--same_partition_load", type=int, default=0)
    parser.add_argument("--attention_in_fp32", type=int, default=0)
    parser.add_argument("--placement_strategy", type=str, default="cluster")
    parser.add_argument("--checkpoint_freq", type=int, default=4)
    parser.add_argument("--manual_partition", type=int, default=1)
    parser.add_argument("--match_weights", type=int, default=0)
    parser.add_argument("--gather_if_shard", type=int, default=1)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--losses", default="")
    args, _ = parser.parse_known_args()
    return args


def main():
    args = parse_args()
    smp_config = {
        "ddp": True,
        "tensor_parallel_degree": args.tensor_parallel_degree,
        "pipeline_parallel_degree": args.pipeline_parallel_degree,
        "microbatches": args.microbatches,
        "checkpoint_attentions": False if args.activation_checkpointing else True,
        "shard_optimizer_state": args.shard_optimizer_state > 0,
        "prescaled_batch": args.prescaled_batch > 0,
        "_match_weights": args.match_weights > 0,
        "fp16_params": args.fp16 > 0,
        "optimize": args.optimize,
        "placement_strategy": args.placement_strategy,
        "auto_partition": False if args.manual_partition else True,
        "default_partition": 0,
    }
    smp.init(smp_config)
    if smp.local_rank() == 0:
        for path in [args.model_dir, args.checkpoint_dir]:
            os.makedirs(path, exist_ok=True)
    smp.barrier()
    model_config = GPT2Config(vocab_size=args.vocab_size, n_positions=args.max_context_width, n_embd=args.hidden_width,
                              n_layer=args.num_layers, n_head=args.num_heads, n_inner=None,
                              activation_function="gelu_new", resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                              layer_norm_epsilon=1e-05, initializer_range=0.02, use_cache=True, bos_token_id=0,
                              eos_token_id=0, return_dict=True)
    # the following improves start-up time by skipping proper initialization
    # of weights in the original model. this is not a problem because DistributedModel
    # will override those weights anyway when tensor_parallel_degree > 1.
    if smp.tp_size() > 1 and args.match_weights < 1:
        from transformers.modeling_utils import PreTrainedModel

        PreTrainedModel.init_weights = lambda x: None
    set_seed(args.seed)
    with smp.tensor_parallelism(enabled=smp.tp_size() > 1, attention_in_fp32=args.attention_in_fp32 > 0):
        with smp.delay_param_initialization(
            enabled=(smp.tp_size() > 1 and args.match_weights < 1 and args.delayed_param > 0)
        ):
            model = AutoModelForCausalLM.from_config(model_config)
    num_params = sum([np.prod(p.size()) for p in model.parameters()])
    set_seed(args.seed + smp.tp_rank())
    model = smp.DistributedModel(model, trace_device="gpu", gradient_as_bucket_view=True)
    m = model
    if smp.tp_size() > 1:
        transformer_layers = m.module.module.transformer.seq_layers
    else:
        transformer_layers = m.module.module.transformer.h
    if args.manual_partition:
        div, rem = divmod(args.num_layers, smp.pp_size())
        get_num_layers = lambda x: (div + 1 if x >= smp.pp_size() - rem else div)  # noqa: E731
        assignments = []
        for pp_rank in range(smp.pp_size()):
            assignments += [pp_rank for _ in range(get_num_layers(pp_rank))]
        for i, c in enumerate(transformer_layers.children()):
            smp.set_partition(c, assignments[i])
    param_groups = get_param_groups_by_weight_decay(model)
    optimizer = optim.Adam(param_groups, betas=(args.beta1, args.beta2), lr=args.lr, weight_decay=args.weight_decay)
    if args.activation_checkpointing:
        kwargs = {}
        if isinstance(transformer_layers, nn.Sequential):
            kwargs["pack_args_as_tuple"] = True
            kwargs["strategy"] = args.activation_strategy
        smp.set_activation_checkpointing(transformer_layers, **kwargs)
    optimizer = smp.DistributedOptimizer(optimizer)
    lr_scheduler = optim.lr_scheduler.LambdaLR(optimizer, lambda it: min(1.0, (it + 1) / 4))  # AnnealingLR's warmup

    total_steps, start_batch_index = 0, 0
    if args.load_full or args.load_partial:
        partial = not args.load_full
        path = args.checkpoint_dir if partial else args.model_dir
        model, optimizer, total_steps, start_batch_index = load_model_and_optimizer(
            path, model, optimizer, lr_scheduler if partial else None, partial, args, translate_from_hf=not partial,
            seq_length=args.max_context_width, load_model=True, load_optimizer=args.load_partial > 0,
            num_params=num_params)
    start = total_steps
    total_steps, losses = train(model, optimizer, lr_scheduler, model_config, start_batch_index, num_params,
                                total_steps, args)
    if args.losses:
        with open(f"{args.losses}_{smp.rank()}.json", "w") as f:
            json.dump({"start": int(start), "losses": losses}, f)
    if args.save_final_full_model:
        out_path = os.path.join(args.model_dir, f"trained_gpt_nparams-{num_params}_steps-{total_steps}.pt")
        if smp.rdp_rank() == 0:
            save(out_path, model, optimizer, lr_scheduler, model_config, num_params, total_steps, args, partial=False,
                 translate_to_hf=smp.tp_size() > 1, seq_length=args.max_context_width)
    smp.barrier()
    if smp.rank() == 0:
        print("SMP training finished successfully")


if __name__ == "__main__":
    main()
