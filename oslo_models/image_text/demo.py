"""A small image-caption task built in code, for the example, tests and benchmarks: no download.

- :class:`ShapesCaptions`: sample ``i`` is a ``size x size`` RGB image of a coloured shape (square, disc, bar,
  cross) on a coloured background, drawn from ``i`` (deterministic), with a prompt and the caption that describes it
  (``"a red disc on blue"``). Lengths vary: some prompts are longer, and some captions add the shape's size.
- :func:`caption_tokenizer`: a word-level ``transformers`` tokenizer over the task's words, with ``<pad>`` (0),
  ``<s>`` (1), ``</s>`` (2) and the image placeholder ``<image>`` as special tokens.
- :func:`llava_processor`: ``transformers``' ``LlavaProcessor`` around it and a CLIP image processor of ``size``
  pixels (the processor expands ``<image>`` to ``(size / patch) ** 2`` image tokens), and :func:`tiny_llava_config`,
  a LLaVA config that matches it.
"""
from __future__ import annotations

import numpy as np

COLOURS = {"red": (220, 30, 30), "green": (30, 180, 60), "blue": (40, 60, 220), "yellow": (230, 210, 40),
           "white": (245, 245, 245), "black": (10, 10, 10)}
SHAPES = ("square", "disc", "bar", "cross")
PROMPTS = ("<image> describe:", "<image> what is shown in this picture ? answer:")
_WORDS = ("a", "on", "small", "large", "describe", ":", "what", "is", "shown", "in", "this", "picture", "?",
          "answer", *COLOURS, *SHAPES)
SPECIAL = ("<pad>", "<s>", "</s>", "<image>")


def caption_tokenizer():
    """A word-level fast tokenizer over this task's words (ids: the specials first, then the words)."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers, processors

    vocab = {word: index for index, word in enumerate((*SPECIAL, "<unk>", *_WORDS))}
    core = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    return transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<s>",
                                                eos_token="</s>", unk_token="<unk>",
                                                extra_special_tokens={"image_token": "<image>"})


def llava_processor(size: int = 28, patch: int = 7, tokenizer=None):
    """``LlavaProcessor`` (CLIP image processor at ``size`` pixels, no crop change, CLS dropped)."""
    import transformers

    image_processor = transformers.CLIPImageProcessor(size={"shortest_edge": size},
                                                      crop_size={"height": size, "width": size})
    return transformers.LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer or caption_tokenizer(),
                                       patch_size=patch, vision_feature_select_strategy="default",
                                       image_token="<image>", num_additional_image_tokens=1)


def tiny_llava_config(tokenizer, size: int = 28, patch: int = 7, hidden: int = 64, layers: int = 2):
    """A LLaVA config (CLIP tower of hidden 32, Llama decoder of ``hidden``) matching :func:`llava_processor`."""
    import transformers

    text = transformers.LlamaConfig(vocab_size=len(tokenizer), hidden_size=hidden, intermediate_size=2 * hidden,
                                    num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=2,
                                    max_position_embeddings=256, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    vision = dict(model_type="clip_vision_model", hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                  num_attention_heads=4, image_size=size, patch_size=patch, projection_dim=32)
    return transformers.LlavaConfig(text_config=text.to_dict(), vision_config=vision,
                                    image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
                                    vision_feature_layer=-1, pad_token_id=0)


class ShapesCaptions:
    """``num_samples`` image-caption samples ``{"image", "prompt", "text"}`` (module docstring); ``offset`` starts
    the sample ids elsewhere (a held-out split)."""

    def __init__(self, num_samples: int, size: int = 28, offset: int = 0):
        self.num_samples, self.size, self.offset = num_samples, size, offset

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict:
        from PIL import Image

        rng = np.random.default_rng(self.offset + index)
        names = list(COLOURS)
        fg, bg = rng.choice(len(names), 2, replace=False)
        shape = SHAPES[int(rng.integers(len(SHAPES)))]
        large = bool(rng.integers(2))
        image = np.empty((self.size, self.size, 3), dtype=np.uint8)
        image[:] = COLOURS[names[bg]]
        half = self.size // (3 if large else 5)
        c = self.size // 2
        yy, xx = np.mgrid[:self.size, :self.size]
        mask = {"square": (abs(yy - c) <= half) & (abs(xx - c) <= half),
                "disc": (yy - c) ** 2 + (xx - c) ** 2 <= half ** 2,
                "bar": (abs(yy - c) <= half // 2) & (abs(xx - c) <= half * 2),
                "cross": ((abs(yy - c) <= half // 3) | (abs(xx - c) <= half // 3)) & (abs(yy - c) <= half)
                & (abs(xx - c) <= half)}[shape]
        image[mask] = COLOURS[names[fg]]
        size_word = ["large"] if large and index % 2 else ["small"] if index % 2 else []
        caption = " ".join(["a", *size_word, names[fg], shape, "on", names[bg]])
        return {"image": Image.fromarray(image), "prompt": PROMPTS[index % len(PROMPTS)], "text": caption}
