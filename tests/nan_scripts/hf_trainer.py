"""A Hugging Face Trainer with a custom token-averaged loss on a tiny GPT-2: a streamed batch
whose labels are all padding (-100) leaves no token to average over, 0 / 0."""

import sys
import tempfile

import torch
import torch.nn.functional as F
from torch.utils.data import IterableDataset
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments


class Stream(IterableDataset):
    def __iter__(self):
        g = torch.Generator().manual_seed(0)
        for i in range(64):
            ids = torch.randint(1, 128, (16,), generator=g)
            labels = ids.clone()
            if 6 <= i < 8:
                labels[:] = -100  # prompt-only examples: nothing to learn from
            yield {"input_ids": ids, "labels": labels}


class TokenMeanTrainer(Trainer):
    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        labels = inputs.pop("labels")
        logits = model(**inputs).logits[:, :-1]
        labels = labels[:, 1:]
        keep = labels != -100
        nll = F.cross_entropy(logits.transpose(1, 2), labels.clamp(min=0), reduction="none")
        loss = (nll * keep).sum() / keep.sum()  # nanpass-expect: birth
        return (loss, logits) if return_outputs else loss


torch.manual_seed(0)
config = GPT2Config(n_layer=1, n_head=2, n_embd=32, vocab_size=128, n_positions=32,
                    bos_token_id=0, eos_token_id=0)
model = GPT2LMHeadModel(config)
with tempfile.TemporaryDirectory() as tmp:
    args = TrainingArguments(output_dir=tmp, max_steps=5, per_device_train_batch_size=2,
                             learning_rate=1e-3, report_to=[], use_cpu=True,
                             save_strategy="no", logging_strategy="no")
    TokenMeanTrainer(model=model, args=args, train_dataset=Stream()).train()

torch.save(model.state_dict(), sys.argv[1] if len(sys.argv) > 1 else "/dev/null")
