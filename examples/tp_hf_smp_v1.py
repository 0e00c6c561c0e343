"""An SMP v1 tensor-parallel script for a Hugging Face model, running on smp (only the import changed).

    torchrun --nproc-per-node 4 examples/tp_hf_smp_v1.py --model llama --steps 20

Config as SMP v1 users write it: tensor_parallel_degree 2, pipeline_parallel_degree 2, ddp, and the
default ``prescaled_batch: False`` (each rank loads its own batch by ``smp.dp_rank()``; the TP group
runs on the combined batch). The model is marked with ``smp.tensor_parallelism()`` around its
construction, partitioned automatically, trained with ``@smp.step``, evaluated, checkpointed with
``smp.save_checkpoint`` and exported with ``model.save_pretrained`` (loadable by plain transformers).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp
import torch
import transformers

CONFIGS = {
    "llama": lambda v: transformers.LlamaConfig(vocab_size=v, hidden_size=64, intermediate_size=128,
                                                num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2),
    "mistral": lambda v: transformers.MistralConfig(vocab_size=v, hidden_size=64, intermediate_size=128,
                                                    num_hidden_layers=4, num_attention_heads=4,
                                                    num_key_value_heads=2),
    "gpt_neox": lambda v: transformers.GPTNeoXConfig(vocab_size=v, hidden_size=64, intermediate_size=128,
                                                     num_hidden_layers=4, num_attention_heads=4),
    "gpt2": lambda v: transformers.GPT2Config(vocab_size=v, n_embd=64, n_layer=4, n_head=4, n_positions=64,
                                              bos_token_id=0, eos_token_id=0),
    "mixtral": lambda v: transformers.MixtralConfig(vocab_size=v, hidden_size=64, intermediate_size=64,
                                                    num_hidden_layers=2, num_attention_heads=4,
                                                    num_key_value_heads=2, num_local_experts=4),
}


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--model", default="llama", choices=sorted(CONFIGS))
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch", type=int, default=4, help="per-rank batch (sequences)")
    parser.add_argument("--seq", type=int, default=32)
    parser.add_argument("--out", default="tp-output")
    parser.add_argument("--losses", default="", help="write each rank's per-step losses to LOSSES_<rank>.json")
    args = parser.parse_args()

    smp.init({"tensor_parallel_degree": 2, "pipeline_parallel_degree": int(os.environ.get("PP", "2")),
              "microbatches": 2, "ddp": True, "auto_partition": True, "placement_strategy": "cluster"})
    torch.manual_seed(1234)
    vocab = 256
    with smp.tensor_parallelism():
        model = transformers.AutoModelForCausalLM.from_config(CONFIGS[args.model](vocab))
    model = smp.DistributedModel(model)
    optimizer = smp.DistributedOptimizer(torch.optim.AdamW(model.parameters(), lr=3e-3))

    @smp.step
    def train_step(model, input_ids):  # type: ignore[no-untyped-def]
        loss = model(input_ids=input_ids, labels=input_ids)["loss"]
        model.backward(loss)
        return loss

    @smp.step
    def eval_step(model, input_ids):  # type: ignore[no-untyped-def]
        logits = model(input_ids=input_ids).logits
        return (logits[:, :-1].argmax(-1) == input_ids[:, 1:]).float().mean()

    # A learnable toy language: every sequence counts up from a random start.
    g = torch.Generator().manual_seed(smp.dp_rank())
    start = time.perf_counter()
    losses: list[float] = []
    for step in range(args.steps):
        begin = torch.randint(0, vocab, (args.batch, 1), generator=g)
        ids = (begin + torch.arange(args.seq)) % vocab
        optimizer.zero_grad()
        loss = train_step(model, ids).reduce_mean()
        optimizer.step()
        losses.append(loss.item())
        if smp.rank() == 0 and (step % 5 == 0 or step == args.steps - 1):
            print(f"step {step:3d}  loss {loss.item():.4f}", flush=True)
    if args.losses:
        with open(f"{args.losses}_{smp.rank()}.json", "w") as f:
            json.dump({"dp_rank": smp.dp_rank(), "tp_rank": smp.tp_rank(), "losses": losses}, f)
    accuracy = eval_step(model, ids).reduce_mean()
    if smp.rank() == 0:
        print(f"next-token accuracy {accuracy.item():.3f}  ({time.perf_counter() - start:.1f} s)", flush=True)
    smp.save_checkpoint(os.path.join(args.out, "checkpoint"), tag="final", partial=True, model=model,
                        optimizer=optimizer)
    model.save_pretrained(os.path.join(args.out, "hf"))
    if smp.rank() == 0:
        print(f"saved {args.out}/checkpoint and {args.out}/hf (plain transformers loads it)", flush=True)


if __name__ == "__main__":
    main()
