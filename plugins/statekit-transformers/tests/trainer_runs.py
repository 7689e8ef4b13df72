"""Trainer runs for the tests, built as Trainer users build them: a small GPT-2 from a
config (no Hub download), a word-level tokenizer built in code, a shuffled dataset, a
masked-language-modelling collator that draws random masks, dropout, warm-up + cosine.

:func:`run` trains a fresh ``StatekitTrainer`` (or ``Trainer``) and returns what the tests
compare: the loss of every micro-batch, bit for bit, and the final weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

import torch

VOCAB = ["[PAD]", "[UNK]", "[MASK]"] + [f"w{i}" for i in range(61)]


def tokenizer():
    """A ``PreTrainedTokenizerFast`` over :data:`VOCAB` (word level, whitespace split)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(VOCAB)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", mask_token="[MASK]", unk_token="[UNK]")


def gpt2(seed: int = 0, frozen_embedding: bool = False):
    """A 2-layer GPT-2 (its ``lm_head`` tied to ``wte``), dropout 0.1 everywhere."""
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=len(VOCAB), n_positions=16)
    model = GPT2LMHeadModel(config)
    if frozen_embedding:
        model.transformer.wte.weight.requires_grad_(False)
    return model


class Sentences(torch.utils.data.Dataset):
    """``n`` fixed sentences of 12 tokens, tokenized (a map-style dataset)."""

    def __init__(self, n: int = 40, seed: int = 1) -> None:
        g = torch.Generator().manual_seed(seed)
        tok = tokenizer()
        words = torch.randint(3, len(VOCAB), (n, 12), generator=g)
        self.items = [tok(" ".join(VOCAB[int(w)] for w in row)) for row in words]

    def __len__(self) -> int:
        return len(self.items)

    def __getitem__(self, i: int) -> dict[str, Any]:
        return dict(self.items[i])


@dataclass
class Result:
    losses: list[tuple[int, float]] = field(default_factory=list)  # (global step, micro-batch loss), exact
    weights: dict[str, torch.Tensor] = field(default_factory=dict)
    trainer: Any = None


class Stop(Exception):
    """Raised by :func:`stopper` to kill a run at a step (after its save, like a crash)."""


def stopper(at_step: int):
    from transformers import TrainerCallback

    class _Stop(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step == at_step:
                raise Stop(at_step)

    return _Stop()


def arguments(output_dir: str, **overrides: Any):
    from transformers import TrainingArguments

    kw = dict(
        output_dir=output_dir, per_device_train_batch_size=4, gradient_accumulation_steps=2, num_train_epochs=3,
        learning_rate=5e-3, lr_scheduler_type="cosine", warmup_steps=3, save_strategy="steps", save_steps=3,
        logging_steps=1, report_to=[], seed=7, use_cpu=True, disable_tqdm=True, dataloader_num_workers=0,
    )
    kw.update(overrides)
    return TrainingArguments(**kw)


def run(output_dir: str, *, resume: Any = None, stop_at: int | None = None, plain: bool = False,
        model: Any = None, trainer_cls: Any = None, statekit_options: dict | None = None, dataset: Any = None,
        eval_dataset: Any = None, callbacks: list | None = None, **overrides: Any) -> Result:
    """Train (or resume) a fresh trainer; see the module docstring."""
    from transformers import DataCollatorForLanguageModeling, Trainer

    from statekit_transformers import StatekitTrainer

    result = Result()
    base = trainer_cls or (Trainer if plain else StatekitTrainer)

    class Recording(base):  # a user's subclass: records every micro-batch's loss exactly
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            result.losses.append((self.state.global_step, float(loss.detach())))
            return loss

    tok = tokenizer()
    kwargs: dict[str, Any] = dict(
        model=model if model is not None else gpt2(), args=arguments(output_dir, **overrides),
        train_dataset=dataset if dataset is not None else Sentences(), eval_dataset=eval_dataset,
        data_collator=DataCollatorForLanguageModeling(tok, mlm=True, mlm_probability=0.3), processing_class=tok,
        callbacks=(callbacks or []) + ([stopper(stop_at)] if stop_at is not None else []),
    )
    if not plain:
        kwargs["statekit_options"] = statekit_options
    trainer = Recording(**kwargs)
    result.trainer = trainer
    try:
        trainer.train(resume_from_checkpoint=resume)
    except Stop:
        pass
    result.weights = {k: v.detach().clone() for k, v in trainer.model.state_dict().items()}
    return result


def trainer_state(path: str) -> dict[str, Any]:
    with open(f"{path}/trainer_state.json", encoding="utf-8") as f:
        return json.load(f)
