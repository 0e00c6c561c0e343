"""The Hugging Face Trainer's SMP path (transformers 4.2x, ``is_sagemaker_mp_enabled()``), as a script.

transformers 5 removed SMP support from its Trainer, so this script carries the Trainer's SMP code
paths itself, in their shapes: ``smp.init()`` configured by ``SM_HP_MP_PARAMETERS``; the data
sharded by ``smp.dp_rank()`` over ``smp.dp_size()`` replicas; ``smp.DistributedModel(model,
backward_passes_per_step=gradient_accumulation_steps)``; ``smp.DistributedOptimizer``;
``smp_forward_backward`` (an ``@smp.step()`` taking the inputs dict, dividing the loss by the
accumulation steps, ``model.backward``), ``smp_forward_only``, ``smp_gather``
(``smp.allgather(..., smp.CommGroup.DP_GROUP)``) and ``smp_nested_concat`` (``StepOutput.concat()``)
for evaluation; saving with ``model_wrapped.state_dict()`` on every process, ``torch.save`` on
``smp.rank() == 0``, ``optimizer.local_state_dict(gather_if_shard=False)`` + ``smp.barrier()`` +
``smp.save(..., partial=True, v3=smp.state.cfg.shard_optimizer_state)`` on ``rdp_rank() == 0``
and an empty ``user_content.pt``; resuming with ``smp.resume_from_checkpoint(path, tag=WEIGHTS_NAME,
partial=False, load_optimizer=False)`` and the optimizer loaded in a post-step hook from
``smp.load(..., partial=True)``.
"""

import argparse
import json
import os
from pathlib import Path

import smp.torch as smp  # was: import smdistributed.modelparallel.torch as smp
import torch
import transformers

WEIGHTS_NAME, OPTIMIZER_NAME, SCHEDULER_NAME, TRAINER_STATE_NAME = (
    "pytorch_model.bin", "optimizer.pt", "scheduler.pt", "trainer_state.json")


# --- transformers.trainer_pt_utils (SMP part) ---------------------------------------------------

@smp.step()
def smp_forward_backward(model, inputs, gradient_accumulation_steps=1):
    outputs = model(**inputs)
    loss = outputs["loss"] if isinstance(outputs, dict) else outputs[0]
    loss /= gradient_accumulation_steps
    model.backward(loss)
    return loss


@smp.step()
def smp_forward_only(model, inputs):
    return model(**inputs)


def smp_gather(tensor):
    if isinstance(tensor, (list, tuple)):
        return type(tensor)(smp_gather(t) for t in tensor)
    elif isinstance(tensor, dict):
        return type(tensor)({k: smp_gather(v) for k, v in tensor.items()})
    elif not isinstance(tensor, torch.Tensor):
        raise TypeError(f"Can't gather the values of type {type(tensor)}, only of nested list/tuple/dicts of tensors.")
    all_tensors = smp.allgather(tensor, smp.CommGroup.DP_GROUP)
    all_tensors = [t if len(t.shape) > 0 else t[None] for t in all_tensors]
    return torch.cat([t.cpu() for t in all_tensors], dim=0)


def smp_nested_concat(tensor):
    if isinstance(tensor, (list, tuple)):
        return type(tensor)(smp_nested_concat(t) for t in tensor)
    elif isinstance(tensor, dict):
        return type(tensor)({k: smp_nested_concat(v) for k, v in tensor.items()})
    # It doesn't seem possible to check here if `tensor` is a StepOutput because StepOutput lives in `smp.step`
    # which is also the name of the decorator so Python is confused.
    return tensor.concat().detach().cpu()


# --- transformers.Trainer (SMP part) --------------------------------------------------------------

class Trainer:
    def __init__(self, model, args, train_dataset, eval_dataset):
        self.model, self.args = model, args
        self.train_dataset, self.eval_dataset = train_dataset, eval_dataset
        self.model_wrapped = self._wrap_model(model)
        self.optimizer = self.lr_scheduler = None
        self.global_step = 0
        self.losses = []

    @property
    def should_save(self):
        return smp.rank() == 0

    def _wrap_model(self, model):
        if isinstance(model, smp.model.DistributedModel):
            return model
        return smp.DistributedModel(model, backward_passes_per_step=self.args.gradient_accumulation_steps)

    def create_optimizer_and_scheduler(self, num_training_steps):
        decay = [p for n, p in self.model_wrapped.named_parameters() if "bias" not in n and "norm" not in n]
        no_decay = [p for n, p in self.model_wrapped.named_parameters() if "bias" in n or "norm" in n]
        self.optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": 0.01},
                                            {"params": no_decay, "weight_decay": 0.0}], lr=self.args.learning_rate)
        self.optimizer = smp.DistributedOptimizer(self.optimizer)
        self.lr_scheduler = transformers.get_linear_schedule_with_warmup(self.optimizer, 2, num_training_steps)

    def get_train_batches(self):
        """What the Trainer's DistributedSampler gives this process: world_size = smp.dp_size(),
        process_index = smp.dp_rank() (prescaled_batch off); no shuffle."""
        world_size, process_index = smp.dp_size(), smp.dp_rank()
        ids = self.train_dataset[process_index::world_size]
        size = self.args.per_device_train_batch_size
        return [ids[i:i + size] for i in range(0, len(ids) - size + 1, size)]

    def training_step(self, model, inputs):
        model.train()
        loss_mb = smp_forward_backward(model, inputs, self.args.gradient_accumulation_steps)
        return loss_mb.reduce_mean().detach()

    def train(self, resume_from_checkpoint=None):
        batches = self.get_train_batches()
        num_steps = len(batches) // self.args.gradient_accumulation_steps * self.args.num_train_epochs
        self.create_optimizer_and_scheduler(num_steps)
        if resume_from_checkpoint is not None:
            self._load_from_checkpoint(resume_from_checkpoint)
            self._load_optimizer_and_scheduler(resume_from_checkpoint)
        model = self.model_wrapped
        steps_trained = self.global_step
        accumulated = 0.0
        for epoch in range(self.args.num_train_epochs):
            for step, ids in enumerate(batches):
                at = epoch * len(batches) + step
                if at < steps_trained * self.args.gradient_accumulation_steps:
                    continue  # skipped: already trained before the checkpoint
                inputs = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
                accumulated += self.training_step(model, inputs).item()
                if (step + 1) % self.args.gradient_accumulation_steps == 0:
                    self.optimizer.step()
                    self.lr_scheduler.step()
                    self.optimizer.zero_grad()
                    self.global_step += 1
                    self.losses.append(accumulated)
                    accumulated = 0.0
                    if self.args.save_steps and self.global_step % self.args.save_steps == 0:
                        self._save_checkpoint()
        return self.losses

    def evaluate(self):
        model = self.model_wrapped
        model.eval()
        ids = self.eval_dataset[smp.dp_rank()::smp.dp_size()]
        with torch.no_grad():
            raw_outputs = smp_forward_only(model, {"input_ids": ids, "labels": ids})
        loss_mb = raw_outputs["loss"]
        logits_mb = tuple(v for k, v in raw_outputs.items() if k not in ["loss", "past_key_values"])
        loss = loss_mb.reduce_mean().detach().cpu()
        logits = smp_nested_concat(logits_mb)
        all_losses = smp_gather(loss)
        all_logits = smp_gather(logits)
        return {"eval_loss": all_losses.mean().item(), "logits_rows": all_logits[0].shape[0]}

    def _save_checkpoint(self):
        output_dir = os.path.join(self.args.output_dir, f"checkpoint-{self.global_step}")
        self.save_model(output_dir)
        opt_state_dict = self.optimizer.local_state_dict(gather_if_shard=False)
        smp.barrier()
        if smp.rdp_rank() == 0 or smp.state.cfg.shard_optimizer_state:
            smp.save(opt_state_dict, os.path.join(output_dir, OPTIMIZER_NAME), partial=True,
                     v3=smp.state.cfg.shard_optimizer_state)
        if self.should_save:
            torch.save(self.lr_scheduler.state_dict(), os.path.join(output_dir, SCHEDULER_NAME))
            with open(os.path.join(output_dir, TRAINER_STATE_NAME), "w") as f:
                json.dump({"global_step": self.global_step}, f)
        smp.barrier()

    def save_model(self, output_dir):
        os.makedirs(output_dir, exist_ok=True)
        state_dict = self.model_wrapped.state_dict()  # on all processes
        if self.should_save:
            torch.save(state_dict, os.path.join(output_dir, WEIGHTS_NAME))
            Path(os.path.join(output_dir, "user_content.pt")).touch()  # saved with smp >= 1.10

    def _load_from_checkpoint(self, resume_from_checkpoint):
        if os.path.isfile(os.path.join(resume_from_checkpoint, "user_content.pt")):
            smp.resume_from_checkpoint(path=resume_from_checkpoint, tag=WEIGHTS_NAME, partial=False,
                                       load_optimizer=False)
        else:
            state_dict = torch.load(os.path.join(resume_from_checkpoint, WEIGHTS_NAME), map_location="cpu")
            state_dict["_smp_is_partial"] = False
            self.model_wrapped.load_state_dict(state_dict, strict=True)
        with open(os.path.join(resume_from_checkpoint, TRAINER_STATE_NAME)) as f:
            self.global_step = json.load(f)["global_step"]

    def _load_optimizer_and_scheduler(self, checkpoint):
        if os.path.isfile(os.path.join(checkpoint, "user_content.pt")):
            def opt_load_hook(mod, opt):
                opt.load_state_dict(smp.load(os.path.join(checkpoint, OPTIMIZER_NAME), partial=True))
        else:
            def opt_load_hook(mod, opt):
                opt.load_state_dict(smp.load(os.path.join(checkpoint, OPTIMIZER_NAME), partial=True,
                                             back_compat=True))
        self.model_wrapped.register_post_step_hook(opt_load_hook)
        self.lr_scheduler.load_state_dict(torch.load(os.path.join(checkpoint, SCHEDULER_NAME)))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--resume_from_checkpoint", default=None)
    parser.add_argument("--num_train_epochs", type=int, default=1)
    parser.add_argument("--per_device_train_batch_size", type=int, default=4)
    parser.add_argument("--gradient_accumulation_steps", type=int, default=2)
    parser.add_argument("--learning_rate", type=float, default=3e-3)
    parser.add_argument("--save_steps", type=int, default=2)
    parser.add_argument("--samples", type=int, default=64)
    parser.add_argument("--losses", default="")
    args = parser.parse_args()

    smp.init()  # training_args: SMP enabled, the configuration comes from SM_HP_MP_PARAMETERS
    transformers.set_seed(42)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32,
                                      use_cache=False)
    model = transformers.AutoModelForCausalLM.from_config(config)
    g = torch.Generator().manual_seed(0)
    starts = torch.randint(0, 128, (args.samples + 16, 1), generator=g)
    data = (starts + torch.arange(16)) % 128
    trainer = Trainer(model, args, train_dataset=data[:args.samples], eval_dataset=data[args.samples:])
    losses = trainer.train(resume_from_checkpoint=args.resume_from_checkpoint)
    metrics = trainer.evaluate()
    if smp.rank() == 0:
        print(f"losses {losses} eval {metrics}")
    if args.losses:
        with open(f"{args.losses}_{smp.rank()}.json", "w") as f:
            json.dump({"dp_rank": smp.dp_rank(), "losses": losses, "eval": metrics,
                       "global_step": trainer.global_step}, f)


if __name__ == "__main__":
    main()
