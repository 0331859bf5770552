"""GRPO on a verifiable toy task, built in: a small causal LM learns to add (``"3+4="`` -> ``"7"``), rewarded by
checking its own sampled answers. Any tensor x data layout; completions come from the model's own ``generate`` at
that layout (the same tokens on every tp rank) and log-probabilities are vocabulary parallel.

    torchrun --nproc_per_node 4 examples/train_grpo.py --tp 2 --steps 200                  # CPU or GPU
    torchrun --nproc_per_node 4 examples/train_grpo.py --tp 2 --zero 3 --beta 0.04 --ref-tp 4
    ... examples/train_grpo.py --loss-type dapo --num-generations 8 --temperature 0.9 --top-p 0.95
    python examples/train_grpo.py --config run.yaml                   # any option below as a YAML key

Each step every data-parallel replica draws ``--batch-size`` problems of ``--digits``-digit numbers, samples
``--num-generations`` answers per problem (one group), scores them (1 for the right sum, else 0.5 x the share of its
leading digits that are right), normalizes the rewards within each group (GRPO's advantages) and takes one step on
``om.post_training.grpo_objective``: the clipped ratio (``--epsilon``), the KL to the frozen starting model when
``--beta`` > 0 (at its own layout, ``--ref-tp``), aggregated as TRL's ``--loss-type``. The model is a small Llama
over a 14-token character vocabulary (sized by ``--n-layer``/``--n-embd``/``--n-head``); ``--model`` fine-tunes a
checkpoint with its own tokenizer instead. Pipeline and context parallelism are refused.

Writes to ``--output``: ``loss.json``, ``loss.png`` (with matplotlib) and ``model/`` (a Hub folder with the
tokenizer).
"""
from __future__ import annotations

import os

import torch
import transformers

import oslo_models as om
from _common import UsageError, build_parser, check_launch, finish, make_accelerator, run
from _common import parse_args as _parse_args
from _post_training import add_frozen_options, check_layout, frozen, frozen_context, train
from oslo_models.training.global_batch import global_share

CHARS = "0123456789+="


def make_parser():
    parser = build_parser(__doc__, output="train_grpo_out", lr=1e-3,
                          model_help="Hub id or folder of a causal LM to fine-tune on the task (with its tokenizer); "
                                     "default: a small Llama over the task's characters")
    add = parser.add_argument
    add("--digits", type=int, default=1, help="digits of each addend")
    add("--num-generations", type=int, default=4, help="answers sampled per problem (a group)")
    add("--max-new-tokens", type=int, default=4, help="tokens sampled per answer (the EOS included)")
    add("--temperature", type=float, default=1.0, help="sampling temperature (the log-probabilities use it too)")
    add("--top-p", type=float, default=1.0, help="nucleus sampling")
    add("--beta", type=float, default=0.0, help="weight of the KL to the frozen starting model (0: no reference)")
    add("--epsilon", type=float, default=0.2, help="ratio clipping")
    add("--loss-type", default="grpo", choices=om.post_training.grpo.LOSS_TYPES,
        help="grpo (sequence mean), bnpo (token mean), dr_grpo, dapo (token mean over the global batch)")
    add_frozen_options(parser, "ref")
    return parser


def parse_args(argv=None):
    return _parse_args(make_parser(), argv)


def arithmetic_tokenizer() -> transformers.PreTrainedTokenizerFast:
    """One token per character of ``CHARS``, ``<pad>`` = 0 and ``<eos>`` = 1."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(CHARS)}}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tokenizer.decoder = decoders.Fuse()
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="<pad>", eos_token="<eos>",
                                                padding_side="left")


def build(args, context, tokenizer):
    """The policy: ``--model`` at ``context``, or the small Llama from the seed (the same at every layout)."""
    if args.model:
        return om.AutoModelForCausalLM.from_pretrained(args.model, parallel=context, progress=False).train()
    torch.manual_seed(args.seed)
    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=args.n_embd, num_hidden_layers=args.n_layer,
        num_attention_heads=args.n_head, num_key_value_heads=args.n_head, intermediate_size=2 * args.n_embd,
        max_position_embeddings=64, pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id)
    return om.AutoModelForCausalLM.from_config(config, parallel=context).train()


def reward(answer: str, expected: str) -> float:
    """1 for the right sum; else half the share of its leading characters that are right."""
    if answer == expected:
        return 1.0
    right = 0
    for got, want in zip(answer, expected):
        if got != want:
            break
        right += 1
    return 0.5 * right / len(expected)


def rollouts(args, context, tokenizer):
    """``next_batch(step, model)``: this replica's problems, their sampled answers, rewards and advantages."""
    generator = torch.Generator().manual_seed(args.seed * 1000 + context.dp_rank)  # each replica its own problems
    high = 10 ** args.digits

    def next_batch(step: int, model) -> dict:
        pairs = torch.randint(0, high, (args.batch_size, 2), generator=generator).tolist()
        prompts = tokenizer([f"{a}+{b}=" for a, b in pairs], return_tensors="pt", padding=True)
        rollout = om.post_training.generate_completions(
            model, prompts["input_ids"], prompts["attention_mask"], num_generations=args.num_generations,
            max_new_tokens=args.max_new_tokens, eos_token_id=tokenizer.eos_token_id,
            pad_token_id=tokenizer.pad_token_id, temperature=args.temperature, top_p=args.top_p)
        answers = tokenizer.batch_decode(rollout["completion_ids"], skip_special_tokens=True)
        expected = [str(a + b) for a, b in pairs for _ in range(args.num_generations)]
        rewards = torch.tensor([reward(got.strip(), want) for got, want in zip(answers, expected)])
        rollout["advantages"] = om.post_training.group_advantages(rewards, args.num_generations)
        rollout["reward"] = rewards.mean()
        if args.loss_type == "dapo":  # the global batch's completion tokens: this replica's share (one all-reduce)
            rollout["num_items_in_batch"] = global_share(rollout["completion_mask"].sum(), context)
        return rollout

    return next_batch


def objective(model, batch, **options):
    """GRPO's loss, with the replica's mean reward among the logged metrics."""
    options = dict(options)
    if "num_items_in_batch" in batch:
        options["num_items_in_batch"] = batch["num_items_in_batch"]
    loss, metrics = om.post_training.grpo_objective(model, batch, **options)
    metrics["reward"] = batch["reward"]
    return loss, metrics


def main(argv=None) -> None:
    args = parse_args(argv)
    check_layout(args)
    if args.num_generations < 2:
        raise UsageError("--num-generations must be at least 2 (advantages are relative to the group)")
    cfg = check_launch(args, om.AutoModelForCausalLM)
    accelerator, context = make_accelerator(args, cfg)
    tokenizer = (transformers.AutoTokenizer.from_pretrained(args.tokenizer or args.model, padding_side="left")
                 if args.model else arithmetic_tokenizer())
    model = build(args, context, tokenizer)
    reference = frozen(build(args, frozen_context(args, context, "ref"), tokenizer)) if args.beta else None
    os.makedirs(args.output, exist_ok=True)
    train(args, accelerator, context, model, rollouts(args, context, tokenizer), objective,
          f"GRPO ({args.loss_type}) on {args.digits}-digit addition", tokenizer, reference=reference, beta=args.beta,
          temperature=args.temperature, epsilon_low=args.epsilon, loss_type=args.loss_type,
          max_completion_length=args.max_new_tokens)
    finish(accelerator)


if __name__ == "__main__":
    run(main)
