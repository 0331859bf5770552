"""``ImageTextCollator`` with a real ``LlavaProcessor`` (word-level tokenizer and CLIP image processor built in code,
``image_text/demo.py``) on the built-in shapes-caption samples (prompts of 2 lengths, captions of 6-7 words):

- one sample per row: the prompt and its 16 image tokens are masked, exactly the caption + eos carry labels, and
  plain ``transformers``' LLaVA on the batch gives the loss of each sample's own rows;
- packed (``pack_to``): fewer rows than samples, and the generic-path LLaVA (``om.AutoModelForImageTextToText``,
  one process) on the packed batch gives the loss and every gradient of plain ``transformers`` on the same samples
  one per row (fp32, 1e-5); negative control: the packed batch without ``position_ids`` / ``cu_seqlens`` is off;
- packing is refused with the reason for a Qwen-VL-style output (M-RoPE).
"""
from __future__ import annotations

import pytest
import torch
import transformers

import oslo_models as om
from oslo_models.image_text.demo import ShapesCaptions, caption_tokenizer, llava_processor, tiny_llava_config

TOL = dict(atol=1e-5, rtol=1e-5)


def _models(tokenizer):
    config = tiny_llava_config(tokenizer)
    torch.manual_seed(0)
    reference = transformers.LlavaForConditionalGeneration(config).eval()
    model = om.AutoModelForImageTextToText.from_config(config).eval()
    model.load_state_dict(reference.state_dict())
    return model, reference


def test_masking_packing_and_parity():
    tokenizer = caption_tokenizer()
    processor = llava_processor(tokenizer=tokenizer)
    samples = [ShapesCaptions(6)[i] for i in range(6)]
    rows = om.data.ImageTextCollator(processor)(samples)
    image = tokenizer.convert_tokens_to_ids("<image>")
    assert rows["input_ids"].shape[0] == 6 and rows["pixel_values"].shape == (6, 3, 28, 28)
    for r, sample in enumerate(samples):
        caption = tokenizer(sample["text"], add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        assert rows["labels"][r][rows["labels"][r] != -100].tolist() == caption
        assert int((rows["input_ids"][r] == image).sum()) == 16
    assert not bool((rows["labels"] == image).any())
    counts = (rows["labels"] != -100).sum(-1)
    assert len(set(counts.tolist())) > 1  # rows with different label counts

    packed = om.data.ImageTextCollator(processor, pack_to=64)(samples)
    assert packed["input_ids"].shape[0] < 6 and int((packed["labels"] != -100).sum()) == int(counts.sum())
    model, reference = _models(tokenizer)
    expected = reference(**rows).loss
    expected.backward()
    got = model(**packed).loss
    got.backward()
    torch.testing.assert_close(got, expected, **TOL)
    ref_params = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, ref_params[name].grad, msg=lambda m, n=name: f"{n}: {m}", **TOL)
    with torch.no_grad():  # negative control: without the packing marks the samples attend to each other
        unmarked = {k: v for k, v in packed.items() if k not in ("position_ids", "cu_seqlens")}
        assert abs(float(model(**unmarked).loss) - float(expected)) > 1e-4


def test_packing_refused_for_mrope():
    class Qwenish:  # what a Qwen-VL processor returns next to the tokens
        tokenizer = caption_tokenizer()
        image_token = "<image>"

        def __call__(self, images, text, return_tensors):
            ids = self.tokenizer(text, return_tensors="pt")
            return {**ids, "pixel_values": torch.zeros(4, 24), "image_grid_thw": torch.tensor([[1, 2, 2]]),
                    "mm_token_type_ids": torch.zeros_like(ids["input_ids"])}

    samples = [ShapesCaptions(2)[i] for i in range(2)]
    batch = om.data.ImageTextCollator(Qwenish())(samples)  # one per row: fine, grids concatenated
    assert batch["image_grid_thw"].shape == (2, 3) and batch["mm_token_type_ids"].shape == batch["input_ids"].shape
    with pytest.raises(NotImplementedError, match="M-RoPE"):
        om.data.ImageTextCollator(Qwenish(), pack_to=64)(samples)
