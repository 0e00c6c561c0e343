"""SMP v1's GPT-2 example (the shape of AWS's ``train_gpt_simple.py``) on smp: only the import changed.

    torchrun --nproc-per-node 4 examples/train_gpt_simple.py --steps 20 --checkpoint-dir gpt-ckpt

What the SMP v1 script does, and so does this one: tensor_parallel_degree 2 x
pipeline_parallel_degree 2 (``--tp``, ``--pp``), the GPT-2 built from config inside
``smp.model_creation(tensor_parallelism=True, dtype=...)`` with delayed parameter initialisation,
so smp gives it SMP v1's structure (``transformer.seq_layers``, docs/huggingface.md); every layer
checkpointed with ``smp.set_activation_checkpointing``; AdamW with SMP v1's weight-decay groups
inside ``smp.DistributedOptimizer`` with dynamic loss scaling under ``--fp16``, its state sharded
over the DP replicas with ``--shard-optimizer-state 1``;
``optimizer.clip_master_grads``; the LR scheduler steps only when the optimizer did (no overflow);
``smp.save_checkpoint`` every ``--save-every`` steps (partial) and ``smp.resume_from_checkpoint``
with ``--resume``; at the end the full model translated to Hugging Face names with
``translate_state_dict_to_hf_gpt2`` and saved by ``smp.save(partial=False)``, which plain
``transformers.GPT2LMHeadModel`` loads.

The data is a learnable toy language (each sequence counts up from a random start) drawn from a
seed per step and DP rank, so a resumed run sees the batches the uninterrupted one saw.
"""

from __future__ import annotations

import argparse
import json
import os

import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp
import torch
import transformers
from smp.torch.nn.huggingface.gpt2 import translate_state_dict_to_hf_gpt2

VOCAB = 256


def get_param_groups_by_weight_decay(module: torch.nn.Module, weight_decay: float) -> list[dict]:
    """SMP v1's helper: no weight decay on biases and layer-norm weights."""
    decay, no_decay = [], []
    for name, param in module.named_parameters():
        (no_decay if name.endswith("bias") or "layernorm" in name.lower() or "ln_" in name else decay).append(param)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


def batch(step: int, size: int, seq: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + smp.dp_rank())
    start = torch.randint(0, VOCAB, (size, 1), generator=g)
    return (start + torch.arange(seq)) % VOCAB


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--pp", type=int, default=2)
    parser.add_argument("--microbatches", type=int, default=2)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--use-distributed-transformer", type=int, default=1,
                        help="SMP v1's structure (transformer.seq_layers) also at tp=1")
    parser.add_argument("--fp16", type=int, default=0)
    parser.add_argument("--init-scale", type=float, default=2.0**12, help="initial dynamic loss scale (fp16)")
    parser.add_argument("--shard-optimizer-state", type=int, default=0,
                        help="ZeRO-1: each DP replica keeps and steps 1/rdp of the optimizer state")
    parser.add_argument("--grad-clip", type=float, default=1.0)
    parser.add_argument("--lr", type=float, default=3e-3)
    parser.add_argument("--dropout", type=float, default=0.0, help="GPT-2's three dropouts (0: a resume repeats "
                        "the uninterrupted run exactly; the RNG state is not part of a checkpoint)")
    parser.add_argument("--checkpoint-dir", default="gpt-checkpoints")
    parser.add_argument("--save-every", type=int, default=0, help="save a partial checkpoint every N steps (0: never)")
    parser.add_argument("--resume", type=int, default=0, help="resume from the newest checkpoint in --checkpoint-dir")
    parser.add_argument("--losses", default="", help="write each rank's per-step losses to LOSSES_<rank>.json")
    args = parser.parse_args()

    smp.init({"tensor_parallel_degree": args.tp, "pipeline_parallel_degree": args.pp,
              "microbatches": args.microbatches, "ddp": True, "fp16": bool(args.fp16),
              "shard_optimizer_state": bool(args.shard_optimizer_state),
              "delayed_parameter_initialization": True, "random_seed": 12345, "auto_partition": False,
              "default_partition": 0, "placement_strategy": "cluster"})
    config = transformers.GPT2Config(vocab_size=VOCAB, n_embd=64, n_layer=args.layers, n_head=4,
                                     n_positions=args.seq, bos_token_id=0, eos_token_id=0,
                                     resid_pdrop=args.dropout, embd_pdrop=args.dropout, attn_pdrop=args.dropout)
    dtype = torch.float16 if args.fp16 else torch.float32
    with smp.model_creation(tensor_parallelism=smp.tp_size() > 1 or args.use_distributed_transformer > 0, dtype=dtype, attention_in_fp32=True,
                            fused_softmax=True, fused_bias_gelu=True):
        model = transformers.AutoModelForCausalLM.from_config(config)
    model = smp.DistributedModel(model)
    layers = model.get_module().transformer.seq_layers  # SMP v1's structure
    for i, layer in enumerate(layers):  # the second half of the layers on the second stage
        if args.pp > 1 and i >= len(layers) // 2:
            smp.set_partition(layer, 1)
        smp.set_activation_checkpointing(layer)

    param_groups = get_param_groups_by_weight_decay(model, weight_decay=0.01)
    optimizer = torch.optim.AdamW(param_groups, lr=args.lr, betas=(0.9, 0.95))
    optimizer = smp.DistributedOptimizer(optimizer, static_loss_scale=None, dynamic_loss_scale=True,
                                         dynamic_loss_args={"scale_window": 1000, "min_scale": 1,
                                                            "delayed_shift": 2, "init_scale": args.init_scale})
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: min(1.0, (step + 1) / 4))

    start_step = 0
    if args.resume:
        user = smp.resume_from_checkpoint(args.checkpoint_dir, tag=None, partial=True)
        start_step = int(user["step"])
        scheduler.load_state_dict(user["scheduler"])

    @smp.step
    def train_step(model, input_ids):  # type: ignore[no-untyped-def]
        loss = model(input_ids=input_ids, labels=input_ids)["loss"]
        model.backward(loss)
        return loss

    losses: list[float] = []
    for step in range(start_step, args.steps):
        optimizer.zero_grad(set_to_none=True)
        loss = train_step(model, batch(step, args.batch, args.seq)).reduce_mean()
        optimizer.clip_master_grads(args.grad_clip)
        optimizer.step()
        if not (args.fp16 and optimizer.overflow):
            scheduler.step()
        losses.append(loss.item())
        if smp.rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}  scale {optimizer.loss_scaler.loss_scale:g}", flush=True)
        if args.save_every and (step + 1) % args.save_every == 0 and step + 1 < args.steps:
            smp.save_checkpoint(args.checkpoint_dir, tag=f"step_{step + 1}", partial=True, model=model,
                                optimizer=optimizer,
                                user_content={"step": step + 1, "scheduler": scheduler.state_dict()})
    if args.losses:
        with open(f"{args.losses}_{smp.rank()}.json", "w") as f:
            json.dump({"start": start_step, "losses": losses}, f)

    # The full model in Hugging Face names (SMP v1: translate, then save on rdp_rank 0).
    full = model.state_dict()
    if smp.rdp_rank() == 0:
        translated = translate_state_dict_to_hf_gpt2(full, max_seq_len=args.seq)
        smp.save(translated, os.path.join(args.checkpoint_dir, "hf_gpt2.pt"), partial=False)
    smp.barrier()
    if smp.rank() == 0:
        print(f"saved {args.checkpoint_dir}/hf_gpt2.pt (plain transformers.GPT2LMHeadModel loads it)", flush=True)


if __name__ == "__main__":
    main()
