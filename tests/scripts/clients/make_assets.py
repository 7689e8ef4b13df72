"""Builds the tiny local "pretrained" folders and data sets the client scripts train on.

Nothing is downloaded: every model is built from a config in code (seeded) and written with
``save_pretrained``, every tokenizer is built from a vocabulary written here, every image is
drawn with numpy and saved with PIL. ``--what`` picks the assets (comma-separated):

- ``unconditional``: ``unet_config.json`` (a ``UNet2DModel`` of 3 channels, 8x8, with an
  attention block like the upstream default's) and ``images/`` (12 PNGs of 10x8 pixels: the
  script's ``Resize(8)`` keeps them 10x8 and its random crop draws a column offset);
- ``sd``: ``sd/``, a ``StableDiffusionPipeline`` folder (``model_index.json``,
  ``scheduler/``, ``tokenizer/`` (a ``CLIPTokenizer`` over letters), ``text_encoder/``
  (``CLIPTextModel``, hidden size 8), ``vae/`` (``AutoencoderKL``, 4 blocks: 32x32 images to
  4x4 latents, the factor 8 of Stable Diffusion's, which ``ControlNetModel.from_unet`` assumes),
  ``unet/`` (``UNet2DConditionModel``, cross-attention dim 8)); ``captioned/`` (12 PNGs of 36x32
  and a ``metadata.jsonl`` with a ``text`` column: an ``imagefolder``); ``instance/`` (the same
  images, no metadata: DreamBooth's instance folder); ``conditioned/data/train.parquet`` (image, text,
  conditioning_image of 32x32: the layout ``train_controlnet.py`` loads with ``load_dataset(dir)``);
- ``clm``: ``gpt2/`` (a 2-layer ``GPT2LMHeadModel``, dropout 0.1, and a word-level
  ``PreTrainedTokenizerFast``), ``train.txt`` / ``validation.txt`` (16 and 4 lines of 8 words:
  16 and 4 blocks of 8 tokens once grouped);
- ``mrpc``: ``bert/`` (a 2-layer ``BertForSequenceClassification``, dropout 0.1, and a word-level
  tokenizer with BERT's special tokens), ``mrpc/train.jsonl`` / ``validation.jsonl`` (the
  columns of GLUE MRPC: sentence1, sentence2, label, idx).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import string

import numpy as np
import torch
from PIL import Image

N_IMAGES = 12
WORDS = [f"w{i}" for i in range(40)]


def _images(folder: str, size: tuple[int, int], seed: int, metadata: bool) -> list[Image.Image]:
    """``N_IMAGES`` RGB images of ``size`` (width, height): smooth colour gradients plus noise."""
    os.makedirs(folder, exist_ok=True)
    rng = np.random.default_rng(seed)
    images, rows = [], []
    w, h = size
    for i in range(N_IMAGES):
        base = rng.integers(0, 256, size=3)
        ramp = np.linspace(0, 1, w)[None, :, None] * rng.integers(-80, 80, size=3)
        noise = rng.integers(-20, 20, size=(h, w, 3))
        pixels = np.clip(base + ramp + noise, 0, 255).astype(np.uint8)
        image = Image.fromarray(pixels, "RGB")
        name = f"{i:02d}.png"
        image.save(os.path.join(folder, name))
        images.append(image)
        colour = ["red", "green", "blue", "grey"][i % 4]
        rows.append({"file_name": name, "text": f"a {colour} picture number {i}"})
    if metadata:
        with open(os.path.join(folder, "metadata.jsonl"), "w", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps(row) + "\n")
    return images


def unconditional(out: str) -> None:
    from diffusers import UNet2DModel

    config = dict(
        sample_size=8, in_channels=3, out_channels=3, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("DownBlock2D", "AttnDownBlock2D"), up_block_types=("AttnUpBlock2D", "UpBlock2D"),
        norm_num_groups=4, attention_head_dim=4,
    )
    with open(os.path.join(out, "unet_config.json"), "w", encoding="utf-8") as f:
        f.write(UNet2DModel(**config).to_json_string())
    _images(os.path.join(out, "images"), (10, 8), seed=1, metadata=False)


def clip_tokenizer():
    """A ``CLIPTokenizer`` whose vocabulary is the letters and digits (with and without ``</w>``)."""
    from transformers import CLIPTokenizer

    vocab = {"<|startoftext|>": 0, "<|endoftext|>": 1}
    for ch in string.ascii_lowercase + string.digits:
        vocab[ch] = len(vocab)
        vocab[ch + "</w>"] = len(vocab)
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=8)


def sd(out: str) -> None:
    import datasets
    from diffusers import AutoencoderKL, DDPMScheduler, StableDiffusionPipeline, UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    tokenizer = clip_tokenizer()
    torch.manual_seed(0)
    text_encoder = CLIPTextModel(CLIPTextConfig(
        vocab_size=len(tokenizer), hidden_size=8, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2,
        max_position_embeddings=8, projection_dim=8, bos_token_id=0, eos_token_id=1, pad_token_id=1,
    ))
    vae = AutoencoderKL(
        in_channels=3, out_channels=3, latent_channels=4, block_out_channels=(8, 8, 8, 8), layers_per_block=1,
        down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
        norm_num_groups=4, sample_size=32,
    )
    unet = UNet2DConditionModel(
        sample_size=4, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(8, 16),
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=8, attention_head_dim=2, norm_num_groups=4,
    )
    pipeline = StableDiffusionPipeline(
        vae=vae, text_encoder=text_encoder, tokenizer=tokenizer, unet=unet, scheduler=DDPMScheduler(),
        safety_checker=None, feature_extractor=None, requires_safety_checker=False,
    )
    pipeline.save_pretrained(os.path.join(out, "sd"))
    images = _images(os.path.join(out, "captioned"), (36, 32), seed=2, metadata=True)
    _images(os.path.join(out, "instance"), (36, 32), seed=2, metadata=False)
    conditions = _images(os.path.join(out, "conditioned", "png"), (32, 32), seed=3, metadata=False)
    features = datasets.Features(
        {"image": datasets.Image(), "text": datasets.Value("string"), "conditioning_image": datasets.Image()}
    )
    table = datasets.Dataset.from_dict(
        {"image": images, "text": [f"a shape number {i}" for i in range(N_IMAGES)], "conditioning_image": conditions},
        features=features,
    )
    os.makedirs(os.path.join(out, "conditioned", "data"), exist_ok=True)
    table.to_parquet(os.path.join(out, "conditioned", "data", "train.parquet"))
    shutil.rmtree(os.path.join(out, "conditioned", "png"))


def word_tokenizer(specials: list[str], **kwargs):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(specials + WORDS)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token=kwargs["unk_token"]))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, **kwargs)


def _sentences(rng: np.random.Generator, n: int, low: int, high: int) -> list[str]:
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(low, high)))) for _ in range(n)]


def clm(out: str) -> None:
    from transformers import GPT2Config, GPT2LMHeadModel

    tokenizer = word_tokenizer(["<|endoftext|>"], unk_token="<|endoftext|>", bos_token="<|endoftext|>",
                               eos_token="<|endoftext|>", model_max_length=8)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(GPT2Config(n_layer=2, n_embd=16, n_head=2, n_positions=8, vocab_size=len(tokenizer),
                                       bos_token_id=0, eos_token_id=0))
    model.save_pretrained(os.path.join(out, "gpt2"))
    tokenizer.save_pretrained(os.path.join(out, "gpt2"))
    rng = np.random.default_rng(4)
    for name, n in (("train", 16), ("validation", 4)):  # lines of 8 words: 16 and 4 blocks of 8 tokens
        with open(os.path.join(out, f"{name}.txt"), "w", encoding="utf-8") as f:
            f.write("\n".join(_sentences(rng, n, 8, 9)) + "\n")


def mrpc(out: str) -> None:
    from transformers import BertConfig, BertForSequenceClassification

    tokenizer = word_tokenizer(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]"], unk_token="[UNK]", pad_token="[PAD]",
                               cls_token="[CLS]", sep_token="[SEP]", mask_token="[MASK]", model_max_length=32)
    from tokenizers import processors

    tokenizer.backend_tokenizer.post_processor = processors.TemplateProcessing(
        single="[CLS] $A [SEP]", pair="[CLS] $A [SEP] $B:1 [SEP]:1", special_tokens=[("[CLS]", 2), ("[SEP]", 3)]
    )
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(
        vocab_size=len(tokenizer), hidden_size=16, num_hidden_layers=2, num_attention_heads=2, intermediate_size=32,
        max_position_embeddings=32, num_labels=2,
    ))
    model.save_pretrained(os.path.join(out, "bert"))
    tokenizer.save_pretrained(os.path.join(out, "bert"))
    rng = np.random.default_rng(5)
    os.makedirs(os.path.join(out, "mrpc"), exist_ok=True)
    for name, n in (("train", 24), ("validation", 8)):
        with open(os.path.join(out, "mrpc", f"{name}.jsonl"), "w", encoding="utf-8") as f:
            for i, (a, b) in enumerate(zip(_sentences(rng, n, 2, 7), _sentences(rng, n, 2, 7))):
                f.write(json.dumps({"sentence1": a, "sentence2": b, "label": int(rng.integers(0, 2)), "idx": i}) + "\n")


BUILDERS = {"unconditional": unconditional, "sd": sd, "clm": clm, "mrpc": mrpc}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", required=True)
    parser.add_argument("--what", default=",".join(BUILDERS))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    for name in args.what.split(","):
        BUILDERS[name](args.out)


if __name__ == "__main__":
    main()
