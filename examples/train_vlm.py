"""Fine-tune an image-text model (LLaVA, LLaVA-NeXT, Gemma 3, Qwen2.5-VL, Qwen3-VL, Mistral 3, Idefics3 / SmolVLM,
any type ``transformers``' ``AutoModelForImageTextToText`` builds) with tensor, pipeline or context parallelism,
ZeRO over data parallelism and Accelerate, on image-caption pairs.

    torchrun --nproc_per_node 2 examples/train_vlm.py --tp 2                 # a tiny LLaVA on the built-in set
    torchrun --nproc_per_node 4 examples/train_vlm.py --tp 2 --zero 3 --freeze-vision
    torchrun --nproc_per_node 8 examples/train_vlm.py --model path/to/vlm --tp 2 --zero 3   # its own processor
    torchrun --nproc_per_node 4 examples/train_vlm.py --pp 2 --zero 1    # vision tower on the first stage
    torchrun --nproc_per_node 4 examples/train_vlm.py --cp 2 --zero 3    # merged sequence split over 2 ranks
    ... examples/train_vlm.py --pack --seq-len 128 --batch-size 8   # several samples packed per row (LLaVA-style)
    ACCELERATE_USE_CPU=1 accelerate launch --num_processes 2 examples/train_vlm.py --tp 2   # same script

The options are ``train_clm.py``'s (``--tp``, ``--zero``, ``--steps``, ``--lr``, ``--batch-size``, ``--grad-accum``,
``--output``, ``--resume``, ``--eval-every``, ``--report-to``, ``--push-to-hub``, ...), plus ``--freeze-vision``
and ``--pack``. ``--model`` takes a folder (or Hub id) with an image-text model and its processor; without it a
tiny LLaVA (a CLIP tower, a Llama decoder of ``--n-embd`` / ``--n-layer``) is built from config with a word-level
tokenizer and a 28x28 CLIP image processor made here (``oslo_models.image_text.demo``). The data is the built-in
shapes-caption set: each sample's image (a coloured shape on a coloured background) is drawn on the fly from its
index, with a prompt and the caption that describes it (nothing downloaded; ``--eval-samples`` held-out samples
from another index range are evaluated at ``--eval-every`` and at the end). Batches come from
``om.data.ImageTextCollator`` (the processor expands the image tokens; prompt and image tokens are masked from the
loss; ``--pack``: samples packed first-fit into rows of ``--seq-len`` tokens).

Writes to ``--output``: ``checkpoint/`` (resumable), ``loss.json`` and ``model/``, a Hub folder (model + processor)
that plain ``transformers`` opens; at the end rank 0 captions a held-out image with it (``generate`` with pixel
values).

``--pp``: the language model's layers in stages, the vision tower and projector on the first
(``oslo_models/image_text/pipeline.py``; steps and evaluations run ``train_step`` / ``eval_step``). ``--cp``: each cp
rank merges its rows' whole images, the merged sequence is split after the merge
(``oslo_models/image_text/context_parallel.py``; the collator pads rows to a length the layout splits and keeps the
rank's chunk of the labels). Refused with one clear error before anything starts: ``--pp`` with ``--cp``, ``--pack``
with ``--pp`` or ``--cp``, and what ``AutoModelForImageTextToText`` refuses.
"""
from __future__ import annotations

import math
import os

import torch
import transformers

import oslo_models as om
from _common import UsageError, build_parser, check_launch, export, finish, fit, make_accelerator, run
from _common import parse_args as _parse_args
from oslo_models.image_text.context_parallel import ContextParallelCollate
from oslo_models.image_text.demo import ShapesCaptions, llava_processor, tiny_llava_config


def make_parser():
    parser = build_parser(__doc__, output="train_vlm_out", lr=3e-3,
                          model_help="folder or Hub id of an image-text model with its processor; default: a tiny "
                                     "LLaVA built from config")
    parser.add_argument("--freeze-vision", action="store_true",
                        help="train the language model only: the vision tower and projector keep their weights "
                             "(no gradients, no optimizer state)")
    parser.add_argument("--pack", action="store_true",
                        help="pack samples first-fit into rows of --seq-len tokens (per-sample attention); "
                             "--batch-size counts samples")
    parser.add_argument("--train-samples", type=int, default=0,
                        help="size of the built-in training set (0: steps x global batch, every sample new)")
    parser.set_defaults(eval_samples=16)
    return parser


class CaptionEvaluator:
    """Mean held-out loss over ``samples`` built-in samples (split over dp ranks, whole batches only) and its
    perplexity; collective: call on every rank."""

    def __init__(self, collator, samples: int, batch_size: int, context):
        per_step = batch_size * context.dp_size
        usable = max(per_step, samples // per_step * per_step)
        self.dataset = ShapesCaptions(usable, offset=10 ** 6)
        self.collator, self.batch_size, self.context = collator, batch_size, context

    def _loss(self, model, batch) -> torch.Tensor:
        """The batch's mean caption loss: pp, ``eval_step`` (the dp mean, on every rank); cp, each chunk's summed
        token losses over the rows' label count, summed over cp (every cp rank the rows' mean)."""
        context = self.context
        if context.pp_size > 1:
            return model.eval_step(batch)
        if context.cp_size == 1:
            return model(**batch).loss
        count = (batch["shift_labels"] != -100).sum().float()
        torch.distributed.all_reduce(count, group=context.cp_group)
        loss = model(**batch, num_items_in_batch=count.clamp(min=1.0)).loss.detach().clone()
        torch.distributed.all_reduce(loss, group=context.cp_group)
        return loss

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        loader = om.data.build_dataloader(self.dataset, self.batch_size, self.collator, parallel_context=self.context,
                                          shuffle=False, drop_last=True, split_context=False)
        was_training = model.training
        model.eval()
        total, batches = torch.zeros((), dtype=torch.float64), 0
        for batch in loader:
            total += self._loss(model, {k: v.to(self.context.device) for k, v in batch.items()}).double().cpu()
            batches += 1
        model.train(was_training)
        mean = (total / batches).float()
        if self.context.world_size > 1:  # tp / pp / cp ranks hold equal values: the world mean is the dp mean
            torch.distributed.all_reduce(mean)
            mean = mean / self.context.world_size
        loss = float(mean)
        return {"loss": loss, "perplexity": math.exp(min(loss, 700.0)), "samples": len(self.dataset)}


def build(args, context):
    """``(model, processor)``: ``--model`` with its processor, or the tiny LLaVA and the processor made here."""
    torch.manual_seed(args.seed)  # every rank alike: the same full initial weights, sliced per rank
    if args.model:
        processor = transformers.AutoProcessor.from_pretrained(args.model)
        model = om.AutoModelForImageTextToText.from_pretrained(args.model, parallel=context,
                                                               freeze_vision=args.freeze_vision)
        return model.train(), processor
    processor = llava_processor()
    config = tiny_llava_config(processor.tokenizer, hidden=args.n_embd, layers=args.n_layer)
    model = om.AutoModelForImageTextToText.from_config(config, parallel=context, freeze_vision=args.freeze_vision)
    return model.train(), processor


def main(argv=None) -> None:
    args = _parse_args(make_parser(), argv)
    if args.model_type or args.data or args.eval_data:
        raise UsageError("train_vlm.py trains on its built-in image-caption set: --model-type, --data and "
                         "--eval-data are not taken (use --model for a checkpoint)")
    cfg = check_launch(args, om.AutoModelForImageTextToText)
    try:
        om.AutoModelForImageTextToText.check_parallel(cfg)  # what image-text models refuse, before any process group
    except NotImplementedError as error:
        raise UsageError(str(error)) from None
    if args.pack and (args.pp > 1 or args.cp > 1):
        raise UsageError("--pack is not implemented with --pp / --cp for image-text models (one sample per row)")
    accelerator, context = make_accelerator(args, cfg)
    model, processor = build(args, context)
    collator = om.data.ImageTextCollator(processor, pack_to=args.seq_len if args.pack else None)
    eval_collator = om.data.ImageTextCollator(processor)
    if context.cp_size > 1:  # whole rows and images on every cp rank, the labels split (split after the merge)
        pad = processor.tokenizer.pad_token_id
        collator = ContextParallelCollate(collator, context, pad)
        eval_collator = ContextParallelCollate(eval_collator, context, pad)
    global_batch = args.batch_size * args.grad_accum * context.dp_size
    dataset = ShapesCaptions(args.train_samples or args.steps * global_batch)
    evaluator = CaptionEvaluator(eval_collator, args.eval_samples, args.batch_size, context)
    # a trained vision tower whose last layers feed nothing (LLaVA reads an inner layer's features: CLIP's last
    # layer and post_layernorm get no gradient) stops plain DDP unless it looks for unused parameters
    ddp = {"find_unused_parameters": True} if (args.zero <= 1 and not args.freeze_vision and context.dp_cp_size > 1
                                               and context.tp_size == 1 and context.pp_size == 1) else {}
    model, step, losses, reporter = fit(args, accelerator, context, model, dataset, collator, "an image + caption",
                                        evaluator, split_context=False, **ddp)
    model_dir = export(args, accelerator, model, processor, losses, "train_vlm.py", reporter)
    if accelerator.is_main_process:
        plain = transformers.AutoModelForImageTextToText.from_pretrained(model_dir).eval()  # plain transformers
        plain_processor = transformers.AutoProcessor.from_pretrained(model_dir)
        sample = ShapesCaptions(1, offset=10 ** 6)[0]
        inputs = plain_processor(images=[sample["image"]], text=[sample["prompt"]], return_tensors="pt")
        tokens = plain.generate(**inputs, max_new_tokens=8, do_sample=False,
                                pad_token_id=plain_processor.tokenizer.pad_token_id)
        caption = plain_processor.tokenizer.decode(tokens[0, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {step} steps; Hub folder: {model_dir}")
        print(f"plain transformers caption: {caption!r} (truth: {sample['text']!r})")
        with open(os.path.join(args.output, "caption.txt"), "w", encoding="utf-8") as handle:
            handle.write(caption + "\n")
    finish(accelerator)


if __name__ == "__main__":
    run(main)
