"""Fine-tune any encoder (or decoder) with a sequence-classification head, at any layout, with held-out accuracy
and F1.

    python examples/train_classification.py     # built-in data, tiny BERT: held-out accuracy 1.0 in ~30 s on CPU
    torchrun --nproc_per_node 2 examples/train_classification.py --tp 2 --sequence-parallel
    accelerate launch --num_processes 4 examples/train_classification.py --model microsoft/deberta-v3-base \\
        --data train.csv --eval-data dev.csv --tp 2 --zero 2 --bf16 --eval-every 100
    python examples/train_classification.py --model answerdotai/ModernBERT-base --data glue --dataset-config sst2 \\
        --text-field sentence --eval-split validation

``--data``: a CSV or jsonl file, or a ``datasets`` name (``--dataset-config``, ``--split``, ``--eval-split``), with
a text column (``--text-field``), optionally a second one for text pairs (``--text-pair-field``: NLI, paraphrase) and
a label column (``--label-field``: class names or integers; the classes are the sorted distinct labels of the
training data). Without ``--data`` the built-in data (examples/data/sentiment.csv) is used. Held-out data:
``--eval-data`` (file), ``--eval-split`` (dataset split), else the last ``--eval-fraction`` of the training rows.

``--model`` takes a checkpoint of any type with a sequence-classification head (native family or the generic path;
its own head is replaced when the label count differs); ``--model-type TYPE`` builds a small new one; default: a
tiny BERT. The tokenizer is ``--tokenizer`` or ``--model``'s, else a WordPiece one trained on the training texts.
Samples are padded / truncated to ``--seq-len`` tokens.

Every ``--eval-every`` steps and at the end: held-out loss, accuracy and macro F1 (the same figures at any layout:
the held-out rows are split over data-parallel ranks and the confusion counts summed; under pipeline parallelism
the schedule returns the loss only, so accuracy and F1 are computed at the end, on the saved model).

Writes to ``--output``: ``checkpoint/`` (``--resume``), ``loss.json``, ``loss.png``, ``metrics.json`` and ``model/``,
a Hub folder (``id2label`` / ``label2id`` set) that plain ``transformers.pipeline("text-classification")`` runs.
Options and ``--config run.yaml`` as in train_clm.py.
"""
from __future__ import annotations

import csv
import json
import os

import torch
import transformers

import oslo_models as om
from _common import (
    HERE,
    UsageError,
    build_parser,
    check_launch,
    export,
    finish,
    fit,
    make_accelerator,
    run,
    small_config,
)
from _common import parse_args as _parse_args
from _data import tokenizer_source
from train_mlm import train_tokenizer

BUILTIN_DATA = os.path.join(HERE, "data", "sentiment.csv")


def make_parser():
    """This script's options: the shared ones (``_common.build_parser``) and its own."""
    parser = build_parser(__doc__, output="train_classification_out", lr=1e-3,
                          model_help="Hub id or folder to fine-tune, of any type with a sequence-classification "
                                     "head; default: a tiny BERT from config",
                          vocab_help="WordPiece size when training a tokenizer")
    parser.set_defaults(data=None, seq_len=24, steps=200, batch_size=16, n_embd=64)
    parser.add_argument("--text-pair-field", help="second text column (pairs: NLI, paraphrase)")
    parser.add_argument("--label-field", default="label", help="the label column")
    parser.add_argument("--dataset-config", help="the datasets configuration of a datasets --data")
    parser.add_argument("--split", default="train", help="the training split of a datasets --data")
    parser.add_argument("--eval-split", help="the held-out split of a datasets --data")
    parser.add_argument("--eval-fraction", type=float, default=0.2,
                        help="without --eval-data / --eval-split: the last fraction of the training rows held out")
    return parser


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


# ---------------------------------------------------------------------------------------------- data
def read_rows(source: str, args, split: str) -> list[dict]:
    """The rows of a CSV / jsonl file or of a ``datasets`` split, as dicts."""
    if source.endswith((".csv", ".tsv")):
        with open(source, newline="", encoding="utf-8") as handle:
            return list(csv.DictReader(handle, delimiter="\t" if source.endswith(".tsv") else ","))
    if source.endswith((".jsonl", ".json")):
        with open(source, encoding="utf-8") as handle:
            return [json.loads(line) for line in handle if line.strip()]
    try:
        import datasets
    except ImportError:
        raise UsageError(f"--data {source}: not a .csv/.tsv/.jsonl file, and `datasets` is not installed") from None
    return list(datasets.load_dataset(source, args.dataset_config, split=split))


def check_columns(rows: list[dict], args, where: str) -> None:
    if not rows:
        raise UsageError(f"{where} has no rows")
    fields = [args.text_field, args.label_field] + ([args.text_pair_field] if args.text_pair_field else [])
    missing = [field for field in fields if field not in rows[0]]
    if missing:
        raise UsageError(f"{where} has no column(s) {missing}; it has {sorted(rows[0])} (see --text-field, "
                         f"--text-pair-field, --label-field)")


def load_splits(args) -> tuple[list[dict], list[dict], list[str]]:
    """``(train rows, held-out rows, class names)``; every rank reads the same (small) data."""
    source = args.data or BUILTIN_DATA
    train = read_rows(source, args, args.split)
    check_columns(train, args, f"--data {source}")
    if args.eval_data:
        held_out = read_rows(args.eval_data, args, args.split)
        check_columns(held_out, args, f"--eval-data {args.eval_data}")
    elif args.eval_split:
        held_out = read_rows(source, args, args.eval_split)
    else:
        cut = int(len(train) * (1 - args.eval_fraction))
        train, held_out = train[:cut], train[cut:]
    names = sorted({str(row[args.label_field]) for row in train})
    if all(name.lstrip("-").isdigit() for name in names):  # integer labels: class i is label i
        names = sorted(names, key=int)
    if len(names) < 2:
        raise UsageError(f"the training data has {len(names)} class(es) in --label-field {args.label_field!r}")
    unknown = {str(row[args.label_field]) for row in held_out} - set(names)
    if unknown:
        raise UsageError(f"held-out labels {sorted(unknown)} are not among the training labels {names}")
    return train, held_out, names


def encode(rows: list[dict], tokenizer, args, label_ids: dict) -> dict[str, torch.Tensor]:
    """Padded / truncated to ``--seq-len``: ``input_ids``, ``attention_mask`` (+ ``token_type_ids`` when the
    tokenizer makes them), ``labels`` ``[n]``."""
    texts = [str(row[args.text_field]) for row in rows]
    pairs = [str(row[args.text_pair_field]) for row in rows] if args.text_pair_field else None
    encoded = tokenizer(texts, pairs, padding="max_length", truncation=True, max_length=args.seq_len,
                        return_tensors="pt")
    tensors = {key: encoded[key] for key in ("input_ids", "attention_mask", "token_type_ids") if key in encoded}
    tensors["labels"] = torch.tensor([label_ids[str(row[args.label_field])] for row in rows])
    return tensors


class Examples(torch.utils.data.Dataset):
    """``num_samples`` rows drawn epoch after epoch from ``tensors`` (a new order every epoch, from ``seed``)."""

    def __init__(self, tensors: dict[str, torch.Tensor], num_samples: int, seed: int):
        self.tensors, self.num_samples, self.seed = tensors, num_samples, seed
        self.rows = len(tensors["labels"])

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        epoch, offset = divmod(index, self.rows)
        order = torch.randperm(self.rows, generator=torch.Generator().manual_seed(self.seed + epoch))
        return {key: value[order[offset]] for key, value in self.tensors.items()}


def stack(samples: list[dict]) -> dict[str, torch.Tensor]:
    return {key: torch.stack([sample[key] for sample in samples]) for key in samples[0]}


# ---------------------------------------------------------------------------------------------- evaluation
def scores(confusion: torch.Tensor) -> dict[str, float]:
    """Accuracy and macro F1 from ``confusion [true, predicted]`` counts (a class never seen nor predicted is left
    out of the macro mean, as scikit-learn's ``labels`` default does)."""
    confusion = confusion.double()
    true_positive = confusion.diag()
    predicted, actual = confusion.sum(0), confusion.sum(1)
    present = (predicted + actual) > 0
    f1 = 2 * true_positive / (predicted + actual).clamp(min=1)
    return {"accuracy": float(true_positive.sum() / confusion.sum().clamp(min=1)),
            "f1": float(f1[present].mean()) if bool(present.any()) else 0.0}


class ClassificationEvaluator:
    """``evaluator(model) -> {"loss", "accuracy", "f1", "samples"}``; collective: call on every rank. Data-parallel
    rank ``d`` takes held-out rows ``d::dp``; the loss sums and confusion counts are summed over the dp group, so
    the figures are those of the whole held-out set at any layout. Pipelined: the loss only."""

    def __init__(self, tensors: dict[str, torch.Tensor], num_labels: int, batch_size: int, context):
        self.context, self.num_labels, self.batch_size = context, num_labels, batch_size
        self.samples = len(tensors["labels"])
        self.local = {key: value[context.dp_rank::context.dp_size] for key, value in tensors.items()}

    @torch.no_grad()
    def __call__(self, model) -> dict[str, float]:
        context, device = self.context, self.context.device
        was_training = model.training
        model.eval()
        confusion = torch.zeros(self.num_labels, self.num_labels, dtype=torch.float64, device=device)
        totals = torch.zeros(2, dtype=torch.float64, device=device)  # loss sum, rows
        rows = len(self.local["labels"])
        for start in range(0, rows, self.batch_size):
            batch = {key: value[start:start + self.batch_size].to(device) for key, value in self.local.items()}
            count = len(batch["labels"])
            if context.pp_size > 1:
                if count % (context.config.num_microbatches or context.pp_size):
                    continue  # the schedule needs whole microbatches
                loss = model.eval_step(batch)  # already the dp mean: counted on dp rank 0 only below
                totals += torch.stack([loss.double() * count * context.dp_size, torch.tensor(
                    count * context.dp_size, dtype=torch.float64, device=device)]) * (context.dp_rank == 0)
                continue
            outputs = model(**batch)
            totals += torch.stack([outputs.loss.double() * count, torch.tensor(count, dtype=torch.float64,
                                                                               device=device)])
            predicted = outputs.logits.argmax(-1)
            confusion.index_put_((batch["labels"], predicted), torch.ones_like(predicted, dtype=torch.float64),
                                 accumulate=True)
        if context.dp_size > 1:
            torch.distributed.all_reduce(totals, group=context.dp_group)
            torch.distributed.all_reduce(confusion, group=context.dp_group)
        model.train(was_training)
        result = {"loss": float(totals[0] / totals[1].clamp(min=1)), "samples": self.samples}
        if context.pp_size == 1:
            result.update(scores(confusion.cpu()))
        return result


def final_scores(model_dir: str, rows: list[dict], args) -> dict[str, float]:
    """Accuracy and macro F1 of the saved Hub folder on the held-out rows, through plain ``transformers``'
    ``pipeline("text-classification")`` (rank 0)."""
    classify = transformers.pipeline("text-classification", model=model_dir, tokenizer=model_dir, device="cpu")
    inputs = [({"text": str(row[args.text_field]), "text_pair": str(row[args.text_pair_field])}
               if args.text_pair_field else str(row[args.text_field])) for row in rows]
    predictions = classify(inputs, truncation=True, max_length=args.seq_len)
    label2id = classify.model.config.label2id
    confusion = torch.zeros(len(label2id), len(label2id))
    for row, prediction in zip(rows, predictions):
        confusion[label2id[str(row[args.label_field])], label2id[prediction["label"]]] += 1
    return scores(confusion)


# ---------------------------------------------------------------------------------------------- model
def prepare_tokenizer(args, train_rows: list[dict], context):
    """``--tokenizer`` / ``--model``'s, else a WordPiece tokenizer trained on the training texts (rank 0 writes)."""
    source = tokenizer_source(args)
    if source is None:
        source = os.path.join(args.output, "tokenizer")
        if context.is_main_process and not os.path.isfile(os.path.join(source, "tokenizer.json")):
            os.makedirs(args.output, exist_ok=True)
            texts = os.path.join(args.output, "texts.txt")
            with open(texts, "w", encoding="utf-8") as handle:
                for row in train_rows:
                    handle.write(str(row[args.text_field]) + "\n")
                    if args.text_pair_field:
                        handle.write(str(row[args.text_pair_field]) + "\n")
            train_tokenizer(texts, source, args.vocab_size)
        context.barrier()
    tokenizer = transformers.AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token is None:  # decoders: pad with the end-of-sequence token (the head reads the last real one)
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_model(args, tokenizer, names: list[str], context):
    torch.manual_seed(args.seed)  # every rank alike: the same full initial weights, sliced per rank
    labels = dict(num_labels=len(names), id2label=dict(enumerate(names)),
                  label2id={name: i for i, name in enumerate(names)}, pad_token_id=tokenizer.pad_token_id)
    auto = om.AutoModelForSequenceClassification
    if args.model:
        return auto.from_pretrained(args.model, parallel=context, progress=False, ignore_mismatched_sizes=True,
                                    **labels).train()
    if args.model_type:
        return auto.from_config(small_config(args, len(tokenizer), **labels), parallel=context).train()
    config = transformers.BertConfig(vocab_size=len(tokenizer), hidden_size=args.n_embd,
                                     num_hidden_layers=args.n_layer, num_attention_heads=args.n_head,
                                     intermediate_size=4 * args.n_embd, max_position_embeddings=max(64, args.seq_len),
                                     **labels)
    return auto.from_config(config, parallel=context).train()


def main(argv=None) -> None:
    args = parse_args(argv)
    cfg = check_launch(args, om.AutoModelForSequenceClassification)  # one clean error per job, before any group
    train_rows, held_out, names = load_splits(args)
    accelerator, context = make_accelerator(args, cfg)
    tokenizer = prepare_tokenizer(args, train_rows, context)
    model = build_model(args, tokenizer, names, context)
    label_ids = {name: i for i, name in enumerate(names)}

    global_batch = args.batch_size * args.grad_accum * context.dp_size
    dataset = Examples(encode(train_rows, tokenizer, args, label_ids), args.steps * global_batch, args.seed)
    evaluator = ClassificationEvaluator(encode(held_out, tokenizer, args, label_ids), len(names), args.batch_size,
                                        context)
    model, step, losses, reporter = fit(args, accelerator, context, model, dataset, stack,
                                        f"{args.seq_len} tokens ({len(names)} classes, {len(train_rows)} rows)",
                                        evaluator)

    model_dir = export(args, accelerator, model, tokenizer, losses, "train_classification.py", reporter)
    if accelerator.is_main_process:
        final = final_scores(model_dir, held_out, args)  # plain transformers on the saved folder
        with open(os.path.join(args.output, "metrics.json"), "w", encoding="utf-8") as handle:
            json.dump({"held_out": final, "evaluations": reporter.evaluations}, handle, indent=1)
        print(f"loss {losses[0]:.3f} -> {losses[-1]:.3f} over {step} steps; held-out accuracy "
              f"{final['accuracy']:.3f}, macro F1 {final['f1']:.3f} (plain transformers pipeline); Hub folder: "
              f"{model_dir}")
    finish(accelerator)


if __name__ == "__main__":
    run(main)
