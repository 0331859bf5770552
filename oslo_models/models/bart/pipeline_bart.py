"""BartForConditionalGeneration as pipeline stages (see ``oslo_models/pipeline/adapter.py`` for the vocabulary), cut
across encoder and decoder as T5 is (``t5/pipeline_t5.py``).

Layers: ``model.encoder.layers`` then ``model.decoder.layers`` (flat layer ``i < E`` is encoder layer ``i``,
``E + j`` decoder layer ``j``; ``E = encoder_layers``). Stages cut that concatenation anywhere.

Stage modules: the first stage embeds both ``input_ids`` and ``decoder_input_ids`` with ``shared`` (times
``embed_scale``) and each stack's learned positions, ``layernorm_embedding``, embedding dropout and SP scatter; the
last one runs ``lm_head`` plus its vocabulary slice of ``final_logits_bias`` (a buffer every stage holds). The
stacks' ``embed_tokens`` are ``shared`` under other names: no stage runs them, so they are dropped. Tied group:
``shared`` (first stage) with ``lm_head`` (last stage) when ``tie_word_embeddings``. BART has no final norms, so
the stage with encoder layer ``E-1`` only gathers the encoder output back to full length.

Between stages flow (``d = d_model``; ``s/tp`` where that stack runs sequence-parallel, each TP rank sending its
own slice to the same TP rank of the next stage):

- into an encoder layer: ``(hidden [mb, s_enc(/tp), d], decoder_hidden [mb, s_dec(/tp), d])``, the decoder's
  embedded inputs riding along;
- into a decoder layer: ``(hidden [mb, s_dec(/tp), d], encoder_output [mb, s_enc, d])``, the encoder output full
  and replicated (as the unpipelined cross-attention reads it).

``attention_mask`` (all ones when the batch has none), ``decoder_input_ids`` (shifted labels unless given) and
``decoder_attention_mask`` are keywords to every stage; each stage rebuilds its masks from them with the stacks'
own phases (``stack_inputs``, ``run_stack`` with ``first``/``last`` and the stage's layers), so a stage computes
exactly what the same layers compute inside ``forward``.

The other heads (``BartSequenceClassificationPipelineAdapter``, ``BartQuestionAnsweringPipelineAdapter``) cut the
same way; only the last stage's head differs: ``classification_head`` on the decoder state at each row's last
``<eos>`` of ``input_ids`` (``eos_mask [mb, s]``, computed from the whole batch before the split and handed to every
stage, as the first stage alone receives ``input_ids``) -> ``[mb, num_labels]``, or ``qa_outputs`` on every decoder
state -> ``[mb, s_dec, 2]``. Their decoder reads ``input_ids`` shifted right unless the batch gives
``decoder_input_ids`` (as ``BartModel``), and no ``lm_head`` exists: the tied group is ``shared`` with its aliases.
"""
from __future__ import annotations

import torch

from ...distributed.context import ParallelContext
from ...pipeline.adapter import PipelineAdapter
from ..common import use_sequence_parallel
from ..common.head_rules import QUESTION_ANSWERING, SEQUENCE_CLASSIFICATION
from ..common.lm_loss import token_loss

ENCODER, DECODER = "model.encoder.layers", "model.decoder.layers"
EMBEDDINGS = ("model.encoder.embed_tokens", "model.decoder.embed_tokens")  # aliases of ``shared``: dropped


class BartPipelineAdapter(PipelineAdapter):
    layer_paths = (ENCODER, DECODER)
    batch_keys = ("input_ids", "labels", "attention_mask", "decoder_input_ids", "decoder_attention_mask")
    head_modules = {"lm_head": "lm_head"}  # the last stage's head: {attribute: module path}

    def layer_counts(self, model) -> tuple[int, ...]:
        return model.config.encoder_layers, model.config.decoder_layers

    def layer_parameter_counts(self, model) -> tuple[list[float], float, float]:
        """Layers (decoder layers with cross-attention); the embeddings (``shared``, both stacks' positions and
        ``layernorm_embedding``) on the first stage; the head (a full ``V x d`` even when tied) on the last.
        Counted on the stacks built on the meta device without parallelism."""
        from .modeling_bart import BartDecoder, BartEncoder

        with torch.device("meta"):
            context = ParallelContext.single_process()
            encoder, decoder = (cls(model.config, parallel_context=context) for cls in (BartEncoder, BartDecoder))

        def count(*modules) -> float:
            return float(sum(p.numel() for module in modules for p in module.parameters()))

        first = count(encoder.embed_tokens, *(getattr(stack, name) for stack in (encoder, decoder)
                                              for name in ("embed_positions", "layernorm_embedding")))
        return ([count(layer) for layer in encoder.layers] + [count(layer) for layer in decoder.layers], first,
                count(encoder.embed_tokens))

    def stage_modules(self, model, layout, stage: int) -> dict[str, str]:
        modules = {}
        if stage == 0:
            modules["shared"] = "model.shared"
            for stack in ("encoder", "decoder"):
                for name in ("embed_positions", "layernorm_embedding", "dropout"):
                    modules[f"{stack}_{name}"] = f"model.{stack}.{name}"
        if stage == layout.num_stages - 1:
            modules.update(self.head_modules)
        return modules

    def optional_modules(self, model, layout) -> set[str]:
        return super().optional_modules(model, layout) | set(EMBEDDINGS)

    def tied_groups(self, model) -> list[tuple[str, ...]]:
        group = ("model.shared.weight",) + tuple(f"{path}.weight" for path in EMBEDDINGS)
        if model.config.tie_word_embeddings and "lm_head" in self.head_modules:
            group += ("lm_head.weight",)
        return [group]

    # ------------------------------------------------------------------ batches and shapes
    def prepare_batch(self, model, batch):
        from transformers.models.bart.modeling_bart import shift_tokens_right

        if "decoder_input_ids" not in batch:
            batch["decoder_input_ids"] = shift_tokens_right(batch["labels"], model.config.pad_token_id,
                                                            model.config.decoder_start_token_id)
        if "attention_mask" not in batch:  # every stage reads the encoder length from it
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch

    def use_sequence_parallel(self, model, batch) -> bool:
        """Whether either stack runs sequence-parallel (each decides on its own length, as unpipelined)."""
        return (use_sequence_parallel(model, batch["input_ids"].shape[-1])
                or use_sequence_parallel(model, batch["decoder_input_ids"].shape[-1]))

    def stage_io(self, model, layout, stage, microbatch, sequence_parallel):
        config, tp = model.config, model.parallel_context.tp_size
        mb, enc_len = microbatch["input_ids"].shape
        dec_len = microbatch["decoder_input_ids"].shape[-1]
        dtype = next(model.parameters()).dtype
        enc_sp, dec_sp = _stack_sequence_parallel(sequence_parallel, tp, enc_len, dec_len)

        def meta(*shape):
            return torch.empty(*shape, dtype=dtype, device="meta")

        def boundary(layer: int) -> tuple[torch.Tensor, ...]:  # what flows into flat layer ``layer``
            decoder_hidden = meta(mb, dec_len // (tp if dec_sp else 1), config.d_model)
            if layer < config.encoder_layers:
                return meta(mb, enc_len // (tp if enc_sp else 1), config.d_model), decoder_hidden
            return decoder_hidden, meta(mb, enc_len, config.d_model)

        layers = layout.ranges[stage]
        inputs = (microbatch["input_ids"],) if stage == 0 else boundary(layers.start)
        if stage < layout.num_stages - 1:
            return inputs, boundary(layers.stop)
        return inputs, (meta(*self.head_output_shape(model, mb, dec_len)),)

    def head_output_shape(self, model, mb: int, dec_len: int) -> tuple[int, ...]:
        return mb, dec_len, model.lm_head.weight.shape[0]  # this rank's vocabulary slice

    # ------------------------------------------------------------------ compute
    def stage_forward(self, stage, *inputs, attention_mask=None, decoder_input_ids=None, decoder_attention_mask=None,
                      **head_inputs):
        config, context, owner = stage.model_config, stage.parallel_context, stage.owner
        encoder, decoder = owner.model.encoder, owner.model.decoder
        layers, num_encoder = stage.layout.ranges[stage.stage_index], config.encoder_layers
        blocks = {ENCODER: [], DECODER: []}
        for (path, _), layer in zip(stage.layer_ids, stage.layers):
            blocks[path].append(layer)
        (mb, enc_len), dec_len = attention_mask.shape, decoder_input_ids.shape[-1]
        enc_sp, dec_sp = _stack_sequence_parallel(stage.sequence_parallel, context.tp_size, enc_len, dec_len)
        device, dtype = decoder_input_ids.device, next(owner.parameters()).dtype
        dec_like = _shape_only(mb, dec_len, config.d_model, dtype, device)
        dec_inputs = decoder.stack_inputs(dec_like, decoder_attention_mask, sequence_parallel=dec_sp)

        # ---- encoder layers (and, on the first stage, both stacks' embeddings, the encoder's first)
        if layers.start < num_encoder:
            enc_inputs = encoder.stack_inputs(_shape_only(mb, enc_len, config.d_model, dtype, device),
                                              attention_mask, sequence_parallel=enc_sp)
            if stage.is_first:  # the stacks' embed_tokens are ``shared``: dropped on stages
                hidden = encoder.run_stack(None, enc_inputs, layers=(), last=False,
                                           inputs_embeds=stage.shared(inputs[0]) * encoder.embed_scale)
                # the decoder's embedded inputs [mb, s_dec(/tp), d] ride along through the encoder stages
                decoder_hidden = decoder.run_stack(None, dec_inputs, layers=(), last=False,
                                                   inputs_embeds=stage.shared(decoder_input_ids) * decoder.embed_scale)
            else:
                hidden, decoder_hidden = inputs
            encoder_ends = num_encoder - 1 in layers
            hidden = encoder.run_stack(hidden, enc_inputs, layers=blocks[ENCODER], first=False, last=encoder_ends)
            if not encoder_ends:
                return _activations(hidden, decoder_hidden)
            hidden, encoder_output = decoder_hidden, hidden  # the encoder output, gathered to full length
            if not blocks[DECODER]:
                return _activations(hidden, encoder_output)
        else:
            hidden, encoder_output = inputs

        # ---- decoder layers
        encoder_mask = decoder.cross_attention_mask(dec_like, attention_mask, encoder_output)
        hidden = decoder.run_stack(hidden, dec_inputs, layers=blocks[DECODER], first=False, last=stage.is_last,
                                   encoder_hidden_states=encoder_output, encoder_attention_mask=encoder_mask)
        if not stage.is_last:
            return _activations(hidden, encoder_output)
        return self.head_forward(stage, hidden, **head_inputs)

    def head_forward(self, stage, hidden: torch.Tensor, **head_inputs) -> torch.Tensor:
        """The last stage's output from the decoder output ``[mb, s_dec, d]``."""
        return stage.owner.head_logits(hidden)  # [mb, s_dec, V_padded/tp], with final_logits_bias

    def loss(self, model, local_logits, labels, num_items_in_batch):
        return token_loss(local_logits, labels, model.lm_head, num_items_in_batch=num_items_in_batch)


class _BartHeadStages(BartPipelineAdapter):
    """A head over ``BartModel`` whose decoder reads ``input_ids`` shifted right unless given (``BartModel``'s
    rule; the labels are the head's targets, not tokens). Its output shape, batch and loss are the task's rule
    (``common/head_rules.py``), as for the encoders' heads."""

    rule = None

    def head_output_shape(self, model, mb, dec_len):
        return self.rule.output_shape(model, mb, dec_len)

    def num_loss_items(self, labels):
        return self.rule.num_loss_items(labels)

    def loss_items(self, model, labels):
        return self.rule.loss_items(model, labels)

    def loss(self, model, logits, labels, num_items_in_batch):
        return self.rule.loss(model, logits, labels, num_items_in_batch)

    def prepare_batch(self, model, batch):
        from transformers.models.bart.modeling_bart import shift_tokens_right

        if "decoder_input_ids" not in batch:
            batch["decoder_input_ids"] = shift_tokens_right(batch["input_ids"], model.config.pad_token_id,
                                                            model.config.decoder_start_token_id)
        if "attention_mask" not in batch:
            batch["attention_mask"] = torch.ones_like(batch["input_ids"])
        return batch


class BartSequenceClassificationPipelineAdapter(_BartHeadStages):
    """``classification_head`` on the decoder state at each row's last ``<eos>`` -> ``[mb, num_labels]``; the loss is
    the model's (``config.problem_type``) as this microbatch's share of the whole batch's mean."""

    head_modules = {"classification_head": "classification_head"}
    rule = SEQUENCE_CLASSIFICATION

    def prepare_batch(self, model, batch):
        from .heads_bart import eos_positions

        batch = super().prepare_batch(model, batch)
        batch["eos_mask"] = eos_positions(batch["input_ids"], model.config.eos_token_id)  # checked on the batch
        return batch

    def head_forward(self, stage, hidden, eos_mask=None):
        from .heads_bart import last_eos_state

        return stage.classification_head(last_eos_state(hidden, eos_mask))


class BartQuestionAnsweringPipelineAdapter(_BartHeadStages):
    """``qa_outputs`` on every decoder state -> ``[mb, s_dec, 2]``; the positions index the decoder sequence and
    become the labels as for the encoders' span heads (``QUESTION_ANSWERING``)."""

    head_modules = {"qa_outputs": "qa_outputs"}
    rule = QUESTION_ANSWERING
    batch_keys = BartPipelineAdapter.batch_keys + QUESTION_ANSWERING.extra_batch_keys

    def prepare_batch(self, model, batch):
        return self.rule.prepare_batch(model, super().prepare_batch(model, batch), span_key="decoder_input_ids")

    def head_forward(self, stage, hidden):
        return stage.qa_outputs(hidden)


def _stack_sequence_parallel(sequence_parallel: bool, tp: int, enc_len: int, dec_len: int) -> tuple[bool, bool]:
    """Each stack runs sequence-parallel when it is on and the stack's length splits evenly (as unpipelined)."""
    return sequence_parallel and enc_len % tp == 0, sequence_parallel and dec_len % tp == 0


def _activations(*tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    return tuple(tensor.contiguous() for tensor in tensors)


def _shape_only(batch: int, seq_len: int, hidden: int, dtype, device) -> torch.Tensor:
    """A zero-size expanded ``[mb, s, d]`` view: the masks read only its batch, length, dtype and device."""
    return torch.zeros((), dtype=dtype, device=device).expand(batch, seq_len, hidden)
